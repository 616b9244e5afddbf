"""Streaming prepare (``write_prepared`` over ``iter_prepared``) writes what the in-memory path writes
(``prepare`` then ``write_dataset``, the slow reference), in memory that does not grow with the data."""

from __future__ import annotations

import json
import subprocess
import sys

import datasets
import numpy as np
import pytest
from fault_helpers import ENV

from onepass.data.mathchat import sample_path
from onepass.prepare.parallel import iter_prepared
from onepass.prepare.pipeline import PrepareConfig, PrepareStats, load_rows, prepare, write_dataset, write_prepared
from onepass.prepare.shards import RowWriter, TreeSpool
from onepass.layout.tree import COLUMNS, Layout


def _data(tmp_path):
    """40 bundled conversations with a record that is not JSON and one that is not a conversation."""
    lines = sample_path().read_text(encoding="utf-8").splitlines()[:40]
    bad = json.dumps({"messages": [{"role": "bot", "content": "x"}]})
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(lines[:3] + ["{not json", *lines[3:30], bad, *lines[30:]]) + "\n")
    return path


def _reference(data, tokenizer, config, out):
    from onepass.data.sources import load_conversations

    report = load_conversations(data, strict=False)
    stats = PrepareStats()
    for line in report.skipped:
        stats.skip("invalid record", line)
    rows, stats = prepare(report.conversations, tokenizer, config, stats=stats)
    return write_dataset(rows, stats, out)


def _assert_same_dataset(a, b):
    da, db = datasets.load_from_disk(str(a)), datasets.load_from_disk(str(b))
    assert da.features == db.features and da.num_rows == db.num_rows
    assert da.data.table.equals(db.data.table)  # every value, with its Arrow type
    assert json.loads((a / "stats.json").read_text()) == json.loads((b / "stats.json").read_text())
    for x, y in zip(load_rows(a), load_rows(b)):
        for c in COLUMNS:
            assert getattr(x, c).dtype == getattr(y, c).dtype
            np.testing.assert_array_equal(getattr(x, c), getattr(y, c))


@pytest.mark.parametrize("num_proc", [1, 2])
@pytest.mark.parametrize("config", [PrepareConfig(), PrepareConfig(max_tokens=900, pack=True, weighting="turn")],
                         ids=["trees", "packed"])
def test_streaming_output_equals_the_in_memory_path(tmp_path, qwen3_tokenizer, config, num_proc, monkeypatch):
    import onepass.prepare.shards

    monkeypatch.setattr(onepass.prepare.shards, "BATCH_ROWS", 7)  # several record batches and shards
    monkeypatch.setattr(onepass.prepare.shards, "SHARD_BYTES", 100_000)
    data = _data(tmp_path)
    expected = _reference(data, qwen3_tokenizer, config, tmp_path / "reference")
    stats = PrepareStats()
    got = write_prepared(iter_prepared(data, qwen3_tokenizer, config, stats, num_proc=num_proc),
                         stats, config, tmp_path / "streamed")
    assert got == tmp_path / "streamed" and len(list(got.glob("data-*.arrow"))) > 1
    _assert_same_dataset(got, expected)
    assert stats.skipped_by_reason["invalid record"] == 2
    if config.pack:
        assert stats.skipped_by_reason["over max_tokens"] >= 1 and stats.rows < stats.trees


def test_same_rows_give_the_same_bytes(tmp_path, qwen3_tokenizer):
    data, config = _data(tmp_path), PrepareConfig(max_tokens=2048, pack=True)
    for n in (1, 2):
        stats = PrepareStats()
        write_prepared(iter_prepared(data, qwen3_tokenizer, config, stats, num_proc=n), stats, config,
                       tmp_path / f"out{n}")
    files = sorted(p.name for p in (tmp_path / "out1").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "out2").iterdir())
    for name in files:
        assert (tmp_path / "out1" / name).read_bytes() == (tmp_path / "out2" / name).read_bytes(), name


def test_nothing_to_write_publishes_nothing_and_keeps_the_old_output(tmp_path, qwen3_tokenizer):
    out = tmp_path / "prepared"
    stats = PrepareStats()
    assert write_prepared(iter([]), stats, PrepareConfig(), out) is None
    assert not out.exists() and not list(tmp_path.iterdir())
    config = PrepareConfig()
    write_prepared(iter_prepared("builtin:mathchat", qwen3_tokenizer, config, PrepareStats(), limit=2),
                   PrepareStats(), config, out)
    before = (out / "data-00000-of-00001.arrow").read_bytes()
    assert write_prepared(iter([]), PrepareStats(), config, out) is None
    assert (out / "data-00000-of-00001.arrow").read_bytes() == before


def _layout(n, start=0):
    ids = np.arange(start, start + n)
    return Layout(input_ids=ids, position_ids=np.arange(n), kv_end=np.full(n, n), targets=ids + 1,
                  weights=np.full(n, 1 / 3))


def test_spool_gives_back_every_tree_exactly(tmp_path):
    trees = [_layout(n, start=10 * n) for n in (3, 1, 5, 2)]
    with TreeSpool(tmp_path / "spool") as spool:
        for t in trees:
            spool.append(t)
        assert spool.lengths == [3, 1, 5, 2]
        for i in (2, 0, 3, 1, 2):
            got = spool.read(i)
            for c in COLUMNS:
                assert getattr(got, c).dtype == getattr(trees[i], c).dtype
                np.testing.assert_array_equal(getattr(got, c), getattr(trees[i], c))
    assert not (tmp_path / "spool").exists()


def test_a_value_that_does_not_fit_int32_is_an_error_not_a_wrap(tmp_path):
    row = _layout(2, start=2**31 - 1)
    with pytest.raises(Exception, match="overflow|out of bounds|Integer value"):
        with RowWriter(tmp_path, batch_rows=1) as w:
            w.write(row)
    assert not list(tmp_path.iterdir())  # the shards of a failed write are removed
    with pytest.raises(AssertionError, match="does not fit int32"):
        with TreeSpool(tmp_path / "spool") as spool:
            spool.append(row)


_PEAK = """import resource, sys
import onepass.prepare.shards
onepass.prepare.shards.BATCH_TOKENS = 4096  # a record batch far smaller than the data, so growth would show
from onepass.cli import main
rc = main(sys.argv[1:])
r = resource
print("PEAK_KB", r.getrusage(r.RUSAGE_SELF).ru_maxrss, r.getrusage(r.RUSAGE_CHILDREN).ru_maxrss)
sys.exit(rc)
"""


def _peak_kb(tmp_path, n, num_proc):
    proc = subprocess.run([sys.executable, "-c", _PEAK, "prepare", "--data", "synthetic:mathchat-sync",
                           "--limit", str(n), "--num-proc", str(num_proc), "--no-progress",
                           "--out", str(tmp_path / f"out{n}")], env=ENV, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.startswith("PEAK_KB"))
    return [int(v) for v in line.split()[1:]]


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("num_proc", [1, 2])
def test_peak_memory_does_not_grow_with_the_number_of_conversations(tmp_path, num_proc):
    # The in-memory path grows ~0.3 MB a conversation (rows, then a python-list copy for Arrow):
    # ~45 MB from 50 to 200 conversations. Streaming holds one record batch and a few chunks.
    small, large = _peak_kb(tmp_path, 50, num_proc), _peak_kb(tmp_path, 200, num_proc)
    growth_mb = [(b - a) / 1024 for a, b in zip(small, large)]  # this process, its largest worker
    assert max(growth_mb) < 20, f"peak RSS grew {growth_mb} MB from 50 to 200 conversations ({small} -> {large} KB)"
