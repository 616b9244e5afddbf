"""The one loader of a causal LM: every command and trainer gets its model here.

Why this module exists: ``onepass train``, ``OnePassTrainer``, ``onepass verify`` (and ``--rollouts``),
``onepass eval``, ``onepass export`` and the exactness guard all load a model. How one loads (a local
folder or a hub id while offline, ``dtype``, device or device map, 4-bit quantization,
``trust_remote_code``, a peft adapter, eager MoE experts in float64) is decided here, once, from a
:class:`ModelSpec`: the typed record a command's ``--model`` / ``--tiny`` / ``--dtype`` flags or a config
become at the edge. What a caller does with the model after (LoRA, gradient checkpointing, float64 norms
for verify, the recurrent mixers' tree forward: :func:`onepass.mixers.tree.install`, by whoever runs the
one-pass forward) stays with the caller; the model layer knows no layer above it.

    >>> model = load_causal_lm(ModelSpec(tiny="qwen3", vocab_size=64, dtype="float64"))   # doctest: +SKIP
    >>> model = load_causal_lm(ModelSpec(model="Qwen/Qwen3-8B", dtype="bfloat16", device="cuda",
    ...                                  attention="flex_attention"))                      # doctest: +SKIP

Whether a model is a peft model, and what it was loaded from, are :mod:`onepass.model.couplings`' (they rely
on peft's classes and transformers' ``_name_or_path``): :func:`~onepass.model.couplings.is_peft`,
:func:`~onepass.model.couplings.base_model`, :func:`~onepass.model.couplings.loaded_from`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from onepass.model.dtypes import torch_dtype
from onepass.errors import ConfigError, OnePassError
from onepass.hub import hub_offline, offline_reason
from onepass.model.tiny import tiny_model


class ModelLoadError(ConfigError, OSError):
    """A model that cannot be loaded (missing, not a causal LM, offline); one line naming it. An
    ``OSError`` too, as transformers' own loading errors are."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSpec:
    """What to load: a saved model (``model``: a local folder or a hub id) or a random tiny one (``tiny``)."""

    model: str | None = None
    tiny: str | None = None  # an architecture of onepass.model.tiny.TINY_ARCHS
    vocab_size: int | None = None  # tiny: its vocabulary (compacted to the ids that occur, often)
    tiny_config: Mapping[str, Any] = field(default_factory=dict)  # tiny: size overrides
    seed: int = 0  # tiny: the initialisation's seed
    dtype: Any = "float32"  # a name of onepass.model.dtypes.DTYPES, "auto", or a torch.dtype
    device: Any = None  # where the model goes; None: where from_pretrained put it (cpu, or device_map's)
    device_map: Any = None  # from_pretrained's device_map (a quantized model, OnePassTrainer on CUDA)
    attention: str | None = None  # attn_implementation; None: transformers' choice (sdpa for tiny)
    quantization: Any = None  # a transformers BitsAndBytesConfig
    trust_remote_code: bool = False
    init_kwargs: Mapping[str, Any] = field(default_factory=dict)  # other from_pretrained keywords (revision, ...)
    adapter: str | None = None  # a peft adapter folder put on the model
    merge_adapter: bool = False  # ... and merged into its weights (onepass export)
    label: str = "model"  # what an error calls it: "--model", "base model", ...

    def __post_init__(self) -> None:
        assert (self.model is None) != (self.tiny is None), "a ModelSpec names a model or a tiny architecture"


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def _looks_like_path(spec: str) -> bool:
    """Hub ids are ``name`` or ``org/name``; anything else that does not exist is a missing path."""
    return spec.startswith(("/", "./", "../", "~", ".")) or spec.count("/") > 1


def load_model_config(model: str, *, label: str = "model", trust_remote_code: bool = False,
                      **kwargs: Any) -> Any:
    """The config of ``model`` (a folder with a ``config.json``, or a hub id reachable now or cached),
    or one :class:`ModelLoadError` line: a missing path, a folder that is not a saved model, offline."""
    from transformers import AutoConfig

    path = Path(model).expanduser()
    if path.exists() and not (path / "config.json").is_file():
        raise ModelLoadError(f"{label} directory {model} has no config.json (is it a saved HF model?)")
    if not path.exists() and _looks_like_path(model):
        raise ModelLoadError(f"{label} path not found: {model}")
    try:
        return AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code, **kwargs)
    except (OSError, ValueError, KeyError) as e:
        if isinstance(e, OnePassError):
            raise
        why = (f"it is not a local path and the hub is offline ({offline_reason()}), and it is not in the HF cache"
               if not path.exists() and hub_offline() else _first_line(e))
        raise ModelLoadError(f"{label} {model} cannot be loaded as a causal LM: {why}") from None


def load_causal_lm(spec: ModelSpec) -> Any:
    """The model ``spec`` names, in its dtype, on its device, in eval mode (train it with ``.train()``)."""
    dtype = torch_dtype(spec.dtype)
    if spec.tiny is not None:
        assert spec.vocab_size is not None, "a tiny model needs its vocabulary size"
        model = tiny_model(spec.tiny, spec.vocab_size, dtype=dtype, seed=spec.seed,
                           attn_implementation=spec.attention or "sdpa", device=spec.device or "cpu",
                           **spec.tiny_config)
    else:
        model = _from_pretrained(spec, dtype)
    if spec.adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, spec.adapter)
        model = model.merge_and_unload() if spec.merge_adapter else model
    return model.eval()


def _from_pretrained(spec: ModelSpec, dtype: Any) -> Any:
    from transformers import AutoModelForCausalLM

    assert spec.model is not None
    load_model_config(spec.model, label=spec.label, trust_remote_code=spec.trust_remote_code,  # one line if not a model
                      **{k: v for k, v in spec.init_kwargs.items() if k == "revision"})
    kwargs: dict[str, Any] = {**spec.init_kwargs, "dtype": dtype, "trust_remote_code": spec.trust_remote_code}
    if spec.attention is not None:
        kwargs["attn_implementation"] = spec.attention
    if spec.quantization is not None:
        kwargs["quantization_config"] = spec.quantization
    if spec.device_map is not None:
        kwargs["device_map"] = spec.device_map
    if dtype == torch.float64:
        kwargs.setdefault("experts_implementation", "eager")  # MoE experts: grouped_mm has no float64 kernel
    try:
        model = AutoModelForCausalLM.from_pretrained(spec.model, **kwargs)
    except (OSError, ValueError, KeyError) as e:  # not a causal LM, weights that do not fit the config
        if isinstance(e, OnePassError):
            raise
        raise ModelLoadError(f"{spec.label} {spec.model} cannot be loaded as a causal LM: {_first_line(e)}") from None
    if spec.device is not None and spec.device_map is None and spec.quantization is None:
        model = model.to(spec.device)
    return model
