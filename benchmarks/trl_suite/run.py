"""TRL's own tests of SFTTrainer and GRPOTrainer, on the installed trl, unmodified (control) and renamed to onepass.

    python benchmarks/trl_suite/run.py --trl /tmp/trl-src --out runs/trl_suite
    python benchmarks/trl_suite/run.py --trl /tmp/trl-src --out runs/trl_suite --suite sft --variant renamed -k packing
    python benchmarks/trl_suite/run.py --trl /tmp/trl-src --out runs/trl_suite --suite sft --stream

Why this exists: a drop-in is measured by the tests of what it replaces, run against what users install. ``--trl``
is a TRL source tree (a checkout or ``git archive`` of huggingface/trl) read at run time for its ``tests/`` and
``scripts/`` only; nothing of it is kept in this repository, and its ``trl/`` package is not used: the tests run
against the trl installed beside onepass (its version and path are recorded, and a run whose tests would
import another trl is refused). For each suite and variant, ``tests/`` and ``scripts/`` are copied into a
temporary folder and pytest runs the suite's file there, one process (``-n 0``), with the stand-ins of
:mod:`standins` (a hub cache, ``HF_HUB_OFFLINE=1``, and :mod:`trl_suite_plugin` for the datasets):

- ``sft`` (``tests/test_sft_trainer.py``): renamed, ``from onepass.train import OnePassConfig, OnePassTrainer``
  for ``from trl import SFTConfig, SFTTrainer`` and the two class names replaced, nothing else;
- ``grpo`` (``tests/test_grpo_trainer.py``): renamed, ``GRPOTrainer`` is onepass's adapter
  (``onepass.rl.trl_grpo.onepass_grpo_trainer()``, a ``trl.GRPOTrainer`` subclass), ``GRPOConfig`` stays TRL's.

Variants: ``control`` and ``renamed``; with ``--stream`` also ``control-stream`` and ``renamed-stream``, the same
tests with every ``datasets.Dataset`` the trainer is given made an ``IterableDataset`` (``to_iterable_dataset()``,
``max_steps`` set to the map-style run's when the test left it unset: :mod:`trl_suite_plugin`), as a user
streaming the same data would. TRL's tests of one commit import a few names that the installed release may
lack: such a module-level ``from trl... import`` binds each missing name to a placeholder that raises when
used (the same in every variant; the names are listed in the report), so the rest of the file still runs.

Writes ``OUT/trl_suite.json`` and ``OUT/trl_suite.md``: every test's outcome in every variant with the first line
of its failure, and the pass rate of the renamed run over the tests that pass unmodified. Not part of
``make test``: it runs TRL's suites several times (an hour or more on two cores).
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


@dataclass(frozen=True, kw_only=True)
class Suite:
    """One of TRL's test files and how its renamed copy is made."""

    test_file: str
    import_line: str  # the line the renamed copy replaces
    onepass_import: str  # what replaces it
    names: dict[str, str]  # TRL's class name -> onepass's


SUITES = {
    "sft": Suite(test_file="tests/test_sft_trainer.py", import_line="from trl import SFTConfig, SFTTrainer",
                 onepass_import="from onepass.train import OnePassConfig, OnePassTrainer",
                 names={"SFTConfig": "OnePassConfig", "SFTTrainer": "OnePassTrainer"}),
    "grpo": Suite(test_file="tests/test_grpo_trainer.py", import_line="from trl import GRPOConfig, GRPOTrainer",
                  onepass_import="from trl import GRPOConfig\nfrom onepass.rl.trl_grpo import onepass_grpo_trainer\n\n"
                                 "OnePassGRPOTrainer = onepass_grpo_trainer()",
                  names={"GRPOTrainer": "OnePassGRPOTrainer"}),
}
VARIANTS = ("control", "renamed", "control-stream", "renamed-stream")


def renamed(text: str, suite: Suite) -> str:
    """The test file with the import and the class names changed, and nothing else."""
    if suite.import_line not in text:
        raise SystemExit(f"{suite.test_file} has no line {suite.import_line!r}: this harness does not know that TRL")
    text = text.replace(suite.import_line, "\0")
    for theirs, ours in suite.names.items():
        text = re.sub(rf"\b{theirs}\b", ours, text)
    return text.replace("\0", suite.onepass_import)


