"""CPU attention, forward + backward: dense SDPA vs the onepass_cpu fast path vs visible pairs alone.

Why this exists (issue 5): with a dense L x L mask, attention costs L^2 whatever
the mask hides; the fast path should cost what the visible pairs cost. For
packed rows of the bundled MathChat sample (real Qwen3 template and
vocabulary), one-pass and N-pass alike, it times one attention layer through
the transformers attention-function interface (the call a HF model makes):

    dense     transformers' sdpa with the dense bool mask (onepass.attention.mask.dense_mask)
    fast      onepass_cpu with cpu_attention_mask (segment plan, flash pieces)
    visible   per-document causal SDPA on separate tensors whose causal area equals
              each document's visible pairs: what the visible pairs alone cost

plus the mask / plan construction each needs (once per step), and the useful
attention FLOP rate against a matmul peak measured in the same run.

    .venv/bin/python benchmarks/attention_cpu.py                 # ~3 min on 2 quiet cores
    .venv/bin/python benchmarks/attention_cpu.py --lengths 2048 4096 --repeats 2

Writes results.json, results.md and attention_cpu.png to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

STRATEGIES = ("one-pass", "n-pass")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def timed(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> tuple[float, float]:
    """Median wall time and median process CPU time of ``fn`` over ``repeats`` runs after ``warmup`` (s).

    CPU time (all threads of this process) is the steadier figure on a shared machine.
    """
    for _ in range(warmup):
        fn()
    wall, cpu = [], []
    for _ in range(repeats):
        w0, c0 = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - w0)
        cpu.append(time.process_time() - c0)
    return statistics.median(wall), statistics.median(cpu)


def timed_together(fns: dict[str, Callable[[], Any]], repeats: int) -> dict[str, tuple[float, float]]:
    """:func:`timed` for several functions, their runs interleaved so they share the machine's conditions."""
    for fn in fns.values():
        fn()
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            w0, c0 = time.perf_counter(), time.process_time()
            fn()
            runs[name].append((time.perf_counter() - w0, time.process_time() - c0))
    return {name: (statistics.median(w for w, _ in r), statistics.median(c for _, c in r)) for name, r in runs.items()}


def matmul_peak(threads: int) -> float:
    """GFLOP/s of a float32 2048 x 2048 matmul with this run's threads (median of 5)."""
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    seconds, _ = timed(lambda: a @ b, repeats=5, warmup=2)
    return 2 * 2048 ** 3 / seconds / 1e9


def build_rows(lengths: list[int], limit: int | None) -> dict[tuple[str, int], np.ndarray]:
    """The fullest packed row (kv_end, padded to L) per (strategy, L), from the bundled sample."""
    from onepass.data.mathchat import load_sample
    from onepass.pack import pack_layouts
    from onepass.render import render_views
    from onepass.schedule import parse_schedule, schedule_views
    from onepass.tokenizer import load_tokenizer

    tokenizer = load_tokenizer("builtin:qwen3")
    views = [render_views(c, tokenizer) for c in load_sample(limit=limit)]
    rows = {}
    for strategy in STRATEGIES:
        trees = [x for vs in views for x in schedule_views(vs, parse_schedule(strategy)).layouts]
        for L in lengths:
            packed = pack_layouts([t for t in trees if len(t) <= L], L)
            row = max(packed, key=len)
            rows[strategy, L] = np.concatenate([row.kv_end, np.arange(len(row), L) + 1])
    return rows


def documents(kv_end: np.ndarray) -> list[tuple[int, int]]:
    """[start, stop) of each document (tree or pad) of a row: nothing before start covers it."""
    L = len(kv_end)
    covered = np.zeros(L, dtype=bool)
    covered[1:] = np.maximum.accumulate(kv_end)[:-1] > np.arange(1, L)
    starts = np.flatnonzero(~covered)
    return list(zip(starts.tolist(), np.append(starts[1:], L).tolist()))


class _Layer(torch.nn.Module):
    """What a HF attention function reads from its module."""

    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups, self.is_causal, self.layer_idx = groups, True, 0


