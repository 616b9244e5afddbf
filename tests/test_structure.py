"""The package's shape: no import cycles, the pure data layout imports no torch, files stay small by concept,
one loader per resource, imports of our modules at module level.

The rules cited are the house style's (``../shared/STYLE.md`` beside the repo, "How the code should feel"), by
their number there and quoted, so they read without it."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import warnings
from pathlib import Path

import onepass

SRC = Path(onepass.__file__).parent
PURE_STAGES = ("conversation", "render", "layout", "prepare")  # the stages before the model: every module
PURE = (*sorted(".".join(("onepass", *p.relative_to(SRC).with_suffix("").parts)) for stage in PURE_STAGES
                for p in (SRC / stage).glob("*.py") if p.name != "__init__.py"),
        "onepass.render", "onepass.attention.blocks", "onepass.attention.segments", "onepass.attention.gather",
        "onepass.attention.paper",
        "onepass.model.config", "onepass.model.dtypes", "onepass.rl.rollouts", "onepass.rl.layout",
        "onepass.rl.synthetic", "onepass.parallel.plan", "onepass.prepare.guard_sample", "onepass.train.run.data", "onepass.lazy",
        "onepass.data.synthetic")


TOP = {"__init__", "__main__", "cli", "lazy", "errors", "key_value", "files", "hub", "settings", "demo", "loss", "head",
       "batch"}
"""The modules at the top of src/onepass: the command line's (registry, lazy step, errors, flags, files, hub, settings, demo)
and the loss (its head, its batch); everything else lives in its stage's folder (docs/code-map.md)."""


def module_name(path: Path) -> str:
    parts = ("onepass", *path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in SRC.rglob("*.py") if p.name != "__main__.py"}


def _imports_of(node: ast.AST) -> set[str]:
    if isinstance(node, ast.Import):
        return {a.name for a in node.names if a.name.startswith("onepass")}
    if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("onepass"):
        return {node.module} | {f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in MODULES}
    return set()


def imports(tree: ast.Module, *, bodies: bool = True) -> set[str]:
    """Modules of ours ``tree`` imports (not under TYPE_CHECKING); with ``bodies``, inside functions too."""
    out: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        todo = [node]
        while todo:
            sub = todo.pop()
            if isinstance(sub, ast.FunctionDef | ast.AsyncFunctionDef) and not bodies:
                continue
            out |= _imports_of(sub)
            todo.extend(ast.iter_child_nodes(sub))
    return {m for m in out if m in MODULES}


def top_level_imports(path: Path) -> set[str]:
    """Modules of ours imported when ``path`` is imported (module level; not under TYPE_CHECKING)."""
    return imports(ast.parse(path.read_text()), bodies=False)


def function_level_imports(path: Path) -> list[str]:
    """``function: import`` for each import of a module of ours inside a function of ``path``."""
    out = []
    for fn in ast.walk(ast.parse(path.read_text())):
        if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            out += [f"{fn.name}: {ast.unparse(sub)}" for sub in ast.walk(fn) if _imports_of(sub)]
    return out


def _function_bodies_read():
    tree = ast.parse("import onepass.layout.view\ndef f():\n    from onepass.layout.tree import Layout\n")
    return (imports(tree) == {"onepass.layout.view", "onepass.layout.tree"}
            and imports(tree, bodies=False) == {"onepass.layout.view"})


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    assert _function_bodies_read()


def test_no_import_cycles_between_our_modules():
    # A package's __init__ re-exporting its submodules is not a cycle; a submodule importing the
    # package that imports it back would be, and is caught (the edge to the package is kept).
    # Function bodies are read too: an import there is an edge like any other (there should be none).
    graph = {name: imports(ast.parse(path.read_text())) - {name} for name, path in MODULES.items()}
    for name in graph:
        if MODULES[name].name == "__init__.py":
            graph[name] = {m for m in graph[name] if not m.startswith(name + ".")}
    assert find_cycle(graph) is None


def imported_closure(name: str) -> set[str]:
    """Every module of ours that importing ``name`` imports (module level, transitively)."""
    seen: set[str] = set()
    todo = [name]
    while todo:
        for m in top_level_imports(MODULES[todo.pop()]):
            parts = m.split(".")  # importing a.b.c imports its packages a.b and a too
            for n in {".".join(parts[:i]) for i in range(2, len(parts) + 1)} & MODULES.keys():
                if n not in seen:
                    seen.add(n)
                    todo.append(n)
    return seen


