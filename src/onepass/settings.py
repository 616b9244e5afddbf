"""A setting declared once: its field carries its help, flags, allowed values, range and resume relevance.

Why this module exists: a run's settings used to be written three times (``TrainConfig``, ``OnePassConfig``'s
flat copy of the data settings, a table of ranges) and checked in four places, with the keys ``--resume``
compares kept as a fifth hand-written list. Here a setting is one dataclass field made by :func:`setting`,
and everything else is read from it: the command-line flags (:mod:`onepass.train.cli`,
:func:`onepass.prepare.config.add_data_arguments`), the flat YAML keys and ``to_dict`` (:func:`flat_dict`),
``OnePassConfig``'s one-pass fields, the checks (:func:`check_settings`, one path for every record) and the
keys a resumed run must keep (:func:`resume_keys`).

Settings are grouped in nested frozen records, one per component (model, data, fine-tuning, ...), each a field
made by :func:`component`; the flat names stay what users type (``learning_rate``, ``--max-steps``), so a
config is read, written and shown flat and built nested (:func:`build`, :func:`replace_flat`)::

    >>> @dataclass(frozen=True, kw_only=True)
    ... class Optim:
    ...     lr: float = setting(1e-3, "peak learning rate", range=Range(low=0.0), resume=True)
    >>> @dataclass(frozen=True, kw_only=True)
    ... class Run:
    ...     optim: Optim = component(Optim, "optimisation")
    ...     seed: int = setting(0, "the seed")
    >>> [leaf.name for leaf in leaves(Run)], resume_keys(Run)
    (['lr', 'seed'], ('lr',))
    >>> flat_dict(build(Run, {"lr": 0.5}))
    {'lr': 0.5, 'seed': 0}
    >>> range_problem("lr", -1.0, Range(low=0.0))
    'lr must be >= 0, got -1.0'

Add a setting: one :func:`setting` field in the component it belongs to, with its help, and its ``choices``
or ``range`` if it has any; ``resume=True`` when a resumed run must keep it; ``path=True`` when it names a
file (compared resolved). Its flag, YAML key, check and resume key follow. No torch here: pure data.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

SEED_LIMIT = 2**32  # numpy's legacy seeding (transformers' set_seed) takes [0, 2**32); shown as 2**32


@dataclass(frozen=True, kw_only=True, slots=True)
class Range:
    """Allowed values: a finite number (an integer if ``integer``) in ``[low, high]`` (``high_open``:
    ``[low, high)``; ``low_open``: ``(low, ...``), or None when ``optional``. ``note`` is said after the
    interval ("(or unset)"), ``meaning`` after the value (what a special value means); ``typed``: the
    interval reads "an integer >= 2" and a value of another type gets that same line."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    integer: bool = False
    optional: bool = False
    note: str = ""
    meaning: str = ""
    typed: bool = False

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
        return ("an integer " if self.typed else "") + interval + (f" {self.note}" if self.note else "")


def _num(x: float) -> str:
    return "2**32" if x == SEED_LIMIT else str(int(x)) if float(x).is_integer() else repr(x)


def range_problem(name: str, value: Any, rule: Range | None) -> str | None:
    """Why ``value`` is not allowed for ``name`` by ``rule`` (one line naming it), or None when it is."""
    if rule is None or (value is None and rule.optional):
        return None
    said = f" ({rule.meaning})" if rule.meaning else ""
    if rule.typed and (isinstance(value, bool) or not isinstance(value, int)):
        return f"{name} must be {rule.text()}, got {value!r}"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"{name} must be a number, got {value!r}"
    if not math.isfinite(value):
        return f"{name} must be a finite number, got {value!r}" + said
    if rule.integer and value != int(value):
        return f"{name} must be an integer, got {value!r}"
    low_bad = rule.low is not None and (value <= rule.low if rule.low_open else value < rule.low)
    high_bad = rule.high is not None and (value >= rule.high if rule.high_open else value > rule.high)
    if low_bad or high_bad:
        return f"{name} must be {rule.text()}, got {value!r}" + said
    return None


def setting(default: Any = dataclasses.MISSING, help: str = "", *, default_factory: Any = dataclasses.MISSING,
            flags: tuple[str, ...] = (), metavar: str | None = None, choices: tuple[str, ...] | None = None,
            what: str | None = None, range: Range | None = None, resume: bool = False, path: bool = False,
            hf: bool = False) -> Any:
    """A settings field: its default, the ``--help`` line, extra flag names (``--out``) and ``metavar``; its
    ``choices`` (``what`` names the value in the error: "unknown tiny architecture 'gpt9'") or :class:`Range`;
    ``resume``: a resumed run must keep it (``--resume`` refuses another value); ``path``: compared as a resolved
    path; ``hf``: ``transformers.TrainingArguments`` has it with the same meaning, so ``OnePassConfig`` checks
    the same range."""
    meta = {"help": help, "flags": flags, "metavar": metavar, "choices": choices, "what": what, "range": range,
            "resume": resume, "path": path, "hf": hf}
    if default_factory is not dataclasses.MISSING:
        return field(default_factory=default_factory, metadata=meta)
    return field(default=default, metadata=meta)


def component(cls: type, group: str | None = None) -> Any:
    """A field holding a nested settings record (default: ``cls()``); ``group`` titles its flags in ``--help``."""
    return field(default_factory=cls, metadata={"component": True, "group": group})


def is_component(f: dataclasses.Field) -> bool:
    return bool(f.metadata.get("component"))


def _hints(cls: type) -> dict[str, Any]:
    """The fields' type hints (a component's class is its default factory, so it resolves wherever it is defined)."""
    local = {f.default_factory.__name__: f.default_factory for f in dataclasses.fields(cls) if is_component(f)}
    return typing.get_type_hints(cls, localns=local)  # type: ignore[arg-type]


@dataclass(frozen=True, kw_only=True, slots=True)
class Leaf:
    """One setting of a nested record: its flat ``name``, the attributes leading to the record that holds it
    (``path``), its field, type hint and the group of its component."""

    name: str
    path: tuple[str, ...]
    field: dataclasses.Field
    hint: Any
    group: str | None

    @property
    def meta(self) -> Mapping[str, Any]:
        return self.field.metadata

    @property
    def default(self) -> Any:
        f = self.field
        return f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]


