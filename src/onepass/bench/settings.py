"""The settings ``onepass bench`` times, and the rows of each: numpy only, so a plan can be built and costed
without torch (``make gpu-check``'s dry run, :mod:`onepass.bench.gpu_plan`).

Why this module exists: a speed ratio compares two settings on the same conversations, so every
timer (the bench harness, the GPU check's speed step) must lay a workload out the one way.
"""

from __future__ import annotations

from collections.abc import Sequence

from onepass.errors import UsageError
from onepass.layout.pack import pack_layouts
from onepass.layout.schedule import parse_schedule, schedule_views
from onepass.layout.share import share_rows
from onepass.layout.tree import Layout
from onepass.layout.view import View

SETTINGS: dict[str, tuple[str, bool]] = {
    "n-pass": ("n-pass", False),
    "n-pass-packed": ("n-pass", True),
    "one-pass": ("one-pass", False),
    "one-pass-packed": ("one-pass", True),
    "k-pass-2-packed": ("k-pass:2", True),
    "k-pass-4-packed": ("k-pass:4", True),
    "k-pass-6-packed": ("k-pass:6", True),
    "budget-packed": ("budget", True),
    "one-pass-packed-shared": ("one-pass", True),
}
# settings whose packed rows share prefixes across conversations (onepass.layout.share), and the setting each is
# measured against: the same trees packed one per conversation
SHARED_SETTINGS = {"one-pass-packed-shared": "one-pass-packed"}


def layout_setting(views: Sequence[Sequence[View]], setting: str, max_tokens: int) -> list[Layout]:
    """Rows of ``setting`` for the workload; a tree over ``max_tokens`` is an error (no silent drop)."""
    schedule_name, packed = SETTINGS[setting]
    schedule = parse_schedule(schedule_name)
    trees: list[Layout] = []
    units: list[int] = []
    for c, conv_views in enumerate(views):
        out = schedule_views(conv_views, schedule, max_tokens=max_tokens)
        if out.skipped:
            raise UsageError(f"{setting}: {out.skipped[0]}; raise --max-tokens or drop that conversation")
        trees.extend(out.layouts)
        units.extend([c] * len(out.layouts))
    if setting in SHARED_SETTINGS:
        return share_rows(trees, units, max_tokens)
    return pack_layouts(trees, max_tokens) if packed else trees
