"""The ranges ``OnePassConfig`` checks: those of ``TrainConfig``'s settings that ``TrainingArguments`` shares.

Why this module exists: a value out of range does not fail where it is given. ``max_grad_norm: -1``
made the clip coefficient negative, so every step climbed the loss (5.72 -> 7.10) and the run said
"finished"; an infinite learning rate or weight decay trained one step of NaN weights before the loss
noticed; ``adam_beta1: 2`` or ``seed: -1`` passed the config and raised deep in torch or numpy once
the data and the model were loaded. Each setting's :class:`~onepass.settings.Range` is declared once, on
its field of :mod:`onepass.train.config` (``range=``; ``hf=True`` where ``TrainingArguments`` has the
same setting), and both configs check their values against it, so a bad value is one line naming the key,
before anything is loaded, the same line from a YAML file, a flag or ``OnePassConfig(...)``:

    >>> range_problem("adam_beta1", 2.0, RANGES["adam_beta1"])
    'adam_beta1 must be in [0, 1), got 2.0'
    >>> range_problem("learning_rate", float("inf"), RANGES["learning_rate"])
    'learning_rate must be a finite number, got inf'
    >>> range_problem("max_grad_norm", -1.0, RANGES["max_grad_norm"]) is None, clip_norm(-1.0), clip_norm(0.5)
    (True, None, 0.5)

Where ``transformers.TrainingArguments`` gives a value a meaning, that meaning is kept for both
configs: ``max_grad_norm`` 0, negative or None turns clipping off (the Trainer clips only when it is
> 0), so ``-1`` means "no clipping" in ``onepass train`` too (it used to mean gradient ascent). A value
that can only train something other than what was asked (NaN, an infinite rate, a beta outside
[0, 1), a seed numpy refuses) is refused everywhere. Add a range: ``range=`` on the setting's field (and
``hf=True`` if ``TrainingArguments`` has it), and a test in ``tests/faults/test_hyperparam_faults.py``; a
``TrainingArguments`` field ``onepass train`` has no setting for is a row of :data:`TRAINING_ARGUMENTS_ONLY`.
No torch here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from onepass.settings import SEED_LIMIT, Range, range_problem, ranges
from onepass.train.config import TrainConfig

TRAINING_ARGUMENTS_ONLY: dict[str, Range] = {
    "data_seed": Range(low=0, high=SEED_LIMIT, high_open=True, integer=True, optional=True),
    "per_device_eval_batch_size": Range(low=1, integer=True),
}
"""``TrainingArguments`` fields with no ``onepass train`` setting, and their ranges."""

RANGES: dict[str, Range] = {**ranges(TrainConfig, hf=True), **TRAINING_ARGUMENTS_ONLY}
"""The ranges ``OnePassConfig`` checks, by ``TrainingArguments`` name: generated from the settings' fields."""


def check_hyperparameters(values: Mapping[str, Any] | Any, *, names: tuple[str, ...] | None = None,
                          error: Callable[[str], BaseException] = ValueError) -> None:
    """Raise ``error(line)`` for the first value out of its :data:`RANGES` row. ``values``: a mapping
    or an object with the fields as attributes (a config); ``names``: which rows (default: every row
    ``values`` has)."""
    get = values.get if isinstance(values, Mapping) else (lambda key, default: getattr(values, key, default))
    missing = object()
    for name in names or tuple(RANGES):
        value = get(name, missing)
        if value is missing:
            continue
        problem = range_problem(name, value, RANGES[name])
        if problem is not None:
            raise error(problem)


def epochs_counted(counted: bool) -> tuple[str, ...]:
    """The rows to check: all, but ``num_train_epochs`` only where it counts (no ``max_steps``: both
    configs then ignore it, as the Trainer does)."""
    return tuple(name for name in RANGES if counted or name != "num_train_epochs")


def clip_norm(max_grad_norm: float | None) -> float | None:
    """The norm to clip gradients to, or None for no clipping (``max_grad_norm`` 0, negative or None:
    the ``transformers.Trainer`` rule, which clips only when it is > 0)."""
    return float(max_grad_norm) if max_grad_norm is not None and max_grad_norm > 0 else None


__all__ = ["RANGES", "TRAINING_ARGUMENTS_ONLY", "check_hyperparameters", "clip_norm", "epochs_counted"]
