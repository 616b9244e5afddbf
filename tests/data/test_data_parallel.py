"""``prepare_parallel`` (forked workers, num_proc=2) gives the serial pipeline's rows and stats exactly."""

from __future__ import annotations

import json

import numpy as np
import pytest

from onepass.conversation.parse import ConversationError
from onepass.data.sources import load_conversations
from onepass.data.mathchat import sample_path
from onepass.prepare.parallel import prepare_parallel
from onepass.prepare.pipeline import PrepareConfig, PrepareStats, prepare
from onepass.layout.tree import COLUMNS


def serial(spec, tokenizer, config, *, limit=None):
    report = load_conversations(spec, strict=False, limit=limit)
    stats = PrepareStats()
    for line in report.skipped:
        stats.skip("invalid record", line)
    return prepare(report.conversations, tokenizer, config, stats=stats)


def assert_same(a, b):
    rows_a, stats_a = a
    rows_b, stats_b = b
    assert stats_a.to_dict() == stats_b.to_dict()
    assert len(rows_a) == len(rows_b)
    for x, y in zip(rows_a, rows_b):
        for c in COLUMNS:
            assert getattr(x, c).dtype == getattr(y, c).dtype
            np.testing.assert_array_equal(getattr(x, c), getattr(y, c))


def test_parallel_equals_serial_on_the_bundled_sample(tmp_path, qwen3_tokenizer):
    # 160 bundled conversations (3-turn follow-ups and 2-turn corrections; the whole sample takes
    # ~3x longer for nothing new) plus two bad records; a budget that skips a tree; packed rows
    lines = sample_path().read_text(encoding="utf-8").splitlines()
    lines = lines[:80] + lines[150:230]
    bad = json.dumps({"messages": [{"role": "bot", "content": "x"}]})
    data = tmp_path / "mixed.jsonl"
    data.write_text("\n".join(lines[:5] + ["{not json", *lines[5:100], bad, *lines[100:]]) + "\n")
    config = PrepareConfig(max_tokens=1024, pack=True)
    expected = serial(data, qwen3_tokenizer, config)
    got = prepare_parallel(data, qwen3_tokenizer, config, num_proc=2)
    assert_same(got, expected)
    stats = got[1]
    assert stats.conversations == 160 and stats.skipped_by_reason["invalid record"] == 2
    assert stats.skipped_by_reason["over max_tokens"] >= 1 and stats.rows < stats.trees


def test_limit_and_strict_match_the_serial_reader(tmp_path, qwen3_tokenizer):
    config = PrepareConfig(schedule="n-pass")
    assert_same(prepare_parallel("builtin:mathchat", qwen3_tokenizer, config, num_proc=1, limit=7),
                serial("builtin:mathchat", qwen3_tokenizer, config, limit=7))
    data = tmp_path / "bad.jsonl"
    data.write_text(sample_path().read_text(encoding="utf-8").splitlines()[0] + "\n{oops\n")
    with pytest.raises(ConversationError, match=r"bad\.jsonl line 2: not valid JSON"):
        prepare_parallel(data, qwen3_tokenizer, config, num_proc=1, strict=True)


def test_workers_take_sigterm_at_its_default_action_while_the_parent_handles_it(qwen3_tokenizer):
    # A worker that inherits the parent's Python SIGTERM handler can drop a SIGTERM sent during
    # its after-fork start-up, and Pool.terminate then joins it forever (seen as a hung
    # `--strict` test). Workers must be forked with the default action; the parent keeps its own.
    import multiprocessing
    import signal
    from pathlib import Path

    from onepass.prepare.parallel import exit_on_sigterm, iter_prepared

    def catches_sigterm(pid: int) -> bool:
        caught = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                      if line.startswith("SigCgt:"))
        return bool(int(caught.split()[1], 16) >> (signal.SIGTERM - 1) & 1)

    if not Path("/proc/self/status").exists():
        pytest.skip("reads /proc (Linux)")
    with exit_on_sigterm():
        trees = iter_prepared("builtin:mathchat", qwen3_tokenizer, PrepareConfig(), PrepareStats(),
                              num_proc=2, limit=40)
        next(trees)
        workers = multiprocessing.active_children()
        assert workers and catches_sigterm(workers[0].pid) is False
        assert catches_sigterm(__import__("os").getpid()) is True
        trees.close()


