"""The one dtype table: every weight dtype a command or config takes, by torch's name, and what each allows.

Why this module exists: ``--dtype`` is a flag of verify, train, eval, export and bench, a key of
``TrainConfig`` and of ``OnePassConfig.model_init_kwargs``. Each used to keep its own tuple of names
and turn a name into a ``torch.dtype`` its own way (``getattr(torch, name)`` on whatever was typed).
Here the names, which command takes which, and verify's default tolerance are one table; parsers
take their choices from it (no torch needed), and :func:`torch_dtype` is the one conversion.

    >>> dtype_names(trains=True)
    ('float32', 'bfloat16', 'float64')
    >>> dtype_names(auto=True)
    ('auto', 'float32', 'bfloat16', 'float16', 'float64')
    >>> default_tolerance("float64")
    1e-09

Add a dtype: one :class:`Dtype` row (torch's name; whether training takes it; verify's default
tolerance, or None when verify does not take it). No torch here until :func:`torch_dtype` runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from onepass.errors import UsageError

AUTO = "auto"  # from_pretrained's "the dtype the checkpoint was saved in"


@dataclass(frozen=True, kw_only=True, slots=True)
class Dtype:
    name: str  # torch's name: torch.<name>
    trains: bool  # onepass train / TrainConfig.dtype takes it (float16 weights without loss scaling do not train)
    verify_tolerance: float | None  # onepass verify's default relative tolerance; None: verify does not take it


DTYPES = (
    Dtype(name="float32", trains=True, verify_tolerance=1e-4),
    Dtype(name="bfloat16", trains=True, verify_tolerance=2e-2),
    Dtype(name="float16", trains=False, verify_tolerance=None),
    Dtype(name="float64", trains=True, verify_tolerance=1e-9),
)
_BY_NAME = {d.name: d for d in DTYPES}


def dtype_names(*, trains: bool | None = None, verified: bool | None = None, auto: bool = False) -> tuple[str, ...]:
    """The names in the table, those that train (``trains=True``) or that verify takes (``verified=True``);
    ``auto`` first when asked."""
    names = tuple(d.name for d in DTYPES if (trains is None or d.trains == trains)
                  and (verified is None or (d.verify_tolerance is not None) == verified))
    return ((AUTO,) if auto else ()) + names


def default_tolerance(name: str) -> float:
    """``onepass verify``'s default relative tolerance for weights in ``name``."""
    tolerance = _BY_NAME[name].verify_tolerance
    assert tolerance is not None, f"verify does not take {name}"
    return tolerance


def torch_dtype(name: Any) -> Any:
    """The ``torch.dtype`` of ``name``; ``"auto"`` and a ``torch.dtype`` pass through. A name not in the
    table is one line naming the ones that are."""
    if name == AUTO or not isinstance(name, str):
        return name
    if name not in _BY_NAME:
        raise UsageError(f"unknown dtype {name!r}; use one of {', '.join(dtype_names(auto=True))}")
    import torch

    return getattr(torch, name)
