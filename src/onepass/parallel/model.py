"""A model made sequence-parallel: its heads checked against the degree, its attention backend wrapped.

Why this module exists: a degree that cannot split a model must stop before any work, in one line,
and the model's attention must go through the wrapper of :mod:`onepass.parallel.attention` for the
rest of the run (a gradient checkpoint's recomputation included), whatever wraps the model later
(peft, DDP, FSDP). Both happen once, here, on the loaded model:

    >>> from onepass.model.tiny import tiny_model                                  # doctest: +SKIP
    >>> model = tiny_model("qwen3", 100, attn_implementation="onepass_cpu")   # doctest: +SKIP
    >>> install(model, 2); model.config._attn_implementation                  # doctest: +SKIP
    'onepass_sp:onepass_cpu'

The wrapped backend is the one the model had; :func:`onepass.attention.backends.model_backend`
reads through the prefix, so masks are built for it as before. The name lives on the config's
``_attn_implementation``, which ``save_pretrained`` never writes.
"""

from __future__ import annotations

from typing import Any

from onepass.attention.backends import SP_PREFIX, model_backend
from onepass.model.couplings import recurrent_mixer
from onepass.model.layers import decoder_layers
from onepass.model.config import text_config
from onepass.parallel.attention import register
from onepass.model.private_names import private
from onepass.parallel.plan import HeadSplit, LayerShapes, SequenceParallelError, head_split


def model_heads(config: Any) -> tuple[int, int] | None:
    """(query heads, key/value heads the attention function receives) of ``config``; None without attention.

    Latent attention (DeepSeek: ``kv_lora_rank``) expands keys and values to one per query head.
    """
    config = text_config(config)
    heads = getattr(config, "num_attention_heads", None)
    if not heads:
        return None
    kv = getattr(config, "num_key_value_heads", None) or heads
    if getattr(config, "kv_lora_rank", None):
        kv = heads
    return int(heads), int(kv)


def head_dims(config: Any) -> tuple[int, int]:
    """(query/key, value) head size of ``config``'s attention (latent attention: they differ)."""
    config = text_config(config)
    if getattr(config, "kv_lora_rank", None):
        return int(config.qk_nope_head_dim + config.qk_rope_head_dim), int(config.v_head_dim)
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return int(dim), int(dim)


def layer_shapes(model: Any) -> list[LayerShapes]:
    """What each decoder layer of ``model`` exchanges under sequence parallelism
    (:func:`onepass.parallel.plan.forward_volume`): its attention's heads, its recurrent mixer's width."""
    config = text_config(model.config)
    heads = model_heads(config)
    qk, v = head_dims(config) if heads else (0, 0)
    out = []
    for layer in decoder_layers(model) or ():
        modules = list(layer.modules())
        mixer = any(recurrent_mixer(type(m)) is not None for m in modules)
        attention = any(type(m).__name__.endswith("Attention") and recurrent_mixer(type(m)) is None for m in modules)
        out.append(LayerShapes(heads=heads[0] if attention and heads else 0, kv_heads=heads[1] if attention and heads
                               else 0, qk_dim=qk if attention else 0, v_dim=v if attention else 0,
                               mixer_width=int(config.hidden_size) if mixer else 0))
    return out


def check_degree(config: Any, degree: int) -> HeadSplit | None:
    """The head split of ``config`` over ``degree`` ranks; :class:`SequenceParallelError` (one line) if none."""
    shape = model_heads(config)
    if shape is None:
        return None
    name = type(text_config(config)).__name__.removesuffix("Config")
    return head_split(*shape, degree, where=name)


def install(model: Any, degree: int) -> HeadSplit | None:
    """Check ``model`` splits over ``degree`` ranks and wrap its attention backend (idempotent)."""
    if degree < 1:
        raise SequenceParallelError(f"sp_size must be >= 1, got {degree}")
    split = check_degree(model.config, degree)
    if degree > 1:
        register()
        private("transformers.PreTrainedConfig._attn_implementation")  # a release without it: one line
        model.config._attn_implementation = SP_PREFIX + model_backend(model)
    return split


def uninstall(model: Any) -> None:
    """The model's own backend again."""
    model.config._attn_implementation = model_backend(model)


def is_installed(model: Any) -> bool:
    return str(getattr(model.config, "_attn_implementation", "") or "").startswith(SP_PREFIX)


__all__ = ["check_degree", "head_dims", "install", "is_installed", "layer_shapes", "model_heads", "uninstall"]