def test_an_early_stop_lets_in_flight_tasks_finish_before_the_workers_are_killed():
    # Pool.terminate kills a worker wherever it is; one killed while writing a result holds the result
    # queue's lock and terminate then hangs forever (1 in a few hundred early stops before this fix).
    from onepass.prepare.parallel import _stop

    calls = []

    class Result:
        def __init__(self, finishes: bool) -> None:
            self.finishes = finishes

        def wait(self, timeout: float) -> None:
            calls.append(("wait", self.finishes))

        def ready(self) -> bool:
            return self.finishes

    class Pool:
        def close(self) -> None:
            calls.append("close")

        def join(self) -> None:
            calls.append("join")

        def terminate(self) -> None:
            calls.append("terminate")

    _stop(Pool(), [Result(True), Result(True)])
    assert calls == ["close", ("wait", True), ("wait", True), "join", "terminate"]
    calls.clear()
    _stop(Pool(), [Result(True), Result(False)], timeout=0.0)  # a task that never ends: no join, terminate
    assert calls == ["close", ("wait", True), ("wait", False), "terminate"]


def test_early_stops_of_a_parallel_prepare_return(qwen3_tokenizer):
    from onepass.prepare.parallel import iter_prepared

    for _ in range(20):  # each closes the stream with tasks in flight
        trees = iter_prepared("builtin:mathchat", qwen3_tokenizer, PrepareConfig(), PrepareStats(), num_proc=2,
                              limit=40)
        next(trees)
        trees.close()


def _template_units(tokenizer, case, num_proc):
    from onepass.prepare.parallel import iter_units
    from onepass.prepare.template_report import tool_chain_conversations

    config = PrepareConfig(completion_format=case.completion_format, template_kwargs=case.template_kwargs,
                           reasoning=case.reasoning)
    stats = PrepareStats()
    trees = [t for unit in iter_units(tool_chain_conversations(), tokenizer, config, stats, num_proc=num_proc)
             for t in unit]
    return trees, stats


def test_parallel_stats_merge_every_count_on_every_vendored_template(qwen3_tokenizer, monkeypatch):
    """Every count survives the workers' merge, on every vendored template and setting (the flags each sets:
    derived views, reasoning left out by choice or by the template, parsed tool arguments, skips). The merge
    takes every running total of PrepareStats by itself; before, a hand-kept list of them (ADDITIVE) did,
    and a count missing from it was lost with --num-proc 2 while the suite stayed green (the parallel tests
    ran num_proc=1 on the one template that sets views_history_reasoning_dropped)."""
    import sys
    from pathlib import Path

    import onepass.prepare.parallel

    sys.path.insert(0, str(Path(__file__).parents[1]))
    from test_real_templates import CASES, EOS, chat_template

    monkeypatch.setattr(onepass.prepare.parallel, "CHUNK", 2)  # the 6 conversations over both workers
    seen = set()
    for case in CASES:
        before, eos = qwen3_tokenizer.chat_template, qwen3_tokenizer.eos_token
        qwen3_tokenizer.chat_template = chat_template(case.template)
        qwen3_tokenizer.eos_token = EOS.get(case.template, eos)
        try:
            serial_trees, serial_stats = _template_units(qwen3_tokenizer, case, 1)
            parallel_trees, parallel_stats = _template_units(qwen3_tokenizer, case, 2)
        finally:
            qwen3_tokenizer.chat_template, qwen3_tokenizer.eos_token = before, eos
        assert parallel_stats.to_dict() == serial_stats.to_dict(), case.id
        assert len(parallel_trees) == len(serial_trees), case.id
        for x, y in zip(parallel_trees, serial_trees):
            np.testing.assert_array_equal(x.input_ids, y.input_ids)
        seen |= {k for k, v in serial_stats.to_dict().items() if isinstance(v, int) and v}
    # the templates between them set every provenance flag (else this test would not see a lost one)
    assert {"views_derived", "views_reasoning_dropped", "views_history_reasoning_dropped",
            "tool_arguments_parsed", "views_skipped"} <= seen, seen
