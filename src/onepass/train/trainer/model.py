"""What ``OnePassTrainer`` loads as TRL's ``SFTTrainer`` does: a model given by name, its tokenizer, a chat
template from ``chat_template_path``, the ``eos_token`` / ``pad_token`` settings.

Why this module exists: these follow TRL's rules (``model_init_kwargs``, no device map when distributed
or on CPU, the tokenizer of the folder or hub id the model came from, the special tokens mirrored onto
the model's config and generation config) and have nothing to do with the one-pass loss; the trainer
(:mod:`onepass.train.trainer.trainer`) calls them before it prepares the data.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from onepass.attention.backends import default_backend
from onepass.errors import UsageError
from onepass.model.load import ModelSpec
from onepass.render.tokenizer import read_template
from onepass.train.core.load import load_model as load_one, load_tokenizer as load_one_tokenizer
from onepass.train.hf_config import OnePassConfig

_SPEC_KEYS = ("dtype", "quantization_config", "trust_remote_code", "device_map", "attn_implementation")


def load_model(model: str, args: OnePassConfig, quantization_config: Any = None) -> Any:
    """``model`` loaded with ``args.model_init_kwargs`` as TRL loads it (``dtype`` float32 unless given,
    ``trust_remote_code``, ``quantization_config``, no device map when distributed or on CPU, else
    ``"auto"``), with a tree-mask attention backend unless one is named; by the one loader
    (:func:`onepass.train.core.load.load_model`)."""
    kwargs = dict(args.model_init_kwargs or {})
    if quantization_config is not None:
        if kwargs.get("quantization_config") is not None:
            raise ValueError("quantization_config is set both as a trainer argument and in "
                             "args.model_init_kwargs; set it in one place")
        kwargs["quantization_config"] = quantization_config
    trust = kwargs.get("trust_remote_code")
    if args.distributed_state.distributed_type in ("MULTI_GPU", "DEEPSPEED") or args.device.type in ("cpu", "mps"):
        device_map = None
    else:
        device_map = kwargs["device_map"] if "device_map" in kwargs else "auto"
    spec = ModelSpec(model=model, dtype=kwargs.get("dtype") or "float32",
                     quantization=kwargs.get("quantization_config"),
                     trust_remote_code=args.trust_remote_code if trust is None else bool(trust),
                     device_map=device_map, attention=kwargs.get("attn_implementation") or default_backend(args.device),
                     init_kwargs={k: v for k, v in kwargs.items() if k not in _SPEC_KEYS and v is not None})
    return load_one(spec)


def load_tokenizer(model_id: str, args: OnePassConfig) -> Any:
    """The tokenizer of ``model_id`` (a model given by name, or the folder/hub id a model or PeftModel was
    loaded from), as TRL finds it when ``processing_class`` is not given."""
    revision = (args.model_init_kwargs or {}).get("revision")
    return load_one_tokenizer(model_id, shipped=True, revision=revision, trust_remote_code=args.trust_remote_code)


def chat_template_of(spec: str, args: OnePassConfig) -> str:
    """``chat_template_path``: a template file (``.jinja``/``.j2`` or any file), ``builtin:NAME``, or a tokenizer
    folder or hub id whose template is taken (TRL also adds that tokenizer's special tokens; here they must be in
    the vocabulary already: the template renders text, tokenized by the model's tokenizer)."""
    if spec.startswith("builtin:") or Path(spec).is_file():
        return read_template(spec)
    template = getattr(load_tokenizer(spec, args), "chat_template", None)
    if not template:
        raise UsageError(f"chat_template_path {spec}: that tokenizer has no chat template")
    return template


def set_special_tokens(tokenizer: Any, model: Any, args: OnePassConfig) -> None:
    """``eos_token`` / ``pad_token`` as TRL sets them: on the tokenizer, and mirrored onto the model's
    config and generation config (a generation config keeps its other EOS ids: any of them stops)."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    generation = getattr(model, "generation_config", None)
    for name in ("eos_token", "pad_token"):
        token = getattr(args, name)
        if token is None:
            continue
        if token not in tokenizer.get_vocab():
            raise UsageError(f"{name}={token!r} is not in the vocabulary of the tokenizer "
                             f"({type(tokenizer).__name__})")
        setattr(tokenizer, name, token)
        token_id = getattr(tokenizer, f"{name}_id")
        if text is not None:
            setattr(text, f"{name}_id", token_id)
        if generation is not None and name == "eos_token":
            ids = generation.eos_token_id
            ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
            if token_id not in ids:
                generation.eos_token_id = [token_id, *ids]
        elif generation is not None:
            generation.pad_token_id = token_id
