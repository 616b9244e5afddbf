"""``prepare_parallel`` (forked workers, num_proc=2) gives the serial pipeline's rows and stats exactly."""

from __future__ import annotations

import json

import numpy as np
import pytest

from onepass.conversation import ConversationError
from onepass.data.load import load_conversations
from onepass.data.mathchat import sample_path
from onepass.data.parallel import prepare_parallel
from onepass.prepare import PrepareConfig, PrepareStats, prepare
from onepass.tree import COLUMNS


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

    from onepass.data.parallel import exit_on_sigterm, iter_prepared

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
    from onepass.data.parallel import _stop

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
    from onepass.data.parallel import iter_prepared

    for _ in range(20):  # each closes the stream with tasks in flight
        trees = iter_prepared("builtin:mathchat", qwen3_tokenizer, PrepareConfig(), PrepareStats(), num_proc=2,
                              limit=40)
        next(trees)
        trees.close()
