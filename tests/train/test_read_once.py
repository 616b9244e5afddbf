"""A run reads ``--data`` once: the spec resolved once, each conversation parsed and rendered once.

STYLE.md 12: "Turn a spec (``--data``, a config file, a model name) into a typed record once, at the
edge, and pass the record down; never re-resolve a string in a deeper layer." Before, a
2-conversation ``onepass train`` resolved ``--data`` 5 times, parsed each record twice and rendered
each conversation twice: once for the exactness guard, once for training. The guard now checks the
views training rendered (:class:`onepass.prepare.guard_sample.ViewSample`).
"""

from __future__ import annotations

import collections
import sys

import pytest

import onepass.conversation.parse
import onepass.data.sources
import onepass.render.views
import onepass.train.run.loop  # noqa: F401  (imported before the counters go in: every module that runs is loaded)
from onepass.cli import main


@pytest.fixture
def calls(monkeypatch):
    """How often each function ran, wherever a module imported it from (every ``onepass`` namespace); for
    parse_record, which record each call parsed."""
    counts: collections.Counter[str] = collections.Counter()
    parsed: list[tuple[str, int]] = []
    wrapped = {}
    for module, name in ((onepass.data.sources, "resolve_data"), (onepass.conversation.parse, "parse_record"),
                         (onepass.render.views, "render_conversation")):
        original = getattr(module, name)

        def counting(*args, __original=original, __name=name, **kwargs):
            counts[__name] += 1
            if __name == "parse_record":
                parsed.append((kwargs.get("source"), kwargs.get("index")))
            return __original(*args, **kwargs)

        wrapped[original] = counting
    for mod in [m for n, m in sys.modules.items() if n == "onepass" or n.startswith("onepass.")]:
        for attr, value in list(vars(mod).items()):
            if callable(value) and value in wrapped:
                monkeypatch.setattr(mod, attr, wrapped[value])
    counts.parsed = parsed  # type: ignore[attr-defined]
    return counts


def test_onepass_train_resolves_data_once_and_renders_each_conversation_once(calls, tmp_path):
    assert main(["train", "--tiny", "qwen3", "--data", "builtin:mathchat", "--limit", "2", "--max-steps", "1",
                 "--output-dir", str(tmp_path / "run"), "--no-progress", "--no-save-model"]) == 0
    metrics = (tmp_path / "run" / "metrics.json").read_text()
    assert '"checked": true' in metrics and "2 conversations of builtin:mathchat" in metrics  # the guard ran on them
    assert calls["resolve_data"] == 1 and calls["render_conversation"] == 2
    # each record parsed once: the 2 read, and at most the next one (the reader looks one past --limit to say
    # whether the limit cut the data)
    assert len(set(calls.parsed)) == len(calls.parsed) and calls["parse_record"] <= 3, calls.parsed