ABSENT = '''class _AbsentFromInstalledTrl:  # trl_suite: a name these tests import that the installed trl lacks
    def __init__(self, name):
        self._name = name

    def __getattr__(self, attr):
        raise ImportError(f"the installed trl has no {self._name}")

    def __call__(self, *args, **kwargs):
        raise ImportError(f"the installed trl has no {self._name}")


'''


def _missing(module: str, name: str) -> bool:
    try:
        found = importlib.import_module(module)
    except ImportError:
        return True
    if hasattr(found, name):
        return False
    try:
        importlib.import_module(f"{module}.{name}")
    except ImportError:
        return True
    return False


def tolerant_imports(text: str) -> tuple[str, list[str]]:
    """``text`` with each module-level ``from trl... import`` that names something the installed trl lacks
    rewritten: the names it has imported as before, each missing one bound to a placeholder that raises when
    used. Returns the text and the missing names (``module.name``)."""
    tree = ast.parse(text)
    lines = text.splitlines(keepends=True)
    absent: list[str] = []
    for node in reversed(tree.body):
        if not (isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "trl"):
            continue
        missing = [a for a in node.names if _missing(node.module, a.name)]
        if not missing:
            continue
        kept = [a for a in node.names if a not in missing]
        new = [f"from {node.module} import {', '.join(ast.unparse(a) for a in kept)}\n"] if kept else []
        new += [f"{a.asname or a.name} = _AbsentFromInstalledTrl({node.module + '.' + a.name!r})\n" for a in missing]
        lines[node.lineno - 1:node.end_lineno] = new
        absent += [f"{node.module}.{a.name}" for a in missing]
    if not absent:
        return text, []
    first = next(n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom)) and
                 not (isinstance(n, ast.ImportFrom) and n.module == "__future__"))
    lines.insert(first.lineno - 1, ABSENT)
    return "".join(lines), sorted(absent)


def trl_commit(trl: Path) -> str:
    """The commit of the tests (git, else ``$TRL_SUITE_COMMIT``) and the version their tree says."""
    version = (trl / "VERSION").read_text().strip() if (trl / "VERSION").is_file() else "?"
    proc = subprocess.run(["git", "-C", str(trl), "rev-parse", "HEAD"], capture_output=True, text=True, check=False)
    commit = proc.stdout.strip() if proc.returncode == 0 else os.environ.get("TRL_SUITE_COMMIT", "unknown")
    return f"{commit} ({version})"


def _env(standins: Path, out: Path, tag: str, stream: bool, src: Path) -> dict[str, str]:
    return {**os.environ, "HF_HUB_CACHE": str(standins / "hub"), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1", "TRL_SUITE_DATASETS": str(standins / "datasets"),
            "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1", "TRL_SUITE_STREAM": "1" if stream else "",
            "TRL_SUITE_FAILURES": str(out / f"failures-{tag}.tsv"),
            "PYTHONPATH": os.pathsep.join([str(src), str(HERE)])}


def copy_tests(trl: Path, suite: Suite, variant: str) -> tuple[Path, list[str]]:
    """A temporary copy of the checkout's ``tests/`` and ``scripts/`` (not its ``trl/``), the suite's file
    renamed for a renamed variant; returns the copy and the names the installed trl lacks."""
    copy = Path(tempfile.mkdtemp(prefix=f"trl-suite-{variant}-")) / "trl"
    for part in ("tests", "scripts"):
        shutil.copytree(trl / part, copy / part)
    if (trl / "pyproject.toml").is_file():  # pytest's markers
        shutil.copy(trl / "pyproject.toml", copy / "pyproject.toml")
    absent: list[str] = []
    for path in (copy / suite.test_file, copy / "tests" / "testing_utils.py", copy / "tests" / "conftest.py"):
        if path.is_file():
            text, missing = tolerant_imports(path.read_text())
            path.write_text(text)
            absent += missing
    if variant.startswith("renamed"):
        test = copy / suite.test_file
        test.write_text(renamed(test.read_text(), suite))
    return copy, sorted(set(absent))


def installed_trl(copy: Path, env: dict[str, str]) -> dict[str, str]:
    """The trl that the tests in ``copy`` import (refused if it is not the installed one)."""
    code = "import trl, sys; print(trl.__version__); print(trl.__file__)"
    proc = subprocess.run([sys.executable, "-c", code], cwd=copy, env=env, capture_output=True, text=True, check=True)
    version, path = proc.stdout.strip().splitlines()[-2:]
    if Path(path).resolve().is_relative_to(copy.resolve()):
        raise SystemExit(f"the tests would import the checkout's trl ({path}), not the installed one")
    return {"version": version, "path": str(Path(path).parent)}


