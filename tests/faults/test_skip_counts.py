"""Skips are counted in full (issue 24, item 8): every skipped view has a reason in the counts, so the
reasons add up to the views skipped. Before the fix a tree over ``max_tokens`` counted its N views as
skipped but one reason (an 800-turn conversation: 800 skipped views, 335 reasons)."""

from __future__ import annotations

import pytest

from onepass.conversation.parse import parse_record
from onepass.prepare.pipeline import PrepareConfig, prepare


@pytest.mark.parametrize("num_proc", [1, 2])
def test_the_reasons_add_up_to_the_views_skipped(qwen3_tokenizer, num_proc, tmp_path):
    turns = 300
    messages = []
    for k in range(turns):
        messages += [{"role": "user", "content": f"q{k}"}, {"role": "assistant", "content": f"a{k}"}]
    record = {"id": "long", "messages": messages}
    if num_proc == 1:
        _, stats = prepare([parse_record(record)], qwen3_tokenizer, PrepareConfig(max_tokens=2000))
    else:
        import json

        from onepass.prepare.parallel import iter_prepared
        from onepass.prepare.pipeline import PrepareStats

        data = tmp_path / "long.jsonl"
        data.write_text(json.dumps(record) + "\n" + json.dumps({**record, "id": "long2"}) + "\n")
        stats = PrepareStats()
        list(iter_prepared(str(data), qwen3_tokenizer, PrepareConfig(max_tokens=2000), stats, num_proc=2))
    assert stats.views_skipped == turns * (1 if num_proc == 1 else 2)  # the views over the budget + the tree
    assert sum(stats.skipped_by_reason.values()) == stats.views_skipped
    assert stats.skip_summary().startswith(f"{stats.views_skipped} (over max_tokens: {stats.views_skipped})")
