"""Tiny random-weight HF causal LMs built from configs, offline.

Why this module exists: tests, ``onepass verify --tiny ARCH`` and the demo need
real HF architectures (their rotary embeddings, norms, GQA, attention code)
without downloading weights. Each entry is the architecture's own config
class with small sizes; the weights are random, seeded.

    >>> m = tiny_model("qwen3", vocab_size=100, dtype=torch.float64)   # doctest: +SKIP

The architecture names (:data:`TINY_ARCHS`) are plain data, read by configs and parsers that import
no torch; torch and transformers are imported when a model is built.
"""

from __future__ import annotations

from typing import Any

from onepass.errors import UsageError

# dense: one attention type, no window (``mistral`` keeps its window off, as before)
DENSE_ARCHS = ("qwen3", "llama", "qwen2", "mistral", "phi3", "olmo2")
# exact with onepass (tested): windows of 8-16 tokens, so they cut through the history of real conversations
WINDOWED_ARCHS = ("mistral-window", "qwen3-window", "gpt-oss", "olmo3", "gemma3")
MOE_ARCHS = ("gpt-oss", "deepseek-v3", "glm4-moe", "qwen3-next", "granite-4-hybrid")
EXACT_ARCHS = DENSE_ARCHS + WINDOWED_ARCHS + ("deepseek-v3", "glm4-moe")
# recurrent / convolutional layers next to attention: exact with onepass.mixers (scanned chain by chain)
HYBRID_ARCHS = ("qwen3.5", "qwen3-next", "nemotron-h", "lfm2", "granite-4-hybrid", "falcon-h1")
TINY_ARCHS = EXACT_ARCHS + HYBRID_ARCHS

_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=4096)
_IDS = dict(pad_token_id=0, bos_token_id=0, eos_token_id=0)
_LINEAR = dict(linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
               linear_num_key_heads=2, linear_num_value_heads=4)
_MAMBA = dict(mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=16, n_groups=2, conv_kernel=4, chunk_size=16)
_FULL, _WINDOW = "full_attention", "sliding_attention"

# arch -> (config class, its small settings on top of _SHAPE)
_ARCHS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3": ("Qwen3Config", dict(head_dim=16)),
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    "mistral": ("MistralConfig", dict(sliding_window=None)),
    "phi3": ("Phi3Config", _IDS),
    "olmo2": ("Olmo2Config", _IDS),
    # every layer windowed (Mistral applies config.sliding_window to all layers)
    "mistral-window": ("MistralConfig", dict(sliding_window=16)),
    # Qwen3 windows the layers from max_window_layers on: layer 0 full, layer 1 windowed
    "qwen3-window": ("Qwen3Config", dict(head_dim=16, use_sliding_window=True, sliding_window=12,
                                         max_window_layers=1)),
    # alternating window / full (its own pattern), attention sinks, MoE
    "gpt-oss": ("GptOssConfig", dict(head_dim=16, sliding_window=8, num_local_experts=4, num_experts_per_tok=2,
                                     intermediate_size=64, layer_types=[_WINDOW, _FULL])),
    "olmo3": ("Olmo3Config", dict(_IDS, sliding_window=16, layer_types=[_WINDOW, _FULL])),
    "gemma3": ("Gemma3TextConfig", dict(_IDS, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                                        layer_types=[_WINDOW, _FULL])),
    # multi-head latent attention (v head dim != qk head dim), routed + shared experts; layer 0 dense
    "deepseek-v3": ("DeepseekV3Config", dict(num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32,
                                             qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                                             n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                                             n_group=2, topk_group=1, first_k_dense_replace=1,
                                             moe_intermediate_size=32)),
    "glm4-moe": ("Glm4MoeConfig", dict(head_dim=16, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                                       first_k_dense_replace=1, moe_intermediate_size=32, use_qk_norm=True)),
    # hybrids: Gated DeltaNet, Mamba2, short convolutions next to attention layers
    "qwen3.5": ("Qwen3_5TextConfig", dict(_LINEAR, head_dim=16, layer_types=["linear_attention", _FULL])),
    "qwen3-next": ("Qwen3NextConfig", dict(_LINEAR, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                           moe_intermediate_size=32, shared_expert_intermediate_size=32,
                                           layer_types=["linear_attention", _FULL])),
    "nemotron-h": ("NemotronHConfig", dict(_MAMBA, head_dim=16, layers_block_type=["mamba", "attention", "mlp"],
                                           **_IDS)),
    "lfm2": ("Lfm2Config", dict(_IDS, full_attn_idxs=[1], block_auto_adjust_ff_dim=False)),
    "granite-4-hybrid": ("GraniteMoeHybridConfig", dict(layer_types=["mamba", "attention"], mamba_n_heads=4,
                                                        mamba_d_state=16, mamba_d_head=32, mamba_chunk_size=16,
                                                        num_local_experts=4, shared_intermediate_size=64)),
    # every layer "hybrid": Mamba2 and attention side by side on the same input, muP multipliers
    "falcon-h1": ("FalconH1Config", dict(mamba_d_ssm=64, mamba_n_heads=4, mamba_d_state=16, mamba_n_groups=2,
                                         mamba_chunk_size=16, mamba_rms_norm=True, lm_head_multiplier=0.5,
                                         embedding_multiplier=2.0, ssm_in_multiplier=0.5)),
}


