"""OnePassTrainer under mixed precision: a model whose weights are in another half dtype than the autocast.

Issue 45: fp16 weights with ``bf16=True`` crashed in the LM-head loss (``expected m1 and m2 to have the same
dtype``), full fine-tuning and LoRA alike, where SFTTrainer trains (its head runs inside the autocast forward).
The head's dtype rule (:func:`onepass.head.head_dtype`) multiplies in the autocast dtype, as the model's own head.
"""

from __future__ import annotations

import math

import pytest
import torch

from onepass.layout.tree import row_from_columns
from onepass.model.tiny import tiny_model
from onepass.train.trainer.trainer import OnePassTrainer, rows_dataset

pytestmark = pytest.mark.usefixtures("one_thread")


def _rows():
    rows = []
    for n in (19, 25, 30, 12):
        ids = [1 + (i * 7) % 48 for i in range(n)]
        rows.append(row_from_columns({"input_ids": ids, "position_ids": list(range(n)), "kv_end": [n] * n,
                                      "targets": ids[1:] + [-100], "weights": [1.0] * (n - 1) + [0.0]}))
    return rows_dataset(rows)


@pytest.mark.parametrize("finetune", ["full", "lora"])
def test_fp16_weights_train_under_bf16_mixed_precision(tmp_path, finetune):
    from transformers import TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=2, logging_steps=1,
                             save_strategy="no", report_to=[], use_cpu=True, bf16=True, disable_tqdm=True,
                             learning_rate=1e-3)
    extra = {}
    if finetune == "lora":
        from peft import LoraConfig

        extra["peft_config"] = LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    model = tiny_model("qwen3", 50, dtype=torch.float16, attn_implementation="sdpa")
    trainer = OnePassTrainer(model=model, args=args, train_dataset=_rows(), allow_inexact=True, **extra)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 2 and all(math.isfinite(x) and x > 0 for x in losses), losses
