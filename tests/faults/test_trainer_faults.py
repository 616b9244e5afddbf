"""OnePassTrainer under faults (issue 37): rows it was given are checked as ``onepass train`` checks a
prepared folder, a step with no target weight trains nothing, an endless ``IterableDataset`` streams, and
``evaluate()`` is the weighted mean whatever the eval batch size.

Before the fix: a dataset of rows with one NaN weight trained a NaN model (loss logged 0.0), all-zero
weights, a widened ``kv_end``, a negative weight and an id past the vocabulary trained silently or died in
torch; a step whose rows carry no weight divided 0 by 0 and made every weight NaN; the constructor read an
``IterableDataset`` to the end (an endless one: never returned); eval batch size 8 and 1 gave 3.99068 and
3.98775 (HF averages the batches' means).
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import datasets
import numpy as np
import pytest
import torch
from strategies import synthetic_conversations

from onepass.conversation.parse import parse_record
from onepass.errors import OnePassError
from onepass.model.tiny import tiny_model
from onepass.train.run.evaluation import eval_loss
from onepass.layout.tree import COLUMNS, row_from_columns

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def rows(qwen3_tokenizer):
    """One row per conversation of 12 synthetic conversations, ids compacted to those that occur."""
    from onepass.train.trainer.data import conversation_dataset

    convs = [parse_record(c, index=i) for i, c in enumerate(synthetic_conversations(12))]
    ds = conversation_dataset(convs, qwen3_tokenizer, schedule="one-pass")
    out = [row_from_columns(item) for item in ds]
    ids = np.unique(np.concatenate([np.concatenate([r.input_ids, r.targets[r.targets >= 0]]) for r in out]))
    return [dataclasses.replace(r, input_ids=np.searchsorted(ids, r.input_ids),
                                targets=np.where(r.targets < 0, r.targets,
                                                 np.searchsorted(ids, np.maximum(r.targets, 0)))) for r in out], len(ids)


def _dataset(rows):
    return datasets.Dataset.from_dict({c: [getattr(r, c) for r in rows] for c in COLUMNS})


def _trainer(tmp_path, vocab, train, eval_dataset=None, **overrides):
    from transformers import TrainingArguments

    from onepass.train.trainer.trainer import OnePassTrainer

    values = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, learning_rate=1e-3, max_steps=3,
                  logging_steps=1, save_strategy="no", report_to=[], seed=0, use_cpu=True, disable_tqdm=True,
                  dataloader_num_workers=0, gradient_checkpointing=False)
    model = tiny_model("qwen3", vocab, dtype=torch.float64, attn_implementation="sdpa")
    return OnePassTrainer(model=model, args=TrainingArguments(**values | overrides), train_dataset=train,
                          eval_dataset=eval_dataset, allow_inexact=True)


def _set(row, column, index, value):
    values = getattr(row, column).copy()
    values[index] = value
    return dataclasses.replace(row, **{column: values})


def _broken(row, vocab):
    first_target = int(np.flatnonzero(row.targets != -100)[0])
    n = len(row)
    return {
        "NaN weight": ("weights", _set(row, "weights", first_target, np.nan)),
        "negative weight": ("weights", _set(row, "weights", first_target, -1.0)),
        "widened kv_end": ("kv_end", _set(row, "kv_end", n - 2, n) if row.kv_end[n - 2] != n else
                           _set(row, "kv_end", 1, 2)),
        "id past the vocabulary": ("input_ids", _set(row, "input_ids", 2, vocab + 5)),
    }


@pytest.mark.parametrize("case", ["NaN weight", "negative weight", "widened kv_end", "id past the vocabulary"])
def test_a_broken_row_given_to_the_trainer_is_refused_before_training(tmp_path, rows, case):
    good, vocab = rows
    column, bad = _broken(good[3], vocab)[case]
    with pytest.raises(OnePassError) as raised:
        trainer = _trainer(tmp_path, vocab, _dataset([good[0], good[1], good[2], bad, *good[4:]]))
        trainer.train()  # the old code trains it (or dies in torch)
    line = str(raised.value)
    assert "\n" not in line and f"train_dataset: row 3, {column}" in line, line


def test_all_zero_weights_given_to_the_trainer_are_refused(tmp_path, rows):
    good, vocab = rows
    zero = [dataclasses.replace(r, weights=np.zeros_like(r.weights)) for r in good]
    with pytest.raises(OnePassError, match="no row has a positive weight"):
        _trainer(tmp_path, vocab, _dataset(zero)).train()


def test_a_broken_eval_row_is_refused_too(tmp_path, rows):
    good, vocab = rows
    _, bad = _broken(good[0], vocab)["NaN weight"]
    with pytest.raises(OnePassError, match=r"eval_dataset: row 0, weights"):
        _trainer(tmp_path, vocab, _dataset(good), eval_dataset=_dataset([bad, good[1]])).evaluate()


def test_a_step_with_no_target_weight_trains_nothing_and_keeps_the_weights_finite(tmp_path, rows):
    """Row 0 carries no weight (allowed: others do); with batch size 1 its step has nothing to train."""
    good, vocab = rows
    zero = dataclasses.replace(good[0], weights=np.zeros_like(good[0].weights))
    trainer = _trainer(tmp_path, vocab, _dataset([zero, *good[1:4]]), per_device_train_batch_size=1, max_steps=4,
                       data_seed=0)
    trainer.train()
    bad = [n for n, p in trainer.model.named_parameters() if not bool(torch.isfinite(p).all())]
    assert bad == []  # the old code divided 0 by 0: every weight NaN after the zero-weight step
    assert all(math.isfinite(h["loss"]) for h in trainer.state.log_history if "loss" in h)


def _endless(limit: int = 3000):
    """An ``IterableDataset`` of conversations forever, and how many items were read from it; reading more
    than ``limit`` means someone tried to read it all."""
    records, read = synthetic_conversations(50), {"n": 0}

    def generate():
        for i in itertools.count():
            read["n"] += 1
            if read["n"] > limit:
                raise AssertionError(f"read {limit} items of an endless stream: it is being read whole")
            yield records[i % len(records)]

    return datasets.IterableDataset.from_generator(generate), read


@pytest.mark.parametrize("packing", [False, True])
def test_an_endless_iterable_dataset_streams(tmp_path, qwen3_tokenizer, monkeypatch, packing):
    from transformers import TrainingArguments

    import onepass.train.trainer.stream as hf_stream
    from onepass.train.hf_config import OnePassConfig
    from onepass.train.trainer.trainer import OnePassTrainer

    # 16 records made into rows at a time, not 256: 3 steps read a few such batches (crossing from one to the
    # next), not one batch of 256 conversations rendered for 6 rows; and a narrow model (the LM head over the
    # whole Qwen3 vocabulary is most of a step): streaming is what is tested, not the model
    monkeypatch.setattr(hf_stream, "STREAM_BATCH", 16)
    stream, read = _endless()
    model = tiny_model("qwen3", len(qwen3_tokenizer), dtype=torch.float32, attn_implementation="sdpa",
                       hidden_size=32, intermediate_size=64)
    args = TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, max_steps=3,
                             logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True,
                             dataloader_num_workers=0, gradient_checkpointing=False)
    args = OnePassConfig(**args.to_dict() | {"packing": packing, "max_length": 512})
    trainer = OnePassTrainer(model=model, args=args, train_dataset=stream, processing_class=qwen3_tokenizer,
                             allow_inexact=True)
    assert read["n"] < 1000  # the constructor read a few items (the guard's), not the stream
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 3 and all(math.isfinite(x) and x > 0 for x in losses)


def test_a_streamed_broken_row_is_one_line_naming_the_item(tmp_path, rows):
    good, vocab = rows
    _, bad = _broken(good[5], vocab)["NaN weight"]
    items = [good[i % 4] for i in range(5)] + [bad] + [good[i % 4] for i in range(10)]
    stream = _dataset(items).to_iterable_dataset()
    trainer = _trainer(tmp_path, vocab, stream, per_device_train_batch_size=2, max_steps=6)
    with pytest.raises(OnePassError, match=r"train_dataset: row 5, weights"):
        trainer.train()


def test_evaluate_is_the_weighted_mean_whatever_the_eval_batch_size(tmp_path, rows):
    good, vocab = rows
    ds = _dataset(good[:11])  # 11 rows: every batch size below leaves a partial last batch
    losses = {}
    for size in (1, 3, 8):
        trainer = _trainer(tmp_path / str(size), vocab, ds, per_device_eval_batch_size=size)
        losses[size] = trainer.evaluate(ds)["eval_loss"]
    reference = eval_loss(trainer.model, good[:11])  # sum of weighted CE over the sum of weights
    for size, loss in losses.items():
        assert loss == pytest.approx(reference, rel=1e-10), (size, losses, reference)


def test_an_rl_batch_with_an_id_past_the_vocabulary_is_one_line_naming_the_row():
    """The RL path (token_logprobs, policy_loss, padded_token_logprobs) checks each row it scores like every other
    path; before, an id past the embedding was a raw IndexError inside the forward (a device assert on CUDA)."""
    from onepass.rl.layout import layout_rollouts
    from onepass.rl.logprobs import token_logprobs
    from onepass.rl.rollouts import trajectories_from_records

    records = [{"group": g, "turns": [{"prompt_ids": [1, 2, 3], "completion_ids": [4, 5 if g != "b" else 99], "advantage": 1.0}]}
               for g in ("a", "b")]
    batch = layout_rollouts(trajectories_from_records(records))
    model = tiny_model("qwen3", 50, dtype=torch.float32, attn_implementation="sdpa")
    with pytest.raises(OnePassError, match=r"rollout batch: row 1, (input_ids|targets): position \d+ holds 99, outside "
                                           r"the vocabulary of 50"):
        token_logprobs(model, batch)


def test_a_run_that_ends_with_non_finite_weights_says_so(tmp_path, rows, monkeypatch):
    """The Trainer steps on through a NaN gradient and logs the loss without it (logging_nan_inf_filter): a diverged
    run looked like any other (here an update makes a weight infinite)."""
    good, vocab = rows
    real = torch.optim.AdamW.step

    def poisoned(self, *a, **kw):
        out = real(self, *a, **kw)
        with torch.no_grad():
            self.param_groups[0]["params"][0].view(-1)[0] = float("inf")
        return out

    monkeypatch.setattr(torch.optim.AdamW, "step", poisoned)
    trainer = _trainer(tmp_path, vocab, _dataset(good))
    with pytest.raises(OnePassError, match="training ended with NaN or infinite weights"):
        trainer.train()
