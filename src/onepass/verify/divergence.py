"""Where one-pass and N-pass part: the first layer whose output differs, its type and its mixer.

Why this module exists: "the loss differs by 1e-5" does not tell a user (or us)
what to fix; "layer type conv (Lfm2ShortConv)" does. Each decoder layer's
output at every node of a one-pass tree row is compared with that layer's
output at the same token of a plain forward of the node's root-to-node path
(the N-pass view up to it). The first layer that differs while the layer before
it agreed is the one that is not exact; later layers only carry it on. Used by
the exactness guard (:mod:`onepass.guard`) and ``onepass verify``.

    >>> found = locate(model, views)                               # doctest: +SKIP
    >>> found.describe()                                           # doctest: +SKIP
    'layer 0 (conv, Lfm2ShortConv) is the first whose output differs (by 6.7e-04 relative)'
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from onepass.attention.backends import forward_kwargs
from onepass.layout.geometry import leaf_paths
from onepass.loss import forward_plan, layouts_to_batch
from onepass.model.config import text_config
from onepass.model.layers import decoder_layers, layer_types, mixer_name
from onepass.layout.schedule import Schedule, schedule_views
from onepass.layout.view import View

TOLERANCE = 1e-9  # relative, float64
ROUNDING = 1e-6  # the most a gradient may differ by rounding alone, when every output agrees (see judge)
ZERO = 1e-6
"""A parameter's gradient whose norm is at most this fraction of the whole gradient's, on both sides, is zero up
to rounding: its difference is measured on the whole gradient's scale (:func:`max_rel_grad_diff`)."""


def nan_max(values: Iterable[float], default: float = 0.0) -> float:
    """The largest value, NaN if any is NaN (Python's ``max`` keeps or drops a NaN by where it stands).

    >>> nan_max([1.0, float("nan"), 2.0]), max([1.0, float("nan"), 2.0])
    (nan, 2.0)
    """
    out = default
    for v in values:
        if math.isnan(v):
            return math.nan
        out = max(out, v)
    return out


def rel_diff(got: torch.Tensor | float, want: torch.Tensor | float) -> float:
    """``|got - want| / |want|`` (norms, in float64): 0 when they are equal, inf when ``want`` is 0 and they are
    not. The one measure of a loss's (or any output's) difference; a gradient's is :func:`max_rel_grad_diff`.

    >>> rel_diff(1.5, 1.0), rel_diff(0.0, 0.0), rel_diff(1.0, 0.0)
    (0.5, 0.0, inf)
    """
    got_, want_ = torch.as_tensor(got, dtype=torch.float64), torch.as_tensor(want, dtype=torch.float64)
    diff, scale = float((got_ - want_).norm()), float(want_.norm())
    return diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf)


def max_rel_grad_diff(reference: dict[str, torch.Tensor], other: dict[str, torch.Tensor]) -> tuple[float, str]:
    """The largest difference of a parameter's gradient, and that parameter's name: ``|other - reference|``
    relative to ``|reference|``, or, for a gradient that is zero up to rounding (both norms at most
    :data:`ZERO` of the whole reference gradient's), relative to the whole gradient. NaN or inf anywhere
    is returned as it is (the first parameter holding it), never skipped.

    Why the second scale: a gradient that is exactly zero (a one-token prompt: attention over one key does
    not depend on the query, so ``q_proj``'s gradient is 0) is computed as ~1e-16 of the whole gradient on
    each side, two different roundings of 0; relative to itself that is a difference of 200%.
    """
    total = math.sqrt(sum(float(g.double().norm()) ** 2 for g in reference.values()))
    rel_grad, worst = 0.0, ""
    for name, g_n in reference.items():
        scale, other_scale = g_n.norm().item(), other[name].norm().item()
        diff = (other[name] - g_n).norm().item()
        if not all(map(math.isfinite, (scale, other_scale, diff))):
            return (math.nan if any(map(math.isnan, (scale, other_scale, diff))) else math.inf), name
        if total > 0 and max(scale, other_scale) <= ZERO * total:
            rel = diff / total
        else:
            rel = diff / scale if scale > 0 else diff
        if rel > rel_grad:
            rel_grad, worst = rel, name
    return rel_grad, worst


