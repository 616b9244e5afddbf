"""The attention mask a HF model needs for a batch of rows, by attention backend.

Why this module exists: every backend consumes the same row format
(``kv_end``); only the mask object differs. This is the one place that
knows which object each backend takes:

    onepass_cpu        int64 [B, 1, 1, L]     kv_end + segment plan: only visible pairs (CPU)
    sdpa               bool [B, 1, L, L]      True = may attend
    eager              float [B, 1, L, L]     0 / finfo.min, added to the scores
    flex_attention     BlockMask              blocks with no visible pair are skipped
    onepass_varlen     int64 [B, 1, 1, L]     kv_end + gather plan: each segment against its gathered root
                                              path in one call of torch's flash varlen kernel (CUDA; its
                                              CPU reference elsewhere)
    flash_attention_*  refused                it cannot express a tree mask

flex_attention always runs torch's main flex kernel (:data:`FLEX_KERNEL_OPTIONS`, passed with every
forward by :func:`forward_kwargs`): for a query shorter than 128 tokens torch otherwise picks its
flex-decoding kernel, which on torch 2.11 with grouped-query heads found no kernel at all on an H100
(``NoValidChoicesError`` compiling a 125-token N-pass view of a tiny Qwen3; docs/gpu.md).

Transformers passes a 4D mask (or a BlockMask) through untouched, so the
model never guesses sequence boundaries from the position ids (with
``attention_mask=None`` and non-monotonic position ids it would).

Masks per layer type: a model whose ``config.layer_types`` holds
``"sliding_attention"`` (gpt-oss, OLMo-3, Gemma 3, Qwen2/Qwen3 with
``use_sliding_window``) takes ``attention_mask`` as a dict keyed by layer type
(its ``causal_mask_mapping``); each entry is built here from ``kv_end`` and
``position_ids``, windowed for ``"sliding_attention"`` (:func:`layer_windows`).
A model without ``layer_types`` but with ``sliding_window`` (Mistral, Phi-3)
windows every layer and takes one windowed mask. The ``onepass_cpu`` backend
checks at every layer that its mask was cut for the layer's own window.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from onepass.attention.cpu import BACKEND as ONEPASS_CPU
from onepass.attention.cpu import cpu_attention_mask
from onepass.attention.cpu import register as register_onepass_cpu
from onepass.attention.mask import additive_mask, block_mask, dense_mask
from onepass.attention.varlen import BACKEND as VARLEN
from onepass.attention.varlen import register as register_varlen
from onepass.attention.varlen import varlen_attention_mask
from onepass.errors import ConfigError
from onepass.model.config import text_config
from onepass.model.private_names import private

BACKENDS = ("onepass_cpu", "sdpa", "eager", "flex_attention", VARLEN)
ONE_MASK = ""  # layer_windows' key for a model that takes one mask for every layer
FULL, WINDOW = "full_attention", "sliding_attention"
SP_PREFIX = "onepass_sp:"  # a backend wrapped for sequence parallelism (onepass.parallel.attention): same mask


def default_backend(device: torch.device | str) -> str:
    """``onepass_cpu`` on CPU (computes only visible pairs), ``flex_attention`` on CUDA, else sdpa.

    Registers ``onepass_cpu`` with transformers, so call it before loading a model with it.
    """
    kind = torch.device(device).type
    if kind == "cpu":
        return register_onepass_cpu()
    return "flex_attention" if kind == "cuda" else "sdpa"


class BackendError(ConfigError):
    """An attention backend that cannot serve a tree mask here."""


def model_backend(model: Any) -> str:
    """The attention backend ``model`` runs, whose mask it takes (a sequence-parallel wrapper's: the wrapped one's)."""
    return str(getattr(model.config, "_attn_implementation", None) or "eager").removeprefix(SP_PREFIX)


def check_backend(backend: str, device: torch.device | str, dtype: torch.dtype | None = None) -> None:
    """Raise a clear :class:`BackendError` when ``backend`` cannot train tree rows on ``device`` (in ``dtype``).

    flex_attention has no float64 kernel on CUDA: Triton's flex template accumulates in float32, and
    compiling it for float64 failed on an H100 (torch 2.11, ``CompilationError`` in ``tl.dot``)."""
    if backend.startswith("flash_attention"):
        raise BackendError(f"{backend} cannot apply a tree mask (it supports causal and varlen only); "
                           "use sdpa, eager or flex_attention")
    if backend not in BACKENDS:
        raise BackendError(f"unknown attention backend {backend!r}; use one of {', '.join(BACKENDS)}")
    if backend == "flex_attention" and torch.device(device).type == "cpu":
        raise BackendError("flex_attention has no backward pass on CPU; use onepass_cpu, sdpa or eager on CPU")
    if backend == "flex_attention" and dtype == torch.float64:
        raise BackendError("flex_attention has no float64 kernel on CUDA (Triton's flex template computes in "
                           "float32 at most); use sdpa or eager for float64")
    if backend == ONEPASS_CPU and torch.device(device).type != "cpu":
        raise BackendError("onepass_cpu runs on CPU only; on CUDA use flex_attention (block-sparse) or sdpa")
    if backend == VARLEN and torch.device(device).type == "cuda" and dtype not in (None, torch.float16,
                                                                                    torch.bfloat16):
        raise BackendError(f"{VARLEN} on CUDA is torch's flash kernel: bfloat16 and float16 only, not {dtype}; "
                           "use sdpa or eager for float32 and float64")
    if backend == VARLEN:
        register_varlen()


def layer_windows(config: Any) -> dict[str, int | None]:
    """``{layer type: sliding window or None}`` of the masks ``config``'s model takes.

    ``{ONE_MASK: W or None}`` for a model that takes one mask for every layer.
    Raises :class:`BackendError` for attention that no tree mask can express.
    """
    config = text_config(config)  # a multimodal config: its language model's layers
    name = type(config).__name__
    if getattr(config, "use_bidirectional_attention", False):
        raise BackendError(f"{name} uses bidirectional attention: a causal tree mask cannot express it")
    layer_types = list(getattr(config, "layer_types", None) or [])
    if "chunked_attention" in layer_types or getattr(config, "attention_chunk_size", None):
        raise BackendError(f"{name} uses chunked attention, which onepass does not support; "
                           "use --schedule n-pass")
    window = getattr(config, "sliding_window", None)
    if WINDOW in layer_types:
        if window is None:
            raise BackendError(f"{name}: layer_types has {WINDOW!r} but sliding_window is not set")
        return {t: (int(window) if t == WINDOW else None) for t in dict.fromkeys(layer_types)}
    if not layer_types and window is not None:  # Mistral, Phi-3: config.sliding_window windows every layer
        return {ONE_MASK: int(window)}
    return {ONE_MASK: None}


def supported_backend(model_or_config: Any, device: torch.device | str, dtype: torch.dtype | None = None) -> str:
    """A backend that serves this model's attention exactly on ``device``, registered if it is ours.

    CPU: ``onepass_cpu`` (windows, sinks, latent attention), else ``eager`` (logit soft-capping);
    CUDA: ``flex_attention`` where the model supports it, else ``sdpa``, else ``eager``
    (gpt-oss refuses sdpa: its sinks need eager or flex); in float64 never flex (:func:`check_backend`).
    """
    is_model = hasattr(model_or_config, "config")
    config = model_or_config.config if is_model else model_or_config
    model_class = type(model_or_config) if is_model else _causal_lm_class(config)
    layer_windows(config)  # refuses what no backend can do here
    softcap = getattr(config, "attn_logit_softcapping", None) is not None
    kind = torch.device(device).type
    if kind == "cuda" and getattr(model_class, "_supports_flex_attn", True) and dtype != torch.float64:
        return "flex_attention"
    if kind == "cpu" and not softcap:
        return register_onepass_cpu()
    if not softcap and getattr(model_class, "_supports_sdpa", True):
        return "sdpa"
    return "eager"


CPU_BACKENDS = ("onepass_cpu", "sdpa", "eager", VARLEN)  # onepass_varlen: its CPU reference kernel


def cpu_backend(config: Any, requested: str | None = None) -> str:
    """The backend a model runs exactly on CPU (the guard's twin, ``onepass verify``): ``requested`` when it
    runs on CPU (the one training uses), else the one :func:`supported_backend` picks there."""
    return requested if requested in CPU_BACKENDS else str(supported_backend(config, "cpu"))


def _causal_lm_class(config: Any) -> Any:
    try:
        return private("transformers.AutoModelForCausalLM._model_mapping")[type(config)]
    except (KeyError, ValueError):
        return None


FLEX_KERNEL_OPTIONS = {"FORCE_USE_FLEX_ATTENTION": True}  # the main kernel, never flex-decoding (docstring)


def forward_kwargs(model: Any) -> dict[str, Any]:
    """What every forward of ``model`` passes besides its inputs: flex's kernel choice where the model runs
    flex_attention (transformers hands ``kernel_options`` to ``flex_attention``), else nothing."""
    return {"kernel_options": dict(FLEX_KERNEL_OPTIONS)} if model_backend(model) == "flex_attention" else {}


def attention_mask_for(model: Any, kv_end_BL: torch.Tensor, *, position_ids_BL: torch.Tensor | None = None,
                       dtype: torch.dtype | None = None, block_size: int = 128, host_kv_end: np.ndarray | None = None,
                       host_position_ids: np.ndarray | None = None) -> Any:
    """The mask object ``model`` takes for rows ``kv_end_BL`` (on the model's device).

    A dict ``{layer type: mask}`` for a model with windowed layer types, else one mask.
    ``position_ids_BL`` (the rows' ``position_ids``) are needed when a layer is windowed.
    ``host_kv_end`` / ``host_position_ids``: the same rows as numpy (a batch's
    :class:`onepass.batch.HostRows`): the plans (flex tiles, CPU segments) are made from them, so
    nothing is read back from the device; without them the plans read the tensors (a wait on CUDA).
    """
    backend = model_backend(model)
    if backend.startswith("flash_attention"):
        check_backend(backend, kv_end_BL.device)
    built: dict[int | None, Any] = {}
    plan_kv_end = kv_end_BL if host_kv_end is None else host_kv_end
    plan_positions = position_ids_BL if host_kv_end is None or host_position_ids is None else host_position_ids

    def build(window: int | None) -> Any:
        if backend == ONEPASS_CPU:
            return cpu_attention_mask(plan_kv_end, position_ids=plan_positions, window=window)
        if backend == VARLEN:  # the gather plan: segments against their root paths, one varlen call
            return varlen_attention_mask(plan_kv_end, position_ids=plan_positions, window=window,
                                         device=kv_end_BL.device)
        if backend == "flex_attention":  # built from the block plan: no L x L evaluation
            return block_mask(plan_kv_end, block_size=block_size, device=kv_end_BL.device,
                              position_ids=plan_positions, window=window, kv_end_BL=kv_end_BL,
                              position_ids_BL=position_ids_BL)
        mask_B1LL = dense_mask(kv_end_BL, position_ids=position_ids_BL, window=window)[:, None]
        return mask_B1LL if backend == "sdpa" else additive_mask(mask_B1LL, dtype or model.dtype)

    masks = {}
    for layer_type, window in layer_windows(model.config).items():
        if window not in built:
            built[window] = build(window)
        masks[layer_type] = built[window]
    return masks[ONE_MASK] if ONE_MASK in masks else masks
