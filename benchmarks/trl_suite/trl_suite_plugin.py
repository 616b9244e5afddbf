"""A pytest plugin (``-p trl_suite_plugin``): ``load_dataset`` of a stand-in hub dataset reads the copy the
harness saved (``$TRL_SUITE_DATASETS/ORG/NAME/CONFIG``), with the same ``split`` (slices included) and
``streaming``. Models need no patch: the stand-ins are a hub cache (``HF_HUB_CACHE``, ``HF_HUB_OFFLINE=1``).
Loaded before the test module is collected, so its ``from datasets import load_dataset`` gets this one.

With ``TRL_SUITE_STREAM=1`` (the streamed variants), every ``datasets.Dataset`` given to ``trl.SFTTrainer`` or
``OnePassTrainer`` as ``train_dataset`` / ``eval_dataset`` (or in a dict of eval datasets) is given as
``Dataset.to_iterable_dataset()`` instead, the same records in the same order; a test that left ``max_steps``
unset gets the map-style run's number of steps (a stream has no length to count epochs by): both trainers are
given exactly the same, so a test passes streamed unmodified and fails renamed only where onepass differs."""

from __future__ import annotations

import functools
import inspect
import math
import os
import re
from pathlib import Path
from typing import Any

import datasets

_ROOT = Path(os.environ.get("TRL_SUITE_DATASETS", "/nonexistent"))
_original = datasets.load_dataset


def _split(ds: Any, split: str) -> Any:
    match = re.fullmatch(r"(\w+)(?:\[(-?\d*):(-?\d*)\])?", split)
    if match is None:
        raise ValueError(f"trl_suite_plugin: split {split!r} not understood")
    name, start, stop = match.groups()
    part = ds[name]
    if start or stop:
        part = part.select(range(len(part))[slice(int(start) if start else None, int(stop) if stop else None)])
    return part


def load_dataset(path: str, name: str | None = None, *args: Any, split: str | None = None,
                 streaming: bool = False, **kwargs: Any) -> Any:
    local = _ROOT / str(path) / (name or "default")
    if not local.is_dir():
        return _original(path, name, *args, split=split, streaming=streaming, **kwargs)
    ds = datasets.load_from_disk(str(local))
    if split is not None:
        ds = _split(ds, split)
        return ds.to_iterable_dataset() if streaming else ds
    if streaming:
        return datasets.IterableDatasetDict({k: v.to_iterable_dataset() for k, v in ds.items()})
    return ds


datasets.load_dataset = load_dataset


def _stream(ds: Any) -> Any:
    custom = isinstance(getattr(ds, "format", None), dict) and ds.format.get("type") == "custom"
    return ds.to_iterable_dataset() if isinstance(ds, datasets.Dataset) and not custom else ds


def streamed(init: Any) -> Any:
    """A trainer's ``__init__`` that is given its datasets streamed (see the module doc)."""
    signature = inspect.signature(init)

    @functools.wraps(init)
    def __init__(*args: Any, **kwargs: Any) -> None:
        bound = signature.bind(*args, **kwargs)
        given = bound.arguments
        train = given.get("train_dataset")
        if isinstance(train, datasets.Dataset):
            config = given.get("args")
            if config is not None and getattr(config, "max_steps", 0) <= 0:
                per_step = config.per_device_train_batch_size * config.gradient_accumulation_steps
                config.max_steps = math.ceil(len(train) / per_step) * math.ceil(config.num_train_epochs)
            given["train_dataset"] = _stream(train)
        evals = given.get("eval_dataset")
        if isinstance(evals, dict):
            given["eval_dataset"] = {k: _stream(v) for k, v in evals.items()}
        elif evals is not None:
            given["eval_dataset"] = _stream(evals)
        init(*bound.args, **bound.kwargs)

    return __init__


if os.environ.get("TRL_SUITE_STREAM"):
    import trl

    from onepass.train import OnePassTrainer

    trl.SFTTrainer.__init__ = streamed(trl.SFTTrainer.__init__)
    OnePassTrainer.__init__ = streamed(OnePassTrainer.__init__)


def pytest_runtest_logreport(report: Any) -> None:
    """Each failure's exception line (else its first error line), written as it happens (a run cut short still
    says why)."""
    out = os.environ.get("TRL_SUITE_FAILURES")
    if out and report.failed:
        text = str(report.longrepr)
        errors = [line[1:].strip() for line in text.splitlines() if line.startswith("E ")]
        named = [e for e in errors if re.match(r"[\w.]*(Error|Exception|Exit)\b", e)]
        why = (named or errors or text.strip().splitlines()[-1:] or [""])[0]
        with open(out, "a", encoding="utf-8") as f:
            f.write(f"{report.nodeid}\t{report.when}\t{why[:300]}\n")


def pytest_collection_modifyitems(config: Any, items: list) -> None:
    """A resumed run: the tests an earlier run reported (``$TRL_SUITE_DONE``, one ``Class::name`` a line) are
    deselected, by exact id (pytest's ``--deselect`` takes prefixes: ``test_train_model`` would drop
    ``test_train_model_dtype`` too)."""
    path = os.environ.get("TRL_SUITE_DONE")
    if not path:
        return
    done = set(Path(path).read_text(encoding="utf-8").splitlines())
    keep = [item for item in items if "::".join(item.nodeid.split("::")[-2:]) not in done]
    if len(keep) < len(items):
        config.hook.pytest_deselected(items=[item for item in items if item not in keep])
        items[:] = keep
