"""docs/code-map.md names every module of src/onepass, and names nothing that is not one."""

from __future__ import annotations

import re
from pathlib import Path

import onepass

SRC = Path(onepass.__file__).parent
CODE_MAP = Path(__file__).parents[1] / "docs" / "code-map.md"
ENTRY = re.compile(r"^(?P<indent> {2,7})(?P<name>[\w.]+(?:\.py|/))(?:\s|$)")  # deeper: a description's next line


def mapped(text: str) -> list[str]:
    """The module paths (``render/views.py``) the first code block lists: a ``name/`` line opens a package,
    the ``name.py`` lines indented under it are its modules; descriptions (their lines go on at the
    description's column) and ``#`` stage lines are skipped."""
    block = text.split("```", 2)[1].splitlines()[2:]  # after "src/onepass/"
    out: list[str] = []
    packages: list[tuple[str, int]] = []  # the open packages, outermost first: (name, indent)
    for line in block:
        m = ENTRY.match(line)
        if not m:
            continue
        indent, name = len(m["indent"]), m["name"]
        while packages and indent <= packages[-1][1]:
            packages.pop()
        if name.endswith("/"):
            packages.append((name, indent))
        else:
            out.append("".join(p for p, _ in packages) + name)
    return out


def modules() -> set[str]:
    return {p.relative_to(SRC).as_posix() for p in SRC.rglob("*.py") if p.name not in ("__init__.py", "__main__.py")}


def test_the_parser_reads_packages_and_skips_descriptions():
    text = "```\nsrc/onepass/\n  a.py   x\n                b.py is prose\n  pkg/   y\n    c.py  z\n  d.py\n```\n"
    assert mapped(text) == ["a.py", "pkg/c.py", "d.py"]
    nested = "```\nsrc/onepass/\n  pkg/\n    sub/\n      e.py\n    f.py\n  g.py\n```\n"
    assert mapped(nested) == ["pkg/sub/e.py", "pkg/f.py", "g.py"]


def test_every_module_is_in_the_code_map_and_every_name_there_is_a_module():
    listed = mapped(CODE_MAP.read_text(encoding="utf-8"))
    assert len(listed) == len(set(listed)), "a module listed twice"
    missing, stale = modules() - set(listed), set(listed) - modules()
    assert not missing, f"modules docs/code-map.md does not name: {sorted(missing)}"
    assert not stale, f"names in docs/code-map.md that are no module: {sorted(stale)}"
