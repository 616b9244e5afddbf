"""The table ``make test-compat`` prints: per architecture and transformers release, exact, refused or absent.

Each argument is one release's JUnit report (``.venv-compat/results/<release>.xml``, the release its name). A
test belongs to the architecture its parameter id names (``test_x[qwen3.5-None]``: qwen3.5); per cell, FAIL if
any of the architecture's tests failed, else refused (a skip whose reason is a promised one-line refusal,
``conftest.promised_refusal``), else absent (the release has no such architecture), else exact (every test
passed). Tests of no architecture are counted in the last row. The refusal lines follow the table, once each.
Exit status 1 if any cell is FAIL: nothing may be silently inexact.

    python tests/compat_table.py .venv-compat/results/5.2.0.xml .venv-compat/results/5.8.0.xml
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

from onepass.model.tiny import TINY_ARCHS

OTHER = "(no architecture)"


def arch_of(test_name: str) -> str:
    """The architecture a parametrized test id names, or :data:`OTHER`."""
    if "[" not in test_name:
        return OTHER
    param = test_name[test_name.index("[") + 1:test_name.rindex("]")]
    for arch in sorted(TINY_ARCHS, key=len, reverse=True):  # qwen3-window before qwen3
        if param == arch or param.startswith(arch + "-") or param.endswith("-" + arch) or f"-{arch}-" in param:
            return arch
    return OTHER


def outcomes(report: Path) -> dict[str, list[tuple[str, str]]]:
    """Per architecture, ``(outcome, reason)`` of each test case: passed, failed, refused, absent or skipped."""
    out: dict[str, list[tuple[str, str]]] = defaultdict(list)
    for case in ET.parse(report).getroot().iter("testcase"):
        arch = arch_of(case.get("name", ""))
        if case.find("failure") is not None or case.find("error") is not None:
            out[arch].append(("failed", case.get("name", "")))
        elif (skip := case.find("skipped")) is not None:
            reason = skip.get("message", "")
            kind = next((k for k in ("refused", "absent") if reason.startswith(f"{k}: ")), "skipped")
            out[arch].append((kind, reason.removeprefix(f"{kind}: ")))
        else:
            out[arch].append(("passed", ""))
    return out


def cell(results: list[tuple[str, str]]) -> str:
    kinds = {k for k, _ in results}
    for kind, label in (("failed", "FAIL"), ("refused", "refused"), ("absent", "absent"), ("passed", "exact")):
        if kind in kinds:
            return label
    return "-"


def table(reports: list[Path]) -> tuple[str, bool]:
    """The table's text and whether every cell is free of failures."""
    releases = [r.stem for r in reports]
    per = {release: outcomes(r) for release, r in zip(releases, reports)}
    rows = [arch for arch in TINY_ARCHS if any(arch in per[r] for r in releases)]
    width = max(len(a) for a in rows + [OTHER, "transformers"]) + 2
    lines = ["transformers".ljust(width) + "".join(r.rjust(10) for r in releases)]
    lines += [arch.ljust(width) + "".join(cell(per[r].get(arch, [])).rjust(10) for r in releases) for arch in rows]
    lines.append(OTHER.ljust(width) + "".join(
        (f"{sum(k == 'passed' for k, _ in per[r].get(OTHER, []))} ok" if cell(per[r].get(OTHER, [])) != "FAIL"
         else "FAIL").rjust(10) for r in releases))
    notes: dict[str, set[str]] = defaultdict(set)
    failed = []
    for r in releases:
        for arch, results in per[r].items():
            for kind, reason in results:
                if kind in ("refused", "absent"):
                    notes[f"{kind}: {reason}"].add(r)
                elif kind == "failed":
                    failed.append(f"{r}: FAILED {reason}")
    lines += [""] + [f"  [{', '.join(sorted(rs, key=_version))}] {note}" for note, rs in sorted(notes.items())]
    lines += failed
    return "\n".join(lines), not failed


def _version(release: str) -> tuple[int, ...]:
    return tuple(int(x) for x in release.split(".") if x.isdigit())


def main(argv: list[str]) -> int:
    reports = [Path(a) for a in argv if Path(a).exists()]
    missing = [a for a in argv if not Path(a).exists()]
    text, ok = table(reports)
    print(text)
    for a in missing:
        print(f"no report: {a} (its suites did not run)")
    return 0 if ok and not missing else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
