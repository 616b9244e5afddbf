"""Training: the accelerate loop (``onepass train``) and the ``transformers.Trainer`` subclass.

    config.py       TrainConfig: every knob of a run, from YAML and flags
    hyperparams.py  the range of every hyper-parameter: one table, read by TrainConfig and OnePassConfig
    data.py         units (conversations or prepared rows), the order of steps, micro-batches, passes
    model.py        model, tokenizer, LoRA/QLoRA, attention backend
    step.py         one optimizer step equal to the N-pass step (the loss normaliser over processes)
    evaluation.py   the held-out loss, in a run or for any model (``eval_loss``)
    loop.py         the run around the steps: load, resume, eval and save on schedule, stop (``train``)
    checkpoint.py   atomic checkpoints and exact resume
    report.py       metrics.json + metrics.jsonl, trackers (tensorboard, wandb, ... through accelerate), the plot
    hf_trainer.py   OnePassTrainer: takes what TRL's SFTTrainer takes (HF Trainer, DeepSpeed, FSDP)
    hf_stream.py    the trainer's datasets as rows: streams read as they come, every row checked
    hf_config.py    OnePassConfig: TrainingArguments plus the one-pass settings (what SFTConfig is to TRL)
    cli.py          ``onepass train``
"""

from typing import Any

from onepass.train.evaluation import eval_loss
from onepass.train.loop import train

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
