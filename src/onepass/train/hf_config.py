"""``OnePassConfig``: ``transformers.TrainingArguments`` plus the one-pass settings (what ``SFTConfig`` is to TRL).

Why this module exists: a user moving a TRL script to one-pass should change
class names, not arguments. :class:`OnePassConfig` subclasses
``TrainingArguments`` (not TRL's ``SFTConfig``: TRL is optional), so every
HF argument, ``HfArgumentParser`` and YAML configs work as before, and adds
the settings that shape one-pass rows (``schedule``, ``weighting``,
``max_tokens``, ``completion_format``, ``template_kwargs``, ``reasoning``,
``allow_inexact``) and the ``SFTConfig`` names that mean something here:

- ``max_length``: the per-tree token budget; an alias of ``max_tokens`` (a
  conversation is split into trees of at most this many tokens; one turn
  that does not fit is a counted skip, never silently truncated);
- ``model_init_kwargs``: ``from_pretrained`` arguments when ``model`` is a string;
- ``chat_template_path``: a ``.jinja`` file (or ``builtin:NAME``) replacing the
  tokenizer's chat template (saved with every checkpoint);
- ``packing``, ``completion_only_loss``, ``assistant_only_loss``: one-pass
  always packs a conversation's turns into trees and always trains on the
  assistant turns only. They are accepted; a value we cannot honour
  (``packing=True`` across conversations, ``completion_only_loss=False``,
  ``assistant_only_loss=False``) logs one line saying what is done instead.

    >>> args = OnePassConfig("out", max_length=2048, report_to="none")
    >>> args.schedule, args.max_tokens, args.weighting
    ('one-pass', 2048, 'token')
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

from transformers import TrainingArguments

from onepass.dropped_reasoning import REASONING_HELP

log = logging.getLogger("onepass")


def _json(value: Any, name: str) -> dict[str, Any]:
    """A ``dict | str | None`` field (HfArgumentParser passes dicts as JSON text) as a dict."""
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise ValueError(f"{name} must be a mapping or JSON text of one, got {value!r}") from None
    if not isinstance(value, dict):
        raise TypeError(f"{name} must be a mapping, got {value!r}")
    return value


@dataclass
class OnePassConfig(TrainingArguments):
    """``TrainingArguments`` with the one-pass settings (see the module doc)."""

    schedule: str = field(default="one-pass", metadata={"help": "one-pass (default) | n-pass | k-pass:K | budget"})
    weighting: str = field(default="token", metadata={"help": "token (default) | turn | conversation"})
    max_tokens: int | None = field(default=None, metadata={"help": "tree token budget (max_length is an alias)"})
    completion_format: str | None = field(
        default=None, metadata={"help": "deepseek-r1, think-tags or a format string (see onepass prepare)"})
    template_kwargs: dict | str | None = field(
        default=None, metadata={"help": "extra chat template variables, e.g. {\"enable_thinking\": false}"})
    reasoning: str = field(default="keep", metadata={"help": REASONING_HELP})
    allow_inexact: bool = field(
        default=False, metadata={"help": "train even when the exactness guard finds one-pass != N-pass"})
    # SFTConfig names
    max_length: int | None = field(default=None, metadata={"help": "alias of max_tokens (SFTConfig's name)"})
    model_init_kwargs: dict | str | None = field(
        default=None, metadata={"help": "from_pretrained keyword arguments when model is a string"})
    chat_template_path: str | None = field(
        default=None, metadata={"help": "a .jinja file or builtin:NAME replacing the tokenizer's chat template"})
    packing: bool = field(default=False, metadata={"help": "accepted; one-pass packs each conversation's turns "
                                                           "into trees, never several conversations into a row"})
    completion_only_loss: bool | None = field(
        default=None, metadata={"help": "accepted; one-pass always trains on the assistant turns only"})
    assistant_only_loss: bool = field(
        default=True, metadata={"help": "accepted; one-pass always trains on the assistant turns only"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_length is not None:
            if self.max_tokens is not None and self.max_tokens != self.max_length:
                raise ValueError(f"max_length={self.max_length} and max_tokens={self.max_tokens} disagree; "
                                 "max_length is an alias of max_tokens: set one")
            self.max_tokens = self.max_length
        self.template_kwargs = _json(self.template_kwargs, "template_kwargs")
        self.model_init_kwargs = _json(self.model_init_kwargs, "model_init_kwargs")
        if self.packing:
            log.info("onepass: packing=True: one-pass packs each conversation's turns into trees; rows of "
                     "several conversations are not made (one dataset item is one conversation)")
        if self.completion_only_loss is False or not self.assistant_only_loss:
            log.info("onepass: completion_only_loss/assistant_only_loss=False: one-pass trains on the assistant "
                     "turns only (the loss of N-pass SFT); prompts are never trained")

    def render_config(self) -> Any:
        from onepass.render import RenderConfig

        return RenderConfig(template_kwargs=dict(self.template_kwargs or {}),
                            completion_format=self.completion_format, reasoning=self.reasoning)
