"""Training: the accelerate loop (``onepass train``) and the ``transformers.Trainer`` subclass.

    config.py       TrainConfig: every knob of a run, from YAML and flags
    data.py         units (conversations or prepared rows), the order of steps, micro-batches
    model.py        model, tokenizer, LoRA/QLoRA, attention backend
    loop.py         the loop: exact N-pass-equivalent steps, eval, checkpoints (``train``, ``eval_loss``)
    checkpoint.py   atomic checkpoints and exact resume
    report.py       metrics.json, trackers (tensorboard, wandb, ... through accelerate), the loss plot
    hf_trainer.py   OnePassTrainer: takes what TRL's SFTTrainer takes (HF Trainer, DeepSpeed, FSDP)
    hf_config.py    OnePassConfig: TrainingArguments plus the one-pass settings (what SFTConfig is to TRL)
    cli.py          ``onepass train``
"""

from typing import Any

from onepass.train.loop import eval_loss, train

__all__ = ["OnePassConfig", "OnePassTrainer", "eval_loss", "train"]


def __getattr__(name: str) -> Any:
    """``from onepass.train import OnePassTrainer, OnePassConfig`` without importing ``Trainer`` up front."""
    if name == "OnePassTrainer":
        from onepass.train.hf_trainer import OnePassTrainer

        return OnePassTrainer
    if name == "OnePassConfig":
        from onepass.train.hf_config import OnePassConfig

        return OnePassConfig
    raise AttributeError(f"module 'onepass.train' has no attribute {name!r}")