@functools.cache
def leaves(cls: type, *, _path: tuple[str, ...] = (), _group: str | None = None) -> tuple[Leaf, ...]:
    """Every setting of ``cls`` in declaration order, nested components walked in place (their fields where the
    component is declared): the order of the flags, the YAML keys and ``to_dict``."""
    hints = _hints(cls)
    out: list[Leaf] = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        if is_component(f):
            out.extend(leaves(hints[f.name], _path=(*_path, f.name), _group=f.metadata.get("group") or _group))
        else:
            out.append(Leaf(name=f.name, path=_path, field=f, hint=hints[f.name], group=_group))
    return tuple(out)


@functools.cache
def components(cls: type, *, _path: tuple[str, ...] = ()) -> dict[str, tuple[str, ...]]:
    """Each nested component's attribute name -> the attributes leading to it (``data_config`` ->
    ``("input_config", "data_config")``)."""
    hints = _hints(cls)
    out: dict[str, tuple[str, ...]] = {}
    for f in dataclasses.fields(cls):
        if is_component(f):
            out[f.name] = (*_path, f.name)
            out.update(components(hints[f.name], _path=(*_path, f.name)))
    return out


@functools.cache
def flat_paths(cls: type) -> dict[str, tuple[str, ...]]:
    """Every flat name (settings and components) -> its path of attributes: what a flat view of ``cls`` reads."""
    out = {leaf.name: (*leaf.path, leaf.name) for leaf in leaves(cls)}
    for name, path in components(cls).items():
        out.setdefault(name, path)
    assert len(out) == len(leaves(cls)) + len(components(cls)), f"{cls.__name__}: a flat name is declared twice"
    return out


def resume_keys(cls: type) -> tuple[str, ...]:
    """The settings a resumed run must keep (``resume=True``), in declaration order."""
    return tuple(leaf.name for leaf in leaves(cls) if leaf.meta.get("resume"))


