"""Is sequence parallelism exact for this model? A tiny float64 twin, split over simulated ranks.

Why this module exists: splitting a row over ranks is exact for a layer only if the layer is
per-token (norms, MLPs, experts), goes through the attention interface that
:mod:`onepass.parallel.attention` wraps, or is a recurrent mixer :mod:`onepass.mixers.tree` finds
(it gathers the row). Anything else that mixes positions (a custom convolution, a cumulative
sum, attention that bypasses the interface) would see only its shard and be silently wrong.
Rather than trust a list, this checks the model's own architecture, as the one-pass guard does
(:mod:`onepass.guard`): its tiny float64 twin's loss and every gradient on a branching tree row,
in one process and split over two simulated ranks (:func:`onepass.parallel.comm.run_ranks`:
threads, no process group needed); when they differ, the first module whose output differs is
named in one line.

    >>> check_sequence_parallel(model)          # doctest: +SKIP
    SequenceParallelError: sequence parallelism (sp_size 2) is not exact for LlamaForCausalLM:
    model.layers.0.mlp (CumulativeMLP) is the first module whose output differs (by 4.1e-01 relative)
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from onepass.guard.check import TOLERANCE, build_twin, describe
from onepass.layout.tree import Layout, build_layout
from onepass.layout.view import View
from onepass.loss import batch_loss, layouts_to_batch, pad_batch
from onepass.model.layers import decoder_layers
from onepass.parallel.comm import SequenceShard, run_ranks
from onepass.parallel.model import install, model_heads, uninstall
from onepass.parallel.plan import SequenceParallelError, head_split
from onepass.verify.check import loss_and_grads
from onepass.verify.divergence import first_differing, max_rel_grad_diff, rel_diff


def check_row(vocab_size: int) -> Layout:
    """A branching tree row of 44 tokens: a history, two turns branching off it, a third branching off the
    second, so chains and segments cross the shard boundaries of 2 and 4 ranks (tests/guard/test_sequence_parallel.py).
    Fixed distinct token ids, so the tree is this one whatever the vocabulary."""
    history, a, b = np.arange(1, 18), np.arange(18, 27), np.arange(27, 38)
    views = [View(tokens=np.concatenate([history, a]), num_prompt=12, turn=0),
             View(tokens=np.concatenate([history, b]), num_prompt=14, turn=1),
             View(tokens=np.concatenate([history, b[:4], a[:5] + 20]), num_prompt=17, turn=2)]
    assert vocab_size > 46
    return build_layout(views)


def split_loss_and_grads(model: torch.nn.Module, batch: Mapping[str, torch.Tensor], degree: int
                         ) -> tuple[float, dict[str, torch.Tensor]]:
    """The loss sum and every trainable parameter's gradient of ``batch`` split over ``degree`` simulated
    ranks: each rank a copy of ``model`` (as each process holds its own), the gradients summed over ranks
    (what DDP / FSDP do). ``model`` is made sequence-parallel here. One process's are
    :func:`whole_loss_and_grads`; both sides are measured by :func:`onepass.verify.check.loss_and_grads`."""
    install(model, degree)
    copies = [copy.deepcopy(model) for _ in range(degree)]

    def rank(shard: SequenceShard) -> tuple[float, dict[str, torch.Tensor]]:
        return loss_and_grads(copies[shard.rank], lambda mine: batch_loss(mine, batch, shard=shard))

    results = run_ranks(degree, rank)
    total = {n: sum(r[1][n] for r in results) for n in results[0][1]}
    return sum(r[0] for r in results), total


def whole_loss_and_grads(model: torch.nn.Module, batch: Mapping[str, torch.Tensor]
                         ) -> tuple[float, dict[str, torch.Tensor]]:
    """The same in one process (the reference)."""
    return loss_and_grads(model, lambda whole: batch_loss(whole, batch))


def twin_degree(model: torch.nn.Module) -> int:
    """The degree the twin is split over: 2 (chains and windows cross one boundary), or its head count
    when 2 does not divide its heads."""
    shape = model_heads(model.config)
    if shape is None:
        return 2
    try:
        head_split(*shape, 2)
        return 2
    except SequenceParallelError:
        return shape[0]


def check_sequence_parallel(model_or_config: Any, degree: int, *, backend: str | None = None,
                            tolerance: float = TOLERANCE) -> dict[str, Any]:
    """Raise :class:`SequenceParallelError` (one line naming the first module that differs) unless a tiny
    float64 twin of ``model_or_config`` takes the same loss and gradients split over ranks as in one
    process; returns what metrics.json records (``sequence_parallel``). ``degree``: the run's sp_size (its
    heads are checked on the real config by :func:`onepass.parallel.model.check_degree`)."""
    _, _, architecture = describe(model_or_config)
    vocab = 64
    twin = build_twin(model_or_config, vocab, backend=backend)
    split_over = twin_degree(twin)
    batch = layouts_to_batch([check_row(vocab)])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        want_loss, want = whole_loss_and_grads(twin, batch)
        got_loss, got = split_loss_and_grads(twin, batch, split_over)
        loss_diff = rel_diff(got_loss, want_loss)
        grad_diff, worst = max_rel_grad_diff(want, got)
        if not (loss_diff <= tolerance and grad_diff <= tolerance):
            where = first_differing_module(twin, batch, split_over, tolerance=tolerance)
            raise SequenceParallelError(
                f"sequence parallelism (sp_size {degree}) is not exact for {architecture}: {where} (split over "
                f"{split_over} ranks, a float64 twin: loss differs by {loss_diff:.1e}, gradients by {grad_diff:.1e} "
                f"relative, worst {worst}); train with sp_size 1, or the budget schedule for long trees")
    finally:
        torch.set_num_threads(threads)
    return {"checked": True, "architecture": architecture, "twin_degree": split_over, "rel_loss_diff": loss_diff,
            "max_rel_grad_diff": grad_diff}


def _record(model: torch.nn.Module, store: dict[str, list[torch.Tensor]]) -> Callable[[], None]:
    """Forward hooks keeping each module's first tensor output, by name, in the order modules finish."""
    hooks = []

    def hook(name: str) -> Any:
        def keep(_module: Any, _args: Any, out: Any) -> None:
            first = out[0] if isinstance(out, (tuple, list)) and out else getattr(out, "logits", out)
            if isinstance(first, torch.Tensor) and first.is_floating_point():
                store.setdefault(name, []).append(first.detach())
        return keep

    for name, module in model.named_modules():
        if name:
            hooks.append(module.register_forward_hook(hook(name)))
    return lambda: [h.remove() for h in hooks]


