"""``make gpu-check``'s speed step: the plan of :mod:`onepass.bench.gpu_plan` timed on one GPU, in one process.

Why this module exists: the figures onepass exists for (one-pass and shared against N-pass packed on the
FA2-class kernel, at 8B width, on long reasoning and agent conversations) must come out of one call of
a few minutes, and must survive being cut at the step's box. So: one model at the plan's shape (random
weights, bf16, fused AdamW), shared by every setting (its attention backend switched per setting: the
same weights, one copy in memory); a dense matmul of an 8B layer's MLP shape timed first (the rate the
useful-FLOP utilisation is against); one warm-up step per setting (flex compiles in its first: the
compile time reported is that step's excess over the setting's median step); then rounds, every setting
one epoch per round, interleaved (A B C A B C: drift lands on all alike, ratios are paired per round).
Each epoch's line is printed as it ends and a JSON line after every round, so what was cut keeps its
figures. Peak memory: CUDA's max allocated over the setting's epochs (the shared model and optimizer
state included, the same for every setting).

    python -m onepass.bench.gpu_speed --dry-run              # the plan, its bounds and time boxes (CPU)
    python -m onepass.bench.gpu_speed --device cuda --seconds 200 --out /tmp/speed
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from onepass.attention.cpu import register as register_cpu
from onepass.attention.varlen import register as register_varlen
from onepass.bench import gpu_plan
from onepass.bench.gpu_plan import FLEX, VARLEN, SpeedPlan, Timed
from onepass.bench.harness import Job, Session, environment, peak_memory_since, start_peak_memory, sync_device
from onepass.files import atomic_write_text
from onepass.layout.flops import MODEL_SHAPES, model_kwargs
from onepass.loss import layouts_to_batch
from onepass.model.dtypes import torch_dtype
from onepass.model.tiny import tiny_model
from onepass.render.tokenizer import load_tokenizer
from onepass.layout.vocab import remap, used_ids


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m onepass.bench.gpu_speed", description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="the plan only: rows, bounds, columns, time boxes (no "
                                                          "model, no GPU)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--seconds", type=float, default=200.0, help="the step's box: rounds stop before it")
    p.add_argument("--out", default=None, help="folder for speed.json and table.md")
    p.add_argument("--shape", default=gpu_plan.SHAPE, choices=tuple(MODEL_SHAPES))
    p.add_argument("--layers", type=int, default=gpu_plan.LAYERS)
    p.add_argument("--row-tokens", type=int, default=gpu_plan.ROW_TOKENS)
    p.add_argument("--workloads", default=",".join(w.name for w in gpu_plan.WORKLOADS))
    p.add_argument("--conversations", type=int, default=None, help="per workload, instead of the plan's")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--flex-backend", default=FLEX,
                   help="what runs the flex settings (a CPU rehearsal: onepass_cpu; flex has no CPU backward)")
    p.add_argument("--tokenizer", default="builtin:qwen3")
    p.add_argument("--compact-vocab", action="store_true", help="renumber the ids that occur (a CPU rehearsal)")
    args = p.parse_args(argv)
    names = {w.name for w in gpu_plan.WORKLOADS}
    unknown = [w for w in args.workloads.split(",") if w not in names]
    if unknown:
        p.error(f"unknown workload(s) {', '.join(unknown)}; workloads: {', '.join(sorted(names))}")
    return args


def make_plan(args: argparse.Namespace) -> SpeedPlan:
    """The plan for ``args`` (tokenizer loaded, conversations rendered), its notes printed."""
    tokenizer = load_tokenizer(args.tokenizer)
    views, notes = {}, []
    for workload in gpu_plan.WORKLOADS:
        if workload.name in args.workloads.split(","):
            views[workload.name], skipped = gpu_plan.workload_views(workload, tokenizer, limit=args.conversations)
            notes += skipped
    shape = MODEL_SHAPES[args.shape]
    vocab = shape.vocab or len(tokenizer)  # a real shape keeps its vocabulary; tiny: the tokenizer's
    if args.compact_vocab:  # a CPU rehearsal: the ids that occur renumbered 0..V-1 (one map for all workloads)
        used = used_ids(v.tokens for convs in views.values() for c in convs for v in c)
        views = {name: [[dataclasses.replace(v, tokens=remap(v.tokens, used)) for v in c] for c in convs]
                 for name, convs in views.items()}
        vocab = len(used)
    plan = gpu_plan.build_plan(views, shape=shape, layers=args.layers, row_tokens=args.row_tokens, vocab=vocab)
    for line in [*notes, *plan.notes]:
        print(f"note: {line}", flush=True)
    return plan


def describe(plan: SpeedPlan) -> dict[str, Any]:
    s = plan.shape
    return {"shape": dataclasses.asdict(s), "full_layers": plan.full_layers, "row_tokens": plan.row_tokens,
            "notes": list(plan.notes), "columns": list(gpu_plan.COLUMNS),
            "settings": [{"key": t.key, "rows": [len(r) for r in t.rows], "padded": t.padded,
                          "conversations": t.conversations, "bound": t.bound, "useful_flops": t.useful_flops}
                         for t in plan.timed]}


def dry_run(plan: SpeedPlan, seconds: float) -> int:
    budget = plan.budget(seconds)
    print(f"plan: {plan.shape.name} widths, {plan.shape.num_layers} of {plan.full_layers} layers, vocabulary "
          f"{plan.shape.vocab:,}, rows of {plan.row_tokens:,} tokens; {len(plan.timed)} settings", flush=True)
    print(gpu_plan.table(gpu_plan.figures(plan)), flush=True)
    print(f"budget at {budget['rate'] / 1e12:.0f} TFLOP/s: setup {budget['setup']:.0f} s + compile "
          f"{budget['compile']:.0f} s + warm-up {budget['warm_up']:.0f} s + {budget['rounds']} rounds of "
          f"{budget['round']:.0f} s = {budget['total']:.0f} s of {seconds:.0f}", flush=True)
    print(json.dumps({"dry_run": True, **describe(plan), "budget": budget}), flush=True)
    return 0 if budget["rounds"] >= 2 else 1


# ---------------------------------------------------------------------------------------------
# the GPU run


def layer_matmul_flops(device: Any, dtype: Any, *, tokens: int, hidden: int, ffn: int, repeats: int = 5) -> float:
    """FLOP/s of the dense matmul an 8B layer's MLP runs on a row: ``[tokens, hidden] @ [hidden, ffn]``, best
    of ``repeats`` after a warm-up: the rate the useful-FLOP utilisation is measured against."""
    x = torch.randn(tokens, hidden, device=device, dtype=dtype)
    w = torch.randn(hidden, ffn, device=device, dtype=dtype)
    best = 0.0
    for _ in range(repeats + 1):
        sync_device(torch.device(device))
        t0 = time.perf_counter()
        x @ w
        sync_device(torch.device(device))
        best = max(best, 2 * tokens * hidden * ffn / (time.perf_counter() - t0))
    del x, w
    return best


def run(plan: SpeedPlan, args: argparse.Namespace) -> int:
    start = time.monotonic()
    deadline = start + args.seconds - 5  # the last JSON line and the exit
    device, dtype = torch.device(args.device), torch_dtype(args.dtype)
    env = environment(device)
    print(f"device: {env['device']}  versions: {env['versions']}", flush=True)
    register_varlen()
    if args.flex_backend == "onepass_cpu":
        register_cpu()
    backend_of = {FLEX: args.flex_backend, VARLEN: VARLEN}
    rate = layer_matmul_flops(device, dtype, tokens=plan.row_tokens, hidden=plan.shape.hidden, ffn=plan.shape.ffn)
    print(f"dense {plan.row_tokens} x {plan.shape.hidden} x {plan.shape.ffn} matmul: {rate / 1e12:.1f} TFLOP/s",
          flush=True)
    t0 = time.monotonic()
    model = tiny_model("qwen3", plan.shape.vocab, dtype=dtype, seed=0, attn_implementation=backend_of[FLEX],
                       device=device, **model_kwargs(plan.shape)).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    sessions: dict[str, Session] = {}
    for t in plan.timed:
        job = Job(rows=list(t.rows), vocab=plan.shape.vocab, shape_kwargs=model_kwargs(plan.shape), dtype=args.dtype,
                  backend=backend_of[t.backend], device=str(device), seed=0, repeats=gpu_plan.MAX_ROUNDS, threads=1)
        batches = [layouts_to_batch([r], device=device, length=plan.row_tokens if t.padded else None) for r in t.rows]
        sessions[t.key] = Session(job=job, model=model, opt=opt, batches=batches, device=device)
    print(f"model, optimizer and {sum(len(t.rows) for t in plan.timed)} rows on {device} in "
          f"{time.monotonic() - t0:.1f} s", flush=True)

    measured: dict[str, dict[str, Any]] = {t.key: {"epoch_seconds": [], "epoch_cpu_seconds": []} for t in plan.timed}
    failed: dict[str, str] = {}

    def use(t: Timed) -> Session:
        model.config._attn_implementation = backend_of[t.backend]  # one model, its backend per setting
        return sessions[t.key]

    def guarded(t: Timed, what: str, fn: Any) -> Any:
        try:
            return fn()
        except Exception as e:  # noqa: BLE001: out of memory in one setting, say: the others go on
            failed[t.key] = f"{what}: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"
            print(f"{t.key}: failed in {what}: {failed[t.key]}", flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
            return None

    for t in plan.timed:  # warm-up: one step each, on its longest row; flex compiles here
        session = use(t)

        def warm(session: Session = session) -> float:
            sync_device(device)
            w0 = time.perf_counter()
            session.step(session.batches[0])
            sync_device(device)
            return time.perf_counter() - w0

        seconds = guarded(t, "warm-up", warm)
        if seconds is not None:
            measured[t.key]["warm_up_seconds"] = seconds
            print(f"warm-up {t.key}: {seconds:.2f} s", flush=True)
    rounds, expected = 0, plan.round_seconds()  # the cost model until a round has been timed
    for r in range(gpu_plan.MAX_ROUNDS):
        last = time.monotonic()
        if last + expected > deadline:
            print(f"round {r + 1}: not started, its {expected:.0f} s would pass the box", flush=True)
            break
        for t in plan.timed:
            if t.key in failed:
                continue
            session = use(t)
            before = start_peak_memory(device)
            timed = guarded(t, f"epoch {r + 1}", session.epoch)
            if timed is None:
                continue
            m = measured[t.key]
            m["epoch_seconds"].append(timed[0])
            m["epoch_cpu_seconds"].append(timed[1])
            peak = peak_memory_since(device, before)
            if peak is not None:
                m["peak_memory_bytes"] = max(m.get("peak_memory_bytes") or 0, peak)
            print(f"epoch {r + 1} {t.key}: {timed[0]:.3f} s ({len(t.rows)} rows)", flush=True)
        rounds += 1
        expected = time.monotonic() - last
        result = summary(plan, measured, failed, rate, rounds, env, start)
        print(json.dumps(result), flush=True)
    result = summary(plan, measured, failed, rate, rounds, env, start)
    print(gpu_plan.table(result["figures"]), flush=True)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out / "speed.json", json.dumps(result, indent=1) + "\n")
        atomic_write_text(out / "table.md", gpu_plan.table(result["figures"]))
    print(json.dumps(result), flush=True)
    return 0 if rounds and not failed else 1


def summary(plan: SpeedPlan, measured: dict[str, dict[str, Any]], failed: dict[str, str], rate: float, rounds: int,
            env: dict[str, Any], start: float) -> dict[str, Any]:
    for t in plan.timed:  # compile: the warm-up step's excess over the setting's median step
        m = measured[t.key]
        if m.get("warm_up_seconds") is not None and m["epoch_seconds"]:
            step = statistics.median(m["epoch_seconds"]) / len(t.rows)
            m["compile_seconds"] = max(0.0, m["warm_up_seconds"] - step)
    return {**env, "plan": describe(plan), "matmul_flops": rate, "rounds": rounds, "failed": failed,
            "seconds": round(time.monotonic() - start, 1), "measured": measured,
            "figures": gpu_plan.figures(plan, measured, rate)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    plan = make_plan(args)
    return dry_run(plan, args.seconds) if args.dry_run else run(plan, args)


if __name__ == "__main__":
    sys.exit(main())
