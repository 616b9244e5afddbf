"""Training throughput and memory of every schedule, side by side in one run.

Why this module exists: users choose by the numbers, and a speed ratio is only
honest when both sides run on the same model, data, backend and machine in
the same process. For each setting (a schedule, packed or not) this renders
the workload's views once, lays them out, and times full training steps
(forward, backward, optimizer step) over every row, repeated after a warm-up.

FLOP accounting: :func:`onepass.layout.flops.train_flops`, forward + backward = 3 x
the forward FLOPs (linear per token, attention per visible pair
``sum(kv_end - k)``, LM head per target), the same accounting the ``data
stats`` ideal speedup uses.

The *ideal speedup* is N-pass FLOPs / one-pass FLOPs for the workload: what
one-pass would gain if time followed useful work exactly. *Useful-FLOP
utilisation* is a setting's useful FLOPs per second over a matmul peak
measured in the same run (a dense backend computes masked pairs too, which
count as work done but not as useful work).

Peak memory, three figures per setting: ``peak_memory_bytes`` (CUDA: max allocated;
CPU: peak RSS above the loaded model, over the timed steps: allocator effects included),
``peak_tensor_bytes`` (live tensor bytes at the step's peak, parameters and optimizer
state included, from the allocator's own events: :mod:`onepass.bench.memory`) and
``peak_forward_backward_bytes`` (the same up to the optimizer step: the part a layout
changes). Compare layouts by the tensor figures; RSS is reported beside them.
"""

from __future__ import annotations

import functools
import platform
import re
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from onepass.attention.backends import attention_mask_for
from onepass.attention.cpu import register
from onepass.bench.memory import (
    OPTIMIZER_MARK,
    persistent_tensors,
    step_memory,
    tensor_bytes,
)
from onepass.attention.varlen import BACKEND as VARLEN, register as register_varlen
from onepass.bench.ratio import fastest_ratio, speed_ratio
from onepass.bench.settings import SHARED_SETTINGS
from onepass.model.dtypes import torch_dtype
from onepass.errors import UsageError
from onepass.layout.flops import speed_bound, visible_pairs
from onepass.loss import batch_loss, layouts_to_batch
from onepass.mixers.tree import timing as chain_timing
from onepass.model.tiny import tiny_model
from onepass.layout.tree import Layout

DEPTH_GROUPS = {"G1": (1, 5), "G2": (6, 7), "G3": (8, 16)}
# --arch: the tiny architectures bench builds at a shape's sizes (onepass.model.tiny)
BENCH_ARCHS = ("qwen3", "qwen3.5")


def arch_kwargs(arch: str, shape_kwargs: dict[str, Any]) -> dict[str, Any]:
    """Config sizes of ``arch`` at a Qwen3-style shape. Qwen3.5: its config's own layer pattern (three
    Gated DeltaNet layers to one attention layer) and linear attention sized like Qwen3-Next's (key
    heads x key dim = hidden size, twice as many value heads), here with the shape's heads and head dim."""
    if arch == "qwen3":
        return dict(shape_kwargs)
    if arch == "qwen3.5":
        heads, dim = shape_kwargs["num_attention_heads"], shape_kwargs["head_dim"]
        return dict(shape_kwargs, layer_types=None, linear_num_key_heads=heads, linear_key_head_dim=dim,
                    linear_num_value_heads=2 * heads, linear_value_head_dim=dim)
    raise UsageError(f"unknown bench architecture {arch!r}; use one of {', '.join(BENCH_ARCHS)}")


def peak_rss_reset() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def _status_kb(field_name: str) -> int | None:
    try:
        m = re.search(rf"{field_name}:\s+(\d+) kB", Path("/proc/self/status").read_text())
    except OSError:
        return None
    return int(m.group(1)) * 1024 if m else None


def peak_rss() -> int | None:
    """Peak resident set size since the last :func:`peak_rss_reset` (Linux), else None."""
    return _status_kb("VmHWM")


def current_rss() -> int | None:
    return _status_kb("VmRSS")