def run_variant(name: str, suite: Suite, variant: str, trl: Path, standins: Path, out: Path, keyword: str | None,
                timeout: int, done: dict[str, dict[str, str]] | None = None, src: Path = REPO / "src"
                ) -> tuple[Path, dict]:
    """pytest on one copy; returns its junit XML and what ran (the installed trl, the absent names)."""
    tag = f"{name}-{variant}"
    copy, absent = copy_tests(trl, suite, variant)
    env = _env(standins, out, tag, stream=variant.endswith("-stream"), src=src)
    ran = {"trl": installed_trl(copy, env), "absent_names": absent, "onepass": _onepass_commit(src)}
    junit = out / f"junit-{tag}.xml"
    cmd = [sys.executable, "-m", "pytest", suite.test_file, "-p", "trl_suite_plugin", "-n", "0", "-v", "-p",
           "no:cacheprovider", "-o", "addopts=", f"--junitxml={junit}", "-W", "ignore"]
    if keyword:
        cmd += ["-k", keyword]
    if done:  # a resumed run: what an earlier run reported is not run again (trl_suite_plugin deselects it)
        (out / f"done-{tag}.txt").write_text("\n".join(sorted(done)) + "\n")
        env["TRL_SUITE_DONE"] = str(out / f"done-{tag}.txt")
    log = out / f"pytest-{tag}.log"
    (out / f"failures-{tag}.tsv").unlink(missing_ok=True)
    with log.open("w") as f:
        try:
            subprocess.run(cmd, cwd=copy, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout, check=False)
        except subprocess.TimeoutExpired:
            f.write(f"\ntrl_suite: timed out after {timeout} s\n")
    shutil.rmtree(copy.parent, ignore_errors=True)
    return junit, ran


def outcomes(junit: Path) -> dict[str, dict[str, str]]:
    """Test id -> outcome (passed, failed, error, skipped) and the first line of why; from pytest's log
    (``-v`` lines) when the run was cut short and wrote no junit file."""
    if not junit.is_file():
        return _log_outcomes(junit.with_name(junit.name.replace("junit-", "pytest-").replace(".xml", ".log")))
    result: dict[str, dict[str, str]] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname', '').split('.')[-1]}::{case.get('name')}"
        outcome, why = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = "failed" if tag == "failure" else tag
                text = node.get("message") or node.text or ""
                why = next((line.strip() for line in text.splitlines() if line.strip()), "")[:300]
                break
        result[name] = {"outcome": outcome, "why": why}
    return result


def _log_outcomes(log: Path) -> dict[str, dict[str, str]]:
    result: dict[str, dict[str, str]] = {}
    if not log.is_file():
        return result
    for line in log.read_text(errors="replace").splitlines():
        match = re.match(r"\S*::(\w+)::(\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)", line)
        if match:
            cls, name, outcome = match.groups()
            outcome = {"XFAIL": "skipped", "XPASS": "passed"}.get(outcome, outcome.lower())
            result[f"{cls}::{name}"] = {"outcome": "failed" if outcome == "failed" else outcome, "why": ""}
    failures = log.with_name(log.name.replace("pytest-", "failures-").replace(".log", ".tsv"))
    if failures.is_file():  # the plugin's lines, written as each test failed
        for line in failures.read_text(errors="replace").splitlines():
            nodeid, _, why = line.split("\t", 2)
            key = "::".join(nodeid.split("::")[-2:])
            result.setdefault(key, {"outcome": "failed", "why": ""})["why"] = why
    for line in log.read_text(errors="replace").splitlines():  # pytest's short summary: the first line of why
        match = re.match(r"(FAILED|ERROR) \S*::(\w+)::(\S+) - (.*)", line)
        if match and f"{match.group(2)}::{match.group(3)}" in result:
            result[f"{match.group(2)}::{match.group(3)}"]["why"] = match.group(4)[:300]
    return result


