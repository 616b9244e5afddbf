"""Attention under sequence parallelism: the model's own backend on the whole row, for a subset of heads.

Why this module exists: a transformers model calls its attention function with the query, key and
value of the tokens it holds. Under sequence parallelism those are this rank's positions only, but
the tree mask (``k <= q < kv_end[k]``), sliding windows and attention sinks need every position.
So each backend is wrapped (registered as ``onepass_sp:<backend>``): one all-to-all turns
``[B, H, L/S, D]`` into ``[B, H/S, L, D]``, the backend runs as it does in one process, on the
mask built for the whole row (:func:`onepass.attention.attention_mask_for`, unchanged), and
another all-to-all turns its ``[B, L, H/S, D]`` output back into this rank's positions with every
head. Nothing of the mask, the segment plan or the kernels changes.

A call whose forward record (:class:`onepass.parallel.forward.ForwardPlan`) holds no shard, or that has
none (the plain N-pass reference, generation, a forward that holds the whole row), is the backend itself.
Key/value heads follow :func:`onepass.parallel.plan.head_split` (repeated when there are fewer than
ranks); attention sinks (gpt-oss: one logit per query head, as the ``s_aux`` keyword or the module's
``sinks``) are sliced to the rank's heads.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from onepass.attention.backends import BACKENDS, SP_PREFIX
from onepass.attention.cpu import register as register_onepass_cpu
from onepass.parallel.forward import take
from onepass.parallel.plan import SequenceParallelError, head_split


class _RankView:
    """``module`` as the backend sees it on this rank's heads: its own attributes, but the number of query
    heads per key/value head of the rank's slice (sdpa and eager repeat keys by it) and the rank's slice of
    its attention sinks (gpt-oss's eager reads ``module.sinks``, not the ``s_aux`` keyword)."""

    def __init__(self, module: torch.nn.Module, groups: int, sinks: torch.Tensor | None) -> None:
        self.__dict__.update(_module=module, num_key_value_groups=groups)
        if sinks is not None:
            self.__dict__["sinks"] = sinks

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_module"], name)


def core_function(backend: str, module: torch.nn.Module) -> Any:
    """The attention function ``backend`` names, as the model would call it (eager: its own file's)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if backend == "eager":
        eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        if eager is None:
            raise SequenceParallelError(f"{type(module).__name__} has no eager_attention_forward beside it; "
                                        "run sequence parallelism with the onepass_cpu, sdpa or flex_attention backend")
        return eager
    return ALL_ATTENTION_FUNCTIONS[backend]


def sequence_parallel_attention(backend: str) -> Any:
    """The HF attention function ``onepass_sp:<backend>``: ``backend`` over the whole row for this rank's heads."""

    def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: Any, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
        forward = take(kwargs)
        shard = None if forward is None else forward.shard
        core = core_function(backend, module)
        if shard is None:
            return core(module, query, key, value, attention_mask, *args, **kwargs)
        split = head_split(query.shape[1], key.shape[1], shard.degree,
                           where=f"layer {getattr(module, 'layer_idx', '?')} ({type(module).__name__})")
        if split.kv_repeat > 1:
            key, value = key.repeat_interleave(split.kv_repeat, 1), value.repeat_interleave(split.kv_repeat, 1)
        q_BhLD, k_BjLD, v_BjLD = shard.to_heads(query), shard.to_heads(key), shard.to_heads(value)
        if kwargs.get("s_aux") is not None:  # attention sinks: one per query head
            kwargs["s_aux"] = shard.heads_of(split, kwargs["s_aux"])
        sinks = getattr(module, "sinks", None)
        sinks = shard.heads_of(split, sinks) if isinstance(sinks, torch.Tensor) and sinks.shape == (split.heads,) \
            else None
        view = _RankView(module, split.local_heads // split.local_kv_heads, sinks)
        out_BLhD, _ = core(view, q_BhLD, k_BjLD, v_BjLD, attention_mask, *args, **kwargs)
        return shard.to_sequence(out_BLhD), None

    return attention


def register() -> None:
    """Register ``onepass_sp:<backend>`` for every backend onepass serves, with the mask function of the
    backend (idempotent). transformers looks a model's attention up by this name at every call."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    register_onepass_cpu()
    for backend in (*BACKENDS, "eager"):
        name = SP_PREFIX + backend
        if name not in ALL_ATTENTION_FUNCTIONS:
            AttentionInterface.register(name, sequence_parallel_attention(backend))
        if name not in ALL_MASK_ATTENTION_FUNCTIONS and backend in ALL_MASK_ATTENTION_FUNCTIONS:
            AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[backend])


__all__ = ["core_function", "register", "sequence_parallel_attention"]