def start_peak_memory(device: torch.device) -> int | None:
    """Start a peak-memory window; pass the result to :func:`peak_memory_since`."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return None
    before = current_rss()
    peak_rss_reset()
    return before


def peak_memory_since(device: torch.device, before: int | None) -> int | None:
    """CUDA: max allocated; CPU: peak RSS above ``before`` (None where the OS does not say)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    peak = peak_rss()
    return peak - before if peak is not None and before is not None else None


def matmul_peak_flops(device: torch.device, dtype: torch.dtype, n: int = 2048, repeats: int = 5) -> float:
    """Best observed FLOP/s of an n x n matmul: the machine's practical peak for this dtype."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    best = 0.0
    for _ in range(repeats + 1):
        sync_device(device)
        t0 = time.perf_counter()
        a @ b
        sync_device(device)
        best = max(best, 2 * n**3 / (time.perf_counter() - t0))
    return best


def sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(kw_only=True)
class Timing:
    epoch_seconds: list[float] = field(default_factory=list)
    # this process's CPU seconds over the same epochs: on a loaded CPU machine the wall clock also counts
    # the time the neighbours held the core; CPU time does not (it still feels their cache traffic)
    epoch_cpu_seconds: list[float] = field(default_factory=list)
    peak_memory_bytes: int | None = None  # CUDA: max allocated; CPU: peak RSS above the loaded model
    # live tensor bytes at the step's peak, all included, and up to the optimizer step (onepass.bench.memory)
    peak_tensor_bytes: int | None = None
    peak_forward_backward_bytes: int | None = None
    mask_seconds: float = 0.0  # building the attention mask objects, summed over one epoch
    chain_loop_seconds: float | None = None  # recurrent layers: state passing per epoch (mixers.tree.timing)
    chain_mixer_seconds: float | None = None  # recurrent layers: their own forwards, chain by chain, per epoch
    chains: int | None = None  # recurrent layers: mixer calls per epoch (chains x mixer layers)


@dataclass(frozen=True, kw_only=True)
class Job:
    """Everything a fresh process needs to time one setting (picklable)."""

    rows: list[Layout]
    vocab: int
    shape_kwargs: dict[str, int]  # config sizes (onepass.layout.flops.model_kwargs)
    dtype: str
    backend: str
    device: str
    seed: int
    repeats: int
    threads: int
    warmup: int = 2
    lr: float = 1e-4
    arch: str = "qwen3"  # one of BENCH_ARCHS
    tensor_memory: bool = True  # one more pass over the rows under the memory profiler (onepass.bench.memory)


@dataclass(kw_only=True)
class Session:
    """One setting ready to time: its model, optimizer and batches (longest row first) on the device."""

    job: Job
    model: Any
    opt: Any
    batches: list[dict[str, torch.Tensor]]
    device: torch.device

    def step(self, batch: dict[str, torch.Tensor]) -> None:
        """One full training step over one row: forward, backward, optimizer step."""
        loss = batch_loss(self.model, batch) / batch["weights"].sum()
        loss.backward()
        with torch.profiler.record_function(OPTIMIZER_MARK):  # splits forward+backward from the update
            self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def warm_up(self) -> None:
        for batch in self.batches[:self.job.warmup]:  # the longest rows first
            self.step(batch)

    def epoch(self) -> tuple[float, float]:
        """Seconds for one step over every row, the device synchronised at both ends: wall clock and this
        process's CPU time."""
        sync_device(self.device)
        t0, c0 = time.perf_counter(), time.process_time()
        for batch in self.batches:
            self.step(batch)
        sync_device(self.device)
        return time.perf_counter() - t0, time.process_time() - c0


def start_session(job: Job) -> Session:
    """Build ``job``'s model (its backend registered first: a fresh process knows only transformers' own),
    a fused AdamW and its batches."""
    torch.set_num_threads(job.threads)
    device = torch.device(job.device)
    if job.backend == "onepass_cpu":
        register()
    if job.backend == VARLEN:
        register_varlen()
    model = tiny_model(job.arch, job.vocab, dtype=torch_dtype(job.dtype), seed=job.seed,
                       attn_implementation=job.backend, device=device, **arch_kwargs(job.arch, job.shape_kwargs))
    model.train()
    # fused: transformers' default optimizer with torch >= 2.8 (adamw_torch_fused; the TRL setting uses it too),
    # and it holds no parameter-sized temporaries, so the step's peak is the layout's, not AdamW's
    opt = torch.optim.AdamW(model.parameters(), lr=job.lr, fused=True)
    order = sorted(range(len(job.rows)), key=lambda i: -len(job.rows[i]))
    batches = [layouts_to_batch([job.rows[i]], device=device) for i in order]
    return Session(job=job, model=model, opt=opt, batches=batches, device=device)


