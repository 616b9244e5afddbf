"""Training: two front ends over one core.

    core/           what both call, written once: the normaliser and eval mean, the guard's call, the model and
                    tokenizer loader, TRL's rows of its dataset types, the loss plot and metrics files
    run/            ``onepass train``: the accelerate loop (data, model, optimizer, step, evaluation, loop)
    trainer/        ``OnePassTrainer``: a drop-in for TRL's SFTTrainer (HF Trainer, DeepSpeed, FSDP)
    config.py       TrainConfig: every knob of a run, one component per concern, read flat; from YAML and flags
    hf_config.py    OnePassConfig: TrainingArguments plus the one-pass settings (what SFTConfig is to TRL)
    hyperparams.py  the ranges OnePassConfig checks, generated from TrainConfig's fields; clipping
    fingerprint.py  digests of the data and tokenizer, compared on resume
    checkpoint.py   atomic checkpoints and exact resume
    distributed.py  DDP / FSDP: what the launcher asked for, what runs
    sequence_parallel.py  sp_size: the degree asked for; ParallelDims (the parallel layout, built once)
    cli.py          ``onepass train``'s flags (no torch)
"""

from onepass.lazy import package_getattr

# loaded on first use: onepass.train.cli and .config are imported by `onepass --help`, which imports no torch
__all__ = ["OnePassConfig", "OnePassTrainer", "eval_loss", "train"]
__getattr__ = package_getattr(__name__, {"train": "onepass.train.run.loop:train",
                                         "eval_loss": "onepass.train.run.evaluation:eval_loss",
                                         "OnePassTrainer": "onepass.train.trainer.trainer:OnePassTrainer",
                                         "OnePassConfig": "onepass.train.hf_config:OnePassConfig"})
