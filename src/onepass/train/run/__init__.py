"""``onepass train``: the accelerate loop, one front end over :mod:`onepass.train.core`.

    data.py         units (conversations, TRL's records, or prepared rows), the order of steps, micro-batches, passes
    model.py        device, attention backend, the exactness guard, the model with LoRA/QLoRA, saving
    optimizer.py    the optimizer and the learning-rate schedule
    step.py         one optimizer step equal to the N-pass step (scaled by the core's normaliser)
    compiles.py     compiled attention on static shapes
    signals.py      how a run stops on a signal
    evaluation.py   the held-out loss, in a run or for any model (``eval_loss``)
    loop.py         the run around the steps: load, resume, eval and save on schedule, stop (``train``)
"""