def path_keys(cls: type) -> tuple[str, ...]:
    """The settings that name a file or folder (``path=True``): compared as resolved paths."""
    return tuple(leaf.name for leaf in leaves(cls) if leaf.meta.get("path"))


def ranges(cls: type, *, hf: bool = False) -> dict[str, Range]:
    """Each setting's :class:`Range` by flat name (``hf``: only those ``TrainingArguments`` shares)."""
    return {leaf.name: leaf.meta["range"] for leaf in leaves(cls)
            if leaf.meta.get("range") is not None and (leaf.meta.get("hf") or not hf)}


def build(cls: type, values: Mapping[str, Any]) -> Any:
    """A nested ``cls`` from flat ``values`` (each component built from its own settings; the rest default)."""
    hints = _hints(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if is_component(f):
            kwargs[f.name] = values[f.name] if f.name in values else build(hints[f.name], values)
        elif f.init and f.name in values:
            kwargs[f.name] = values[f.name]
    return cls(**kwargs)


def replace_flat(record: Any, changes: Mapping[str, Any]) -> Any:
    """A copy of the nested ``record`` with flat ``changes`` (a setting's or a component's name); a component
    without changes is kept as it is (not rebuilt, so not checked or parsed again); one with a ``replace``
    method (``DataConfig``: it keeps its parsed schedule) is changed through it."""
    unknown = set(changes) - set(flat_paths(type(record)))
    if unknown:
        raise TypeError(f"{type(record).__name__} has no setting {sorted(unknown)[0]!r}")
    own: dict[str, Any] = {}
    names = {f.name: f for f in dataclasses.fields(record)}
    for f in names.values():
        if not is_component(f):
            continue
        sub = changes.get(f.name, getattr(record, f.name))
        inner = {k: v for k, v in changes.items() if k in flat_paths(type(sub))}
        if inner:
            sub = sub.replace(**inner) if hasattr(sub, "replace") else replace_flat(sub, inner)
        if sub is not getattr(record, f.name):
            own[f.name] = sub
    own.update({k: v for k, v in changes.items() if k in names and not is_component(names[k])})
    return dataclasses.replace(record, **own)


def flat_dict(record: Any) -> dict[str, Any]:
    """Plain values by flat name, in declaration order (tuples as lists, mappings as dicts): a YAML file's keys."""
    out: dict[str, Any] = {}
    for leaf in leaves(type(record)):
        value = record
        for name in (*leaf.path, leaf.name):
            value = getattr(value, name)
        out[leaf.name] = list(value) if isinstance(value, tuple) else dict(value) if isinstance(value, Mapping) \
            else value
    return out


def check_settings(record: Any, error: Callable[[str], BaseException], *, skip: tuple[str, ...] = ()) -> None:
    """Raise ``error(line)`` for the first of ``record``'s own settings (not its components') outside its
    ``choices`` or :class:`Range` (or not true or false, for a ``bool``), in declaration order; ``skip``: settings
    not read in this record's case (``num_train_epochs`` under ``max_steps``). A tuple value is checked element by
    element against ``choices``."""
    for f in dataclasses.fields(record):
        if not f.init or is_component(f) or f.name in skip:
            continue
        value = getattr(record, f.name)
        if f.type in ("bool", bool) and not isinstance(value, bool):
            raise error(f"{f.name} must be true or false, got {value!r}")
        allowed = f.metadata.get("choices")
        if allowed is not None and value is not None:
            for v in value if isinstance(value, tuple) else (value,):
                if v not in allowed:
                    raise error(f"unknown {f.metadata.get('what') or f.name} {v!r}; use one of {', '.join(allowed)}")
        problem = range_problem(f.name, value, f.metadata.get("range"))
        if problem is not None:
            raise error(problem)


__all__ = ["Leaf", "Range", "SEED_LIMIT", "build", "check_settings", "component", "components", "flat_dict",
           "flat_paths", "is_component", "leaves", "path_keys", "range_problem", "ranges", "replace_flat",
           "resume_keys", "setting"]
