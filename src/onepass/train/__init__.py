"""Training: the accelerate loop (``onepass train``) and the ``transformers.Trainer`` subclass.

    config.py       TrainConfig: every knob of a run, from YAML and flags
    data.py         units (conversations or prepared rows), the order of steps, micro-batches
    model.py        model, tokenizer, LoRA/QLoRA, attention backend
    loop.py         the loop: exact N-pass-equivalent steps, eval, checkpoints (``train``, ``eval_loss``)
    checkpoint.py   atomic checkpoints and exact resume
    report.py       metrics.json, tensorboard, the loss plot
    hf_trainer.py   OnePassTrainer for users already on HF's Trainer / DeepSpeed
    cli.py          ``onepass train``
"""

from onepass.train.loop import eval_loss, train

__all__ = ["eval_loss", "train"]
