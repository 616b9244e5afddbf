"""Tiny random-weight HF causal LMs built from configs, offline.

Why this module exists: tests, ``onepass verify --tiny ARCH`` and the demo need
real HF architectures (their rotary embeddings, norms, GQA, attention code)
without downloading weights. Each entry is the architecture's own config
class with small sizes; the weights are random, seeded.

    >>> m = tiny_model("qwen3", vocab_size=100, dtype=torch.float64)   # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

import torch

TINY_ARCHS = ("qwen3", "llama", "qwen2", "mistral", "phi3", "olmo2")

_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=4096)


def tiny_config(arch: str, vocab_size: int, **overrides: Any) -> Any:
    """A small config of ``arch`` (one of :data:`TINY_ARCHS`)."""
    import transformers as tf

    classes = {"qwen3": "Qwen3Config", "llama": "LlamaConfig", "qwen2": "Qwen2Config",
               "mistral": "MistralConfig", "phi3": "Phi3Config", "olmo2": "Olmo2Config"}
    if arch not in classes:
        raise ValueError(f"unknown tiny architecture {arch!r}; use one of {', '.join(TINY_ARCHS)}")
    kwargs = dict(_SHAPE, vocab_size=vocab_size, tie_word_embeddings=False)
    if arch == "qwen3":
        kwargs["head_dim"] = 16
    if arch == "mistral":
        kwargs["sliding_window"] = None
    if arch in ("phi3", "olmo2"):
        kwargs.update(pad_token_id=0, bos_token_id=0, eos_token_id=0)
    kwargs.update(overrides)
    return getattr(tf, classes[arch])(**kwargs)


def tiny_model(arch: str, vocab_size: int, *, dtype: torch.dtype = torch.float32, seed: int = 0,
               attn_implementation: str = "sdpa", device: torch.device | str = "cpu",
               **overrides: Any) -> Any:
    """A seeded random-weight causal LM of ``arch``, in ``dtype`` on ``device``, in eval mode."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(arch, vocab_size, **overrides)
    config._attn_implementation = attn_implementation
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    return model.to(device).eval()
