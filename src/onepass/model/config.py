"""The decoder's part of a model config: one reading for every module that looks at layers.

Why this module exists: a multimodal model (Gemma 3, Qwen3.5-VL, Mistral 3, ...) keeps its
language model's layers, windows and vocabulary in a nested text config; a plain causal LM keeps
them at the top. The attention masks (``attention.backends.layer_windows``), the chunked LM head
(``head.head_of``) and the exactness guard (``guard``) must read the same one, so they ask here.
Pure: no torch, no transformers import (it only calls the config's own ``get_text_config``).

    >>> class Plain: num_hidden_layers = 2
    >>> text_config(Plain()).num_hidden_layers
    2
    >>> class Multimodal:
    ...     def get_text_config(self, decoder=False): return Plain()
    >>> type(text_config(Multimodal())).__name__
    'Plain'
"""

from __future__ import annotations

from typing import Any


def text_config(config: Any) -> Any:
    """The decoder's config: ``config`` itself, or the text part of a multimodal config."""
    getter = getattr(config, "get_text_config", None)
    if getter is None:
        return config
    try:
        return getter(decoder=True)
    except TypeError:  # an older or custom config whose getter takes no ``decoder``
        return getter()