def compare(control: dict[str, dict[str, str]], renamed_: dict[str, dict[str, str]]) -> dict:
    """The renamed run over the tests that pass unmodified and that it ran: how many pass, and each that does
    not, with why. A run cut short by its time limit ran only some: the tests that passed unmodified and were
    not run renamed are counted apart (``not_run``), never as failures or passes."""
    ran = [n for n, r in control.items() if r.get("outcome") == "passed"]
    base = sorted(n for n in ran if n in renamed_)
    passed = [n for n in base if renamed_[n].get("outcome") == "passed"]
    return {"control_passed": len(base), "renamed_passed_of_those": len(passed),
            "rate": round(len(passed) / len(base), 4) if base else None,
            "not_run": sorted(n for n in ran if n not in renamed_),
            "control_counts": _counts(control), "renamed_counts": _counts(renamed_),
            "still_failing": {n: renamed_[n] for n in base if n not in passed},
            "pass_renamed_only": sorted(n for n, r in renamed_.items() if r.get("outcome") == "passed"
                                        and control.get(n, {}).get("outcome") not in ("passed", None))}


def table(results: dict[str, dict[str, dict[str, dict[str, str]]]], meta: dict) -> tuple[dict, str]:
    """``results[suite][variant][test]``: the JSON summary and the Markdown report."""
    lines = [f"# TRL's own tests on the installed trl {meta['trl']['version']}, unmodified and renamed to onepass", "",
             f"Tests: huggingface/trl {meta['tests']}; trl imported from `{meta['trl']['path']}`; onepass "
             f"{meta['onepass']}. Run "
             f"{meta['date']} on {meta['machine']}: python {meta['python']}, "
             + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()), "",
             f"Command: `{meta['command']}`", ""] + [f"Resumed: `{c}`" for c in meta.get("resumed", [])] + [""]
    if meta.get("absent_names"):
        lines += ["Names the tests import that the installed trl lacks (bound to a placeholder that raises when "
                  "used, in every variant): " + ", ".join(f"`{n}`" for n in meta["absent_names"]), ""]
    summary: dict[str, dict] = {}
    for name, variants in results.items():
        pairs = [("control", "renamed")] + ([("control-stream", "renamed-stream")] if "renamed-stream" in variants
                                             else [])
        for control, ren in pairs:
            if ren not in variants:
                continue
            key = name if control == "control" else f"{name}-stream"
            s = summary[key] = compare(variants.get(control, {}), variants[ren])
            lines += [f"## {key}: {SUITES[name].test_file}" + (" (datasets streamed)" if "stream" in control else ""),
                      "", f"- {control}: {_fmt(s['control_counts'])}", f"- {ren}: {_fmt(s['renamed_counts'])}",
                      f"- **of the {s['control_passed']} tests that pass unmodified, {s['renamed_passed_of_those']} "
                      f"pass renamed ({100 * (s['rate'] or 0):.1f}%)**"]
            if s["not_run"]:
                lines += [f"- {len(s['not_run'])} more pass unmodified and were not run renamed (time limit)"]
            lines.append("")
            if s["still_failing"]:
                lines += ["Pass unmodified, fail renamed:", "", "| test | renamed | why |", "|---|---|---|"]
                lines += [f"| `{n}` | {r['outcome']} | {r['why'].replace('|', '/')} |"
                          for n, r in s["still_failing"].items()]
                lines.append("")
        for variant in (v for v in VARIANTS if v in variants):
            lines += [f"<details><summary>{name} {variant}: every test</summary>", "", "| test | outcome | why |",
                      "|---|---|---|"]
            lines += [f"| `{n}` | {r['outcome']} | {r['why'].replace('|', '/') if r['outcome'] != 'passed' else ''} |"
                      for n, r in sorted(variants[variant].items())]
            lines += ["", "</details>", ""]
    data = {"meta": meta, "summary": summary, "tests": results}
    return data, "\n".join(lines) + "\n"