def test_the_layout_imports_no_rendering_module():
    # tree, schedule, pack and loss take views (onepass.layout.view), never how a template produced them
    for name in ("onepass.layout.tree", "onepass.layout.schedule", "onepass.layout.pack", "onepass.loss"):
        rendering = {m for m in imported_closure(name) if m == "onepass.render" or m.startswith("onepass.render.")}
        assert not rendering, f"{name} imports rendering code: {sorted(rendering)}"
    assert "onepass.layout.view" in imported_closure("onepass.layout.tree")  # the check sees imports at all


# The tree read from kv_end has one home, onepass.layout.geometry. Another module defining one of these names
# reads the tree again its own way (the names the old copies had included); the modules that need the
# tree import it from there.
TREE_READERS = {"onepass.mixers.tree", "onepass.attention.window", "onepass.attention.segments",
                "onepass.attention.gather", "onepass.verify.divergence", "onepass.layout.row_check"}
GEOMETRY_NAMES = {"parents", "parents_reference", "depths", "tree_depth", "ancestor_at", "leaf_paths", "_leaf_paths",
                  "row_chains", "batch_chains", "chains_reference", "segment_starts", "segments", "tree_breaks",
                  "is_tree", "check_tree", "_range_min"}


def defined_functions(path: Path) -> set[str]:
    return {n.name for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.FunctionDef)}


def test_the_tree_is_read_from_kv_end_in_one_module():
    old_names = {"tree_depth", "_leaf_paths", "_range_min"}
    assert GEOMETRY_NAMES - old_names <= defined_functions(MODULES["onepass.layout.geometry"])
    again = {name: sorted(defined_functions(p) & GEOMETRY_NAMES) for name, p in MODULES.items()
             if name != "onepass.layout.geometry" and defined_functions(p) & GEOMETRY_NAMES}
    assert not again, f"these modules read the tree from kv_end themselves; use onepass.layout.geometry: {again}"
    assert top_level_imports(MODULES["onepass.layout.geometry"]) == set(), \
        "geometry is data layout: it imports none of ours"
    missing = {name for name in TREE_READERS if "onepass.layout.geometry" not in top_level_imports(MODULES[name])}
    assert not missing, f"these read the tree but not through onepass.layout.geometry: {sorted(missing)}"


def test_pure_layout_modules_import_no_torch():
    code = "import sys\n" + "".join(f"import {m}\n" for m in PURE) + "print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


SOFT_LINES, HARD_LINES = 400, 600  # past SOFT a warning (a missing concept?), past HARD a failure


def only_reexports(path: Path) -> bool:
    """True when a module holds nothing but its docstring, imports and ``__all__``: it exists to move names."""
    body = ast.parse(path.read_text()).body
    body = body[1:] if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) else body
    return all(isinstance(n, ast.Import | ast.ImportFrom) or (isinstance(n, ast.Assign) and ast.unparse(n.targets[0])
                                                               == "__all__") for n in body)


def test_the_reexport_finder_finds_one(tmp_path):
    (tmp_path / "a.py").write_text('"""Moved."""\nfrom x import y  # noqa: F401\n__all__ = ["y"]\n')
    (tmp_path / "b.py").write_text('"""Real."""\nfrom x import y\n\ndef f():\n    return y\n')
    assert only_reexports(tmp_path / "a.py") and not only_reexports(tmp_path / "b.py")


def test_modules_stay_small_by_concept_not_by_count():
    # STYLE.md 8: "A file that grows past ~400 lines is telling you about a missing concept: split it by
    # concept, never to satisfy a count (no 36-line modules that exist only to move lines, no stale
    # re-exports)". So: a warning, not a reason to split
    # off a file; past 600 it fails. A module (not a package's __init__) that only re-exports names is a
    # stale shim: import from the home of the name instead.
    lines = {name: len(p.read_text().splitlines()) for name, p in MODULES.items()}
    long = {name: n for name, n in lines.items() if n > SOFT_LINES}
    if long:
        warnings.warn(f"modules past {SOFT_LINES} lines (a missing concept?): {long}", stacklevel=1)
    assert not {n: k for n, k in long.items() if k > HARD_LINES}, f"split these by concept: {long}"
    shims = [name for name, p in MODULES.items() if p.name != "__init__.py" and only_reexports(p)]
    assert not shims, f"modules that only re-export: {shims}"


STEP_LINES = 50  # a step of a run reads on one screen; `_train` had 155 lines, OnePassTrainer.__init__ 121


def long_functions(source: str, limit: int = STEP_LINES) -> dict[str, int]:
    """``name: lines`` of each function (or method) of ``source`` longer than ``limit`` lines, signature included."""
    return {fn.name: n for fn in ast.walk(ast.parse(source))
            if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef) and (n := fn.end_lineno - fn.lineno + 1) > limit}