def time_training(job: Job) -> Timing:
    """Time full training steps (one row per step) over ``job.rows``, after warm-up.

    Runs in the calling process; :func:`time_in_subprocess` gives each setting a
    fresh process so allocator state never carries over between settings and
    the CPU peak RSS is this setting's own.
    """
    device = torch.device(job.device)
    session = start_session(job)
    before = start_peak_memory(device)  # above the loaded model
    session.warm_up()
    timing = Timing()
    with chain_timing() as chains:
        for _ in range(job.repeats):
            wall, cpu = session.epoch()
            timing.epoch_seconds.append(wall)
            timing.epoch_cpu_seconds.append(cpu)
    if chains.calls:
        timing.chain_loop_seconds = chains.loop_seconds / job.repeats
        timing.chain_mixer_seconds = chains.mixer_seconds / job.repeats
        timing.chains = chains.chains // job.repeats
    timing.peak_memory_bytes = peak_memory_since(device, before)
    if job.tensor_memory:  # after the RSS window: the profiler's own memory stays out of it
        _tensor_memory(session, timing)
    t0 = time.perf_counter()
    for batch in session.batches:
        attention_mask_for(session.model, batch["kv_end"], position_ids_BL=batch["position_ids"])
    timing.mask_seconds = time.perf_counter() - t0
    return timing


def time_interleaved(jobs: Sequence[Job], *, log: Callable[[str], None] = print) -> list[Timing]:
    """Time several settings in one process (CUDA), their epochs interleaved: A B C A B C ..., so a slow
    drift of the machine (clocks, heat, a neighbour) lands on every setting alike and the ratios can be
    paired (:func:`onepass.bench.ratio.speed_ratio`). Every model stays resident, so a setting's peak
    memory is its own model and optimizer state (:mod:`onepass.bench.memory`) plus the most its epochs
    allocated above what was resident when they began. A setting that fails (its start, warm-up or an
    epoch) is reported in one line and left out (its Timing has no epochs); the others go on."""
    sessions: list[Session | None] = []
    timings = [Timing() for _ in jobs]
    for job in jobs:
        t0 = time.perf_counter()
        try:
            session = start_session(job)
            session.warm_up()  # compiles (flex) happen here, outside the timed epochs
        except Exception as e:  # noqa: BLE001: one setting's failure must not lose the others' figures
            log(f"{job.backend} ({len(job.rows)} rows): failed before timing: {type(e).__name__}: "
                f"{(str(e).splitlines() or [''])[0][:300]}")
            session = None
        else:
            log(f"{job.backend} ({len(job.rows)} rows): built and warmed up in {time.perf_counter() - t0:.1f} s")
        sessions.append(session)
    resident = [tensor_bytes(persistent_tensors(s.model, s.opt, s.batches[0])) if s else 0 for s in sessions]
    transient = [0] * len(jobs)
    for repeat in range(max((j.repeats for j in jobs), default=0)):
        for i, session in enumerate(sessions):
            if session is None:
                continue
            before = torch.cuda.memory_allocated(session.device) if session.device.type == "cuda" else 0
            peak = start_peak_memory(session.device)
            try:
                wall, cpu = session.epoch()
                timings[i].epoch_seconds.append(wall)
                timings[i].epoch_cpu_seconds.append(cpu)
            except Exception as e:  # noqa: BLE001: out of memory in a long row, say: the others go on
                log(f"{session.job.backend} ({len(session.job.rows)} rows): failed in epoch {repeat + 1}: "
                    f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}")
                sessions[i], timings[i] = None, Timing()
                continue
            used = peak_memory_since(session.device, peak)
            if used is not None:
                transient[i] = max(transient[i], used - before if session.device.type == "cuda" else used)
            log(f"epoch {repeat + 1} {session.job.backend} ({len(session.job.rows)} rows): "
                f"{timings[i].epoch_seconds[-1]:.3f} s")  # a run stopped later still has its figures in the log
    for i, session in enumerate(sessions):
        if session is not None:
            timings[i].peak_memory_bytes = resident[i] + transient[i]
            if session.job.tensor_memory:  # after every epoch: the profiler's own cost stays out of the timing
                _tensor_memory(session, timings[i])
    return timings


