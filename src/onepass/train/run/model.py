"""The model a run trains: device, attention backend, full / LoRA / QLoRA, and how it is saved.

Why this module exists: everything that depends on the hardware or on optional
packages (peft, bitsandbytes) is decided here, once, before any data is
touched, so a run that cannot work stops in its first second with one line
(:class:`~onepass.train.config.TrainConfigError`), not after an hour of
preparing data.

    full    every parameter trains; save_pretrained writes the whole model
    lora    peft LoRA adapters (r, alpha, dropout, target modules); the adapter is saved
    qlora   the base model in 4-bit NF4 (bitsandbytes, CUDA only) + LoRA adapters

    >>> device = resolve_device("cpu"); resolve_attention("auto", device)   # doctest: +SKIP
    'sdpa'
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from onepass.attention.backends import check_backend, default_backend
from onepass.attention.cpu import register
from onepass.model.dtypes import torch_dtype
from onepass.model.load import ModelSpec, load_model_config
from onepass.model.tiny import tiny_config
from onepass.train.core.guard import run_guard
from onepass.train.core.load import load_model as load_model_of, load_tokenizer
from onepass.train.config import QLORA_ON_CPU, TrainConfig, TrainConfigError
from onepass.train.run.data import TrainData
from onepass.parallel.model import install as install_sequence_parallel

_LOG = logging.getLogger("onepass")


def resolve_device(spec: str) -> torch.device:
    """``auto``: CUDA when available, else CPU. Refuses a CUDA device that is not there."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(spec)
    except RuntimeError:
        raise TrainConfigError(f"unknown device {spec!r}; use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise TrainConfigError(f"device {spec} was asked for but no CUDA GPU is available; use device: auto or cpu")
    return device


def resolve_attention(spec: str, device: torch.device) -> str:
    """The attention backend name HF gets. ``auto``: flex_attention on CUDA, onepass_cpu on
    CPU (both compute only the pairs the mask shows), sdpa elsewhere.

    Any name :func:`onepass.attention.check_backend` accepts passes through.
    """
    backend = spec
    if spec == "auto":
        backend = default_backend(device)
        if backend == "flex_attention" and not _has_flex():
            backend = "sdpa"
    if backend == "onepass_cpu":
        register()  # transformers must know the name before the model is built
    check_backend(backend, device)
    return backend


def _has_flex() -> bool:
    try:
        import torch.nn.attention.flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def check_environment(config: TrainConfig, device: torch.device) -> None:
    """Everything about ``config`` that depends on this machine, checked before any work."""
    _require("accelerate", "onepass train", "pip install accelerate")
    if config.finetune == "qlora":
        if device.type != "cuda":
            raise TrainConfigError(QLORA_ON_CPU)
        _require("bitsandbytes", "qlora", "pip install bitsandbytes")
    if config.optim.endswith("8bit"):
        if device.type != "cuda":
            raise TrainConfigError(f"optimizer {config.optim} (bitsandbytes) needs a CUDA GPU; use adamw")
        _require("bitsandbytes", f"optimizer {config.optim}", "pip install bitsandbytes")
    if config.finetune in ("lora", "qlora"):
        _require("peft", config.finetune, "pip install peft")
    if config.mixed_precision == "bf16" and config.dtype == "float64":
        raise TrainConfigError("mixed_precision bf16 with dtype float64 makes no sense; use dtype float32")
    for tracker in config.report_to:  # accelerate's trackers: the module is named as the tracker
        _require(tracker, f"report_to: {tracker}", f"pip install {tracker.replace('_', '-')}")
    if config.model is not None:
        load_model_config(config.model)  # a local folder with a config, or a hub id reachable now (or cached)


def _require(module: str, what: str, install: str) -> None:
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise TrainConfigError(f"{what} needs the {module!r} package: {install}")


def load_tokenizer_for(config: TrainConfig) -> Any:
    """The tokenizer of ``config`` (its own spec, else the model's, else builtin:qwen3 for tiny)."""
    spec = config.tokenizer or (config.model if config.model is not None else "builtin:qwen3")
    return load_tokenizer(spec, chat_template=config.chat_template)


def check_exactness(config: TrainConfig, data: TrainData, tokenizer: Any | None, *, attention: str,
                    log: Any = _LOG.info) -> dict[str, Any]:
    """The exactness guard (:mod:`onepass.guard`) for this run, before any training: one-pass
    against N-pass on a tiny float64 twin of the model, on two of the run's conversations as the run
    rendered them (:attr:`~onepass.train.run.data.TrainData.guard_views`); on the bundled MathChat pair
    rendered with the run's tokenizer when the data is prepared rows.

    Raises :class:`onepass.guard.InexactModelError` (one line) when they differ, unless
    ``allow_inexact``. Returns what metrics.json records under ``exactness``.
    """
    data_config = config.data_config
    if data_config.schedule_spec.kind == "n-pass" and not data_config.pack:
        return {"checked": False, "why": "n-pass rows without packing are each one plain sequence"}
    rows = data.kind == "row"  # no conversations: the bundled pair, rendered with the run's tokenizer
    result, where = run_guard(model_config_of(config), tokenizer=load_tokenizer_for(config) if tokenizer is None
                              else tokenizer, render=data_config.render, sampled=None if rows else data.guard_views,
                              source=config.data, empty="the data is prepared rows", pack=data_config.pack,
                              backend=attention, allow_inexact=config.allow_inexact, log=log)
    return {"checked": True, "data": where, **result.to_dict()}


def model_config_of(config: TrainConfig) -> Any:
    """The HF config of the run's model (a tiny architecture's, or the saved model's)."""
    if config.tiny is not None:
        return tiny_config(config.tiny, 64, **config.tiny_config)
    return load_model_config(config.model)


def load_model(config: TrainConfig, *, device: torch.device, attention: str, vocab_size: int | None = None
               ) -> Any:
    """The model to train, loaded by the one loader (:func:`onepass.train.core.load.load_model`), on ``device``, in
    train mode, with adapters when asked."""
    check_backend(attention, device, torch_dtype(config.dtype))  # flex_attention has no float64 kernel: before loading
    qlora = config.finetune == "qlora"
    spec = ModelSpec(model=config.model, tiny=config.tiny, vocab_size=vocab_size, tiny_config=config.tiny_config,
                     seed=config.seed, dtype=config.dtype, attention=attention, device=device,
                     quantization=quantization_config(config) if qlora else None,
                     device_map={"": device.index if device.index is not None else torch.cuda.current_device()}
                     if qlora else None)
    model = load_model_of(spec)
    model.config.use_cache = False
    if qlora:
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(
            model, use_gradient_checkpointing=config.gradient_checkpointing,
            gradient_checkpointing_kwargs={"use_reentrant": False})
    elif config.gradient_checkpointing:
        enable_checkpointing(model)
    if config.finetune in ("lora", "qlora"):
        model = add_lora(model, config)
    if config.sp_size > 1:  # its attention through the sequence-parallel wrapper of its backend
        install_sequence_parallel(model, config.sp_size)
    model.train()
    return model


def qlora_settings(config: TrainConfig) -> dict[str, Any]:
    """QLoRA's quantization: the base model's weights in 4-bit NF4, double-quantized, computing in ``dtype``."""
    return dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                bnb_4bit_compute_dtype=torch_dtype("bfloat16" if config.dtype == "bfloat16" else "float32"))