def test_the_long_function_finder_finds_one():
    body = "".join(f"        x{i} = {i}\n" for i in range(STEP_LINES))  # a method of 1 + STEP_LINES lines
    assert long_functions(f"class A:\n    def f(self):\n{body}\n\ndef g():\n    return 1\n") == {"f": STEP_LINES + 1}


def test_a_run_and_the_trainers_init_read_as_named_steps():
    # issue 38: `onepass train`'s run (train/loop.py `_train`) and OnePassTrainer.__init__ are lists of named
    # steps, each a function with a docstring: set up, load, check, build, resume, step, finish
    for module in ("onepass.train.run.loop", "onepass.train.trainer.trainer"):
        long = long_functions(MODULES[module].read_text())
        assert not long, f"{module}: functions past {STEP_LINES} lines (break them into named steps): {long}"


def test_only_render_template_calls_the_chat_template():
    calls = {name for name, p in MODULES.items() if ".apply_chat_template(" in p.read_text()}
    assert calls == {"onepass.render.template"}, calls


def test_every_record_reasoning_key_is_a_candidate_the_template_probe_tries():
    # two lists on purpose: the keys a record may give reasoning under (reading records) and the keys a
    # template may read it from, in probe order (plus Command R7B's tool_plan, never a record field)
    from onepass.conversation.schemas import REASONING_KEYS
    from onepass.render.fields import TEMPLATE_REASONING_KEYS

    assert set(REASONING_KEYS) < set(TEMPLATE_REASONING_KEYS)
    assert set(TEMPLATE_REASONING_KEYS) - set(REASONING_KEYS) == {"tool_plan"}


# ---------------------------------------------------------------------------------------------
# one loader per resource (STYLE.md 11: "One loader per resource (model, tokenizer, data source), used by
# every command and trainer")