class ArchitectureAbsent(UsageError):
    """The installed transformers has no config class for this architecture (it came in a later release)."""


def tiny_config(arch: str, vocab_size: int, **overrides: Any) -> Any:
    """A small config of ``arch`` (one of :data:`TINY_ARCHS`), 2 layers (3 for nemotron-h's block pattern)."""
    import transformers as tf

    if arch not in _ARCHS:
        raise UsageError(f"unknown tiny architecture {arch!r}; use one of {', '.join(TINY_ARCHS)}")
    class_name, settings = _ARCHS[arch]
    if not hasattr(tf, class_name):
        raise ArchitectureAbsent(f"transformers {tf.__version__} has no {class_name}: the tiny {arch} needs a "
                                 "release that has the architecture")
    kwargs = dict(_SHAPE, vocab_size=vocab_size, tie_word_embeddings=False, **settings)
    if "layers_block_type" in kwargs:  # nemotron-h: the layer count is the pattern's length
        kwargs.pop("num_hidden_layers")
    kwargs.update(overrides)
    config = getattr(tf, class_name)(**kwargs)
    _check_overrides(config, overrides, arch)
    return config


def _check_overrides(config: Any, overrides: dict[str, Any], arch: str) -> None:
    """Every override is a setting of the architecture's config: transformers keeps an unknown key as a
    plain attribute, so a misspelled ``hidden_sizes=64`` trained the default model without a word."""
    import difflib
    import inspect

    known = set(type(config)().to_dict()) | set(inspect.signature(type(config).__init__).parameters)
    unknown = sorted(k for k in overrides if k not in known)
    if unknown:
        close = difflib.get_close_matches(unknown[0], sorted(known), n=1)
        raise UsageError(f"tiny_config: {unknown[0]!r} is not a setting of {type(config).__name__} ({arch})"
                         + (f"; did you mean {close[0]!r}?" if close else ""))


def tiny_model(arch: str, vocab_size: int, *, dtype: Any = None, seed: int = 0,
               attn_implementation: str = "sdpa", device: Any = "cpu", **overrides: Any) -> Any:
    """A seeded random-weight causal LM of ``arch``, in ``dtype`` (default float32) on ``device``, in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    config = tiny_config(arch, vocab_size, **overrides)
    config._attn_implementation = attn_implementation
    # experts as a loop over experts: grouped_mm has no float64 kernel, and tiny experts gain nothing from it
    experts = {"experts_implementation": "eager"} if arch in MOE_ARCHS else {}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype or torch.float32,
                                                 attn_implementation=attn_implementation,
                                                 **experts)
    return model.to(device).eval()
