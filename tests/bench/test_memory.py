"""The bench's tensor-level peak memory (onepass.bench.memory): known allocations, and the chrome trace as reference."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from onepass.bench.memory import (
    OPTIMIZER_MARK,
    running_peaks,
    step_memory,
    tensor_bytes,
)

MB = 2**20


def test_running_peaks_overall_and_before_the_mark() -> None:
    events = [(30, -5), (10, 4), (20, 3), (40, 9), (50, -9)]  # out of order on purpose
    assert running_peaks(events, mark_ns=35) == (11, 7)
    assert running_peaks(events, mark_ns=None) == (11, 11)
    assert running_peaks([], mark_ns=None) == (0, 0)


def test_tensor_bytes_counts_a_shared_storage_once() -> None:
    w = torch.zeros(256, 4)
    assert tensor_bytes([w, w[:10], torch.zeros(3, dtype=torch.float64)]) == 256 * 4 * 4 + 24


def test_step_memory_sees_freed_transients_and_splits_at_the_optimizer_mark() -> None:
    kept: list[torch.Tensor] = []

    def step() -> None:
        a = torch.ones(4 * MB // 4)  # 4 MiB, freed before the mark
        kept.append(torch.ones(2 * MB // 4))  # 2 MiB, still alive after the step
        del a
        with torch.profiler.record_function(OPTIMIZER_MARK):
            b = torch.ones(8 * MB // 4)  # 8 MiB in the "optimizer": the step's peak is here
            del b

    mem = step_memory(step, persistent=100, device=torch.device("cpu"))
    assert abs(mem.peak_bytes - (100 + 10 * MB)) < MB // 8
    assert abs(mem.forward_backward_bytes - (100 + 6 * MB)) < MB // 8


def _trace_peak(prof: torch.profiler.profile, path: str) -> int:
    """The slow reference: the running sum of the chrome trace's ``[memory]`` events."""
    prof.export_chrome_trace(path)
    events = json.loads(Path(path).read_text())["traceEvents"]
    mem = sorted((e["ts"], e["args"]["Bytes"]) for e in events if e.get("name") == "[memory]")
    total = peak = 0
    for _, nbytes in mem:
        total += nbytes
        peak = max(peak, total)
    return peak


def test_step_memory_matches_the_chrome_trace_on_a_training_step(tmp_path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.GELU(), torch.nn.Linear(512, 1000))
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(300, 64)

    def step() -> None:
        model(x).logsumexp(-1).sum().backward()
        with torch.profiler.record_function(OPTIMIZER_MARK):
            opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # optimizer state exists from here, as in the bench
    mem = step_memory(step, persistent=0, device=torch.device("cpu"))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    assert mem.peak_bytes == _trace_peak(prof, str(tmp_path / "trace.json"))
    grads = sum(p.numel() * 4 for p in model.parameters())
    activations = 300 * (512 * 2 + 1000) * 4
    assert mem.forward_backward_bytes >= grads + activations // 2  # gradients and saved activations are counted


def test_step_memory_holds_back_only_the_profilers_own_stderr_lines(capfd) -> None:
    """The C++ profiler prints ``USDT: ... profiler_start/stop`` per step; the step's own stderr survives."""
    import sys

    def step() -> None:
        (torch.randn(100, 100, requires_grad=True) * 2).sum().backward()
        print("the step's own warning", file=sys.stderr)

    step_memory(step, persistent=0, device=torch.device("cpu"))
    err = capfd.readouterr().err
    assert "the step's own warning" in err and "USDT" not in err
