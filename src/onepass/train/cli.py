"""``onepass train``: a YAML config plus flag overrides -> :func:`onepass.train.train`.

Why this module exists: the training command has many options; keeping its
parser here keeps ``cli.py`` small. The flags are generated from the fields of
:class:`~onepass.train.config.TrainConfig` (type, default, help and group from
the field; the data settings by :func:`onepass.prepare.config.add_data_arguments`,
the function that makes ``onepass prepare``'s), so every flag overrides the config
key of the same name (dashes for underscores) and the YAML and the command line
cannot drift apart. The names
are ``transformers.TrainingArguments``' (``--learning-rate``,
``--per-device-train-batch-size``, ``--report-to``, ...); the short ones of the
last release (``--lr``, ``--batch-size``, ...) still work, with a warning.

    onepass train --config configs/qwen3-8b-qlora.yaml --data chats.jsonl --max-steps 100
    onepass train --tiny qwen3 --data builtin:mathchat --max-steps 50 --learning-rate 1e-3 --output-dir runs/t
    onepass train --config configs/qwen3-8b-qlora.yaml --resume          # latest checkpoint

Also runnable alone (``python -m onepass.train.cli ...``), which is what
``torchrun`` / ``accelerate launch`` start on every process. The parser imports no torch; the
run is :func:`onepass.train.run.loop.run`, imported when the command runs (:data:`RUN`).
"""

from __future__ import annotations

import argparse
import logging
import sys
import types
import typing
from collections.abc import Sequence
from typing import Any

from onepass.prepare.config import DATA_KEYS, add_data_arguments, data_flag_values
from onepass.errors import run_main
from onepass.key_value import key_value_arg
from onepass.lazy import resolve
from onepass.settings import Leaf, leaves
from onepass.train.config import DEPRECATED_KEYS, TrainConfig

RUN = "onepass.train.run.loop:run"  # the command's runner (torch), imported when it runs

_DESCRIPTION = "Fine-tune a HF causal LM on one-pass rows: a YAML config (--config) plus flag overrides."
_EPILOG = """\
Every flag overrides the config key of the same name (--max-steps or HF's --max_steps ->
max_steps); the names are transformers.TrainingArguments'. A step covers per_device_train_batch_size *
gradient_accumulation_steps * processes conversations (or prepared rows);
its loss is divided by the step's total target weight, so one-pass and n-pass take
the same steps. Outputs in --output-dir: metrics.json, loss.png, checkpoints/, final/
(save_pretrained: full model or LoRA adapter, with the tokenizer and chat template)."""


def _csv(value: str) -> list[str] | str:
    parts = [p.strip() for p in value.split(",") if p.strip()]
    return parts[0] if len(parts) == 1 else parts