def quantization_config(config: TrainConfig, settings: dict[str, Any] | None = None) -> Any:
    """``BitsAndBytesConfig(**settings)`` (default :func:`qlora_settings`), refusing a name it does not take.

    transformers' ``BitsAndBytesConfig`` takes ``**kwargs`` and only logs the ones it does not
    know, so a misspelled setting would quietly be the default; built here (no CUDA needed).
    """
    import inspect

    from transformers import BitsAndBytesConfig

    settings = qlora_settings(config) if settings is None else settings
    known = {n for n, p in inspect.signature(BitsAndBytesConfig.__init__).parameters.items()
             if p.kind is p.POSITIONAL_OR_KEYWORD and n != "self"}
    unknown = sorted(set(settings) - known)
    if unknown:
        raise TrainConfigError(f"BitsAndBytesConfig takes no {', '.join(unknown)}; it takes {', '.join(sorted(known))}")
    if settings.get("bnb_4bit_quant_type", "fp4") not in ("fp4", "nf4"):
        raise TrainConfigError(f"bnb_4bit_quant_type {settings['bnb_4bit_quant_type']!r}: use nf4 or fp4")
    return BitsAndBytesConfig(**settings)


def enable_checkpointing(model: Any) -> None:
    """Recompute each layer's activations in the backward pass (non-reentrant: works with DDP and peft)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def lora_config(config: TrainConfig) -> Any:
    from peft import LoraConfig

    targets = config.lora_target_modules  # peft reads any other single string as a regex
    targets = targets if targets == "all-linear" else [targets] if isinstance(targets, str) else list(targets)
    return LoraConfig(r=config.lora_r, lora_alpha=config.lora_alpha, lora_dropout=config.lora_dropout,
                      target_modules=targets,
                      bias="none", task_type="CAUSAL_LM")


def add_lora(model: Any, config: TrainConfig) -> Any:
    """peft LoRA adapters on ``model``; their initialisation is seeded by ``config.seed``."""
    from peft import get_peft_model

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        try:
            return get_peft_model(model, lora_config(config))
        except ValueError as e:  # peft's NoMatchingPeftModuleError (a ValueError): no module of that name
            if "not found in the base model" not in str(e):
                raise
            linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
            raise TrainConfigError(f"lora_target_modules {config.lora_target_modules!r}: no such module in "
                                   f"{type(model).__name__}; its linear layers are {', '.join(linear)} (or use "
                                   "all-linear)") from None


def count_parameters(model: Any) -> tuple[int, int]:
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trainable, sum(p.numel() for p in model.parameters())


def save_final(model: Any, tokenizer: Any | None, out_dir: str | Path, *, used_ids: Any | None = None,
               state_dict: dict[str, torch.Tensor] | None = None) -> Path:
    """``save_pretrained`` (safetensors): the adapter for LoRA/QLoRA, else the whole model.

    ``state_dict``: the gathered weights of a sharded (FSDP) run. The tokenizer (with its
    chat template) is saved beside it, unless the vocabulary was
    compacted (a tiny test model): then ``compact_vocab.json`` maps new ids to the original ones.
    """
    import json

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    kwargs = {"state_dict": state_dict} if state_dict is not None else {}
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # "Writing model shards" for a one-file model is noise
    try:
        model.save_pretrained(str(out), safe_serialization=True, **kwargs)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    if used_ids is not None:
        (out / "compact_vocab.json").write_text(json.dumps({"original_ids": [int(i) for i in used_ids]}))
    elif tokenizer is not None:
        tokenizer.save_pretrained(str(out))
    return out
