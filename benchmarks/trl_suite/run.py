"""TRL's SFT tests, unmodified (control) and renamed to OnePassTrainer / OnePassConfig, on offline stand-ins.

    python benchmarks/trl_suite/run.py --trl /tmp/trl-src --out runs/trl_suite
    python benchmarks/trl_suite/run.py --trl /tmp/trl-src --out runs/trl_suite --variant renamed -k packing

``--trl`` is a TRL source tree (a checkout or ``git archive`` of huggingface/trl); nothing of it is kept in
this repository. For each variant the checkout is copied into a temporary folder; the renamed copy's
``tests/test_sft_trainer.py`` gets ``from onepass.train import OnePassConfig, OnePassTrainer`` for
``from trl import SFTConfig, SFTTrainer`` and the two class names replaced, nothing else. pytest then runs
that file in the copy (so ``trl`` there is the checkout's own package, the one its tests were written
for; the trainer under test is onepass's in the renamed run), one process (``-n 0``), with the stand-ins of
:mod:`standins` (a hub cache, ``HF_HUB_OFFLINE=1``, and :mod:`trl_suite_plugin` for the datasets).

Writes ``OUT/trl_suite.json`` and ``OUT/trl_suite.md``: every test's outcome in both runs with the first line
of its failure, and the pass rate of the renamed run over the tests that pass unmodified. Not part of
``make test``: it needs a TRL checkout and runs TRL's suite twice (tens of minutes on two cores).
"""

from __future__ import annotations

import argparse
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
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
TEST_FILE = "tests/test_sft_trainer.py"
IMPORT = "from trl import SFTConfig, SFTTrainer"


def renamed(text: str) -> str:
    """The test file with the import and the two class names changed, and nothing else."""
    if IMPORT not in text:
        raise SystemExit(f"{TEST_FILE} has no line {IMPORT!r}: this harness does not know that TRL")
    text = text.replace(IMPORT, "from onepass.train import OnePassConfig, OnePassTrainer")
    return re.sub(r"\bSFTTrainer\b", "OnePassTrainer", re.sub(r"\bSFTConfig\b", "OnePassConfig", text))


def trl_commit(trl: Path) -> str:
    version = (trl / "VERSION").read_text().strip() if (trl / "VERSION").is_file() else "?"
    proc = subprocess.run(["git", "-C", str(trl), "rev-parse", "HEAD"], capture_output=True, text=True, check=False)
    commit = proc.stdout.strip() if proc.returncode == 0 else os.environ.get("TRL_SUITE_COMMIT", "unknown")
    return f"{commit} ({version})"