def _tensor_memory(session: Session, timing: Timing) -> None:
    """Live tensor bytes at the step's peak over ``session``'s rows, all included and up to the optimizer step
    (:mod:`onepass.bench.memory`), into ``timing``."""
    for batch in session.batches:
        persistent = tensor_bytes(persistent_tensors(session.model, session.opt, batch))
        mem = step_memory(functools.partial(session.step, batch), persistent, session.device)
        timing.peak_tensor_bytes = max(timing.peak_tensor_bytes or 0, mem.peak_bytes)
        timing.peak_forward_backward_bytes = max(timing.peak_forward_backward_bytes or 0, mem.forward_backward_bytes)


def time_in_subprocess(job: Any, timer: Callable[[Any], Timing] | None = None) -> Timing:
    """``timer(job)`` (default :func:`time_training`) in a fresh spawned process; CUDA jobs run here."""
    timer = timer or time_training
    if job.device.startswith("cuda"):
        return timer(job)
    import multiprocessing as mp

    with mp.get_context("spawn").Pool(1) as pool:
        return pool.apply(timer, (job,))


def environment(device: torch.device) -> dict[str, Any]:
    import transformers

    cpu = platform.processor() or platform.machine()
    try:
        m = re.search(r"model name\s*:\s*(.*)", Path("/proc/cpuinfo").read_text())
        cpu = m.group(1).strip() if m else cpu
    except OSError:
        pass
    info = {"device": str(device), "cpu": cpu, "threads": torch.get_num_threads(),
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None}
    versions = {"python": platform.python_version(), "torch": torch.__version__,
                "transformers": transformers.__version__, "numpy": np.__version__}
    return {"device": info, "versions": versions}


def summarise(name: str, backend: str, group: str, rows: Sequence[Layout], timing: Timing,
              num_conversations: int, useful: float, peak: float) -> dict[str, Any]:
    med = statistics.median(timing.epoch_seconds)
    spread = (max(timing.epoch_seconds) - min(timing.epoch_seconds)) / med if med else 0.0
    step_seconds = med
    return {
        "setting": name, "backend": backend, "depth_group": group, "rows": len(rows),
        "tokens": sum(len(r) for r in rows), "target_tokens": sum(r.num_targets for r in rows),
        "epoch_seconds_median": med, "epoch_seconds_spread": spread, "epochs": len(timing.epoch_seconds),
        "epoch_seconds": list(timing.epoch_seconds), "work": work_counts(rows),
        # the fastest epoch: interference on a shared machine only ever slows one down (timeit's reasoning)
        "epoch_seconds_best": min(timing.epoch_seconds) if timing.epoch_seconds else None,
        "epoch_cpu_seconds": list(timing.epoch_cpu_seconds),  # empty where not measured (TRL's timer)
        "epoch_cpu_seconds_best": min(timing.epoch_cpu_seconds) if timing.epoch_cpu_seconds else None,
        "conversations_per_s": num_conversations / med, "tokens_per_s": sum(len(r) for r in rows) / med,
        "target_tokens_per_s": sum(r.num_targets for r in rows) / med,
        "peak_memory_bytes": timing.peak_memory_bytes,
        "peak_tensor_bytes": timing.peak_tensor_bytes,
        "peak_forward_backward_bytes": timing.peak_forward_backward_bytes,
        "mask_fraction_of_step": timing.mask_seconds / step_seconds if step_seconds else None,
        # recurrent layers (None without): forward time in the chain loops outside the mixers' own
        # forwards (state passing), and in those forwards, as fractions of the epoch; mixer calls per epoch
        "state_passing_fraction_of_step": _fraction(timing.chain_loop_seconds, med),
        "recurrent_mixer_fraction_of_step": _fraction(timing.chain_mixer_seconds, med),
        "recurrent_chain_calls": timing.chains,
        "useful_flops": useful, "useful_flop_utilisation": useful / med / peak if peak else None,
    }


