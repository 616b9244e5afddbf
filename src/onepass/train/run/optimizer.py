"""The optimizer and learning-rate schedule of ``onepass train``: TrainingArguments' names, transformers' rules.

Why this module exists: what updates the weights is one concept, apart from the model that is loaded
(:mod:`onepass.train.run.model`) and the step that scales the gradients (:mod:`onepass.train.run.step`). The
parameter groups follow transformers' ``Trainer`` (weight decay on matrices, not on norms and biases), the
8-bit optimizers are bitsandbytes' under TrainingArguments' names, and ``lr_scheduler_type`` is
transformers' ``get_scheduler`` (``constant`` with its warmup). ``OnePassTrainer`` keeps HF ``Trainer``'s own.

    adamw            torch AdamW, fused where the device and dtype have a kernel
    sgd              torch SGD, fused likewise
    adamw_8bit       bitsandbytes AdamW8bit (CUDA)
    paged_adamw_8bit bitsandbytes PagedAdamW8bit (CUDA)
"""

from __future__ import annotations

import math
from typing import Any

import torch

from onepass.train.config import TrainConfig


BNB_OPTIMIZERS = {"adamw_8bit": "AdamW8bit", "paged_adamw_8bit": "PagedAdamW8bit"}
"""onepass's 8-bit optimizer names (TrainingArguments' names) -> the ``bitsandbytes.optim`` classes."""


def make_optimizer(model: Any, config: TrainConfig) -> torch.optim.Optimizer:
    """Weight decay on matrices only (not on norms and biases), as transformers' Trainer does."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": config.weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    if config.optim == "sgd":
        return _fused_if_possible(torch.optim.SGD, groups, lr=config.learning_rate)
    betas = (config.adam_beta1, config.adam_beta2)
    if config.optim == "adamw":
        return _fused_if_possible(torch.optim.AdamW, groups, lr=config.learning_rate, betas=betas,
                                  eps=config.adam_epsilon)
    import bitsandbytes as bnb

    cls = getattr(bnb.optim, BNB_OPTIMIZERS[config.optim])
    return cls(groups, lr=config.learning_rate, betas=betas, eps=config.adam_epsilon)


def _fused_if_possible(cls: type[torch.optim.Optimizer], groups: list[dict[str, Any]],
                       **kwargs: Any) -> torch.optim.Optimizer:
    """``cls(groups, fused=True)`` (one kernel per update, transformers' Trainer default since torch 2.8, and an
    update the step can skip on the device: :class:`onepass.train.run.step.Stepper`), else the default
    implementation where the parameters' device or dtype has no fused kernel."""
    try:
        return cls(groups, fused=True, **kwargs)
    except (RuntimeError, ValueError):
        return cls(groups, **kwargs)


def make_scheduler(optimizer: torch.optim.Optimizer, config: TrainConfig, total: int) -> Any:
    from transformers import get_scheduler

    warmup = config.warmup_steps or math.ceil(config.warmup_ratio * total)
    name = "constant_with_warmup" if config.lr_scheduler_type == "constant" else config.lr_scheduler_type
    return get_scheduler(name, optimizer, num_warmup_steps=warmup, num_training_steps=total)


__all__ = ["BNB_OPTIMIZERS", "make_optimizer", "make_scheduler"]
