"""True float64 for the recurrent kernels, for verification (like :mod:`onepass.precision` for norms).

Why this module exists: transformers' torch scans cast to float32 whatever the
model dtype (``x.to(torch.float32)`` in the gated delta rule, ``x.float()`` in
the Mamba2 chunk scan). One-pass splits a row into chains where N-pass scans a
whole view, so the float32 roundings differ (~1e-7 relative; more for the
small gradients of the decay parameters) although the math is identical. To
check equivalence at 1e-9, :func:`float64_kernels` replaces each known kernel
by a dispatcher: float64 inputs run a copy of the kernel's own source with the
float32 casts made float64; any other dtype runs the original, unchanged.
The gated RMSNorms inside the mixers (``*RMSNormGated``, not covered by
:func:`onepass.precision.float64_norms`) get the same treatment per instance in
a float64 model (:func:`float64_mixers`), and so does a causal LM whose forward
casts its logits (Nemotron-H's ``self.lm_head(hidden_states).float()``, meant
to upcast half precision, rounds float64 logits to float32: the loss of both
one-pass and N-pass becomes a float32 sum, ~1e-7 apart, although every layer
agrees to 1e-16). The copies are the models' own code with one cast changed;
tests/mixers/test_hybrids.py checks they agree with the originals to float32
precision.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import re
import textwrap
from typing import Any

import torch

# module -> kernel functions that cast to float32 inside
KERNELS: dict[str, tuple[str, ...]] = {
    "transformers.models.qwen3_next.modeling_qwen3_next": ("torch_chunk_gated_delta_rule",
                                                           "torch_recurrent_gated_delta_rule"),
    "transformers.models.qwen3_5.modeling_qwen3_5": ("torch_chunk_gated_delta_rule",
                                                     "torch_recurrent_gated_delta_rule"),
    "transformers.models.nemotron_h.modeling_nemotron_h": ("mamba2_chunk_scan", "mamba2_selective_state_update"),
    "transformers.models.granitemoehybrid.modeling_granitemoehybrid": ("mamba2_chunk_scan",
                                                                      "mamba2_selective_state_update"),
    "transformers.models.falcon_h1.modeling_falcon_h1": ("mamba2_chunk_scan", "mamba2_selective_state_update"),
}
_PATCHED = "_onepass_float64"


def _float64_copy(fn: Any, module: Any) -> Any:
    """``fn``'s source with float32 casts made float64, compiled in ``module``'s namespace."""
    src = textwrap.dedent(inspect.getsource(inspect.unwrap(fn)))
    src = src[src.index("def "):]  # drop decorators
    src = re.sub(r"torch\.float(32)?\b", "torch.float64", src).replace(".float()", ".double()")
    namespace = dict(vars(module))
    exec(compile(src, f"<float64 {module.__name__}.{fn.__name__}>", "exec"), namespace)  # noqa: S102
    return namespace[inspect.unwrap(fn).__name__]


def _first_tensor(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    return next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)
                 and a.is_floating_point()), None)


def float64_kernels() -> int:
    """Make the known recurrent kernels compute float64 inputs in float64 (idempotent, process-wide:
    other dtypes are untouched). Returns how many kernels are patched."""
    count = 0
    for name, kernels in KERNELS.items():
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        for kernel in kernels:
            original = getattr(module, kernel, None)
            if original is None:
                continue
            if not getattr(original, _PATCHED, False):
                exact = _float64_copy(original, module)

                def dispatch(*args: Any, _original: Any = original, _exact: Any = exact, **kwargs: Any) -> Any:
                    first = _first_tensor(args, kwargs)
                    use = _exact if first is not None and first.dtype == torch.float64 else _original
                    return use(*args, **kwargs)

                functools.update_wrapper(dispatch, original)
                setattr(dispatch, _PATCHED, True)
                setattr(module, kernel, dispatch)
            count += 1
    return count


def _casts(cls: type) -> bool:
    try:
        src = inspect.getsource(inspect.unwrap(cls.forward))
    except (OSError, TypeError):
        return False
    return re.search(r"torch\.float(32)?\b", src) is not None or ".float()" in src


def float64_mixers(model: torch.nn.Module) -> int:
    """:func:`float64_kernels`, and in a float64 ``model`` the forward of each registered mixer, gated
    RMSNorm (``*RMSNormGated``, not covered by :func:`onepass.precision.float64_norms`), MoE router
    (``*Router``) and causal LM (``*ForCausalLM``: its logits) that casts to float32, computed in
    float64 instead. Returns how many were patched."""
    import types

    from onepass.mixers.tree import MIXERS

    float64_kernels()
    if next(model.parameters()).dtype != torch.float64:
        return 0
    count = 0
    for mod in model.modules():
        cls = type(mod)
        wanted = cls.__name__ in MIXERS or cls.__name__.endswith(("RMSNormGated", "Router", "ForCausalLM"))
        if wanted and _PATCHED not in mod.__dict__ and "forward" not in mod.__dict__ and _casts(cls):
            exact = _float64_copy(cls.forward, importlib.import_module(cls.__module__))
            mod.forward = types.MethodType(exact, mod)
            mod.__dict__[_PATCHED] = True
            count += 1
    return count
