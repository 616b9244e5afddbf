"""The one loader of the model a front end trains, and of its tokenizer.

Why this module exists: ``onepass train`` (:mod:`onepass.train.run.model`) and ``OnePassTrainer``
(:mod:`onepass.train.trainer.model`) each loaded the model and then installed the recurrent mixers' tree forward,
and each had its own way to the tokenizer. Both go through here now. The model is
:func:`onepass.model.load.load_causal_lm` of a :class:`~onepass.model.load.ModelSpec` (each front end turns
its settings into that spec once: TrainConfig's fields, or TRL's ``model_init_kwargs``) with the mixers
installed, so a coupling that broke is one ``CouplingError`` line at load, in either.

The tokenizer has two rules, one per front end, kept because users of each rely on theirs:

- ``onepass train`` (``shipped=False``): any spec every command takes (``builtin:qwen3``, a folder, a hub id
  refused offline in one line), ``chat_template`` replacing the tokenizer's own, a default template for a
  tokenizer without one; cached per process (a 150k-token vocabulary takes seconds; the demo and the tests
  run many short runs), keyed by the template file's bytes so an edited template is read again;
- ``OnePassTrainer`` (``shipped=True``): the tokenizer as the model ships it, at the model's ``revision``,
  with ``trust_remote_code``, as TRL's ``SFTTrainer`` finds it (the trainer then sets ``chat_template_path``
  and the special tokens on it: never cached, since it is changed in place).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from onepass.mixers.tree import install as install_mixers
from onepass.model.load import ModelSpec, load_causal_lm
from onepass.render.tokenizer import auto_tokenizer
from onepass.render.tokenizer import load_tokenizer as command_tokenizer


def load_model(spec: ModelSpec) -> Any:
    """The model of ``spec``, by the one loader, with the recurrent mixers' tree forward (couplings checked now)."""
    model = load_causal_lm(spec)
    install_mixers(model)  # the recurrent mixers' tree forward, couplings checked now: one CouplingError line at load
    return model


def load_tokenizer(spec: str, *, chat_template: str | None = None, shipped: bool = False, revision: str | None = None,
                   trust_remote_code: bool = False) -> Any:
    """The tokenizer of ``spec`` by the rule of the front end asking (see the module doc): ``shipped`` is
    OnePassTrainer's (``revision``, ``trust_remote_code``), else ``onepass train``'s (``chat_template``)."""
    if shipped:
        return auto_tokenizer(spec, revision=revision, trust_remote_code=trust_remote_code)
    content = Path(chat_template).read_bytes() if chat_template and Path(chat_template).is_file() else None
    return _cached_tokenizer(spec, chat_template, content)


@functools.lru_cache(maxsize=4)
def _cached_tokenizer(spec: str, chat_template: str | None, _content: bytes | None = None) -> Any:
    """``_content``: the template file's bytes, so an edited template is loaded again."""
    return command_tokenizer(spec, chat_template=chat_template)


__all__ = ["load_model", "load_tokenizer"]
