"""One huge record over ``--max-tokens`` is skipped cheaply (issue 24, resources): before the fix a 50 MB record
cost 6.9 GB of RSS and 35 s only to be skipped, because every view was tokenized before its length was compared
with the budget. Now its token floor (onepass.render.token_floor) is over the budget and it is never tokenized.

A subprocess runs ``onepass prepare`` on a 20 MB single-turn record and on a tiny one; its peak RSS
(``ru_maxrss`` of the children) and wall time must stay near the tiny run's, and the skip is the normal
counted one (``over max_tokens: 1``)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from fault_helpers import ENV

MB = 1 << 20

_RUN = """
import resource, sys, time
from onepass.cli import main
t = time.monotonic()
try:
    main(sys.argv[1:])
except SystemExit as e:
    rc = e.code
else:
    rc = 0
print("WALL", time.monotonic() - t, "RSS_KB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "RC", rc)
"""


def _prepare(tmp_path, name, user_text):
    data = tmp_path / f"{name}.jsonl"
    record = {"id": name, "messages": [{"role": "user", "content": user_text}, {"role": "assistant", "content": "ok"}]}
    data.write_text(json.dumps(record) + "\n" + json.dumps({"id": "small", "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}) + "\n")
    out = tmp_path / f"{name}-out"
    proc = subprocess.run([sys.executable, "-c", _RUN, "prepare", "--data", str(data), "--tokenizer", "builtin:qwen3",
                           "--out", str(out), "--no-progress", "--max-tokens", "512"],
                          env=ENV, capture_output=True, text=True, timeout=600)
    text = proc.stdout + proc.stderr
    wall, rss = text.split("WALL ")[1].split()[0], text.split("RSS_KB ")[1].split()[0]
    return float(wall), int(rss) * 1024, json.loads((out / "stats.json").read_text()), text


@pytest.mark.e2e
def test_a_huge_record_over_max_tokens_is_skipped_without_tokenizing_it(tmp_path):
    words = "lorem ipsum dolor sit amet consectetur adipiscing elit 12345 ".split()
    huge = " ".join(words[i % len(words)] + str(i % 97) for i in range(20 * MB // 8))[:20 * MB]
    wall, rss, stats, text = _prepare(tmp_path, "huge", huge)
    base_wall, base_rss, base_stats, _ = _prepare(tmp_path, "tiny", "hello")
    assert stats["skipped_by_reason"] == {"over max_tokens": 1}, text
    assert stats["views_skipped"] == 1 and stats["views_trained"] == 1 and base_stats["views_trained"] == 2
    assert "huge.jsonl line 1, message 1: view of " in stats["skipped"][0], stats["skipped"]
    # the record itself (20 MB of text, a few copies while it is read and rendered) is all it may cost;
    # tokenizing it took ~3 GB and ~15 s here before the fix
    assert rss - base_rss < 600 * MB, f"peak RSS {rss / MB:.0f} MB vs {base_rss / MB:.0f} MB for a tiny record"
    assert wall - base_wall < 6, f"{wall:.1f} s vs {base_wall:.1f} s for a tiny record"