def trains_nothing(reference: dict[str, torch.Tensor]) -> bool:
    """True when every gradient of the reference (N-pass, per-turn) is exactly zero: nothing is trained (a
    mask of zeros, a weight of 0 everywhere), so the other side's zeros agree with it on nothing. A verdict
    then is no verdict: ``verify`` says so as an error, as it does when it checked no view at all.

    >>> trains_nothing({"a": torch.zeros(3)}), trains_nothing({"a": torch.zeros(3), "b": torch.tensor([0.0, 1e-30])})
    (True, False)
    """
    return all(not bool(g.any()) for g in reference.values())


def layer_differences(model: Any, conversations: Sequence[Sequence[View]]) -> list[float]:
    """Per decoder layer: the largest relative difference between its output at a one-pass tree
    node and its output at the same token of a plain forward of that node's path. Empty when the
    layers cannot be found."""
    layers = decoder_layers(model)
    if layers is None:
        return []
    seen: dict[int, torch.Tensor] = {}
    hooks = [layer.register_forward_hook(
        lambda _m, _i, out, i=i: seen.__setitem__(i, (out[0] if isinstance(out, tuple) else out)[0]))
        for i, layer in enumerate(layers)]
    worst = [0.0] * len(layers)
    device = next(model.parameters()).device
    try:
        with torch.no_grad():
            for views in conversations:
                for layout in schedule_views(views, Schedule(kind="one-pass")).layouts:
                    batch = layouts_to_batch([layout], device=device)
                    model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], logits_to_keep=1,
                          use_cache=False, **forward_plan(model, batch).model_kwargs())  # mask, mixers' chains
                    tree = dict(seen)
                    for path in leaf_paths(layout.kv_end):  # each N-pass sequence of the row
                        ids = torch.as_tensor(layout.input_ids[path], device=device).long()[None]
                        model(input_ids=ids, logits_to_keep=1, use_cache=False, **forward_kwargs(model))
                        for i, ref in seen.items():
                            diff = (tree[i][torch.as_tensor(path, device=device)] - ref).norm(dim=-1)
                            rel = diff / ref.norm(dim=-1).clamp_min(torch.finfo(ref.dtype).tiny)
                            worst[i] = nan_max((worst[i], float(rel.max())))
    finally:
        for h in hooks:
            h.remove()
    return worst


def first_differing(diffs: Sequence[float], tolerance: float = TOLERANCE) -> int | None:
    """The first layer whose difference is within 1e-3 of the largest: the one that introduces it
    (rounding noise in earlier layers stays far below a structural difference)."""
    if not diffs or max(diffs) <= tolerance:
        return None
    cut = max(tolerance, 1e-3 * max(diffs))
    return next(i for i, d in enumerate(diffs) if d > cut)


def layer_of_parameter(parameter: str) -> int | None:
    """``model.layers.3.self_attn.q_proj.weight`` -> 3 (None outside the decoder layers)."""
    match = re.search(r"\.(?:layers|h|blocks|layer)\.(\d+)\.", parameter)
    return int(match.group(1)) if match else None


@dataclass(frozen=True, kw_only=True, slots=True)
class LayerDiff:
    """Where one-pass and N-pass part: the first layer whose output differs, its type and mixer."""

    index: int | None
    layer_type: str | None
    mixer: str | None
    max_diff: float | None  # the largest relative difference of any layer's output (None: not compared)

    def describe(self) -> str:
        if self.index is None:
            return ("every layer's output agrees" if self.max_diff is None else
                    f"every layer's output agrees within {self.max_diff:.1e}")
        return f"layer {self.index} ({self.layer_type}, {self.mixer}) is the first whose output differs" + (
            f" (by {self.max_diff:.1e} relative)" if self.max_diff is not None else "")


def locate(model: Any, conversations: Sequence[Sequence[View]], *, worst_parameter: str = "",
           tolerance: float = TOLERANCE) -> LayerDiff:
    """The first layer of ``model`` whose output differs between one-pass and N-pass; when the
    outputs cannot be compared, the layer of ``worst_parameter`` (the largest gradient difference)."""
    diffs = layer_differences(model, conversations)
    index = first_differing(diffs, tolerance)
    if index is None and not diffs and worst_parameter:
        index = layer_of_parameter(worst_parameter)
    return named_layer(model, index, max(diffs) if diffs else None)