_GROUPS = tuple(dict.fromkeys(leaf.group for leaf in leaves(TrainConfig)))  # the components, in order (--help)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _kind(hint: Any) -> Any:
    """The flag's type for a field's type hint: ``X | None`` is ``X``; ``str | tuple[str, ...]`` is a list."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return tuple if any(typing.get_origin(a) is tuple for a in args) else _kind(args[0])
    origin = typing.get_origin(hint)
    return origin if origin in (tuple, dict) else hint


# the flags `onepass train --help` shows; `--help-all` shows every flag
COMMON_FLAGS = ("config", "resume", "model", "tiny", "data", "eval_data", "schedule", "max_tokens", "finetune",
                "learning_rate", "num_train_epochs", "max_steps", "per_device_train_batch_size",
                "gradient_accumulation_steps", "output_dir")


class _Help(argparse.Action):
    """``-h``: the common flags only (a screen); ``--help-all``: every flag."""

    def __init__(self, option_strings: Sequence[str], dest: str, full: bool = False, **kwargs: Any) -> None:
        super().__init__(option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, nargs=0, **kwargs)
        self.full = full

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        hidden = []
        if not self.full:
            for action in parser._actions:
                if action.dest not in COMMON_FLAGS and not isinstance(action, _Help) and \
                        action.help is not argparse.SUPPRESS:
                    hidden.append((action, action.help))
                    action.help = argparse.SUPPRESS
        try:
            text = parser.format_help()
        finally:
            for action, text_ in hidden:
                action.help = text_
        if not self.full:
            text = "\n".join(line for line in text.splitlines() if line.strip() not in
                             {f"{g}:" for g in _GROUPS})  # groups left empty
            text += "\n\n(common flags only: --help-all lists every flag)\n"
        parser._print_message(text, sys.stdout)
        parser.exit()


def _add_field(g: Any, leaf: Leaf) -> None:
    kind = _kind(leaf.hint)
    default = leaf.default
    shown = "" if default in (None, (), {}) or kind is bool else f" (default: {default})"
    names = [_flag(leaf.name), *leaf.meta["flags"]]
    if "_" in leaf.name:  # HF's own spelling (--max_steps) too, not listed in --help
        _add_kind(g, ["--" + leaf.name], kind, dict(dest=leaf.name, default=None, help=argparse.SUPPRESS))
    common: dict[str, Any] = dict(dest=leaf.name, default=None, help=leaf.meta["help"] + shown)
    _add_kind(g, names, kind, common)


def _add_kind(g: Any, names: list[str], kind: Any, common: dict[str, Any]) -> None:
    if kind is bool:
        g.add_argument(*names, action=argparse.BooleanOptionalAction, **common)
    elif kind is dict:
        g.add_argument(*names, action="append", type=key_value_arg, metavar="KEY=VALUE", **common)
    elif kind is tuple:
        g.add_argument(*names, type=_csv, metavar="A,B", **common)
    else:
        g.add_argument(*names, type=kind if kind in (int, float) else str, **common)


def add_arguments(p: argparse.ArgumentParser, config: type = TrainConfig) -> None:
    """One flag per :class:`~onepass.train.config.TrainConfig` setting (type, help from the field; group from its
    component); the data settings as ``onepass prepare`` has them."""
    p.add_argument("-h", "--help", action=_Help, help="show the common flags and exit")
    p.add_argument("--help-all", action=_Help, full=True, help="show every flag and exit")
    p.add_argument("--config", help="a YAML file of config keys (see configs/); flags override it")
    p.add_argument("--resume", nargs="?", const=True, default=None, metavar="CHECKPOINT",
                   help="continue from the latest checkpoint in --output-dir, or from CHECKPOINT")
    p.add_argument("--resume-anyway", action="store_true",
                   help="with --resume: continue although settings, data or tokenizer changed since the checkpoint")
    groups = {name: p.add_argument_group(name) for name in dict.fromkeys(leaf.group for leaf in leaves(config))}
    source = groups["model"].add_mutually_exclusive_group()  # --model or --tiny
    settings = {leaf.name: leaf for leaf in leaves(config)}
    for leaf in settings.values():
        if leaf.path[-1] == "data_config":  # its fields, as `onepass prepare` has them; checked with the config
            if leaf.name == DATA_KEYS[0]:
                add_data_arguments(groups[leaf.group], overrides=True)
            continue
        _add_field(source if leaf.name in ("model", "tiny") else groups[leaf.group], leaf)
    for old, new in DEPRECATED_KEYS.items():  # read for one more release, with a warning naming the new flag
        kind = _kind(settings[new].hint)
        p.add_argument(_flag(old), dest=old, default=None, help=argparse.SUPPRESS,
                       type=kind if kind in (int, float) else str)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``train`` to ``onepass``'s subcommands."""
    p = subparsers.add_parser("train", help="fine-tune a model on one-pass rows (YAML config + flags)",
                              description=_DESCRIPTION, epilog=_EPILOG, add_help=False,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=RUN)
    return p


_NOT_CONFIG = ("config", "resume", "resume_anyway", "command", "func")


def overrides_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The config keys the flags set (None: not given); the data settings read by
    :func:`onepass.prepare.config.data_flag_values`, as ``onepass prepare`` reads them."""
    values = {k: v for k, v in vars(args).items() if k not in (*_NOT_CONFIG, *DATA_KEYS) and v is not None}
    if "tiny_config" in values:
        values["tiny_config"] = dict(values["tiny_config"])
    return {**values, **data_flag_values(args)}


class _Stderr(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is now (test harnesses swap it)."""

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, _value: Any) -> None:
        pass


def setup_logging() -> None:
    """``onepass`` messages (INFO and up, the message alone) on stderr."""
    logger = logging.getLogger("onepass")
    if not any(isinstance(h, _Stderr) for h in logger.handlers):
        handler = _Stderr()
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m onepass.train.cli``: the same command without the other subcommands."""
    import os

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    parser = argparse.ArgumentParser(prog="onepass train", description=_DESCRIPTION, add_help=False,
                                     epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run_main(resolve(RUN), parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
