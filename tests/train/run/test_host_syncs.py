"""A training step never waits for the device: no read of a device tensor in forward, backward or update.

Everything a step needs from the layout (masks, chains, target positions, the normaliser) is planned from
the rows on the host (:mod:`onepass.batch`); the non-finite guard skips the update on the device; a step's
numbers are read once the next step is queued. On CPU the ops that would sync on CUDA are counted
(tests/host_syncs.py); on CUDA ``torch.cuda.set_sync_debug_mode("error")`` raises on any sync.
"""

from __future__ import annotations

import pytest
import torch

from onepass.train.config import load_config
from onepass.train.run.step import Stepper

from host_syncs import SyncCounter

pytestmark = pytest.mark.usefixtures("one_thread")


def _config(out, **overrides):
    values = dict(tiny="qwen3", data="builtin:mathchat", limit=4, max_steps=4, per_device_train_batch_size=2,
                  progress=False, save_model=False, output_dir=str(out), device="cpu")
    return load_config(None, values | overrides)


def _count_launches(monkeypatch, config) -> list[SyncCounter]:
    """Train ``config``; a SyncCounter per step launched (forward, backward, reduction, clip, update)."""
    from onepass.train.run.loop import train

    counters: list[SyncCounter] = []
    name = "launch" if hasattr(Stepper, "launch") else "__call__"  # b757769 had no launch: its whole step
    real = getattr(Stepper, name)

    def launch(self, step):
        counter = SyncCounter()
        counters.append(counter)
        with counter.counting():
            return real(self, step)

    monkeypatch.setattr(Stepper, name, launch)
    train(config, log=lambda _m: None)
    return counters


@pytest.mark.parametrize("attention", ["onepass_cpu", "sdpa"])
def test_a_training_step_reads_nothing_back_from_the_device(tmp_path, monkeypatch, attention):
    """Steps 2..4 of `onepass train` (two one-pass rows per forward: the padded batch path) run no op that
    would wait for the GPU. b757769: 13 per step on sdpa, 15 on onepass_cpu (the guard's and the record's
    float reads, the targets' boolean index and its backward, the plan's kv_end read back; and 50 reads of the
    non-fused AdamW's step counters, CPU tensors: benchmarks/host_step.py)."""
    counters = _count_launches(monkeypatch, _config(tmp_path / "run", attention=attention))
    assert len(counters) == 4
    for step, counter in enumerate(counters[1:], start=2):
        assert not counter.ops, f"step {step}: {dict(counter.ops)}\n{counter.report()}"


def test_the_trainer_loss_path_reads_nothing_back(tmp_path, monkeypatch):
    """OnePassTrainer's compute_loss and its backward (the same loss code): nothing read back after the first
    step (which checks the model's head once)."""
    from transformers import TrainingArguments

    from onepass.layout.tree import row_from_columns
    from onepass.model.tiny import tiny_model
    from onepass.train.trainer.trainer import OnePassTrainer, rows_dataset

    rows = []
    for n in (9, 14, 12, 7, 11, 10):
        ids = [1 + (i * 7 + n) % 40 for i in range(n)]
        rows.append(row_from_columns({"input_ids": ids, "position_ids": list(range(n)), "kv_end": [n] * n,
                                      "targets": ids[1:] + [-100], "weights": [1.0] * (n - 1) + [0.0]}))
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=3, logging_steps=10,
                             save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True)
    model = tiny_model("qwen3", 48, dtype=torch.float32, attn_implementation="sdpa")
    trainer = OnePassTrainer(model=model, args=args, train_dataset=rows_dataset(rows), allow_inexact=True)
    counters: list[SyncCounter] = []
    real = OnePassTrainer.compute_loss

    def compute_loss(self, model, inputs, *args, **kwargs):
        counter = SyncCounter()
        counters.append(counter)
        with counter.counting():
            loss = real(self, model, inputs, *args, **kwargs)
            loss.backward(retain_graph=True)  # its backward, counted too (the Trainer's own runs after)
        for p in model.parameters():
            p.grad = None
        return loss

    monkeypatch.setattr(OnePassTrainer, "compute_loss", compute_loss)
    trainer.train()
    assert len(counters) == 3
    for step, counter in enumerate(counters[1:], start=2):
        assert not counter.ops, f"step {step}: {dict(counter.ops)}\n{counter.report()}"


@pytest.mark.requires_cuda
@pytest.mark.parametrize("attention", ["flex_attention", "sdpa"])
def test_a_cuda_step_never_syncs(tmp_path, monkeypatch, attention):
    """On CUDA, torch's own sync check: steps 2..4 launched under set_sync_debug_mode("error"), bf16. flex runs
    in one length bucket (its one compile, in step 1: compiling syncs) and compiles nothing after."""
    import json

    from onepass.train.run.loop import train

    real = Stepper.launch
    launched = []

    def launch(self, step):
        if step == 0:  # the first step compiles flex and checks the head once
            return real(self, step)
        torch.cuda.set_sync_debug_mode("error")
        try:
            launched.append(step)
            return real(self, step)
        finally:
            torch.cuda.set_sync_debug_mode(0)

    monkeypatch.setattr(Stepper, "launch", launch)
    result = train(_config(tmp_path / "run", device="cuda", attention=attention, dtype="bfloat16", length_buckets=1),
                   log=lambda _m: None)
    assert launched == [1, 2, 3]
    metrics = json.loads(result.metrics_path.read_text())
    if attention == "flex_attention":
        (bucket,) = metrics["length_buckets"]
        assert metrics["compiles"]["compiles"] == {str(bucket): 1} and metrics["compiles"]["recompiles"] == 0, \
            metrics["compiles"]


@pytest.mark.parametrize("window", [None, 3])
def test_the_flex_block_mask_is_planned_from_the_host_rows(window):
    """flex_attention's BlockMask (tiles, and the mask_mod's kv_end and positions) built for a batch without a
    read of its tensors: the tiles come from the host rows (on CUDA: copied there without waiting)."""
    from types import SimpleNamespace

    from transformers import Qwen3Config

    from onepass.attention.backends import attention_mask_for
    from onepass.attention.mask import tree_block_mask
    from onepass.batch import host_rows
    from onepass.layout.tree import row_from_columns
    from onepass.loss import layouts_to_batch

    config = Qwen3Config(num_hidden_layers=2, sliding_window=window, use_sliding_window=window is not None,
                         max_window_layers=1, layer_types=None)
    config._attn_implementation = "flex_attention"
    rows = [row_from_columns({"input_ids": list(range(1, n + 1)), "position_ids": list(range(n)),
                              "kv_end": [n] * n, "targets": [1] * (n - 1) + [-100], "weights": [1.0] * n})
            for n in (7, 5)]
    batch = layouts_to_batch(rows)
    host = host_rows(batch)
    counter = SyncCounter()
    with counter.counting():
        masks = attention_mask_for(SimpleNamespace(config=config), batch["kv_end"],
                                   position_ids_BL=batch["position_ids"], host_kv_end=host.kv_end_BL,
                                   host_position_ids=host.position_ids_BL, block_size=4)
    assert not counter.ops, counter.report()
    for layer_type, mask in (masks.items() if isinstance(masks, dict) else [("", masks)]):
        want = tree_block_mask(host.kv_end_BL, block_size=4, position_ids=host.position_ids_BL,
                               window=window if layer_type == "sliding_attention" else None)
        assert torch.equal(mask.to_dense(), want.to_dense()), layer_type
