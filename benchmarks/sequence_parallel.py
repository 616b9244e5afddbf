"""One long tree on CPU ranks: sequence parallelism (sp 1, 2, 4) against the ``budget`` schedule's rows.

Why this exists (issue 36): a tree longer than one device holds has two ways out. The ``budget``
schedule cuts it into rows that fit and re-runs the shared history in each (the tokens one-pass saved
come back); sequence parallelism (:mod:`onepass.parallel`) splits the one row over S ranks and pays
in communication instead. This reports, for one agent-shaped tree (a long history of tool results, each
turn's reasoning branching off it; ~33k tokens by default) at a tiny width:

- per degree S: tokens each rank holds, the peak bytes of live tensors of one forward + backward on each
  rank (:func:`onepass.bench.memory.step_memory`) against one process, and the elements each rank sends
  per step, from the plan (:func:`onepass.parallel.plan.forward_volume`, forward + backward) and counted
  on the wire (they agree: tests/parallel/test_layout.py holds them equal);
- per budget (the longest view, L/2, L/4): the rows it makes, their tokens, the re-run tokens (rows'
  tokens minus the tree's) and the views it cannot train (a view longer than the budget is skipped).

The ranks are ``torchrun`` processes over gloo on this machine's cores, float32. Timings are not the
point (2 shared cores); the token, memory and volume figures do not depend on the machine.

    .venv/bin/python benchmarks/sequence_parallel.py                          # ~5 min on 2 cores
    .venv/bin/python benchmarks/sequence_parallel.py --turns 12 --degrees 1 2  # quick look
    .venv/bin/python benchmarks/sequence_parallel.py --arch qwen3.5 --out benchmarks/results/sequence-parallel-hybrid
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from onepass.bench.harness import environment
from onepass.bench.memory import step_memory, tensor_bytes
from onepass.loss import batch_loss, layouts_to_batch
from onepass.layout.schedule import parse_schedule, schedule_views
from onepass.model.tiny import tiny_model
from onepass.layout.tree import build_layout
from onepass.parallel.comm import SequenceShard, TorchGroup
from onepass.parallel.model import install, layer_shapes
from onepass.parallel.plan import forward_volume, padded_length
from onepass.layout.view import View

MODEL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)


def agent_views(turns: int, tool: int, reasoning: int, answer: int, vocab: int, seed: int = 0) -> list[View]:
    """The views of one agent trace: turn k sees every earlier tool result and answer (not their reasoning)
    and generates reasoning then an answer; distinct random ids, so the tree is exactly this shape."""
    rng = np.random.default_rng(seed)
    history: list[np.ndarray] = []
    views = []
    for k in range(turns):
        history.append(rng.integers(1, vocab, tool))
        completion = rng.integers(1, vocab, reasoning + answer)
        prompt = np.concatenate(history)
        views.append(View(tokens=np.concatenate([prompt, completion]), num_prompt=len(prompt), turn=k))
        history.append(completion[reasoning:])  # the answer stays in the history, the reasoning does not
    return views


class CountingGroup(TorchGroup):
    """A process group that counts the elements this rank sends to the others."""

    sent = 0

    def all_to_all(self, sends, rank):
        self.sent += sum(s.numel() for j, s in enumerate(sends) if j != rank)
        return super().all_to_all(sends, rank)


def worker(args: argparse.Namespace) -> None:
    """One rank (or the one process): one forward + backward of the tree; rank 0 writes what every rank saw."""
    torch.set_num_threads(1)
    degree = int(os.environ.get("WORLD_SIZE", "1"))
    shard = None
    if degree > 1:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        dist.init_process_group("gloo")
        mesh = init_device_mesh("cpu", (1, degree), mesh_dim_names=("dp", "sp"))
        shard = SequenceShard(group=CountingGroup(mesh.get_group("sp")), rank=dist.get_rank())
    views = agent_views(args.turns, args.tool, args.reasoning, args.answer, args.vocab)
    tree = build_layout(views)
    model = tiny_model(args.arch, args.vocab, dtype=torch.float32, attn_implementation=args.backend, **MODEL).train()
    if degree > 1:
        install(model, degree)
    batch = layouts_to_batch([tree])
    params = [p for p in model.parameters()]

    def step() -> None:
        batch_loss(model, batch, shard=shard).backward()

    t0, c0 = time.perf_counter(), time.process_time()
    memory = step_memory(step, tensor_bytes([*params, *batch.values()]), torch.device("cpu"))
    record = dict(rank=0 if shard is None else shard.rank, peak_bytes=memory.peak_bytes,
                  tokens=padded_length(len(tree), degree) // degree, sent_elements=shard.group.sent if shard else 0,
                  wall_s=time.perf_counter() - t0, cpu_s=time.process_time() - c0)
    records = [record]
    if shard is not None:
        import torch.distributed as dist

        records = [None] * degree
        dist.all_gather_object(records, record)
    if record["rank"] == 0:
        volume = forward_volume(layer_shapes(model), length=len(tree), degree=degree)
        Path(args.result).write_text(json.dumps(dict(
            degree=degree, ranks=records, tree_tokens=len(tree), planned_elements_per_step=2 * volume.total,
            planned_attention_elements=2 * volume.attention, planned_mixer_elements=2 * volume.mixers,
            parameters=sum(p.numel() for p in params))))
    if shard is not None:
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()


def budget_rows(views: list[View], budget: int) -> dict[str, int]:
    """The budget schedule's rows for ``budget``: tokens run, and those of the one tree of the views it trains
    (their difference is the history it re-runs); a view longer than the budget is skipped."""
    scheduled = schedule_views(views, parse_schedule("budget"), max_tokens=budget)
    kept = [v for v in views if len(v) <= budget]
    return dict(budget=budget, rows=len(scheduled.layouts), tokens=sum(len(x) for x in scheduled.layouts),
                kept_tree_tokens=len(build_layout(kept)) if kept else 0,
                longest_row=max((len(x) for x in scheduled.layouts), default=0),
                views_skipped=scheduled.num_views_skipped)


def replot(out: Path) -> None:
    """The plot again from ``out/results.json``."""
    saved = json.loads((out / "results.json").read_text())
    _plot(saved["runs"], saved["budgets"], saved["tree_tokens"], out / "sequence-parallel.png")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--turns", type=int, default=24)
    p.add_argument("--tool", type=int, default=800, help="tokens of each tool result (kept in the history)")
    p.add_argument("--reasoning", type=int, default=400, help="tokens of each turn's reasoning (dropped later)")
    p.add_argument("--answer", type=int, default=100, help="tokens of each turn's answer (kept)")
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--arch", default="qwen3")
    p.add_argument("--backend", default="onepass_cpu")
    p.add_argument("--degrees", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--out", default="benchmarks/results/sequence-parallel")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.backend == "onepass_cpu":
        from onepass.attention.cpu import register

        register()
    if args.worker:
        worker(args)
        return 0

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    views = agent_views(args.turns, args.tool, args.reasoning, args.answer, args.vocab)
    tree_tokens = len(build_layout(views))
    n_pass = sum(len(v) for v in views)
    longest_view = max(len(v) for v in views)
    print(f"tree: {args.turns} turns, {tree_tokens:,} tokens one-pass ({n_pass:,} N-pass, longest view "
          f"{longest_view:,})", flush=True)
    runs = []
    for degree in args.degrees:
        result = out / f"degree-{degree}.json"
        cmd = [sys.executable, __file__, "--worker", "--result", str(result), *_forwarded(args)]
        if degree > 1:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(degree),
                   __file__, "--worker", "--result", str(result), *_forwarded(args)]
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        run = json.loads(result.read_text())
        run["launch_s"] = time.perf_counter() - t0
        runs.append(run)
        print(json.dumps({k: v for k, v in run.items() if k != "ranks"}), flush=True)
    one = next((r for r in runs if r["degree"] == 1), None)
    budgets = sorted({longest_view, tree_tokens // 2, tree_tokens // 4}, reverse=True)
    rows = [budget_rows(views, b) for b in budgets]
    bytes_per = 4  # float32
    lines = [f"One tree: {args.turns} turns (tool results {args.tool}, reasoning {args.reasoning}, answers "
             f"{args.answer} tokens), {tree_tokens:,} tokens laid out one-pass ({n_pass:,} N-pass; longest view "
             f"{longest_view:,}). Tiny {args.arch} ({MODEL}), float32, {args.backend}, one forward + backward.",
             "", "| sp degree | tokens per rank | peak tensor MiB per rank (max) | vs one process | sent per rank "
             "per step (plan) | counted | MiB |", "|---|---|---|---|---|---|---|"]
    for r in runs:
        peak = max(x["peak_bytes"] for x in r["ranks"])
        ratio = f"{peak / max(x['peak_bytes'] for x in one['ranks']):.2f}x" if one else "-"
        sent = max(x["sent_elements"] for x in r["ranks"])
        lines.append(f"| {r['degree']} | {r['ranks'][0]['tokens']:,} | {peak / 2**20:.1f} | {ratio} | "
                     f"{r['planned_elements_per_step']:,} | {sent:,} | "
                     f"{r['planned_elements_per_step'] * bytes_per / 2**20:.1f} |")
    lines += ["", "| budget schedule, max_tokens | rows | tokens run | re-run tokens | longest row | views it "
              "cannot train (longer than the budget) |", "|---|---|---|---|---|---|"]
    for b in rows:
        lines.append(f"| {b['budget']:,} | {b['rows']} | {b['tokens']:,} | {b['tokens'] - b['kept_tree_tokens']:,} | "
                     f"{b['longest_row']:,} | {b['views_skipped']} of {len(views)} |")
    table = "\n".join(lines)
    print(table)
    env = environment(torch.device("cpu"))
    env["argv"] = " ".join(argv if argv is not None else sys.argv[1:])
    (out / "results.json").write_text(json.dumps(dict(env=env, tree_tokens=tree_tokens, n_pass_tokens=n_pass,
                                                      longest_view=longest_view, runs=runs, budgets=rows,
                                                      model=dict(MODEL, arch=args.arch, vocab=args.vocab)), indent=1))
    (out / "results.md").write_text(table + "\n\n" + json.dumps(env, indent=1) + "\n")
    _plot(runs, rows, tree_tokens, out / "sequence-parallel.png")
    return 0


def _forwarded(args: argparse.Namespace) -> list[str]:
    return ["--turns", str(args.turns), "--tool", str(args.tool), "--reasoning", str(args.reasoning), "--answer",
            str(args.answer), "--vocab", str(args.vocab), "--arch", args.arch, "--backend", args.backend]


def _plot(runs: list[dict], budgets: list[dict], tree_tokens: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    degrees = [r["degree"] for r in runs]
    a.bar([str(d) for d in degrees], [max(x["peak_bytes"] for x in r["ranks"]) / 2**20 for r in runs])
    a.set_xlabel("sequence-parallel degree")
    a.set_ylabel("peak tensor MiB per rank")
    a.set_title("one forward + backward of the tree")
    bars = b.bar([f"{x['budget'] / 1000:.1f}k" for x in budgets], [(x["tokens"] - x["kept_tree_tokens"]) / 1000
                                                                   for x in budgets])
    for bar, x in zip(bars, budgets):
        if x["views_skipped"]:
            b.annotate(f"{x['views_skipped']} views\nnot trainable", (bar.get_x() + bar.get_width() / 2,
                                                                      bar.get_height()), ha="center", va="bottom",
                       fontsize=8)
    b.set_xlabel("budget schedule, max_tokens")
    b.set_ylabel("re-run tokens (thousands)")
    b.set_title(f"the same tree ({tree_tokens:,} tokens) cut into rows")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
