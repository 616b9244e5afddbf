"""A model's decoder layers, named: the stack, each layer's type, each layer's token mixer.

Why this module exists: the divergence search (which layer is the first whose output differs),
the guard's result (``layer_types`` of the twin) and sequence parallelism (what each layer
exchanges) all walk the same stack of decoder layers and name its layers the same way, as
transformers names them. That is a reading of the model, so it lives with the model, below
everything that checks or wraps one.

    >>> class Config: num_hidden_layers = 2; sliding_window = None
    >>> layer_types(Config())
    ['full_attention', 'full_attention']

Torch is imported when :func:`decoder_layers` runs (no torch at import).
"""

from __future__ import annotations

from typing import Any

from onepass.model.config import text_config


def decoder_layers(model: Any) -> Any:
    """The model's stack of decoder layers (the first ``torch.nn.ModuleList`` with one entry per layer), or None."""
    import torch

    num = getattr(text_config(model.config), "num_hidden_layers", None)
    for _, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == num:
            return module
    return None


def layer_types(config: Any) -> list[str]:
    """One name per layer: ``config.layer_types`` (or the hybrid pattern), else ``full_attention``
    or ``sliding_attention`` for every layer, as transformers names them."""
    types = getattr(config, "layer_types", None) or getattr(config, "layers_block_type", None)
    num = getattr(config, "num_hidden_layers", None)
    if isinstance(types, (list, tuple)) and types:
        return [str(t) for t in types]
    window = getattr(config, "sliding_window", None)
    windowed = isinstance(window, int) and not isinstance(window, bool) and window > 0
    return ["sliding_attention" if windowed else "full_attention"] * int(num or 0)


_NOT_MIXERS = ("norm", "mlp", "moe", "expert", "ffn", "feed_forward", "dropout", "router", "rotary")


def mixer_name(layer: Any) -> str:
    """The class of a decoder layer's token mixer (``self_attn``, ``linear_attn``, ``mamba``,
    ``mixer``, ``conv`` ...): its first child that is not a norm or a feed-forward block."""
    children = list(layer.named_children())
    mixers = [type(c).__name__ for n, c in children if not any(s in n.lower() for s in _NOT_MIXERS)]
    others = [type(c).__name__ for n, c in children if "norm" not in n.lower()]
    return (mixers or others or [type(layer).__name__])[0]