def _onepass_commit(src: Path) -> str:
    """The onepass commit under test: this checkout's HEAD (``+dirty`` with uncommitted changes), or the folder."""
    if src.resolve() != (REPO / "src").resolve():
        return str(src)
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "src"], capture_output=True, text=True)
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def _counts(result: dict[str, dict[str, str]]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for v in result.values():
        counts[v["outcome"]] = counts.get(v["outcome"], 0) + 1
    return counts


def _fmt(counts: dict[str, int]) -> str:
    return ", ".join(f"{v} {k}" for k, v in sorted(counts.items())) or "not run"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trl", required=True, type=Path, help="a TRL source tree (checkout or git archive): its "
                                                               "tests/ and scripts/ are read")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "trl_suite")
    parser.add_argument("--standins", type=Path, default=None, help="where the stand-ins are built (default OUT/standins)")
    parser.add_argument("--suite", choices=["all", *SUITES], default="all")
    parser.add_argument("--variant", choices=["both", *VARIANTS], default="both",
                        help="both: control and renamed (with --stream, their streamed variants too)")
    parser.add_argument("--stream", action="store_true", help="also the streamed variants (every dataset given to "
                                                              "the trainer an IterableDataset)")
    parser.add_argument("-k", dest="keyword", default=None, help="pytest -k expression (a subset)")
    parser.add_argument("--onepass-src", type=Path, default=REPO / "src",
                        help="the onepass source tree the renamed tests import (default: this checkout's; another "
                             "commit's, e.g. `git archive COMMIT src`, to see what the suite says of it)")
    parser.add_argument("--timeout", type=int, default=3600, help="seconds per suite and variant")
    parser.add_argument("--resume", type=Path, action="append", default=[],
                        help="an earlier run's OUT (cut short by --timeout): its outcomes are kept and those tests "
                             "not run again (repeatable)")
    parser.add_argument("--report", action="store_true", help="run nothing: the report of the --resume folders' "
                                                              "outcomes (runs made in parts, or in parallel)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    standins = args.standins or args.out / "standins"
    sys.path.insert(0, str(HERE))
    import standins as building

    report = building.build(standins, args.trl)
    suites = list(SUITES) if args.suite == "all" else [args.suite]
    chosen = ["control", "renamed"] if args.variant == "both" else [args.variant]
    if args.stream:
        chosen += [f"{v}-stream" for v in chosen if not v.endswith("-stream")]
    if args.report:
        chosen = []
    results: dict[str, dict[str, dict[str, dict[str, str]]]] = {}
    ran: dict = {}
    for name in suites:
        results[name] = {}
        for variant in VARIANTS:
            tag = f"{name}-{variant}"
            earlier: dict[str, dict[str, str]] = {}
            for folder in args.resume:
                earlier.update(outcomes(folder / f"junit-{tag}.xml"))
            if variant in chosen:
                start = time.monotonic()
                junit, ran[tag] = run_variant(name, SUITES[name], variant, args.trl, standins, args.out,
                                              args.keyword, args.timeout, done=earlier, src=args.onepass_src)
                results[name][variant] = {**earlier, **outcomes(junit)}
                print(f"{tag}: {_fmt(_counts(results[name][variant]))} in {time.monotonic() - start:.0f} s", flush=True)
            else:  # not run this time: its last results, if any
                last = {**earlier, **outcomes(args.out / f"junit-{tag}.xml")}
                if last:
                    results[name][variant] = last
    import importlib.metadata as md

    earlier_meta = [json.loads((f / "trl_suite.json").read_text())["meta"] for f in args.resume
                    if (f / "trl_suite.json").is_file()]
    for m in earlier_meta:  # what the resumed runs ran, where this one ran nothing of a suite
        ran.setdefault(f"resumed {m['command']}", {"trl": m["trl"], "absent_names": m.get("absent_names", []),
                                                   "onepass": m.get("onepass")})
    first = next(iter(ran.values()), {"trl": {"version": md.version("trl"), "path": "?"}, "absent_names": []})
    meta = {"tests": trl_commit(args.trl), "trl": first["trl"], "date": time.strftime("%Y-%m-%d"),
            "machine": platform.platform(), "python": platform.python_version(),
            "command": " ".join(["python", *sys.argv]),
            "onepass": ", ".join(sorted({r.get("onepass") or _onepass_commit(args.onepass_src) for r in ran.values()}
                                        or {_onepass_commit(args.onepass_src)})),
            "resumed": [m["command"] for m in earlier_meta],
            "versions": {p: md.version(p) for p in ("torch", "transformers", "peft", "accelerate", "datasets")},
            "absent_names": sorted({n for r in ran.values() for n in r["absent_names"]}), "standins": report}
    data, markdown = table(results, meta)
    (args.out / "trl_suite.json").write_text(json.dumps(data, indent=1))
    (args.out / "trl_suite.md").write_text(markdown)
    print(markdown.split("<details>")[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
