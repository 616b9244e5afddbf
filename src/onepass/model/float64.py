"""True float64 for the recurrent kernels, for verification (like :mod:`onepass.model.precision` for norms).

Why this module exists: transformers' torch scans cast to float32 whatever the
model dtype (``x.to(torch.float32)`` in the gated delta rule, ``x.float()`` in
the Mamba2 chunk scan). One-pass splits a row into chains where N-pass scans a
whole view, so the float32 roundings differ (~1e-7 relative; more for the
small gradients of the decay parameters) although the math is identical. To
check equivalence at 1e-9, :func:`float64_kernels` replaces each kernel a
mixer calls (found in its source, not named here) by a dispatcher: float64 inputs run a copy of the kernel's own source with the
float32 casts made float64; any other dtype runs the original, unchanged.
The gated RMSNorms inside the mixers (``*RMSNormGated``, not covered by
:func:`onepass.model.precision.float64_norms`) get the same treatment per instance in
a float64 model (:func:`float64_mixers`), and so does a causal LM whose forward
casts its logits (Nemotron-H's ``self.lm_head(hidden_states).float()``, meant
to upcast half precision, rounds float64 logits to float32: the loss of both
one-pass and N-pass becomes a float32 sum, ~1e-7 apart, although every layer
agrees to 1e-16). The copies are the models' own code with one cast changed;
tests/mixers/test_hybrids.py checks they agree with the originals to float32
precision. The rewrite cannot silently stop applying: :func:`check_float64_mixers`
watches a short float64 forward and refuses in one line if any op inside a
mixer still returns float32.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import re
import sys
import textwrap
from collections.abc import Iterable
from typing import Any

import torch

from onepass.model.couplings import CouplingError, called_kernels, mixer_classes
from onepass.model.private_names import private

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


def _casts(fn: Any) -> bool:
    """Whether ``fn``'s source casts to float32 (``torch.float32``, ``torch.float``, ``.float()``)."""
    try:
        src = inspect.getsource(inspect.unwrap(fn))
    except (OSError, TypeError):
        return False
    return re.search(r"torch\.float(32)?\b", src) is not None or ".float()" in src


def float64_kernels(classes: Iterable[type]) -> int:
    """Make the kernels the mixer ``classes`` call by name, and that cast to float32 inside, compute
    float64 inputs in float64 (idempotent, process-wide: other dtypes run the original). Found in the
    installed code (:func:`onepass.model.couplings.called_kernels`), not from a table of names. Returns how
    many kernels are patched."""
    count = 0
    for cls in classes:
        module = sys.modules[cls.__module__]
        for name, original in called_kernels(cls, wanted=lambda f: getattr(f, _PATCHED, False) or _casts(f)).items():
            if not getattr(original, _PATCHED, False):
                exact = _float64_copy(original, module)

                def dispatch(*args: Any, _original: Any = original, _exact: Any = exact, **kwargs: Any) -> Any:
                    first = _first_tensor(args, kwargs)
                    use = _exact if first is not None and first.dtype == torch.float64 else _original
                    return use(*args, **kwargs)

                functools.update_wrapper(dispatch, original)
                setattr(dispatch, _PATCHED, True)
                setattr(module, name, dispatch)
            count += 1
    return count


def float64_mixers(model: torch.nn.Module) -> int:
    """:func:`float64_kernels`, and in a float64 ``model`` the forward of each recurrent mixer, gated
    RMSNorm (``*RMSNormGated``, not covered by :func:`onepass.model.precision.float64_norms`), MoE router
    (``*Router``) and causal LM (``*ForCausalLM``: its logits) that casts to float32, computed in
    float64 instead. Then :func:`check_float64_mixers` makes sure nothing inside a mixer still rounds
    to float32 (:class:`onepass.model.couplings.CouplingError` if it does). Returns how many were patched."""
    import types

    mixers = mixer_classes(model.modules())
    float64_kernels(mixers)
    if next(model.parameters()).dtype != torch.float64:
        return 0
    count = 0
    for mod in model.modules():
        cls = type(mod)
        wanted = cls in mixers or cls.__name__.endswith(("RMSNormGated", "Router", "ForCausalLM"))
        if wanted and _PATCHED not in mod.__dict__ and "forward" not in mod.__dict__ and _casts(cls.forward):
            exact = _float64_copy(cls.forward, importlib.import_module(cls.__module__))
            mod.forward = types.MethodType(exact, mod)
            mod.__dict__[_PATCHED] = True
            count += 1
    if mixers:
        check_float64_mixers(model)
    return count


def float32_inside_mixers(model: torch.nn.Module, num_tokens: int = 6) -> dict[str, set[str]]:
    """The ops that return a tensor below float64 inside each recurrent mixer, on a short float64
    forward of ``model`` (mixer class name -> op names; empty when float64 is float64 all the way)."""
    TorchDispatchMode = private("torch.utils._python_dispatch.TorchDispatchMode")  # noqa: N806 - a class

    inside: list[str] = []
    found: dict[str, set[str]] = {}

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            if inside and any(isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64
                              for t in (out if isinstance(out, (tuple, list)) else (out,))):
                found.setdefault(inside[-1], set()).add(str(func.overloadpacket.__name__))
            return out

    mixers = mixer_classes(model.modules())
    hooks = []
    for mod in model.modules():
        if type(mod) in mixers:
            hooks.append(mod.register_forward_pre_hook(lambda m, a: inside.append(type(m).__name__) and None))
            hooks.append(mod.register_forward_hook(lambda m, a, o: inside.pop() and None))
    vocab = model.get_input_embeddings().num_embeddings
    ids = (torch.arange(num_tokens) % vocab)[None].to(next(model.parameters()).device)
    try:
        with torch.no_grad(), Watch():
            model(input_ids=ids)
    finally:
        for h in hooks:
            h.remove()
    return found


def check_float64_mixers(model: torch.nn.Module) -> None:
    """Raise :class:`onepass.model.couplings.CouplingError` naming each mixer of a float64 ``model`` that
    still computes below float64 (a kernel the patches no longer reach): a float64 one-pass vs N-pass
    comparison would then differ for rounding (~1e-7), not for the layout."""
    found = float32_inside_mixers(model)
    if found:
        import transformers

        what = "; ".join(f"{name}: {', '.join(sorted(ops)[:4])}" for name, ops in sorted(found.items()))
        raise CouplingError(f"float64 verification: recurrent mixers still compute in float32 on transformers "
                            f"{transformers.__version__} ({what}); onepass's float64 kernel patches no longer "
                            f"reach them")
