"""Recurrent token mixers on a tree: each chain scanned from its parent chain's end state.

Why this module exists: in a one-pass row a recurrent layer that scans the row
left to right would carry one view's tokens into another's. Here every
recurrent mixer (found by :func:`onepass.model.couplings.recurrent_mixer`: a module
whose forward reads conv / recurrent states from its cache argument) runs its *own* forward chain by chain
(:mod:`onepass.layout.geometry`), given a small cache object that holds the
parent chain's end states: the conv state (the last inputs of the causal
convolution, fewer at the start of a path, which the convolution's zero padding
makes equal) and the recurrent state (SSM / delta-rule matrix). That is the
same prefill-with-a-cache path HF uses for generation, so no mixer math is
copied here; states are never detached, so gradients flow through them.

How the chains reach the mixers: :func:`install` wraps the forward of each
mixer instance once (idempotent); :func:`chains_for` gives the rows' chains, which travel
in the forward's one record (:class:`onepass.parallel.forward.ForwardPlan`, built by
:func:`onepass.loss.forward_plan`) that HF forwards through the decoder layers' ``**kwargs``
to the mixer. A mixer called without it (the plain N-pass reference, generation) runs
unchanged; with gradient checkpointing the recomputation gets the same kwargs, so it runs
chain-wise too. Under sequence parallelism (the record's ``shard``, :mod:`onepass.parallel`) a
rank holds a shard of each row and a chain may cross shards: the mixer's input is gathered
along the sequence (an all-gather, exact in both directions), the whole row is scanned chain
by chain, and the rank keeps its own positions.

Loops chain by chain (torch kernels, CPU and GPU). Why not one call per chain
depth: transformers' torch scans (``torch_chunk_gated_delta_rule``,
``mamba2_chunk_scan``, the ``F.conv1d`` fallback of ``causal_conv1d_fn``) take
no ``cu_seqlens``, and stacking only the chains of equal depth *and* length
would save ~5% of the calls (MathChat, 48 conversations packed into 4096-token
rows: 240 chains per layer, 229 distinct (row, depth, length); one call per
depth would be 24). Faster GPU paths take ``cu_seqlens`` plus per-sequence
``initial_state`` and could run all chains of one depth in one call: fla's
``chunk_gated_delta_rule`` (Gated DeltaNet), mamba_ssm's
``mamba_chunk_scan_combined`` (``seq_idx`` / ``initial_states``) and
causal-conv1d's ``causal_conv1d_fn`` (``initial_states``). What the loop costs
is measured by :func:`timing` (``onepass bench --arch qwen3.5``).

Legend: B batch, L row length, D hidden, C conv channels, T chain length.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from onepass.model.couplings import check_cache_api, recurrent_mixer
from onepass.layout.geometry import Chain, batch_chains
from onepass.parallel.forward import take

# The mixers with a float64 equivalence test (tests/mixers/test_hybrids.py), for the docs: which modules
# are mixers, and which argument takes their cache, is read off the installed code
# (onepass.model.couplings.recurrent_mixer), never from this list.
TESTED_MIXERS: tuple[str, ...] = (
    "Lfm2ShortConv",  # LFM2: gated short convolution
    "Qwen3NextGatedDeltaNet",  # Qwen3-Next: conv1d front + gated delta rule
    "Qwen3_5GatedDeltaNet",  # Qwen3.5 / 3.6 (text)
    "NemotronHMamba2Mixer",  # Nemotron-H: Mamba2
    "GraniteMoeHybridMambaLayer",  # Granite-4 hybrid: Mamba2
    "FalconH1Mixer",  # Falcon-H1: Mamba2 beside attention in every layer
)
_WRAPPED = "_onepass_tree_forward"


class ChainState:
    """The slice of HF's linear-attention cache API a mixer calls, for one chain and one layer.

    Holds the parent chain's end states on the way in and this chain's on the way out.
    """

    def __init__(self, conv: torch.Tensor | None, recurrent: torch.Tensor | None) -> None:
        self.conv, self.recurrent = conv, recurrent

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self.conv

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        # a one-token step updates the state in place (Mamba2's selective_state_update): hand out a
        # copy, which then holds this chain's end state
        if self.recurrent is not None:
            self.recurrent = self.recurrent.clone()
        return self.recurrent

    def is_recording_past(self, layer_idx: int) -> bool:
        return True  # always the concatenating conv path, never the in-place decode update

    def update_conv_state(self, conv_BCT: torch.Tensor, layer_idx: int, state_idx: int = 0,
                          conv_kernel_size: int | None = None, **kwargs: Any) -> torch.Tensor:
        """The chain's conv inputs after the parent's; keeps the last ``kernel - 1`` as the end state."""
        full_BCT = conv_BCT if self.conv is None else torch.cat([self.conv.to(conv_BCT.dtype), conv_BCT], -1)
        keep = (conv_kernel_size or full_BCT.shape[-1] + 1) - 1
        self.conv = full_BCT[..., max(full_BCT.shape[-1] - keep, 0):]
        return full_BCT

    def update_recurrent_state(self, state: torch.Tensor, layer_idx: int, state_idx: int = 0,
                               **kwargs: Any) -> torch.Tensor:
        self.recurrent = state
        return state


CHAIN_STATE_METHODS = frozenset(n for n in vars(ChainState) if not n.startswith("_"))


def _one_token_state_update(fn: Any) -> Any:
    """Run ``fn`` with saved tensors copied: a one-token step with a state updates it in place
    (``state.copy_``) after using it, which autograd would otherwise refuse in the backward."""
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t):
        return fn()


@dataclass(kw_only=True, slots=True)
class ChainTime:
    """What the chain loops cost while :func:`timing` is active, forward passes only (a gradient
    checkpoint's recomputation included). Wall clock: exact on CPU; on CUDA it times launches."""

    calls: int = 0  # mixer forwards run chain by chain (one per mixer layer and batch)
    chains: int = 0  # mixer calls made, one per chain
    loop_seconds: float = 0.0  # in the chain loop outside the mixer's own forward: state passing
    mixer_seconds: float = 0.0  # in the mixer's own forward, chain by chain


_TIMERS: list[ChainTime] = []


@contextlib.contextmanager
def timing() -> Iterator[ChainTime]:
    """Accumulate the chain loops' cost (:class:`ChainTime`) until the block ends."""
    timer = ChainTime()
    _TIMERS.append(timer)
    try:
        yield timer
    finally:
        _TIMERS.remove(timer)


def run_chains(forward: Any, cache_kw: str, hidden_BLD: torch.Tensor, plan: Sequence[Sequence[Chain]],
               **kwargs: Any) -> torch.Tensor:
    """``forward`` (a mixer's own) run chain by chain, each from its parent chain's end states."""
    if not _TIMERS:
        return _run_chains(forward, cache_kw, hidden_BLD, plan, **kwargs)
    inside = [0.0]

    def timed(*args: Any, **kw: Any) -> torch.Tensor:
        t0 = time.perf_counter()
        try:
            return forward(*args, **kw)
        finally:
            inside[0] += time.perf_counter() - t0

    t0 = time.perf_counter()
    out = _run_chains(timed, cache_kw, hidden_BLD, plan, **kwargs)
    total = time.perf_counter() - t0
    for timer in _TIMERS:
        timer.calls += 1
        timer.chains += sum(len(chains) for chains in plan)
        timer.loop_seconds += total - inside[0]
        timer.mixer_seconds += inside[0]
    return out


def _run_chains(forward: Any, cache_kw: str, hidden_BLD: torch.Tensor, plan: Sequence[Sequence[Chain]],
                **kwargs: Any) -> torch.Tensor:
    mask = kwargs.pop("attention_mask", None)
    rows = []
    for b, chains in enumerate(plan):
        states: list[ChainState] = []
        outs = []
        for c in chains:
            parent = states[c.parent] if c.parent >= 0 else ChainState(None, None)
            state = ChainState(parent.conv, parent.recurrent)
            mask_1T = None if mask is None or mask.dim() != 2 else mask[b:b + 1, c.start:c.end]

            def call(state=state, c=c, mask_1T=mask_1T, b=b):
                return forward(hidden_BLD[b:b + 1, c.start:c.end], attention_mask=mask_1T,
                               **{cache_kw: state}, **kwargs)
            out = _one_token_state_update(call) if c.end - c.start == 1 and c.parent >= 0 else call()
            states.append(state)
            outs.append(out)
        rows.append(torch.cat(outs, dim=1))
    return torch.cat(rows, dim=0)


def _tree_forward(module: torch.nn.Module, original: Any, cache_kw: str, *args: Any, **kwargs: Any) -> Any:
    forward = take(kwargs)
    plan = None if forward is None else forward.chains
    shard = None if forward is None else forward.shard  # sequence parallelism: this rank holds a shard of each row
    if plan is None:
        if shard is not None:
            raise ValueError(f"{type(module).__name__}: a sequence-parallel shard needs the rows' chains; "
                             "run the model through onepass.loss")
        return original(*args, **kwargs)
    hidden = kwargs.pop("hidden_states") if "hidden_states" in kwargs else args[0]
    if kwargs.get(cache_kw) is not None:
        raise ValueError(f"{type(module).__name__}: a cache and a one-pass tree cannot be combined")
    kwargs.pop(cache_kw, None)
    if shard is not None:  # chains cross the shards: scan the whole row (gathered), keep this rank's outputs
        out = run_chains(original, cache_kw, shard.gather_sequence(hidden), plan, **kwargs)
        return shard.local(out)
    assert hidden.shape[:2] == (len(plan), sum(c.end - c.start for c in plan[0])), "plan does not fit the batch"
    return run_chains(original, cache_kw, hidden, plan, **kwargs)


def _root(model: Any) -> torch.nn.Module | None:
    root = getattr(model, "_wrapped", model)  # onepass.loss.ForwardView
    return root if isinstance(root, torch.nn.Module) else None


def install(model: Any) -> int:
    """Wrap every recurrent mixer of ``model`` (once); returns how many it has. Raises
    :class:`onepass.model.couplings.CouplingError` if a mixer calls a cache method the chain state lacks."""
    root = _root(model)
    if root is None:
        return 0
    count = 0
    for mod in root.modules():
        coupling = recurrent_mixer(type(mod))
        if coupling is None:
            continue
        count += 1
        if _WRAPPED not in mod.__dict__:  # checked and wrapped once per instance (install runs every step)
            check_cache_api(coupling, CHAIN_STATE_METHODS, type(mod))
            original = mod.forward
            mod.forward = functools.partial(_tree_forward, mod, original, coupling.cache_arg)
            mod.__dict__[_WRAPPED] = original
    return count


def uninstall(model: Any) -> None:
    root = _root(model)
    for mod in root.modules() if root is not None else ():
        original = mod.__dict__.pop(_WRAPPED, None)
        if original is None:
            continue
        if getattr(original, "__func__", None) is type(mod).forward:
            del mod.forward  # the class's own forward again, not an instance copy of it
        else:
            mod.forward = original


def chains_for(model: Any, kv_end_BL: torch.Tensor | np.ndarray) -> tuple[tuple[Chain, ...], ...] | None:
    """The rows' chains, for the forward's record (:class:`onepass.parallel.forward.ForwardPlan`), with
    ``model``'s recurrent mixers installed to read them; None for a model without recurrent mixers."""
    if not install(model):
        return None
    kv = kv_end_BL.detach().cpu().numpy() if isinstance(kv_end_BL, torch.Tensor) else kv_end_BL
    return batch_chains(kv)
