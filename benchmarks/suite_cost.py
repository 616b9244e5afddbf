"""What ``make test`` costs on a 2-core CI machine, test by test: CPU seconds, before and after a change.

CI runs the suite with ``pytest -n auto`` on 2 cores, and it is CPU-bound there: its wall time is about its CPU
time over 2. Wall time on a shared machine says more about the neighbours than the tests, so this reads the per-test
CPU (user + sys of the test process, of the children it waited for, and of the commands tests/warm.py's server
started for it) that ``tests/cpuprof.py`` writes, from one or more runs, and compares them by file, by test and in
total. Make a run's figures with

    CPUPROF_OUT=/tmp/after .venv/bin/python -m pytest -q -p cpuprof -n 2 --dist loadfile
    ONEPASS_TESTS_COLD=1 CPUPROF_OUT=/tmp/before .venv/bin/python -m pytest -q -p cpuprof ...   # commands cold

then

    python benchmarks/suite_cost.py --run before=/tmp/before --run after=/tmp/after \\
        --out benchmarks/results/suite-cost.json --markdown benchmarks/results/suite-cost.md \
        --plot benchmarks/results/suite-cost.png

A run is the prefix given to CPUPROF_OUT (every ``PREFIX.<pid>`` file of it: one per xdist worker); several runs
of one name (``--run before=/tmp/slow --run before=/tmp/quick``) are one run made in parts. The CPU of collecting
the tests and starting the workers (about 13 s a worker) is outside every test, so not in these figures.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import platform
import sys
from pathlib import Path


def read_run(prefixes: list[str], renames: dict[str, str] | None = None) -> dict[str, float]:
    """Each test's CPU seconds (setup + call + teardown, own + children) across every file of ``prefixes``; a test
    path starting with a key of ``renames`` is read under its value (a test folder moved between the runs)."""
    tests: dict[str, float] = {}
    for prefix in prefixes:
        files = glob.glob(f"{prefix}.*")
        if not files:
            raise SystemExit(f"suite_cost: no {prefix}.<pid> files (run pytest with CPUPROF_OUT={prefix} -p cpuprof)")
        for name in files:
            for number, line in enumerate(Path(name).read_text(encoding="utf-8").splitlines(), 1):
                try:
                    record = json.loads(line)
                    test = record["id"]
                    for old, new in (renames or {}).items():
                        test = new + test[len(old):] if test.startswith(old) else test
                    tests[test] = record["self"] + record["children"]
                except (ValueError, KeyError) as e:
                    raise SystemExit(f"suite_cost: {name}:{number}: not a cpuprof record ({e})") from None
    return tests


def by_file(tests: dict[str, float]) -> dict[str, float]:
    files: collections.Counter[str] = collections.Counter()
    for test, seconds in tests.items():
        files[test.split("::", 1)[0]] += seconds
    return dict(files)


def compare(runs: dict[str, dict[str, float]], top: int) -> dict:
    names = list(runs)
    common = set.intersection(*(set(t) for t in runs.values()))
    files = {name: by_file({t: s for t, s in tests.items() if t in common}) for name, tests in runs.items()}
    first = names[0]
    order = sorted(files[first], key=lambda f: -files[first][f])
    return {
        "runs": {name: {"tests": len(tests), "cpu_seconds": round(sum(tests.values()), 1),
                        "cpu_seconds_common": round(sum(s for t, s in tests.items() if t in common), 1),
                        "estimated_minutes_on_2_cores": round(sum(tests.values()) / 2 / 60, 1)}
                 for name, tests in runs.items()},
        "common_tests": len(common),
        "files": [{"file": f, **{name: round(files[name].get(f, 0.0), 1) for name in names}} for f in order[:top]],
        "tests": [{"test": t, **{name: round(runs[name][t], 1) for name in names}}
                  for t in sorted(common, key=lambda t: -runs[first][t])[:top]],
        "python": platform.python_version(), "machine": platform.machine(), "cores": os.cpu_count(),
        "versions": versions(),
    }


def versions() -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {}
    for name in ("torch", "transformers", "accelerate", "peft", "trl", "datasets", "pytest", "pytest-xdist"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def plot(result: dict, path: Path) -> None:
    """The files' CPU seconds, one bar a run, the costliest file at the top."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names, rows = list(result["runs"]), result["files"][::-1]
    fig, ax = plt.subplots(figsize=(9, 0.32 * len(rows) + 1.2))
    height = 0.8 / len(names)
    for i, name in enumerate(names):
        ax.barh([k + i * height for k in range(len(rows))], [r[name] for r in rows], height=height, label=name)
    ax.set_yticks([k + height * (len(names) - 1) / 2 for k in range(len(rows))])
    ax.set_yticklabels([r["file"].removeprefix("tests/") for r in rows], fontsize=7)
    ax.set_xlabel("CPU seconds (tests in every run)")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def markdown(result: dict) -> str:
    names = list(result["runs"])
    lines = ["| run | tests | CPU s (all) | CPU s (tests in every run) | estimated min on 2 cores |", "|---|---|---|---|---|"]
    for name, run in result["runs"].items():
        lines.append(f"| {name} | {run['tests']} | {run['cpu_seconds']} | {run['cpu_seconds_common']} | "
                     f"{run['estimated_minutes_on_2_cores']} |")
    lines += ["", "| file | " + " | ".join(f"{n} CPU s" for n in names) + " |", "|---" * (len(names) + 1) + "|"]
    lines += [f"| `{row['file']}` | " + " | ".join(str(row[n]) for n in names) + " |" for row in result["files"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", action="append", required=True, metavar="NAME=PREFIX",
                        help="a run's CPUPROF_OUT prefix; the same NAME again adds a part of that run")
    parser.add_argument("--rename", action="append", default=[], metavar="OLD=NEW",
                        help="read test paths starting OLD as NEW (a folder moved between the runs)")
    parser.add_argument("--top", type=int, default=25, help="files and tests listed (default 25)")
    parser.add_argument("--out", type=Path, help="JSON of the comparison")
    parser.add_argument("--markdown", type=Path, help="the comparison as Markdown tables")
    parser.add_argument("--plot", type=Path, help="PNG: the costliest files' CPU seconds per run")
    args = parser.parse_args(argv)
    parts: dict[str, list[str]] = {}
    for spec in args.run:
        name, sep, prefix = spec.partition("=")
        if not sep or not name or not prefix:
            parser.error(f"--run {spec!r}: give NAME=PREFIX")
        parts.setdefault(name, []).append(prefix)
    renames = dict(spec.split("=", 1) for spec in args.rename if "=" in spec)
    result = compare({name: read_run(prefixes, renames) for name, prefixes in parts.items()}, args.top)
    text = markdown(result)
    print(f"python {result['python']}, {result['cores']} cores; " +
          ", ".join(f"{k} {v}" for k, v in result["versions"].items() if v))
    print(text, end="")
    if args.plot:
        plot(result, args.plot)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
