"""The baseline our users run today: the same N-pass views through TRL's ``SFTTrainer``.

Why this module exists: a speedup is only worth quoting against what people
actually use. This times TRL's ``SFTTrainer`` (``packing=True``,
``packing_strategy="bfd"``, completion-only loss) on the workload's N-pass
views, with the same tiny model, vocabulary, dtype and row budget as the
onepass settings, in a fresh process like them. Each view becomes one
pre-tokenized example (``input_ids`` = the view's tokens, ``completion_mask``
= 1 on its completion), so TRL trains exactly the targets N-pass trains.

Two settings, the same trainer, data and loss:

- ``trl-sft-packed``: TRL's defaults, as a user runs it. ``SFTConfig`` turns
  activation (gradient) checkpointing on, so every layer's forward runs twice;
  the model's attention is ``sdpa`` on CPU (transformers builds a dense
  block-diagonal [L, L] mask from the packed ``position_ids``, so every pair of
  the 4096-token row is computed), FA2 varlen on CUDA when flash-attn is there.
- ``trl-sft-packed-tuned``: TRL's fastest honest configuration: checkpointing
  off, and on CPU the attention onepass uses (``onepass_cpu``), fed TRL's own
  packing: a forward pre-hook turns the padding-free ``position_ids`` into the
  block-diagonal causal ``kv_end`` mask (:func:`kv_end_from_position_ids`).

Neither changes TRL's LM head: ``SFTTrainer`` patches the model with
``add_fused_lm_head`` (never the [L, V] logits; tiles of 4096 positions x 32768
ids) and always asks it for entropy and top-1 too, for its metrics. On CUDA it
projects only the positions with a label; on a device without Triton (CPU) it
projects *every* position of the row, prompts included, and masks after.

Epochs are timed with a ``TrainerCallback``; the first epoch is the warm-up.
Needs ``pip install 'onepass[bench]'`` (TRL); without it the settings are skipped
with a line saying so.
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import torch

from onepass.attention.cpu import cpu_attention_mask, register
from onepass.dtypes import torch_dtype
from onepass.bench.harness import Timing, peak_memory_since, start_peak_memory, sync_device
from onepass.tiny import tiny_model
from onepass.couplings import checkpointing_field
from onepass.view import View

SETTING = "trl-sft-packed"  # TRL's defaults
TUNED = "trl-sft-packed-tuned"  # checkpointing off, onepass's attention backend where TRL can take it
SETTINGS = (SETTING, TUNED)


def available() -> bool:
    try:
        import trl  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass(frozen=True, kw_only=True)
class TrlJob:
    """One TRL timing run (picklable: it crosses into a spawned process)."""

    examples: list[tuple[list[int], int]]  # (view tokens, number of prompt tokens)
    vocab: int
    shape_kwargs: dict[str, int]
    dtype: str
    backend: str  # the model's attention implementation (sdpa on CPU)
    device: str
    seed: int
    repeats: int
    threads: int
    max_tokens: int
    lr: float = 1e-4
    checkpointing: bool = True  # SFTConfig's default (activation checkpointing)


def view_examples(views: list[list[View]]) -> list[tuple[list[int], int]]:
    return [(list(map(int, v.tokens)), int(v.num_prompt)) for conv in views for v in conv]


def _dataset(examples: list[tuple[list[int], int]]) -> Any:
    import datasets

    return datasets.Dataset.from_dict({
        "input_ids": [tokens for tokens, _ in examples],
        "completion_mask": [[0] * p + [1] * (len(tokens) - p) for tokens, p in examples],
    })


def _tokenizer() -> Any:
    """The little of a tokenizer SFTTrainer touches for pre-tokenized, padding-free data (pad and eos ids)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    inner = Tokenizer(models.WordLevel({"<pad>": 0, "<eos>": 1}, unk_token="<pad>"))
    return PreTrainedTokenizerFast(tokenizer_object=inner, pad_token="<pad>", eos_token="<eos>")