def work_counts(rows: Sequence[Layout]) -> dict[str, int]:
    """What an epoch's cost grows with (:func:`onepass.layout.flops.speed_bound`): one step per row here, tokens,
    attention pairs as a block-skipping kernel (visible) and as a dense one (the whole row square)
    computes them, and LM-head targets."""
    return {"rows": len(rows), "tokens": sum(len(r) for r in rows),
            "visible_pairs": sum(visible_pairs(r) for r in rows), "dense_pairs": sum(len(r) ** 2 for r in rows), "targets": sum(r.num_targets for r in rows)}


def _fraction(seconds: float | None, of: float) -> float | None:
    return seconds / of if seconds is not None and of else None


def add_ratios(settings: list[dict[str, Any]], ideal: dict[str, float],
               ideal_shared: dict[str, float] | None = None) -> None:
    """Speed and memory vs N-pass packed (same backend and depth group), and for one-pass
    settings the fraction of the ideal bound reached against N-pass *with the same packing*;
    where ``onepass_varlen`` timed N-pass packed, every setting's speed and memory against it too
    (the FA2-class baseline, same depth group); for the settings that share prefixes across
    conversations (:data:`SHARED_SETTINGS`) the same against the one-pass packed rows they are made
    of (``ideal_shared``: that setting's FLOP bound per group)."""
    by_key = {(s["backend"], s["depth_group"], s["setting"]): s for s in settings}
    trl = next((s for s in settings if s["setting"] == "trl-sft-packed"), None)  # TRL's defaults
    tuned = next((s for s in settings if s["setting"] == "trl-sft-packed-tuned"), None)  # its fastest honest config
    for s in settings:
        s["speedup_vs_trl"] = (s["conversations_per_s"] / trl["conversations_per_s"]
                               if trl and s["depth_group"] == "all" else None)
        s["speedup_vs_trl_tuned"] = (s["conversations_per_s"] / tuned["conversations_per_s"]
                                     if tuned and s["depth_group"] == "all" else None)
        flash = by_key.get((VARLEN, s["depth_group"], "n-pass-packed"))  # torch's flash varlen kernel (CUDA)
        flash = flash if flash is not s else None
        s["speedup_vs_flash_n_pass_packed"] = (s["conversations_per_s"] / flash["conversations_per_s"]
                                               if flash else None)
        s["speed_ratio_vs_flash_n_pass_packed"] = checked_ratio(flash, s)
        s["memory_vs_flash_n_pass_packed"] = (s["peak_memory_bytes"] / flash["peak_memory_bytes"]
                                              if flash and s["peak_memory_bytes"] and flash["peak_memory_bytes"]
                                              else None)
        b = by_key.get((s["backend"], s["depth_group"], "n-pass-packed"))
        s["speedup_vs_n_pass_packed"] = s["conversations_per_s"] / b["conversations_per_s"] if b else None
        s["best_epoch_speedup_vs_n_pass_packed"] = _best_epoch_ratio(b, s)
        s["speed_ratio_vs_n_pass_packed"] = checked_ratio(b, s) if b is not s else None
        mem, bmem = s["peak_memory_bytes"], b["peak_memory_bytes"] if b else None
        s["memory_vs_n_pass_packed"] = mem / bmem if mem and bmem else None
        for key, ratio in (("peak_tensor_bytes", "tensor_memory_vs_n_pass_packed"),
                           ("peak_forward_backward_bytes", "forward_backward_memory_vs_n_pass_packed")):
            mem, bmem = s.get(key), b.get(key) if b else None
            s[ratio] = mem / bmem if mem and bmem else None
        s["fraction_of_ideal"] = s["best_epoch_fraction_of_ideal"] = None
        if s["setting"] in SHARED_SETTINGS:
            _add_shared_ratios(s, by_key.get((s["backend"], s["depth_group"], SHARED_SETTINGS[s["setting"]])),
                               (ideal_shared or {}).get(s["depth_group"]))
        if s["setting"] in ("one-pass", "one-pass-packed"):
            same = by_key.get((s["backend"], s["depth_group"], s["setting"].replace("one-pass", "n-pass")))
            bound = ideal.get(s["depth_group"])
            if same and bound:
                s["fraction_of_ideal"] = s["conversations_per_s"] / same["conversations_per_s"] / bound
                best = _best_epoch_ratio(same, s)
                s["best_epoch_fraction_of_ideal"] = best / bound if best else None