def measure(kv_end: np.ndarray, args: argparse.Namespace) -> dict[str, Any]:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from onepass.attention.cpu import cpu_attention_mask, onepass_cpu_attention
    from onepass.attention.mask import block_mask, dense_mask, tree_block_mask

    L, H, Hkv, D = len(kv_end), args.heads, args.kv_heads, args.head_dim
    kv_end_BL = torch.as_tensor(kv_end)[None]
    gen = torch.Generator().manual_seed(0)
    # HF layout: projections are [B, L, heads, D]; attention sees them transposed to [B, heads, L, D]
    q_BLHD, k_BLHD, v_BLHD = (torch.randn(1, L, h, D, generator=gen).requires_grad_() for h in (H, Hkv, Hkv))
    g_BLHD = torch.randn(1, L, H, D, generator=gen)
    layer, scale = _Layer(H // Hkv), D ** -0.5

    def step(attention: Callable[..., Any], mask: Any) -> Callable[[], None]:
        def run() -> None:
            for x in (q_BLHD, k_BLHD, v_BLHD):
                x.grad = None
            out_BLHD, _ = attention(layer, q_BLHD.transpose(1, 2), k_BLHD.transpose(1, 2),
                                    v_BLHD.transpose(1, 2), mask, scaling=scale)
            out_BLHD.backward(g_BLHD)
        return run

    r: dict[str, Any] = {"length": L}
    r["plan_s"] = timed(lambda: cpu_attention_mask(kv_end_BL), args.repeats)[0]
    r["dense_mask_s"] = timed(lambda: dense_mask(kv_end_BL)[:, None], args.repeats)[0]
    r["block_mask_direct_s"] = timed(lambda: block_mask(kv_end_BL, block_size=128), args.repeats)[0]
    r["block_mask_create_s"] = timed(lambda: tree_block_mask(kv_end_BL, block_size=128), 1, warmup=0)[0]
    fast_mask = cpu_attention_mask(kv_end_BL)
    plan = fast_mask.onepass_segment_plan
    r.update(visible_pairs=plan.visible_pairs, causal_pairs=L * (L + 1) // 2, segments=plan.num_segments,
             kernel_calls=plan.num_kernel_calls)
    big = L > args.dense_repeat_below
    r["dense_s"], r["dense_cpu_s"] = timed(step(sdpa_attention_forward, dense_mask(kv_end_BL)[:, None]),
                                           1 if big else args.repeats, warmup=0 if big else 1)

    # visible pairs alone: per document, causal SDPA of the same visible area on its own tensors
    docs = [int(dense_mask(kv_end[a:b] - a).sum()) for a, b in documents(kv_end)]
    docs = [max(1, round((np.sqrt(1 + 8 * pairs) - 1) / 2)) for pairs in docs]
    num_pads = docs.count(1)  # 1-token documents (padding) run as one batched call, as in the fast path
    docs = [n for n in docs if n > 1] + ([1] * num_pads and [1])
    batch = [1] * (len(docs) - (num_pads > 0)) + ([num_pads] if num_pads else [])
    tensors = [[torch.randn(b, H, n, D, generator=gen).requires_grad_() for _ in range(3)]
               for b, n in zip(batch, docs)]
    grads = [torch.randn(b, H, n, D, generator=gen) for b, n in zip(batch, docs)]

    def visible() -> None:
        outs = [torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
                for q, k, v in tensors]
        torch.autograd.backward(outs, grads)

    both = timed_together({"fast": step(onepass_cpu_attention, fast_mask), "visible": visible}, args.repeats)
    (r["fast_s"], r["fast_cpu_s"]), (r["visible_s"], r["visible_cpu_s"]) = both["fast"], both["visible"]
    r["visible_docs"] = len(docs) - (num_pads > 0) + num_pads
    r["visible_doc_pairs"] = sum(b * n * (n + 1) // 2 for b, n in zip(batch, docs))
    useful = 3 * 4 * plan.visible_pairs * H * D  # forward 2 matmuls x 2 flops; backward twice the forward
    r["fast_gflops"] = useful / r["fast_s"] / 1e9
    return r


def write(results: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    env, peak = results["environment"], results["matmul_peak_gflops"]
    lines = [
        "# CPU attention, one layer, forward + backward",
        "",
        (f"{env['cpu']}, {env['threads']} torch threads, torch {env['torch']}, transformers "
         f"{env['transformers']}, python {env['python']}; load average {env['load_before']} before, "
         f"{env['load_after']} after. Workload: {results['workload']}. Matmul peak in this run: "
         f"{peak:.1f} GFLOP/s (float32 2048^2). Times are medians of wall seconds; in brackets the same "
         "ratio in process CPU seconds, steadier on a shared machine."),
        "",
        ("| strategy | L | visible / causal pairs | segments | calls | dense sdpa | fast | visible alone "
         "| fast / visible (cpu) | dense / fast (cpu) | fast GFLOP/s (% peak) | plan | plan / fast "
         "| dense mask | BlockMask direct | create_block_mask |"),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results["rows"]:
        lines.append(
            f"| {r['strategy']} | {r['length']} | {r['visible_pairs'] / r['causal_pairs']:.3f} | {r['segments']} "
            f"| {r['kernel_calls']} | {r['dense_s']:.3f} | {r['fast_s']:.3f} | {r['visible_s']:.3f} "
            f"| {r['fast_s'] / r['visible_s']:.2f} ({r['fast_cpu_s'] / r['visible_cpu_s']:.2f}) "
            f"| {r['dense_s'] / r['fast_s']:.1f}x ({r['dense_cpu_s'] / r['fast_cpu_s']:.1f}x) "
            f"| {r['fast_gflops']:.1f} ({100 * r['fast_gflops'] / peak:.0f}%) | {r['plan_s'] * 1e3:.2f} ms "
            f"| {100 * r['plan_s'] / r['fast_s']:.2f}% | {r['dense_mask_s'] * 1e3:.1f} ms "
            f"| {r['block_mask_direct_s'] * 1e3:.1f} ms | {r['block_mask_create_s'] * 1e3:.0f} ms |")
    lines += ["", ("plan / fast: the plan is built once per step, the attention runs once per layer, so this "
                   "is an upper bound on the plan's share of a step."), ""]
    (out / "results.md").write_text("\n".join(lines))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, strategy in zip(axes, STRATEGIES):
        rows = [r for r in results["rows"] if r["strategy"] == strategy]
        x = [r["length"] for r in rows]
        for key, label in (("dense_s", "dense sdpa"), ("fast_s", "onepass_cpu"), ("visible_s", "visible pairs alone")):
            ax.plot(x, [r[key] for r in rows], marker="o", label=label)
        ax.set(xscale="log", yscale="log", title=f"{strategy} rows", xlabel="row length (tokens)")
        ax.minorticks_off()
        ax.set_xticks(x, [str(v) for v in x])
    axes[0].set_ylabel("attention forward + backward (s)")
    axes[0].legend()
    fig.suptitle(f"one attention layer, fwd + bwd, float32; {env['threads']} threads, {env['cpu']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "attention_cpu.png", dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dense-repeat-below", type=int, default=4096,
                   help="dense SDPA above this length runs once, without warm-up (it is the slow baseline)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--conversations", type=int, default=None, help="limit the bundled sample")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "attention_cpu")
    p.add_argument("--replot", action="store_true", help="only rewrite results.md and the plot from results.json")
    args = p.parse_args(argv)
    if args.replot:
        write(json.loads((args.out / "results.json").read_text()), args.out)
        return 0
    torch.set_num_threads(args.threads)
    import transformers

    from onepass.attention.cpu import register

    register()
    env = {"device": "cpu", "cpu": cpu_model(), "threads": torch.get_num_threads(), "torch": torch.__version__,
           "transformers": transformers.__version__, "python": platform.python_version(),
           "load_before": [round(x, 2) for x in os.getloadavg()]}
    workload = (f"one attention layer, {args.heads} query / {args.kv_heads} key-value heads, head dim "
                f"{args.head_dim}, float32, batch 1; rows = the fullest packed row of the bundled MathChat sample "
                f"(Qwen3 template) per length, padded to L")
    print(f"{env['cpu']} | threads {env['threads']} | torch {env['torch']} | transformers {env['transformers']} "
          f"| load {env['load_before']}\n{workload}", flush=True)
    t0 = time.perf_counter()
    rows = build_rows(args.lengths, args.conversations)
    print(f"rows built in {time.perf_counter() - t0:.1f}s", flush=True)
    peak = matmul_peak(args.threads)
    print(f"matmul peak {peak:.1f} GFLOP/s", flush=True)
    results: dict[str, Any] = {"environment": env, "workload": workload, "matmul_peak_gflops": peak, "rows": []}
    for L in args.lengths:
        for strategy in STRATEGIES:
            r = {"strategy": strategy, **measure(rows[strategy, L], args)}
            results["rows"].append(r)
            print(f"{strategy:8s} L={L:6d} visible {r['visible_pairs'] / r['causal_pairs']:.3f} of causal | "
                  f"dense {r['dense_s']:.3f}s fast {r['fast_s']:.3f}s visible-alone {r['visible_s']:.3f}s | "
                  f"fast/visible {r['fast_s'] / r['visible_s']:.2f} (cpu {r['fast_cpu_s'] / r['visible_cpu_s']:.2f}) "
                  f"dense/fast {r['dense_s'] / r['fast_s']:.1f}x (cpu {r['dense_cpu_s'] / r['fast_cpu_s']:.1f}x) | "
                  f"plan {r['plan_s'] * 1e3:.2f}ms ({100 * r['plan_s'] / r['fast_s']:.2f}% of fast) | "
                  f"fast {r['fast_gflops']:.1f} GFLOP/s", flush=True)
    env["load_after"] = [round(x, 2) for x in os.getloadavg()]
    env["wall_s"] = round(time.perf_counter() - t0, 1)
    write(results, args.out)
    print(f"wrote {args.out}/results.json, results.md, attention_cpu.png ({env['wall_s']}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
