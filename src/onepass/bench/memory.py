"""Peak memory of one training step as the bytes of live tensors, measured at the allocator.

Why this module exists: on CPU the bench used to report only the peak resident set
size (RSS, ``VmHWM``) above the loaded model. RSS measures the C allocator as much as
the step: glibc keeps freed heap chunks in its arenas, a tensor's pages count only once
touched, and two layouts that allocate the same bytes in a different order or size
peak at different RSS. At Qwen3-0.6B width with the real 151,936-id vocabulary the
N-pass / one-pass RSS ratio moved between 0.96x and 1.01x from run to run while the
tensors were the same. Here the peak is counted from the tensor allocator itself:
``torch.profiler`` with ``profile_memory=True`` reports every CPU (or CUDA) tensor
allocation and free with its size, so the running sum over one step is the bytes of
tensors that step allocated and still holds, independent of glibc.

What the figure includes (``peak_bytes``): the tensors alive before the step
(``persistent``: parameters, optimizer state, the batch; counted by their storages)
plus the highest running sum of the step's own allocations (gradients, activations,
saved tensors, the LM head's chunk buffers, the optimizer's temporaries). What it
leaves out: memory outside tensors (the Python heap, oneDNN scratch, the C allocator's
retained free chunks: those are what RSS adds). ``forward_backward_bytes`` is the same
peak up to the start of the optimizer step (marked by :data:`OPTIMIZER_MARK`), the part
a layout can change; at a real vocabulary a foreach AdamW's update of the [V, D] embedding
(its parameter-sized temporaries) is the step's peak, the same for every layout; the bench's
fused AdamW has none, so there the two figures agree.

Worked example: 2.0 GB of parameters and AdamW state before the step; forward and
backward rise to 1.2 GB of their own allocations, the optimizer step to 1.8 GB: peak_bytes
= 3.8 GB, forward_backward_bytes = 3.2 GB.

Slow reference: the same peak by the chrome trace's ``[memory]`` events (tests/bench).
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

OPTIMIZER_MARK = "onepass.optimizer_step"  # record_function name around opt.step() in the timed step


@dataclass(frozen=True)
class StepMemory:
    peak_bytes: int  # persistent tensors + the step's highest running total of its own allocations
    forward_backward_bytes: int  # the same, up to the start of the optimizer step


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a tied weight counts once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.numel():
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def persistent_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                       batch: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """Parameters, buffers, gradients, optimizer state and the batch: what lives across steps."""
    out = [*model.parameters(), *model.buffers(), *batch.values()]
    out += [p.grad for p in model.parameters() if p.grad is not None]
    out += [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    return out


def running_peaks(events: Iterable[tuple[int, int]], mark_ns: int | None) -> tuple[int, int]:
    """Highest running sum of ``(start_ns, nbytes)`` allocation events overall and before ``mark_ns``."""
    total = peak = before_mark = 0
    for start_ns, nbytes in sorted(events):
        total += nbytes
        peak = max(peak, total)
        if mark_ns is None or start_ns < mark_ns:
            before_mark = max(before_mark, total)
    return peak, before_mark


@contextlib.contextmanager
def _without_profiler_chatter() -> Iterator[None]:
    """Hold back the kineto ``USDT: ... profiler_start/stop`` lines the C++ profiler writes to stderr
    (two per profiled step, one bench run prints hundreds); every other line written meanwhile is
    passed on, after the step."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            for line in held.read().decode(errors="replace").splitlines(keepends=True):
                if not line.startswith("USDT:"):
                    sys.stderr.write(line)


def step_memory(step: Callable[[], None], persistent: int, device: torch.device) -> StepMemory:
    """Run ``step()`` once under the memory profiler; its peak of live tensor bytes on ``device``."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with _without_profiler_chatter(), profile(activities=activities, profile_memory=True) as prof:
        step()
    events, mark_ns = [], None
    for e in prof.profiler.kineto_results.events():
        if e.name() == OPTIMIZER_MARK and mark_ns is None:
            mark_ns = e.start_ns()
        elif e.name() == "[memory]" and e.device_type().name == device.type.upper():
            events.append((e.start_ns(), e.nbytes()))
    peak, forward_backward = running_peaks(events, mark_ns)
    return StepMemory(peak_bytes=persistent + peak, forward_backward_bytes=persistent + forward_backward)