def first_differing_module(model: torch.nn.Module, batch: Mapping[str, torch.Tensor], degree: int, *,
                           tolerance: float = TOLERANCE) -> str:
    """Which module's output first differs (in the order modules finish) between one process and ``degree``
    simulated ranks: the shards' outputs side by side against the whole row's. Modules called more than
    once per forward (inside a chain-by-chain scan) are passed over."""
    uninstall(model)
    whole: dict[str, list[torch.Tensor]] = {}
    remove = _record(model, whole)
    with torch.no_grad():
        batch_loss(model, pad_batch(batch, degree))
    remove()
    install(model, degree)
    copies = [copy.deepcopy(model) for _ in range(degree)]
    shards: list[dict[str, list[torch.Tensor]]] = [{} for _ in range(degree)]

    def rank(shard: SequenceShard) -> None:
        undo = _record(copies[shard.rank], shards[shard.rank])
        with torch.no_grad():
            batch_loss(copies[shard.rank], batch, shard=shard)
        undo()

    run_ranks(degree, rank)
    names, diffs = [], []
    for name, outs in whole.items():
        parts = [s.get(name, []) for s in shards]
        if len(outs) != 1 or any(len(p) != 1 for p in parts):
            continue
        want, got = outs[0], [p[0] for p in parts]
        if want.ndim >= 2 and all(g.shape == got[0].shape for g in got) and got[0].shape[1] * degree == want.shape[1]:
            got_whole = torch.cat(got, dim=1)
        elif all(g.shape == want.shape for g in got):
            got_whole = got[0]
        else:
            continue
        names.append(name)
        diffs.append(rel_diff(got_whole, want))
    first = first_differing(diffs, tolerance)  # the one rule: onepass.verify.divergence
    if first is None:
        return "no single module's output differs (the gradients do)"
    name = layer_part(model, names[first])
    return (f"{name} ({type(dict(model.named_modules())[name]).__name__}) is the first module whose output "
            f"differs (by {diffs[first]:.1e} relative)")


def layer_part(model: torch.nn.Module, name: str) -> str:
    """The part of a decoder layer (its attention, mixer, MLP ...) that holds module ``name``: what a user can
    act on (``model.layers.0.linear_attn``, not its ``out_proj``); ``name`` itself outside the decoder layers."""
    layers = decoder_layers(model)
    prefixes = {n for n, m in model.named_modules() if m is layers}
    for prefix in prefixes:
        parts = name[len(prefix) + 1:].split(".") if name.startswith(prefix + ".") else []
        if len(parts) >= 2:
            return f"{prefix}.{parts[0]}.{parts[1]}"
    return name


__all__ = ["check_row", "check_sequence_parallel", "first_differing_module", "split_loss_and_grads",
           "whole_loss_and_grads"]
