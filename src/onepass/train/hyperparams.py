"""The range of every hyper-parameter: one table, read by ``onepass train`` (YAML and flags) and ``OnePassConfig``.

Why this module exists: a value out of range does not fail where it is given. ``max_grad_norm: -1``
made the clip coefficient negative, so every step climbed the loss (5.72 -> 7.10) and the run said
"finished"; an infinite learning rate or weight decay trained one step of NaN weights before the loss
noticed; ``adam_beta1: 2`` or ``seed: -1`` passed the config and raised deep in torch or numpy once
the data and the model were loaded. Each name has one :class:`Range` here, and both configs check
their values against it (:func:`check_hyperparameters`), so a bad value is one line naming the key,
before anything is loaded, the same line from a YAML file, a flag or ``OnePassConfig(...)``:

    >>> range_problem("adam_beta1", 2.0)
    'adam_beta1 must be in [0, 1), got 2.0'
    >>> range_problem("learning_rate", float("inf"))
    'learning_rate must be a finite number, got inf'
    >>> range_problem("max_grad_norm", -1.0) is None, clip_norm(-1.0), clip_norm(0.5)
    (True, None, 0.5)

Where ``transformers.TrainingArguments`` gives a value a meaning, that meaning is kept for both
configs: ``max_grad_norm`` 0, negative or None turns clipping off (the Trainer clips only when it is
> 0), so ``-1`` means "no clipping" in ``onepass train`` too (it used to mean gradient ascent). A value
that can only train something other than what was asked (NaN, an infinite rate, a beta outside
[0, 1), a seed numpy refuses) is refused everywhere. Add a row: its name (the config field's), the
:class:`Range`, and a test in ``tests/faults/test_hyperparam_faults.py``. No torch here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

SEED_LIMIT = 2**32  # numpy's legacy seeding (transformers' set_seed) takes [0, 2**32)


@dataclass(frozen=True, kw_only=True, slots=True)
class Range:
    """Allowed values: a finite number (an integer if ``integer``) in ``[low, high]`` (``high_open``:
    ``[low, high)``; ``low_open``: ``(low, ...``), or None when ``optional``."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    integer: bool = False
    optional: bool = False
    meaning: str = ""  # what a special value means, said with the error

    def text(self) -> str:
        if self.low is not None and self.high is not None:
            interval = (f"in {'(' if self.low_open else '['}{_num(self.low)}, "
                        f"{_num(self.high)}{')' if self.high_open else ']'}")
        elif self.low is not None:
            interval = f"{'>' if self.low_open else '>='} {_num(self.low)}"
        elif self.high is not None:
            interval = f"{'<' if self.high_open else '<='} {_num(self.high)}"
        else:
            interval = "a finite number"
        return interval


def _num(x: float) -> str:
    return "2**32" if x == SEED_LIMIT else str(int(x)) if float(x).is_integer() else repr(x)


RANGES: dict[str, Range] = {
    "learning_rate": Range(low=0.0),
    "weight_decay": Range(low=0.0),
    "adam_beta1": Range(low=0.0, high=1.0, high_open=True),
    "adam_beta2": Range(low=0.0, high=1.0, high_open=True),
    "adam_epsilon": Range(low=0.0),
    "max_grad_norm": Range(optional=True, meaning="0, a negative value or none: no clipping, as in transformers"),
    "warmup_ratio": Range(low=0.0, high=1.0, high_open=True),
    "warmup_steps": Range(low=0.0),
    "num_train_epochs": Range(low=0.0, low_open=True),
    "seed": Range(low=0, high=SEED_LIMIT, high_open=True, integer=True),
    "data_seed": Range(low=0, high=SEED_LIMIT, high_open=True, integer=True, optional=True),
    "per_device_train_batch_size": Range(low=1, integer=True),
    "per_device_eval_batch_size": Range(low=1, integer=True),
    "gradient_accumulation_steps": Range(low=1, integer=True),
    "lora_alpha": Range(low=0.0, low_open=True),
    "lora_dropout": Range(low=0.0, high=1.0, high_open=True),
}
"""Each hyper-parameter's allowed values, by config key (the ``TrainingArguments`` name where it has one)."""


def range_problem(name: str, value: Any) -> str | None:
    """Why ``value`` is not allowed for ``name`` (one line naming it), or None when it is (or ``name``
    has no row)."""
    rule = RANGES.get(name)
    if rule is None or (value is None and rule.optional):
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"{name} must be a number, got {value!r}"
    if not math.isfinite(value):
        return f"{name} must be a finite number, got {value!r}" + (f" ({rule.meaning})" if rule.meaning else "")
    if rule.integer and value != int(value):
        return f"{name} must be an integer, got {value!r}"
    low_bad = rule.low is not None and (value <= rule.low if rule.low_open else value < rule.low)
    high_bad = rule.high is not None and (value >= rule.high if rule.high_open else value > rule.high)
    if low_bad or high_bad:
        return f"{name} must be {rule.text()}, got {value!r}" + (f" ({rule.meaning})" if rule.meaning else "")
    return None


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
        problem = range_problem(name, value)
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


__all__ = ["RANGES", "Range", "check_hyperparameters", "clip_norm", "epochs_counted", "range_problem"]
