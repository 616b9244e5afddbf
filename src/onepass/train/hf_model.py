"""What ``OnePassTrainer`` loads as TRL's ``SFTTrainer`` does: a model given by name, its tokenizer, a chat
template from ``chat_template_path``, the ``eos_token`` / ``pad_token`` settings.

Why this module exists: these follow TRL's rules (``model_init_kwargs``, no device map when distributed
or on CPU, the tokenizer of the folder or hub id the model came from, the special tokens mirrored onto
the model's config and generation config) and have nothing to do with the one-pass loss; the trainer
(:mod:`onepass.train.hf_trainer`) calls them before it prepares the data.
"""

from __future__ import annotations

from typing import Any

import torch

from onepass.train.hf_config import OnePassConfig


def base_model(model: Any) -> Any:
    base = getattr(model, "get_base_model", None)  # peft
    return base() if callable(base) else model


def is_peft(model: Any) -> bool:
    return callable(getattr(model, "get_base_model", None)) and hasattr(model, "peft_config")


def loaded_from(model: Any) -> str:
    """The hub id or folder a model was loaded from (a PeftModel's base model's), as TRL finds it."""
    config = getattr(base_model(model), "config", None)
    return str(getattr(config, "_name_or_path", "") or "")


def load_model(model: str, args: OnePassConfig, quantization_config: Any = None) -> Any:
    """``AutoModelForCausalLM.from_pretrained(model, **args.model_init_kwargs)`` as TRL loads it
    (``dtype`` float32 unless given, ``trust_remote_code``, ``quantization_config``, no device map
    when distributed or on CPU), with a tree-mask attention backend unless one is named."""
    from transformers import AutoModelForCausalLM

    from onepass.attention import default_backend

    kwargs = dict(args.model_init_kwargs or {})
    if quantization_config is not None:
        if kwargs.get("quantization_config") is not None:
            raise ValueError("quantization_config is set both as a trainer argument and in "
                             "args.model_init_kwargs; set it in one place")
        kwargs["quantization_config"] = quantization_config
    dtype = kwargs.get("dtype") or "float32"
    kwargs["dtype"] = getattr(torch, dtype) if dtype in ("bfloat16", "float16", "float32", "float64") else dtype
    kwargs.setdefault("trust_remote_code", args.trust_remote_code)
    if args.distributed_state.distributed_type in ("MULTI_GPU", "DEEPSPEED") or args.device.type in ("cpu", "mps"):
        kwargs["device_map"] = None
    elif "device_map" not in kwargs:
        kwargs["device_map"] = "auto"
    if not kwargs.get("attn_implementation"):
        kwargs["attn_implementation"] = default_backend(args.device)
    return AutoModelForCausalLM.from_pretrained(model, **{k: v for k, v in kwargs.items() if v is not None or
                                                          k == "device_map"})


def load_tokenizer(model_id: str, args: OnePassConfig) -> Any:
    """The tokenizer of ``model_id`` (a model given by name, or the folder/hub id a model or PeftModel was
    loaded from), as TRL finds it when ``processing_class`` is not given."""
    from transformers import AutoTokenizer

    revision = (args.model_init_kwargs or {}).get("revision")
    return AutoTokenizer.from_pretrained(model_id, revision=revision, trust_remote_code=args.trust_remote_code)


def chat_template_of(spec: str, args: OnePassConfig) -> str:
    """``chat_template_path``: a template file (``.jinja``/``.j2`` or any file), ``builtin:NAME``, or a tokenizer
    folder or hub id whose template is taken (TRL also adds that tokenizer's special tokens; here they must be in
    the vocabulary already: the template renders text, tokenized by the model's tokenizer)."""
    from pathlib import Path

    from onepass.errors import UsageError
    from onepass.tokenizer import read_template

    if spec.startswith("builtin:") or Path(spec).is_file():
        return read_template(spec)
    template = getattr(load_tokenizer(spec, args), "chat_template", None)
    if not template:
        raise UsageError(f"chat_template_path {spec}: that tokenizer has no chat template")
    return template


def set_special_tokens(tokenizer: Any, model: Any, args: OnePassConfig) -> None:
    """``eos_token`` / ``pad_token`` as TRL sets them: on the tokenizer, and mirrored onto the model's
    config and generation config (a generation config keeps its other EOS ids: any of them stops)."""
    from onepass.errors import UsageError

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
