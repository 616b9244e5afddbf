"""A tiny random twin of any HF causal-LM config: the same class and layer types, small sizes.

Why this module exists: one-pass is exact only if *every layer type* of the
model sees, at each tree node, exactly the node's ancestors (docs/design.md). That
is a property of the architecture, not of its size, so the guard
(:mod:`onepass.guard`) checks it on a twin: the user's own config class with
every size shrunk (hidden 64, 4 heads of 16, a few experts, a compacted
vocabulary) and every distinct layer kept. It must also work for architectures
this project has never seen, so shrinking goes by the attribute names HF
configs commonly use; a field it does not know is left as it is.

Two rules make the twin a faithful test rather than a smaller model:

- **Every distinct layer is kept.** A layer's signature is its entry in every
  per-layer list of the config (``layer_types``, ``layers_block_type``, ...) and
  which side of a layer threshold it is on (``first_k_dense_replace``,
  ``mlp_only_layers``). The twin keeps the shortest prefix holding every
  signature (at most 8 layers), else the first layer of each signature, and at
  least 2 layers. Qwen3-Next's ``[linear x3, full] x 12`` becomes its first 4
  layers; Qwen3 with ``max_window_layers=28`` becomes layers 0 and 28.
- **Windows bite.** A sliding window larger than the test row hides a window
  bug, so windows shrink to 8 tokens.

    >>> from transformers import Qwen3NextConfig
    >>> twin = tiny_twin(Qwen3NextConfig(), vocab_size=300)
    >>> twin.hidden_size, twin.num_hidden_layers, twin.layer_types, twin.num_experts
    (64, 4, ['linear_attention', 'linear_attention', 'linear_attention', 'full_attention'], 4)
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Mapping
from typing import Any

from onepass.model.config import text_config

SMALL_WINDOW = 8
MAX_PREFIX_LAYERS = 8

_HIDDEN = ("hidden_size", "d_model", "n_embd")
_LAYERS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
_HEADS = ("num_attention_heads", "n_head", "num_heads", "n_heads")
_KV_HEADS = ("num_key_value_heads", "n_kv_heads", "num_kv_heads", "multi_query_group_num")
_WINDOWS = ("sliding_window", "attention_window", "sliding_window_size")
_LAYER_THRESHOLDS = ("first_k_dense_replace", "max_window_layers")  # "layers below index N are ..."
_LAYER_INDEX_LISTS = ("mlp_only_layers", "full_attn_idxs")  # lists of layer indices
_DROPPED = ("quantization_config",)  # the twin is plain float64 weights

# name -> rule(old value, the config's values) -> new value; applied to ints only (not None, not bool)
_Rule = Callable[[int, Mapping[str, Any]], int]


def _at_most(n: int) -> _Rule:
    return lambda old, _d: min(old, n)


_RULES: dict[str, _Rule] = {
    **{k: _at_most(4) for k in ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts")},
    **{k: _at_most(2) for k in ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_k",
                                 "n_group", "n_groups", "mamba_n_groups", "linear_num_key_heads")},
    **{k: _at_most(1) for k in ("n_shared_experts", "num_shared_experts")},
    **{k: _at_most(128) for k in ("intermediate_size", "ffn_dim", "n_inner", "ffn_hidden_size")},
    **{k: _at_most(16) for k in ("q_lora_rank", "kv_lora_rank", "ssm_state_size", "mamba_d_state",
                                  "state_size", "chunk_size", "mamba_chunk_size")},
    **{k: _at_most(8) for k in ("qk_rope_head_dim", "qk_nope_head_dim", "mamba_num_heads", "mamba_n_heads")},
    "topk_group": lambda old, d: min(old, d.get("n_group") or old),
}


def _rule_for(key: str) -> _Rule | None:
    if key in _RULES:
        return _RULES[key]
    if key.endswith("intermediate_size"):  # moe_, shared_expert_, moe_shared_expert_ ...
        return _at_most(32)
    if key == "head_dim" or key.endswith(("_head_dim", "_d_head")) or key == "head_size":
        return _at_most(16)
    return None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _first(d: Mapping[str, Any], names: tuple[str, ...]) -> str | None:
    return next((k for k in names if _is_int(d.get(k))), None)


def _index_lists(d: Mapping[str, Any]) -> list[str]:
    return [k for k, v in d.items() if isinstance(v, list)
            and (k in _LAYER_INDEX_LISTS or k.endswith(("_idxs", "_indices")))]


def kept_layers(d: Mapping[str, Any], num_layers: int) -> list[int]:
    """Which layers of a ``num_layers``-layer config (as ``to_dict()``) the twin keeps (module doc)."""
    index_lists = _index_lists(d)
    per_layer = {k: v for k, v in d.items() if isinstance(v, list) and len(v) == num_layers
                 and num_layers > 2 and k not in index_lists}

    def signature(i: int) -> tuple[Any, ...]:
        sig: tuple[Any, ...] = tuple(str(v[i]) for v in per_layer.values())
        sig += tuple(i < d[k] for k in _LAYER_THRESHOLDS if _is_int(d.get(k)))
        sig += tuple(i in d[k] for k in index_lists)
        step = d.get("decoder_sparse_step")
        return sig + (((i + 1) % step == 0,) if _is_int(step) and step > 1 else ())

    first: dict[tuple[Any, ...], int] = {}
    for i in range(num_layers):
        first.setdefault(signature(i), i)
    prefix = max(first.values()) + 1
    if prefix <= MAX_PREFIX_LAYERS:
        return list(range(min(num_layers, max(prefix, 2))))
    return sorted(first.values())  # two or more: one kind first appears at layer >= MAX_PREFIX_LAYERS


def _shrink_layers(d: dict[str, Any]) -> None:
    key = _first(d, _LAYERS)
    lists = [k for k, v in d.items() if isinstance(v, list) and v and all(isinstance(x, str) for x in v)
             and k.endswith(("layer_types", "layers_block_type"))]
    num = d[key] if key is not None else (len(d[lists[0]]) if lists else None)
    if num is None:
        return
    keep = kept_layers(d, num)
    index_lists = _index_lists(d)
    for k, v in list(d.items()):
        if k in index_lists:
            d[k] = [keep.index(i) for i in v if i in keep]
        elif isinstance(v, list) and len(v) == num and num > 2:
            d[k] = [v[i] for i in keep]
    for k in _LAYER_THRESHOLDS:
        if _is_int(d.get(k)):
            d[k] = sum(1 for i in keep if i < d[k])
    if key is not None:
        d[key] = len(keep)


def _shrink_sizes(d: dict[str, Any], vocab_size: int) -> None:
    old = dict(d)
    hidden, heads, kv = _first(d, _HIDDEN), _first(d, _HEADS), _first(d, _KV_HEADS)
    if hidden is not None:
        d[hidden] = min(old[hidden], 64)
    if heads is not None:
        d[heads] = min(old[heads], 4)
        if kv is not None:  # keep grouped-query attention valid: kv heads divide heads
            ratio = max(1, old[heads] // max(1, old[kv]))
            new_kv = max(1, d[heads] // ratio)
            while d[heads] % new_kv:
                new_kv -= 1
            d[kv] = new_kv
    for k, v in old.items():
        rule = _rule_for(k)
        if rule is not None and _is_int(v) and v > 0:
            d[k] = rule(v, d)
    if _is_int(old.get("linear_num_value_heads")) and _is_int(old.get("linear_num_key_heads")):
        grows = old["linear_num_value_heads"] > old["linear_num_key_heads"]
        d["linear_num_value_heads"] = 2 * d["linear_num_key_heads"] if grows else d["linear_num_key_heads"]
    if _is_int(old.get("mamba_d_head")) and _is_int(d.get("mamba_n_heads")) and hidden is not None:
        inner = d.get("mamba_expand", 2) * d[hidden]
        if _is_int(old.get("mamba_d_ssm")):  # Falcon-H1: the Mamba width is set apart from the hidden size
            d["mamba_d_ssm"] = inner = min(old["mamba_d_ssm"], inner)
        d["mamba_d_head"] = inner // d["mamba_n_heads"]
    for k in _WINDOWS:
        if _is_int(old.get(k)) and old[k] > 0:
            d[k] = min(old[k], SMALL_WINDOW)
    d["vocab_size"] = vocab_size
    for k, v in old.items():  # special tokens must exist in the compacted vocabulary
        if k.endswith("token_id") and _is_int(v) and v >= vocab_size:
            d[k] = vocab_size - 1
        elif k.endswith("token_id") and isinstance(v, list):
            d[k] = [min(x, vocab_size - 1) if _is_int(x) else x for x in v]


def _declared_fields(config: Any) -> set[str]:
    """The fields a config class takes: its dataclass fields (transformers 5.2x), else the named parameters of
    every ``__init__`` in its class hierarchy (a plain class, 5.2-5.1x). A field set in ``__init__`` from others
    (DeepSeek's ``head_dim = qk_rope_head_dim``) is none of them; handed back as a keyword, an older config keeps
    it as given and the twin disagrees with itself (a rotary of 16 dims on 8-dim query halves)."""
    import dataclasses

    try:
        names = {f.name for f in dataclasses.fields(config)}
    except TypeError:
        names = set()
        for cls in type(config).__mro__:
            init = cls.__dict__.get("__init__")
            if init is None:
                continue
            try:
                params = inspect.signature(init).parameters.values()
            except (TypeError, ValueError):
                continue
            names |= {p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)} - {"self"}
    aliases = getattr(config, "attribute_map", {}) or {}  # e.g. num_local_experts -> num_experts
    return names | set(aliases) | set(aliases.values())


def tiny_twin(config: Any, vocab_size: int) -> Any:
    """A small config of the same class as ``config`` (see the module doc); ``config`` is not changed.
    A multimodal config gives the twin of its text decoder."""
    source = text_config(config)
    original = source.to_dict()
    d = copy.deepcopy(original)
    for k in _DROPPED:
        d.pop(k, None)
    _shrink_layers(d)
    _shrink_sizes(d, vocab_size)
    # a shrunk value that is not a declared field is derived (DeepSeek's head_dim = qk_rope_head_dim):
    # leave it to the config to recompute, and set it only if the config does not
    declared = _declared_fields(source)
    derived = {k: d.pop(k) for k in list(d) if declared and k not in declared and d[k] != original.get(k)}
    twin = type(source).from_dict(d)
    for k, v in derived.items():
        if not hasattr(twin, k):
            setattr(twin, k, v)
    for attr in ("_attn_implementation_internal", "_experts_implementation_internal"):
        if hasattr(source, attr):
            setattr(twin, attr, getattr(source, attr))
    return twin
