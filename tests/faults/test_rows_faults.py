"""Train on prepared rows that are not what prepare writes, and on a step that goes non-finite (issue 24,
items 2 and 5): every broken invariant of the row format is refused before the first step with one line
naming the row and the column; NaN / inf / negative / all-zero weights never train a model reported
"finished"; a NaN loss stops the run before that step's update with a checkpoint of the last good step.

Before the fix: NaN weights trained a NaN model (final loss 0.0, status "finished"), a ``kv_end`` that lets
views see each other trained, an id past the vocabulary was a raw ``IndexError``.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from fault_helpers import onepass

from onepass.errors import OnePassError
from onepass.train.config import load_config
from onepass.train.run.loop import train


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, qwen3_tokenizer):
    """Rows of 4 MathChat conversations as prepare writes them (one tree per conversation)."""
    from onepass.data.sources import load_conversations
    from onepass.prepare.pipeline import PrepareConfig, prepare

    convs = load_conversations("builtin:mathchat", strict=False, limit=4).conversations
    rows, _ = prepare(convs, qwen3_tokenizer, PrepareConfig())
    return rows


def _write(tmp_path, rows, name="rows"):
    from onepass.prepare.pipeline import PrepareStats, write_dataset

    return str(write_dataset(rows, PrepareStats(), tmp_path / name))


def _train(tmp_path, data, **overrides):
    values = dict(tiny="qwen3", data=data, max_steps=2, save_steps=1, progress=False, save_model=False,
                  output_dir=str(tmp_path / "run"))
    return train(load_config(None, values | overrides), log=lambda _m: None)


def _set(row, column, index, value):
    values = getattr(row, column).copy()
    values[index] = value
    return dataclasses.replace(row, **{column: values})


def _cases(row):
    n = len(row)
    first_target = int(np.flatnonzero(row.targets != -100)[0])
    ignored = int(np.flatnonzero(row.targets == -100)[0])
    return {
        "kv_end lets views see each other": ("kv_end", _set(row, "kv_end", n - 2, n) if row.kv_end[n - 2] != n else
                                             _set(row, "kv_end", 1, 2)),
        "kv_end 0": ("kv_end", _set(row, "kv_end", 3, 0)),
        "kv_end 1e9": ("kv_end", _set(row, "kv_end", 3, 10**9)),
        "position id 1e7": ("position_ids", _set(row, "position_ids", 5, 10**7)),
        "negative token id": ("input_ids", _set(row, "input_ids", 2, -5)),
        "NaN weight": ("weights", _set(row, "weights", first_target, np.nan)),
        "inf weight": ("weights", _set(row, "weights", first_target, np.inf)),
        "negative weight": ("weights", _set(row, "weights", first_target, -1.0)),
        "weight on an ignored target": ("weights", _set(row, "weights", ignored, 1.0)),
        "column lengths differ": ("lengths", dataclasses.replace(row, targets=row.targets[:-3])),
    }


CASES = ["kv_end lets views see each other", "kv_end 0", "kv_end 1e9", "position id 1e7", "negative token id",
         "NaN weight", "inf weight", "negative weight", "weight on an ignored target", "column lengths differ"]


@pytest.mark.parametrize("case", CASES)
def test_a_broken_row_is_refused_before_the_first_step(tmp_path, prepared, case, one_thread):
    column, bad = _cases(prepared[2])[case]
    data = _write(tmp_path, [prepared[0], prepared[1], bad, prepared[3]])
    with pytest.raises(OnePassError) as raised:
        _train(tmp_path, data)
    assert f"row 2, {column}:" in str(raised.value)
    assert not (tmp_path / "run" / "checkpoints").exists()  # refused before any step


@pytest.mark.e2e
def test_ids_beyond_the_models_vocabulary_are_one_line(tmp_path, prepared):
    bad = _set(prepared[1], "input_ids", 4, 10**9)
    data = _write(tmp_path, [prepared[0], bad])
    proc = onepass("train", "--tiny", "qwen3", "--no-compact-vocab", "--data", data, "--max-steps", "1",
                   "--no-progress", "--no-save-model", "--output-dir", str(tmp_path / "run"))
    text, _ = proc.communicate(timeout=300)
    assert proc.returncode == 2 and "Traceback" not in text, text
    assert text.strip().splitlines()[-1].startswith("onepass: error: ") and "1,000,000,000" in text


def test_all_zero_weights_are_refused(tmp_path, prepared):
    data = _write(tmp_path, [dataclasses.replace(r, weights=np.zeros_like(r.weights)) for r in prepared])
    with pytest.raises(OnePassError, match="no row has a positive weight"):
        _train(tmp_path, data)


def test_a_non_finite_loss_stops_with_the_last_good_checkpoint(tmp_path, monkeypatch, one_thread):
    """The loss of step 2 turns NaN (an overflow, a bad batch): the run stops before step 2's update, the
    last checkpoint is step 1's and holds finite weights, metrics.json does not say "finished"."""
    from safetensors.torch import load_file

    import onepass.train.run.step as step
    from onepass.train.checkpoint import list_checkpoints

    calls = {"n": 0}
    real = step.batch_loss

    def poisoned(view, batch, **kwargs):  # kwargs: the sequence-parallel shard the step passes
        calls["n"] += 1
        loss = real(view, batch, **kwargs)
        return loss * float("nan") if calls["n"] == 2 else loss

    monkeypatch.setattr(step, "batch_loss", poisoned)
    with pytest.raises(OnePassError, match="step 2: the loss is nan"):
        _train(tmp_path, "builtin:mathchat", limit=4, max_steps=3, per_device_train_batch_size=1)
    out = tmp_path / "run"
    status = json.loads((out / "metrics.json").read_text())["status"]
    assert "finished" not in status and "stopped at step 1" in status
    (last,) = list_checkpoints(out)
    assert last.name == "step-000001"
    weights = load_file(str(last / "trainable.safetensors"))
    assert all(bool(t.isfinite().all()) for t in weights.values())