def modules_calling(text: str) -> set[str]:
    """Our modules whose code (comments and docstrings aside) holds ``text``."""
    out = set()
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text())
        docstrings = {id(n.value) for n in ast.walk(tree)
                      if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
        code = [ast.unparse(n) for n in ast.walk(tree) if isinstance(n, ast.Call) and id(n) not in docstrings]
        if any(text in c for c in code):
            out.add(name)
    return out


def test_models_and_configs_are_loaded_in_one_module_and_tokenizers_in_one():
    # onepass train, OnePassTrainer, verify, eval, export and the guard all load through onepass.model.load
    assert modules_calling("AutoModelForCausalLM.from_pretrained(") == {"onepass.model.load"}
    assert modules_calling("PeftModel.from_pretrained(") == {"onepass.model.load"}
    assert modules_calling("AutoConfig.from_pretrained(") == {"onepass.model.load"}
    assert modules_calling("AutoTokenizer.from_pretrained(") == {"onepass.render.tokenizer"}
    assert {name for name in modules_calling(".from_pretrained(")} == {"onepass.model.load", "onepass.render.tokenizer"}


def test_one_dtype_table_and_one_conversion_to_a_torch_dtype():
    tables = {name for name, p in MODULES.items() for n in ast.walk(ast.parse(p.read_text()))
              if isinstance(n, ast.Assign) and any(ast.unparse(t).endswith("DTYPES") and ast.unparse(t) !=
                                                   "ROW_DISK_DTYPES" for t in n.targets)}
    assert tables == {"onepass.model.dtypes"}, tables
    assert modules_calling("getattr(torch,") == {"onepass.model.dtypes"}
    spelled = {name for name, p in MODULES.items()  # {"float32": torch.float32, ...}: a table of its own
               if re.search(r"""["'](float32|bfloat16|float16|float64)["']\s*:\s*torch\.""", p.read_text())}
    assert not spelled, spelled


def test_one_is_peft_and_nothing_probes_for_peft_by_hand():
    # onepass.model.couplings: the answer relies on peft's classes (every reliance on another library is there)
    defined = {name for name, p in MODULES.items() if {"is_peft", "base_model"} & defined_functions(p)}
    assert defined == {"onepass.model.couplings"}, defined
    probing = {name for name, p in MODULES.items() if name != "onepass.model.couplings"
               and re.search(r"""["'](get_base_model|peft_config)["']""", p.read_text())}
    assert not probing, probing


# ---------------------------------------------------------------------------------------------
# one import rule (STYLE.md 19: "Imports of our own modules go at module level; lazy imports only for heavy
# or optional third-party packages, with one mechanism")


def test_our_modules_are_imported_at_module_level():
    inside = {name: found for name, p in MODULES.items() if (found := function_level_imports(p))}
    assert not inside, f"imports of our modules inside functions (put them at module level): {inside}"


def test_one_lazy_mechanism_for_names_of_ours():
    """What must not load torch early names what it reaches ("module:attribute", onepass.lazy.resolve):
    the command registry's runners and the public names of a package that live in torch modules. No other
    importlib, no hand-written module __getattr__; and every name given that way exists."""
    importing = {name for name, p in MODULES.items() if "import_module(" in p.read_text()}
    # third-party modules imported by name, not ours: mixers.float64 copies a transformers function with its own
    # module's globals (introspection); bench.gpu_check imports what a GPU machine must have, to report each failure;
    # private_names finds another library's private names by their dotted path before they are used
    assert importing == {"onepass.lazy", "onepass.model.float64", "onepass.bench.gpu_check",
                         "onepass.model.private_names"}, importing
    handwritten = {name for name, p in MODULES.items() if name != "onepass.lazy" and any(  # a module's, not a class's
        isinstance(n, ast.FunctionDef) and n.name == "__getattr__" for n in ast.parse(p.read_text()).body)}
    assert not handwritten, handwritten
    from onepass.lazy import resolve

    named = {c.value for p in MODULES.values() for c in ast.walk(ast.parse(p.read_text()))
             if isinstance(c, ast.Constant) and isinstance(c.value, str) and re.fullmatch(r"onepass[\w.]*:\w+", c.value)}
    assert len(named) >= 8, named  # the runners of train, verify, eval, bench, export at least
    for spec in named:
        assert resolve(spec) is not None, spec
    import importlib

    for package in ("onepass.train", "onepass.rl", "onepass.attention", "onepass.guard"):
        module = importlib.import_module(package)
        for name in module.__all__:
            assert getattr(module, name) is not None, (package, name)


def test_a_module_lives_in_its_stage_folder():
    top = {p.stem for p in SRC.glob("*.py")}
    assert top == TOP, (f"modules at the top of src/onepass that belong in a stage folder: {sorted(top - TOP)}"
                        if top - TOP else f"gone from the top: {sorted(TOP - top)}; update TOP")


TESTS = Path(__file__).parent
TEST_FOLDERS_OF_NO_STAGE = {"faults", "fixtures", "__pycache__"}
"""faults/: the fault cases of issue 44, which cross every stage (docs/faults.md); fixtures/: data, not tests."""
PACKAGE_WIDE_TESTS = {"test_equivalence", "test_architectures", "test_share_exactness", "test_views_property",
                      "test_real_templates", "test_prepared_rows_unchanged", "test_structure", "test_layers",
                      "test_code_map", "test_install", "test_warm", "test_tokenizer_cache"}
"""The tests at the top of tests/ that check the whole package (the loss equals N-pass's, views equal the template's,
prepared rows stay byte-identical, the package's shape) or the suite's own machinery (test_warm: a command started
warm is the command; test_tokenizer_cache: a tokenizer loaded once is the tokenizer), beside the tests of the top
modules (``test_<module>``)."""


def test_the_tests_mirror_the_stages():
    """tests/ is shaped like src/onepass/ (issue 47): a stage's tests live in the folder of its name, so the tests
    of a change are found by its path and a stage's tests run alone (``pytest tests/render``)."""
    stages = {p.name for p in SRC.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    folders = {p.name for p in TESTS.iterdir() if p.is_dir()} - TEST_FOLDERS_OF_NO_STAGE
    assert folders <= stages, f"test folders that name no stage of src/onepass: {sorted(folders - stages)}"
    flat = {p.stem for p in TESTS.glob("test_*.py")}
    homeless = flat - PACKAGE_WIDE_TESTS - {f"test_{m}" for m in TOP}
    assert not homeless, (f"tests at the top of tests/ that belong in their stage's folder: {sorted(homeless)} "
                          "(or, if they check the whole package, in PACKAGE_WIDE_TESTS)")


def slow_rows_gone(table: dict[str, list[str]]) -> list[str]:
    """The rows of a table like conftest's SLOW whose test function is not defined in its file."""
    gone = []
    for path, names in table.items():
        source = (TESTS / path).read_text(encoding="utf-8") if (TESTS / path).is_file() else ""
        gone += [f"{path}::{name}" for name in names
                 if not re.search(rf"^(async )?def {re.escape(name.split('[', 1)[0])}\(", source, re.M)]
    return gone


def test_every_slow_row_names_a_test():
    """tests/conftest.py's SLOW (the measured tests ``make test-quick`` leaves to ``make test``) names tests that
    exist: a test renamed or moved takes its row along, else the inner loop quietly runs it again."""
    from conftest import SLOW

    assert slow_rows_gone({"test_structure.py": ["test_every_slow_row_names_a_test", "test_gone[case]"],
                           "nowhere/test_x.py": ["test_y"]}) == ["test_structure.py::test_gone[case]",
                                                                 "nowhere/test_x.py::test_y"]
    assert not slow_rows_gone(SLOW), slow_rows_gone(SLOW)