def kv_end_from_position_ids(position_ids_L: torch.Tensor) -> torch.Tensor:
    """The ``kv_end`` of a padding-free packed row: each sequence starts at position 0 and is causal alone.

    ``position_ids 0 1 2 0 1`` -> ``kv_end 3 3 3 5 5`` (key k is seen by queries k..kv_end[k]-1).
    """
    start_L = position_ids_L == 0
    if position_ids_L.numel() and not bool(start_L[0]):
        raise ValueError("a padding-free row must start a sequence (position_ids[0] == 0)")
    starts = torch.nonzero(start_L).flatten()
    ends = torch.cat([starts[1:], starts.new_tensor([position_ids_L.numel()])])
    return ends[torch.cumsum(start_L.long(), 0) - 1]


def _packed_mask_hook(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """TRL's padding-free batch (``position_ids``, no ``attention_mask``) -> onepass_cpu's kv_end mask."""
    position_ids_BL = kwargs.get("position_ids")
    if kwargs.get("attention_mask") is None and position_ids_BL is not None:
        kv_end_BL = torch.stack([kv_end_from_position_ids(p) for p in position_ids_BL])
        kwargs["attention_mask"] = cpu_attention_mask(kv_end_BL)
    return args, kwargs


def make_trainer(job: TrlJob, out_dir: str, callbacks: list[Any] | None = None) -> Any:
    """An ``SFTTrainer`` over the job's views: packed with BFD, loss on completions only."""
    from trl import SFTTrainer

    if job.backend == "onepass_cpu":  # a fresh process: register the backend again

        register()
    model = tiny_model("qwen3", job.vocab, dtype=torch_dtype(job.dtype), seed=job.seed,
                       attn_implementation=job.backend, device=job.device, **job.shape_kwargs).train()
    if job.backend == "onepass_cpu":
        model.register_forward_pre_hook(_packed_mask_hook, with_kwargs=True)
    return SFTTrainer(model=model, args=sft_config(job, out_dir), train_dataset=_dataset(job.examples),
                      processing_class=_tokenizer(), callbacks=callbacks or [])


def sft_config(job: TrlJob, out_dir: str) -> Any:
    """TRL's ``SFTConfig`` for ``job``: packed with BFD, loss on completions, one row per step. Activation
    checkpointing goes under the name the installed transformers takes (no v6 ``FutureWarning``)."""
    from trl import SFTConfig

    return SFTConfig(
        output_dir=out_dir, packing=True, packing_strategy="bfd", max_length=job.max_tokens,
        completion_only_loss=True, per_device_train_batch_size=1, gradient_accumulation_steps=1,
        num_train_epochs=1 + job.repeats, learning_rate=job.lr, lr_scheduler_type="constant",
        optim="adamw_torch_fused", logging_strategy="no", save_strategy="no", report_to=[], seed=job.seed,
        use_cpu=job.device == "cpu", disable_tqdm=True, dataloader_num_workers=0,
        bf16=job.dtype == "bfloat16", dataset_num_proc=None,
        **{checkpointing_field(): job.checkpointing},  # TRL's default True: activation checkpointing
    )


def time_trl(job: TrlJob) -> Timing:
    """Train ``1 + repeats`` epochs; every epoch after the first is timed."""
    from transformers import TrainerCallback

    torch.set_num_threads(job.threads)
    device = torch.device(job.device)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    class EpochTimer(TrainerCallback):
        def __init__(self) -> None:
            self.seconds: list[float] = []
            self._t0 = 0.0

        def on_epoch_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            sync_device(device)
            self._t0 = time.perf_counter()

        def on_epoch_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            sync_device(device)
            self.seconds.append(time.perf_counter() - self._t0)

    timer = EpochTimer()
    with tempfile.TemporaryDirectory() as tmp:
        trainer = make_trainer(job, tmp, [timer])
        before = start_peak_memory(device)
        trainer.train()
    return Timing(epoch_seconds=timer.seconds[1:], peak_memory_bytes=peak_memory_since(device, before))