def _add_shared_ratios(s: dict[str, Any], base: dict[str, Any] | None, bound: float | None) -> None:
    """A shared-prefix setting against the one-pass packed rows it merges (same backend and group):
    speed (median and fastest epochs), the fraction of its FLOP bound, tensor memory."""
    keys = ("speedup_vs_one_pass_packed", "best_epoch_speedup_vs_one_pass_packed", "fraction_of_shared_bound",
            "best_epoch_fraction_of_shared_bound", "tensor_memory_vs_one_pass_packed", "shared_bound",
            "speed_ratio_vs_one_pass_packed", "cpu_speedup_vs_one_pass_packed",
            "best_cpu_epoch_speedup_vs_one_pass_packed", "cpu_fraction_of_shared_bound",
            "best_cpu_epoch_fraction_of_shared_bound")
    s.update(dict.fromkeys(keys))
    if base is None:
        return
    s["speedup_vs_one_pass_packed"] = s["conversations_per_s"] / base["conversations_per_s"]
    s["best_epoch_speedup_vs_one_pass_packed"] = best = _best_epoch_ratio(base, s)
    s["speed_ratio_vs_one_pass_packed"] = checked_ratio(base, s)
    if s.get("epoch_cpu_seconds") and base.get("epoch_cpu_seconds"):  # CPU time: what a loaded machine distorts least
        s["cpu_speedup_vs_one_pass_packed"] = (statistics.median(base["epoch_cpu_seconds"])
                                               / statistics.median(s["epoch_cpu_seconds"]))
        s["best_cpu_epoch_speedup_vs_one_pass_packed"] = fastest_ratio([base["epoch_cpu_seconds_best"]],
                                                                       [s["epoch_cpu_seconds_best"]])
    if bound:
        s["shared_bound"] = bound
        s["fraction_of_shared_bound"] = s["speedup_vs_one_pass_packed"] / bound
        s["best_epoch_fraction_of_shared_bound"] = best / bound if best else None
        for ratio, fraction in (("cpu_speedup_vs_one_pass_packed", "cpu_fraction_of_shared_bound"),
                                ("best_cpu_epoch_speedup_vs_one_pass_packed",
                                 "best_cpu_epoch_fraction_of_shared_bound")):
            s[fraction] = s[ratio] / bound if s[ratio] else None
    if s.get("peak_tensor_bytes") and base.get("peak_tensor_bytes"):
        s["tensor_memory_vs_one_pass_packed"] = s["peak_tensor_bytes"] / base["peak_tensor_bytes"]


def _best_epoch_ratio(base: dict[str, Any] | None, s: dict[str, Any]) -> float | None:
    """``base``'s fastest epoch over ``s``'s (the same conversations): the speedup with the least
    interference in it, beside the medians' ``speedup_vs_n_pass_packed``."""
    if not base or not base.get("epoch_seconds_best") or not s.get("epoch_seconds_best"):
        return None
    return fastest_ratio([base["epoch_seconds_best"]], [s["epoch_seconds_best"]])


def checked_ratio(base: dict[str, Any] | None, s: dict[str, Any]) -> dict[str, Any] | None:
    """``s``'s speed over ``base``'s epochs, checked against the bound of their counted work
    (:func:`onepass.bench.ratio.speed_ratio`; paired where both were timed interleaved, else one after
    the other); None without epoch times or work counts."""
    if not base or not base.get("epoch_seconds") or not s.get("epoch_seconds") or not s.get("work"):
        return None
    paired = bool(base.get("interleaved") and s.get("interleaved")
                  and len(base["epoch_seconds"]) == len(s["epoch_seconds"]))  # epoch i of both ran side by side
    r = speed_ratio(base["epoch_seconds"], s["epoch_seconds"], bound=speed_bound(base["work"], s["work"]),
                    paired=paired)
    return {**asdict(r), "disturbed": r.disturbed, "trustworthy": r.trustworthy}