@dataclass(frozen=True, kw_only=True, slots=True)
class Verdict:
    """Whether one-pass equals N-pass (or per-turn scoring), and where they part when not within tolerance."""

    equal: bool
    rounding: bool  # equal although a gradient is past the tolerance: rounding only (every output agrees)
    where: LayerDiff | None  # None when everything was within the tolerance (nothing was located)
    finite: bool = True  # False: a difference is NaN or inf (a loss, log-prob or gradient that is not finite)

    @property
    def word(self) -> str:
        """What ``onepass verify`` prints: EQUAL, EQUAL (rounding ...) or DIFFERENT."""
        if not self.finite:
            return "DIFFERENT (a difference is not finite: a loss, log-prob or gradient is NaN or inf)"
        if not self.equal:
            return "DIFFERENT"
        return "EQUAL (a gradient rounds differently; every output agrees)" if self.rounding else "EQUAL"

    def located(self, worst_parameter: str) -> str:
        """One line: where the outputs part (or that they agree), and the parameter of the largest gradient
        difference."""
        assert self.where is not None
        return (f"{self.where.describe()}; largest gradient difference in {worst_parameter}"
                + (" (rounding only)" if self.rounding else ""))

    def to_dict(self) -> dict[str, Any]:
        """``equal``, and where one-pass and N-pass part when something was past the tolerance."""
        if not self.finite:
            return {"equal": False, "finite": False}
        if self.where is None:
            return {"equal": self.equal}
        return {"equal": self.equal, "rounding": self.rounding, "differing_layer": self.where.index,
                "layer_type": self.where.layer_type, "mixer": self.where.mixer,
                "max_layer_diff": self.where.max_diff}


def judge(outputs: float, gradients: float, where: Callable[[], LayerDiff], *,
          tolerance: float = TOLERANCE) -> Verdict:
    """The one rule for "exact", used by the guard, ``onepass verify`` and ``verify --rollouts``.

    ``outputs``: the largest relative difference of what the model computes (loss, log-probs,
    entropies); ``gradients``: the largest relative difference of a parameter's gradient; ``where``:
    locates the first layer whose output differs (called only when something is past ``tolerance``).

    Outputs must agree within ``tolerance``. A gradient may differ by more, up to :data:`ROUNDING`,
    when every layer's output agrees within ``tolerance`` at every tree node: the same function,
    rounded differently. Two causes, both measured: a parameter whose gradient sums many terms of both
    signs loses relative digits to cancellation (a gated-delta-net decay ``A_log`` or ``dt_bias``: up
    to 1.05e-9 on 10 bundled conversations with a tiny float64 Qwen3.5, while the loss agrees to 1e-16),
    and a step computed in float32 inside a float64 model (an MoE router's softmax) sums a shared node's
    gradient before its cast (~1e-8). A structural difference is 1e-4 and more and shows in the outputs.

        >>> judge(1e-16, 5e-10, where=lambda: 1 / 0).equal             # within: nothing is located
        True
        >>> agree = LayerDiff(index=None, layer_type=None, mixer=None, max_diff=3e-15)
        >>> v = judge(1e-16, 1.05e-9, where=lambda: agree); v.equal, v.rounding
        (True, True)
        >>> judge(2e-9, 1e-12, where=lambda: agree).equal              # an output never rounds away
        False
        >>> judge(0.0, float("nan"), where=lambda: 1 / 0).word           # not finite: DIFFERENT, nothing located
        'DIFFERENT (a difference is not finite: a loss, log-prob or gradient is NaN or inf)'

    A gradient that is zero up to rounding is compared on the whole gradient's scale
    (:func:`max_rel_grad_diff`): ``gradients`` is that measure.
    """
    if not (math.isfinite(outputs) and math.isfinite(gradients)):
        return Verdict(equal=False, rounding=False, where=None, finite=False)
    if outputs <= tolerance and gradients <= tolerance:
        return Verdict(equal=True, rounding=False, where=None)
    found = where()
    rounding = (outputs <= tolerance and gradients <= ROUNDING and found.max_diff is not None
                and found.max_diff <= tolerance)
    return Verdict(equal=rounding, rounding=rounding, where=found)


def named_layer(model: Any, index: int | None, max_diff: float | None = None) -> LayerDiff:
    """Layer ``index`` of ``model`` with its type (``config.layer_types`` or the hybrid pattern) and mixer."""
    types, layers = layer_types(text_config(model.config)), decoder_layers(model)
    return LayerDiff(index=index, max_diff=max_diff,
                     layer_type=types[index] if index is not None and index < len(types) else None,
                     mixer=mixer_name(layers[index]) if index is not None and layers is not None
                     and index < len(layers) else None)
