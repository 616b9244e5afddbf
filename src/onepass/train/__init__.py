"""Training: the accelerate loop (``onepass train``) and the ``transformers.Trainer`` subclass.

    config.py       TrainConfig: every knob of a run, from YAML and flags
    hyperparams.py  the range of every hyper-parameter: one table, read by TrainConfig and OnePassConfig
    data.py         units (conversations or prepared rows), the order of steps, micro-batches, passes
    model.py        model, tokenizer, LoRA/QLoRA, attention backend
    optimizer.py    the optimizer and the learning-rate schedule
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

from onepass.lazy import package_getattr

# loaded on first use: onepass.train.cli and .config are imported by `onepass --help`, which imports no torch
__all__ = ["OnePassConfig", "OnePassTrainer", "eval_loss", "train"]
__getattr__ = package_getattr(__name__, {"train": "onepass.train.loop:train",
                                         "eval_loss": "onepass.train.evaluation:eval_loss",
                                         "OnePassTrainer": "onepass.train.hf_trainer:OnePassTrainer",
                                         "OnePassConfig": "onepass.train.hf_config:OnePassConfig"})