def run_variant(variant: str, trl: Path, standins: Path, out: Path, keyword: str | None, timeout: int,
                done: dict[str, dict[str, str]] | None = None) -> Path:
    """pytest on one copy of the checkout; returns its junit XML."""
    tmp = Path(tempfile.mkdtemp(prefix=f"trl-suite-{variant}-"))
    copy = tmp / "trl"
    shutil.copytree(trl, copy, ignore=shutil.ignore_patterns(".git", "docs", "examples", "assets"))
    test = copy / TEST_FILE
    if variant == "renamed":
        test.write_text(renamed(test.read_text()))
    junit = out / f"junit-{variant}.xml"
    env = {**os.environ, "HF_HUB_CACHE": str(standins / "hub"), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "TRL_SUITE_DATASETS": str(standins / "datasets"),
           "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1",
           "TRL_SUITE_FAILURES": str(out / f"failures-{variant}.tsv"),
           "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(HERE)])}
    cmd = [sys.executable, "-m", "pytest", TEST_FILE, "-p", "trl_suite_plugin", "-n", "0", "-v", "-p", "no:cacheprovider",
           "-o", "addopts=", f"--junitxml={junit}", "-W", "ignore"]
    if keyword:
        cmd += ["-k", keyword]
    if done:  # a resumed run: what an earlier run reported is not run again (trl_suite_plugin deselects it)
        (out / f"done-{variant}.txt").write_text("\n".join(sorted(done)) + "\n")
        env["TRL_SUITE_DONE"] = str(out / f"done-{variant}.txt")
    log = out / f"pytest-{variant}.log"
    (out / f"failures-{variant}.tsv").unlink(missing_ok=True)
    with log.open("w") as f:
        try:
            subprocess.run(cmd, cwd=copy, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout, check=False)
        except subprocess.TimeoutExpired:
            f.write(f"\ntrl_suite: timed out after {timeout} s\n")
    shutil.rmtree(tmp, ignore_errors=True)
    return junit


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


def table(results: dict[str, dict[str, dict[str, str]]], meta: dict) -> tuple[dict, str]:
    control, renamed_ = results.get("control", {}), results.get("renamed", {})
    names = sorted(set(control) | set(renamed_))
    base = [n for n in names if control.get(n, {}).get("outcome") == "passed"]
    trainer = [n for n in base if n.startswith("TestSFTTrainer::")]
    passed = [n for n in base if renamed_.get(n, {}).get("outcome") == "passed"]
    passed_trainer = [n for n in passed if n.startswith("TestSFTTrainer::")]
    summary = {
        "control_passed": len(base),
        "renamed_passed_of_those": len(passed),
        "rate": round(len(passed) / len(base), 4) if base else None,
        "trainer_tests_control_passed": len(trainer),
        "trainer_tests_renamed_passed": len(passed_trainer),
        "trainer_rate": round(len(passed_trainer) / len(trainer), 4) if trainer else None,
        "control_counts": _counts(control), "renamed_counts": _counts(renamed_),
        "still_failing": [n for n in base if n not in passed],
    }
    data = {"meta": meta, "summary": summary,
            "tests": {n: {"control": control.get(n), "renamed": renamed_.get(n)} for n in names}}
    lines = [f"# TRL's SFT tests renamed to OnePassTrainer ({meta['trl']})", "",
             f"Run {meta['date']} on {meta['machine']}: python {meta['python']}, " + ", ".join(
                 f"{k} {v}" for k, v in meta["versions"].items()), "",
             f"Command: `{meta['command']}`", "",
             f"- control (unmodified): {_fmt(summary['control_counts'])}",
             f"- renamed: {_fmt(summary['renamed_counts'])}",
             f"- **of the {len(base)} tests that pass unmodified, {len(passed)} pass renamed "
             f"({100 * (summary['rate'] or 0):.1f}%)**; of those that build a trainer (`TestSFTTrainer`), "
             f"{len(passed_trainer)} of {len(trainer)}", "",
             "| test | control | renamed | renamed: first line of the failure |", "|---|---|---|---|"]
    for n in names:
        c, r = control.get(n, {}), renamed_.get(n, {})
        why = r.get("why", "") if r.get("outcome") not in ("passed", None) else ""
        lines.append(f"| `{n}` | {c.get('outcome', '-')} | {r.get('outcome', '-')} | {why.replace('|', '/')} |")
    return data, "\n".join(lines) + "\n"


def _counts(result: dict[str, dict[str, str]]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for v in result.values():
        counts[v["outcome"]] = counts.get(v["outcome"], 0) + 1
    return counts


def _fmt(counts: dict[str, int]) -> str:
    return ", ".join(f"{v} {k}" for k, v in sorted(counts.items())) or "not run"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trl", required=True, type=Path, help="a TRL source tree (checkout or git archive)")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "trl_suite")
    parser.add_argument("--standins", type=Path, default=None, help="where the stand-ins are built (default OUT/standins)")
    parser.add_argument("--variant", choices=["both", "control", "renamed"], default="both")
    parser.add_argument("-k", dest="keyword", default=None, help="pytest -k expression (a subset)")
    parser.add_argument("--timeout", type=int, default=3600, help="seconds per variant")
    parser.add_argument("--resume", type=Path, action="append", default=[],
                        help="an earlier run's OUT (cut short by --timeout): its outcomes are kept and those tests "
                             "not run again (repeatable)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    standins = args.standins or args.out / "standins"
    sys.path.insert(0, str(HERE))
    import standins as building

    report = building.build(standins, args.trl)
    variants = ["control", "renamed"] if args.variant == "both" else [args.variant]
    results = {}
    earlier: dict[str, dict[str, dict[str, str]]] = {"control": {}, "renamed": {}}
    for folder in args.resume:
        for variant in earlier:
            earlier[variant].update(outcomes(folder / f"junit-{variant}.xml"))
    for variant in variants:
        start = time.monotonic()
        results[variant] = {**earlier[variant], **outcomes(run_variant(
            variant, args.trl, standins, args.out, args.keyword, args.timeout, done=earlier[variant]))}
        print(f"{variant}: {_fmt(_counts(results[variant]))} in {time.monotonic() - start:.0f} s", flush=True)
    for variant in ("control", "renamed"):  # a variant not run this time: its last results, if any
        if variant not in results:
            results[variant] = {**earlier[variant], **outcomes(args.out / f"junit-{variant}.xml")}
    import importlib.metadata as md

    meta = {"trl": trl_commit(args.trl), "date": time.strftime("%Y-%m-%d"), "machine": platform.platform(),
            "python": platform.python_version(), "command": " ".join(["python", *sys.argv]),
            "versions": {p: md.version(p) for p in ("torch", "transformers", "peft", "accelerate", "datasets")},
            "standins": report}
    data, markdown = table(results, meta)
    (args.out / "trl_suite.json").write_text(json.dumps(data, indent=1))
    (args.out / "trl_suite.md").write_text(markdown)
    print(markdown.split("| test |")[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
