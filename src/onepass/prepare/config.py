"""The data settings: how conversations become training trees, one record for every entry point.

Why this module exists: ``onepass prepare``, ``onepass train``, ``OnePassTrainer``, ``verify`` and
``show`` all turn conversations into views and trees with the same settings (schedule, token
budget, packing, weighting, the assistant turns trained, completion format, reasoning, template variables,
the date the template renders). They are defined
once here: each field is a :func:`onepass.settings.setting` carrying its ``help``, ``choices`` or range and
whether ``--resume`` compares it (as TRL's configs carry their help), the defaults are the fields', the checks
are :meth:`DataConfig.__post_init__`'s (the fields' own through :func:`onepass.settings.check_settings`, one
line each, a :class:`~onepass.errors.ConfigError`), and the schedule string is parsed once, into
:attr:`DataConfig.schedule_spec`, which everything downstream reads. ``PrepareConfig`` is this
record; ``template_date`` (default: today) is resolved to a concrete ``YYYY-MM-DD`` here, when the record is
built, once per run (:func:`onepass.render.clock.resolve_template_date`), and carried from then on, so a run
renders one date and records which (``OnePassConfig`` takes the date from here too). ``TrainConfig`` holds one
(``data_config``); ``OnePassConfig`` has its fields flat, SFTConfig-style, generated from these, and builds one
from them. The command-line flags of every subcommand are generated from the fields by
:func:`add_data_arguments` and read back by :func:`data_flag_values` / :func:`data_config_from_args`.

Add a data setting: one :func:`~onepass.settings.setting` field of :class:`DataConfig` with its ``help`` (and
``choices`` or ``range``; ``resume=True`` if a resumed run must keep it); a check involving other fields goes in
``__post_init__``. The flags of ``prepare``, ``train``, ``verify`` and ``show``, the YAML key of ``onepass
train``, ``TrainConfig.to_dict``, ``OnePassConfig``'s field and the resume keys follow from the field
(``tests/test_settings.py`` adds one and finds it in each); a spelling ``OnePassConfig`` needs otherwise (a
JSON type, another default) is a row of ``onepass.train.hf_config.FLAT_SPELLING``.

    >>> cfg = DataConfig(schedule="k-pass:2", max_tokens=4096, reasoning="drop")
    >>> cfg.schedule_spec, cfg.render.reasoning
    (Schedule(kind='k-pass', k=2), 'drop')
    >>> DataConfig(pack=True)
    Traceback (most recent call last):
    ...
    onepass.errors.ConfigError: pack needs a row budget: set max_tokens (--max-tokens)

No torch here: this is pure data.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from onepass.errors import ConfigError
from onepass.key_value import key_value_arg, parse_key_value
from onepass.render import COMPLETION_FORMATS, RenderConfig
from onepass.render.clock import resolve_template_date
from onepass.settings import Range, check_settings, flat_dict, setting
from onepass.render.reasoning import REASONING_CHOICES, REASONING_HELP
from onepass.conversation.turns import TRAIN_TURNS, TRAIN_TURNS_HELP
from onepass.layout.schedule import WEIGHTINGS, Schedule, parse_schedule


_UNSET_OK = "(or unset)"


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """How conversations become trees and rows (see the module doc). ``schedule`` may be given as a
    :class:`~onepass.layout.schedule.Schedule` already parsed (then it is not parsed again)."""

    schedule: str | Schedule = setting("one-pass", "one-pass | n-pass | k-pass:K | budget", metavar="SCHEDULE",
                                       resume=True)
    max_tokens: int | None = setting(None, "tree / row token budget", metavar="N", resume=True,
                                     range=Range(low=2, integer=True, optional=True, typed=True, note=_UNSET_OK))
    pack: bool = setting(False, "pack trees into rows of <= max_tokens", resume=True)
    share_prefix: bool = setting(True, "with --pack: trees of different conversations that share a token prefix (a "
                                 "system prompt, tools) become one tree per row, the same loss; --no-share-prefix "
                                 "packs one tree per conversation (n-pass never shares: it is the baseline)")
    share_window: int | None = setting(None, "share prefixes only among this many consecutive conversations of the "
                                       "data order (default: all of prepare's and OnePassTrainer's packed rows, one "
                                       "optimizer step's in onepass train)", metavar="N",
                                       range=Range(low=1, integer=True, optional=True, typed=True, note=_UNSET_OK))
    weighting: str = setting("token", "token | turn | conversation", choices=WEIGHTINGS, resume=True)
    completion_format: str | None = setting(None, "build completions from a format instead of the template: "
                                            + ", ".join(COMPLETION_FORMATS) + " or a format string",
                                            metavar="FORMAT", resume=True)
    reasoning: str = setting("keep", REASONING_HELP, choices=REASONING_CHOICES, resume=True)
    train_turns: str = setting("all", TRAIN_TURNS_HELP, choices=TRAIN_TURNS, resume=True)
    template_kwargs: dict[str, Any] = setting(help="extra chat template variable, e.g. enable_thinking=true "
                                              "(repeatable)", default_factory=dict, flags=("--template-kwarg",),
                                              metavar="KEY=VALUE", resume=True)
    template_date: str | datetime.date | None = setting(  # a date: YAML reads 2030-01-02 as one
        None, "the date a chat template that reads the clock renders (gpt-oss' \"Current date\"), YYYY-MM-DD "
        "(default: today, recorded in stats.json and the run's config)", metavar="YYYY-MM-DD")
    train_greeting: bool = setting(False, "train an assistant message that opens a conversation (tau2-bench's agent "
                                   "greets first: it answers no user turn); default: it is context only, counted as "
                                   "greetings_not_trained")
    schedule_spec: Schedule = field(init=False, repr=False, compare=False)
    """The parsed ``schedule``: what every consumer reads (the string is parsed here, once)."""
    render: RenderConfig = field(init=False, repr=False, compare=False)
    """The rendering part (template variables, completion format, reasoning) as the renderer takes it."""

    def __post_init__(self) -> None:
        spec = self.schedule
        if isinstance(spec, Schedule):
            object.__setattr__(self, "schedule", str(spec))
        elif not isinstance(spec, str):
            raise ConfigError(f"schedule must be a string, got {spec!r}")
        else:
            try:
                spec = parse_schedule(spec)
            except ValueError as e:
                raise ConfigError(str(e)) from None
        object.__setattr__(self, "schedule_spec", spec)
        check_settings(self, ConfigError, skip=("schedule",))  # choices, ranges, true or false
        if self.pack and self.max_tokens is None:
            raise ConfigError("pack needs a row budget: set max_tokens (--max-tokens)")
        if not isinstance(self.template_kwargs, Mapping):
            raise ConfigError(f"template_kwargs must be a mapping, got {self.template_kwargs!r}")
        for key in self.template_kwargs:  # a reserved name: RenderConfig's one check (render.template.RESERVED_KWARGS)
            if not isinstance(key, str):
                raise ConfigError(f"template_kwargs: {key!r} is not a name; template_kwargs are extra template "
                                  "variables, e.g. enable_thinking=false")
        object.__setattr__(self, "template_date", resolve_template_date(self.template_date))  # the one place
        object.__setattr__(self, "render", RenderConfig(template_kwargs=dict(self.template_kwargs),
                                                        completion_format=self.completion_format,
                                                        reasoning=self.reasoning, template_date=self.template_date,
                                                        train_greeting=self.train_greeting,
                                                        train_turns=self.train_turns))

    @property
    def shares(self) -> bool:
        """Do packed rows merge the trees of conversations that share a prefix (:mod:`onepass.layout.share`)?
        With packing and ``share_prefix``, under every schedule but ``n-pass`` (the baseline shares nothing)."""
        return self.pack and self.share_prefix and self.schedule_spec.kind != "n-pass"

    def check_share_window(self, *, pack: bool | None = None, flag: str = "--pack") -> None:
        """Refuse, in one line, a ``share_window`` that nothing reads: without packing (``pack``: the entry
        point's packing, :attr:`pack` when None; ``flag`` names it), with ``share_prefix`` off, or under
        n-pass, no prefix is shared, and a window that is silently ignored is a setting that does not mean
        what it says. Called where a config comes in (flags, YAML, ``OnePassConfig``), not in
        ``__post_init__``: the trainers copy a config unpacked (``replace(pack=False)``) to pack it themselves.

        >>> DataConfig(share_window=4).check_share_window()
        Traceback (most recent call last):
        ...
        onepass.errors.ConfigError: share_window=4 shares prefixes only in packed rows: add --pack (or drop \
share_window)
        """
        if self.share_window is None:
            return
        why = (f"shares prefixes only in packed rows: add {flag}" if not (self.pack if pack is None else pack)
               else "does nothing with share_prefix false (--no-share-prefix)" if not self.share_prefix
               else "does nothing under n-pass, the baseline that never shares" if self.schedule_spec.kind == "n-pass"
               else None)
        if why is not None:
            raise ConfigError(f"share_window={self.share_window} {why} (or drop share_window)")

    def replace(self, **changes: Any) -> DataConfig:
        """A copy with ``changes``; the parsed schedule is carried over, not parsed again."""
        changes.setdefault("schedule", self.schedule_spec)
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """The settings as plain values (the keys of a YAML config)."""
        return flat_dict(self)


_FIELDS = {f.name: f for f in dataclasses.fields(DataConfig) if f.init}
DATA_KEYS: tuple[str, ...] = tuple(_FIELDS)
"""The settings' names: config keys, and (dashes for underscores) flag names."""
RENDER_KEYS = ("completion_format", "reasoning", "template_kwargs", "template_date", "train_greeting",
               "train_turns")
"""The settings that say how a view is rendered and which turns get one (:attr:`DataConfig.render`): what
``verify``, ``show`` and ``templates check`` take besides the schedule."""


# ---------------------------------------------------------------------------------------------
# the command line: flags generated from the fields, read back into a DataConfig


def _bool_arg(text: str) -> bool:
    if text.lower() in ("true", "1", "yes"):
        return True
    if text.lower() in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _schedule_arg(text: str) -> Schedule:
    try:
        return parse_schedule(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_data_arguments(parser: Any, *, names: Collection[str] = DATA_KEYS, overrides: bool = False) -> None:
    """One flag per field named in ``names``: ``--max-tokens`` (and HF's spelling ``--max_tokens``, not listed
    in ``--help``, and the field's extra names), with the field's help, default and choices.

    Every flag's value is None unless given (:func:`data_flag_values` keeps the given ones). Without
    ``overrides`` (``prepare``, ``verify``, ``show``) a bad value is refused while parsing (choices, the
    schedule parsed to a :class:`Schedule` there, once); with ``overrides`` (``train``, whose flags
    override a YAML file) values are checked with the rest of the config, in one line.
    """
    for name in names:
        f = _FIELDS[name]
        meta = f.metadata
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]
        shown = "" if default in (None, {}) or f.type in ("bool", bool) or "(default" in meta["help"] \
            else f" (default: {default})"
        kwargs: dict[str, Any] = dict(dest=name, default=None)
        if f.type in ("bool", bool):  # pack, share_prefix, train_greeting
            kwargs["action"] = argparse.BooleanOptionalAction
        elif name == "template_kwargs":
            kwargs.update(action="append", type=key_value_arg if overrides else str, metavar=meta["metavar"])
        else:
            kwargs["metavar"] = meta["metavar"]
            if name in ("max_tokens", "share_window"):
                kwargs["type"] = int
            elif name == "schedule" and not overrides:
                kwargs["type"] = _schedule_arg
            if meta["choices"] and not overrides:
                kwargs.update(choices=meta["choices"], metavar=None)
        if "_" in name:  # HF's own spelling (--max_tokens) too, not listed in --help; a flag as HF has it
            hidden = dict(kwargs, action="store", nargs="?", const=True, type=_bool_arg) \
                if kwargs.get("action") is argparse.BooleanOptionalAction else kwargs  # (--share_prefix false)
            parser.add_argument("--" + name, **{**hidden, "help": argparse.SUPPRESS})
        parser.add_argument("--" + name.replace("_", "-"), *meta["flags"], help=meta["help"] + shown, **kwargs)


def data_flag_values(args: argparse.Namespace, *, names: Collection[str] = DATA_KEYS) -> dict[str, Any]:
    """The data settings given on the command line (None: not given), as config values."""
    out: dict[str, Any] = {}
    for name in names:
        value = getattr(args, name, None)
        if value is None:
            continue
        if name == "template_kwargs":
            value = dict(v if isinstance(v, tuple) else parse_key_value(v) for v in value)
        out[name] = value
    return out


def data_config_from_args(args: argparse.Namespace, *, names: Collection[str] = DATA_KEYS) -> DataConfig:
    """The :class:`DataConfig` of the flags :func:`add_data_arguments` added (the fields' defaults for the rest);
    a ``--share-window`` nothing reads is refused (:meth:`DataConfig.check_share_window`)."""
    config = DataConfig(**data_flag_values(args, names=names))
    config.check_share_window()
    return config
