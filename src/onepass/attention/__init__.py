"""Attention over a tree layout: every backend derived from the same ``kv_end`` row column.

    backends.py   which mask object each HF attention backend takes (the public entry points below)
    mask.py       the dense mask, its numpy reference, FlexAttention's ``mask_mod``
    blocks.py     the block plan (which query x key tiles hold visible pairs) and the BlockMask built from it
    segments.py   the segment plan: segments (onepass.layout.geometry) tiled for the CPU kernel
    cpu_tiles.py  ``tree_attention``: a segment plan's tiles through the fused CPU flash kernel, and its reference
    cpu.py        ``onepass_cpu``: that kernel as a transformers backend (its mask object, registration)
    gather.py     the gather plan: each segment against its gathered root path, one varlen call (numpy)
    varlen.py     ``onepass_varlen``: the gather plan on torch's flash varlen kernel (CUDA), its CPU reference
    window.py     sliding windows over a tree: where each query's window starts
    paper.py      the seed paper's layout and role-id mask, kept as a separate reference
"""

from onepass.lazy import package_getattr

# The public names live in backends.py (torch). Loaded on first use, so the numpy-only plans
# (blocks, segments, window, paper) can be imported without torch.
__all__ = ["BACKENDS", "BackendError", "attention_mask_for", "check_backend", "default_backend",
           "layer_windows", "model_backend", "supported_backend"]

__getattr__ = package_getattr(__name__, {name: f"onepass.attention.backends:{name}" for name in __all__})
