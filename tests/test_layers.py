"""Stages import only downwards: one ordered list of layers (pyproject.toml, ``[tool.importlinter]``), checked
by import-linter's layers contract (STYLE.md 21: "Stages import only downwards: one ordered list of layers,
checked in CI by a tool made for it; a command sits above everything it calls"; docs/design.md, "Layers").

``lint-imports`` reads every import, in function bodies too; what it cannot see are the ``"module:attribute"``
names :mod:`onepass.lazy` imports when first used, so those are checked here against the same list."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import onepass

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pytest's own TOML reader
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
SRC = Path(onepass.__file__).parent
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def lint_imports(src: Path = SRC.parent) -> subprocess.CompletedProcess[str]:
    """``lint-imports`` on the contract in pyproject.toml, for the ``onepass`` package under ``src``."""
    env = {**os.environ, "PYTHONPATH": str(src)}  # first on the path: this package, not another installed one
    return subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=ROOT, env=env, capture_output=True, text=True)


def broken(out: subprocess.CompletedProcess[str]) -> str:
    """What lint-imports says is broken: each upward import as ``a is not allowed to import b: - a.x -> b.y (l.N)``."""
    text = out.stdout + out.stderr
    return text[text.index("Broken contracts"):] if "Broken contracts" in text else text[-3000:]


def test_every_stage_imports_only_the_layers_below_it():
    out = lint_imports()
    assert out.returncode == 0, f"an import runs up the layers (pyproject.toml [tool.importlinter]):\n{broken(out)}"
    assert "KEPT" in out.stdout


def test_an_import_that_runs_upward_fails_and_is_named(tmp_path):
    """Mutation: the layout (near the bottom) imports the training loop (near the top), in a function body."""
    shutil.copytree(SRC, tmp_path / "onepass", ignore=shutil.ignore_patterns("__pycache__"))
    tree = tmp_path / "onepass" / "layout" / "tree.py"
    tree.write_text(tree.read_text() + "\n\ndef _upward():\n    from onepass.train.run.loop import train\n    return train\n")
    out = lint_imports(tmp_path)
    assert out.returncode != 0
    assert "onepass.layout is not allowed to import onepass.train" in out.stdout, broken(out)
    assert "onepass.layout.tree -> onepass.train.run.loop" in out.stdout, broken(out)


def test_the_two_front_ends_share_only_the_core(tmp_path):
    """Mutation: OnePassTrainer's checks reach into ``onepass train``'s step: what both need belongs in
    onepass.train.core (issue 47.3: two front ends over one core; a chain through a shared module fails too)."""
    shutil.copytree(SRC, tmp_path / "onepass", ignore=shutil.ignore_patterns("__pycache__"))
    checks = tmp_path / "onepass" / "train" / "trainer" / "sft_checks.py"
    checks.write_text(checks.read_text() + "\n\ndef _sideways():\n    from onepass.train.run.step import Stepper\n"
                      "    return Stepper\n")
    out = lint_imports(tmp_path)
    assert out.returncode != 0
    assert "onepass.train.trainer is not allowed to import onepass.train.run" in out.stdout, broken(out)
    assert "onepass.train.trainer.sft_checks -> onepass.train.run.step" in out.stdout, broken(out)


# ---------------------------------------------------------------------------------------------
# the names onepass.lazy imports when first used


def layers() -> list[set[str]]:
    """The contract's layers, top first: each a set of top-level names of onepass (``train``, ``cli``, ...)."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    (contract,) = [c for c in config["contracts"] if c["id"] == "layers"]
    return [{name.strip() for name in re.split(r"[|:]", layer)} for layer in contract["layers"]]


def layer_of(module: str, order: list[set[str]]) -> int:
    """0 for the top layer; ``onepass.train.run.loop`` is in the layer of ``train``."""
    top = module.split(".")[1]
    return next(i for i, names in enumerate(order) if top in names)


COMMANDS = re.compile(r"^onepass\.(cli|\w+\.cli)$")  # a command's parser names its runner, wherever it lives


def lazy_names() -> list[tuple[str, str]]:
    """``(module, "package.module:attribute")`` for every such name written in a module of ours."""
    out = []
    for path in SRC.rglob("*.py"):
        parts = ("onepass", *path.relative_to(SRC).with_suffix("").parts)
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out += [(module, c.value) for c in ast.walk(ast.parse(path.read_text()))
                if isinstance(c, ast.Constant) and isinstance(c.value, str)
                and re.fullmatch(r"onepass(\.\w+)+:\w+", c.value)]
    return out


def test_names_imported_when_first_used_point_down_the_layers_too():
    """A package's public names live in its own modules; only a command's parser may name a runner above it
    (``onepass verify --rollouts`` names :mod:`onepass.rl.cli`'s)."""
    order = layers()
    named = lazy_names()
    assert len(named) >= 8, named  # the command registry's runners at least
    upward = [f"{module} names {name}" for module, name in named
              if not COMMANDS.match(module) and layer_of(name.split(":")[0], order) < layer_of(module, order)]
    assert not upward, f"names imported when first used that run up the layers: {upward}"


def test_the_lazy_name_check_finds_one_running_up():
    order = layers()
    assert layer_of("onepass.train.run.loop", order) < layer_of("onepass.layout.tree", order)
    assert layer_of("onepass.cli", order) < layer_of("onepass.train", order) < layer_of("onepass.errors", order)
    assert COMMANDS.match("onepass.verify.cli") and not COMMANDS.match("onepass.verify.check")
