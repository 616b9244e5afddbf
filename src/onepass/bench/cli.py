"""``onepass bench``: run every setting on one workload and write JSON, Markdown and PNGs.

Why this module exists: it is the orchestration around ``harness.py`` (workload,
model, backends, depth groups) and the command line for it. ``--quick`` is
sized to finish in a few minutes on 2 CPU cores. The workload is any
``--data`` spec of conversations, resolved like every other command's
(:func:`onepass.data.load.resolve_data`); ``--workload mathchat|synthetic`` are
names for ``builtin:mathchat`` and ``synthetic:mathchat-sync``.

    onepass bench --quick --out runs/bench
    onepass bench --quick --data chats.jsonl --out runs/bench-mine
    onepass bench --quick --shape qwen3-0.6b --layers 2 --out runs/bench-0.6b   # real widths, 2 of 28 layers
    onepass bench --quick --arch qwen3.5 --settings n-pass-packed,one-pass-packed --out runs/bench-hybrid

``--shape`` builds a random-weight Qwen3 of a real model's widths, heads, MLP
and vocabulary; ``--layers N`` cuts its depth. Useful FLOPs are those of the
model run; ``useful_flops_full_depth`` (per-layer FLOPs at the full depth, not
run) is reported beside them. ``--arch qwen3.5`` builds a Gated DeltaNet hybrid at the shape's sizes
(:func:`onepass.bench.harness.arch_kwargs`) and reports the share of each step its recurrent layers
spend passing states between chains (:func:`onepass.mixers.tree.timing`).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
from pathlib import Path
from typing import Any

from onepass.errors import DataError, UsageError
from onepass.geometry import branches
from onepass.flops import MODEL_SHAPES, model_kwargs, train_flops

WORKLOADS = {"mathchat": "builtin:mathchat", "synthetic": "synthetic:mathchat-sync",  # --workload NAME: --data SPEC
             "agent": "synthetic:agent"}


def add_parser(sub: Any) -> None:
    p = sub.add_parser("bench", help="training throughput and memory of every schedule, side by side")
    p.add_argument("--out", required=True, help="output directory (summary.json, table.md, *.png)")
    p.add_argument("--quick", action="store_true", help="small workload and few repeats (minutes on CPU)")
    data = p.add_mutually_exclusive_group()
    data.add_argument("--data", help="conversations to time: any --data spec of onepass prepare (a file, a "
                                     "folder, a saved dataset, builtin:mathchat, synthetic:NAME, a hub id)")
    data.add_argument("--workload", choices=tuple(WORKLOADS),
                      help="a named workload: " + ", ".join(f"{k} = --data {v}" for k, v in WORKLOADS.items())
                           + " (default mathchat)")
    p.add_argument("--conversations", type=int, help="how many conversations (default: 24 quick, 300 full)")
    p.add_argument("--seed", type=int, default=0, help="model initialisation seed")
    p.add_argument("--tokenizer", default="builtin:qwen3")
    p.add_argument("--shape", "--model-shape", dest="model_shape", default="tiny",
                   help=f"model shape, random weights: {' | '.join(MODEL_SHAPES)} (real widths, heads, MLP and "
                        "vocabulary; default tiny)")
    p.add_argument("--arch", default="qwen3",
                   help="architecture at the shape's sizes: qwen3 (default) or qwen3.5 (Gated DeltaNet hybrid, "
                        "three linear-attention layers to one attention layer; reports the share of the step "
                        "spent passing recurrent states between chains; FLOPs still counted as Qwen3's)")
    p.add_argument("--layers", type=int, default=None,
                   help="cut the shape to N layers so a CPU run fits in minutes (FLOPs are counted for the model "
                        "run; the full depth's are reported beside them, labelled)")
    vocab_group = p.add_mutually_exclusive_group()
    vocab_group.add_argument("--full-vocab", action="store_true",
                             help="keep the tokenizer's whole vocabulary (default for every shape but tiny: the real "
                                  "model's; tiny compacts it to the ids that occur)")
    vocab_group.add_argument("--compact-vocab", action="store_true",
                             help="compact a real shape's vocabulary too, to the ids that occur: the LM head (the "
                                  "same work in every setting) no longer dominates a CPU run of a cut model")
    p.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16 (CUDA default)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--backends", default=None,
                   help="comma-separated attention backends (default: sdpa,onepass_cpu on CPU; flex_attention,sdpa on "
                        "CUDA; onepass_varlen: N-pass rows through torch's flash varlen kernel, the FA2-class "
                        "baseline, CUDA)")
    p.add_argument("--settings", default=None, help="comma-separated settings (default: all)")
    p.add_argument("--max-tokens", type=int, default=None, help="row budget (default 4096; 16384 for --workload agent)")
    p.add_argument("--repeats", type=int, default=None, help="timed epochs per setting (default 2 quick, 5 full)")
    p.add_argument("--depth-groups", action="store_true", help="also time G1/G2/G3 separately")
    p.add_argument("--interleave", action="store_true",
                   help="time every backend x setting in this one process, their epochs interleaved (A B C A B C: "
                        "drift lands on all alike, ratios paired); all models stay resident (GPU). onepass_varlen "
                        "(torch's flash varlen kernel, CUDA) then times the N-pass settings only")
    p.set_defaults(func=run)


def workload_spec(data: str | None, workload: str | None) -> tuple[str, str]:
    """``(name, spec)`` of the workload: ``--data SPEC`` as given, or a ``--workload`` name's spec."""
    if data is not None:
        return data, data
    name = workload or "mathchat"
    return name, WORKLOADS[name]


def load_workload(spec: str, n: int) -> list[Any]:
    """The first ``n`` valid conversations of ``spec``; invalid records are counted on stderr, never dropped
    silently. Prepared rows are refused (bench lays the conversations out under every schedule)."""
    from onepass.data.load import load_conversations

    report = load_conversations(spec, strict=False, limit=n)
    if report.skipped:
        print(f"skipped {len(report.skipped)} invalid records of {spec}; first: {report.skipped[0]}",
              file=sys.stderr, flush=True)
    if not report.conversations:
        first = f"; first skip: {report.skipped[0]}" if report.skipped else ""
        raise DataError(f"{spec} has no valid conversations to time{first}")
    return report.conversations


def run(args: argparse.Namespace) -> int:
    import torch

    from onepass.bench import harness as bench
    from onepass.bench.report import markdown, plots
    from onepass.data.load import conversation_source
    from onepass.head import head_mode
    from onepass.render import render_views
    from onepass.tokenizer import load_tokenizer
    from onepass.verify import compact_vocab

    if args.model_shape not in MODEL_SHAPES:
        raise UsageError(f"unknown --shape {args.model_shape!r}; use one of {', '.join(MODEL_SHAPES)}")
    if args.layers is not None and args.layers < 1:
        raise UsageError(f"--layers must be >= 1, got {args.layers}")
    if args.arch not in bench.BENCH_ARCHS:
        raise UsageError(f"unknown --arch {args.arch!r}; use one of {', '.join(bench.BENCH_ARCHS)}")
    name, spec = workload_spec(args.data, args.workload)
    conversation_source(spec)  # fails in one line before any work: missing, unrecognised, or prepared rows
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    backends = (args.backends or ("sdpa,onepass_cpu" if device.type == "cpu" else "flex_attention,sdpa")).split(",")
    if "onepass_cpu" in backends:
        from onepass.attention.cpu import register

        register()
    if "onepass_varlen" in backends and device.type != "cuda":
        raise UsageError("--backends onepass_varlen (torch's flash varlen kernel) runs on CUDA only")
    from onepass.bench import trl as bench_trl

    known = [*bench.SETTINGS, *bench_trl.SETTINGS]
    settings = (args.settings or ",".join(known)).split(",")
    unknown = [s for s in settings if s not in known]
    if unknown:
        raise UsageError(f"unknown setting {unknown[0]!r}; use any of {', '.join(known)}")
    trl_settings = [s for s in settings if s in bench_trl.SETTINGS]
    settings = [s for s in settings if s not in bench_trl.SETTINGS]
    if trl_settings and args.arch != "qwen3":  # TRL's baseline builds a Qwen3
        if args.settings:
            raise UsageError(f"{', '.join(trl_settings)} times a Qwen3; drop it or --arch {args.arch}")
        trl_settings = []
    if trl_settings and not bench_trl.available():
        if args.settings:
            raise UsageError(f"{', '.join(trl_settings)} needs TRL: pip install 'onepass[bench]'")
        print(f"TRL is not installed: {', '.join(trl_settings)} skipped (pip install 'onepass[bench]')", flush=True)
        trl_settings = []
    if args.conversations is not None and args.conversations < 1:
        raise UsageError(f"--conversations must be >= 1, got {args.conversations}")
    n = args.conversations or (24 if args.quick else 300)
    repeats = args.repeats or (2 if args.quick else 5)
    max_tokens = args.max_tokens or (16384 if spec == WORKLOADS["agent"] else 4096)  # agent trees: 3-9k tokens
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    env = bench.environment(device)
    print(f"device: {env['device']}  versions: {env['versions']}", flush=True)
    convs = load_workload(spec, n)
    tok = load_tokenizer(args.tokenizer)
    views = [render_views(c, tok) for c in convs]
    full = MODEL_SHAPES[args.model_shape]
    vocab = max(len(tok), full.vocab)  # a real shape keeps its padded vocabulary (Qwen3: 151,936) unless compacted
    if args.compact_vocab or (not args.full_vocab and full.vocab == 0):
        views, vocab = compact_vocab(views)
    depth = [len(v) for v in views]
    full = dataclasses.replace(full, vocab=vocab)
    shape = dataclasses.replace(full, num_layers=args.layers or full.num_layers)  # the model actually run
    shape_kwargs = model_kwargs(shape)
    peak = bench.matmul_peak_flops(device, dtype)
    print(f"workload {name}: {len(convs)} conversations, {sum(depth)} views; model "
          f"{args.model_shape} {args.arch} {bench.arch_kwargs(args.arch, shape_kwargs)}, vocab {vocab}, {dtype}, "
          f"LM head {head_mode()}; "
          f"matmul peak {peak / 1e9:.1f} GFLOP/s", flush=True)
    print(f"layers: {shape.num_layers} run of {full.num_layers}"
          + (" (--layers: FLOPs are the cut model's; full-depth FLOPs reported separately)"
             if shape.num_layers != full.num_layers else ""), flush=True)

    groups: dict[str, list[int]] = {"all": list(range(len(views)))}
    if args.depth_groups:
        for g, (lo, hi) in bench.DEPTH_GROUPS.items():
            members = [i for i, d in enumerate(depth) if lo <= d <= hi]
            if members:
                groups[g] = members

    @functools.cache
    def rows_of(group: str, name: str) -> list[Any]:  # the same rows for every backend (and TRL's count)
        return bench.layout_setting([views[i] for i in groups[group]], name, max_tokens)

    results: list[dict[str, Any]] = []
    ideal = {group: train_flops(rows_of(group, "n-pass"), shape)
             / train_flops(rows_of(group, "one-pass"), shape) for group in groups}
    # sharing prefixes across conversations: the FLOP bound against the one-pass packed rows it merges
    shared_settings = [s for s in settings if s in bench.SHARED_SETTINGS]
    ideal_shared = {group: train_flops(rows_of(group, bench.SHARED_SETTINGS[s]), shape)
                    / train_flops(rows_of(group, s), shape) for group in groups for s in shared_settings[:1]}
    planned: list[tuple[str, str, str, list[Any], int]] = []  # backend, group, setting, rows, conversations
    for backend in backends:
        for group, members in groups.items():
            names = settings if group == "all" else ["n-pass-packed", "one-pass-packed", *shared_settings]
            for setting in names:  # not `name`: that is the workload's, written to the summary
                rows = rows_of(group, setting)
                if setting in bench.SHARED_SETTINGS and not args.settings and sum(map(len, rows)) == sum(
                        map(len, rows_of(group, bench.SHARED_SETTINGS[setting]))):
                    print(f"{backend:>12} {group:>3} {setting:>16}: no prefix shared across conversations (the rows "
                          f"are {bench.SHARED_SETTINGS[setting]}'s): not timed", flush=True)
                    continue
                if backend == "onepass_varlen" and any(branches(r.kv_end) for r in rows):
                    print(f"onepass_varlen {group} {setting}: skipped, its rows are trees that branch (a varlen "
                          "kernel serves N-pass rows only)", flush=True)
                    continue
                planned.append((backend, group, setting, rows, len(members)))

    def job_of(backend: str, rows: list[Any]) -> Any:
        return bench.Job(rows=rows, vocab=vocab, shape_kwargs=shape_kwargs, dtype=str(dtype).replace("torch.", ""),
                         backend=backend, device=str(device), seed=args.seed, repeats=repeats,
                         threads=torch.get_num_threads(), arch=args.arch, tensor_memory=not args.interleave)

    if args.interleave:
        timings = bench.time_interleaved([job_of(b, rows) for b, _, _, rows, _ in planned],
                                         log=lambda line: print(line, flush=True))
    for i, (backend, group, setting, rows, conversations) in enumerate(planned):
        timing = timings[i] if args.interleave else bench.time_in_subprocess(job_of(backend, rows))
        if not timing.epoch_seconds:  # failed before timing (reported above)
            continue
        useful = train_flops(rows, shape)
        results.append(bench.summarise(setting, backend, group, rows, timing, conversations, useful, peak))
        results[-1]["useful_flops_full_depth"] = train_flops(rows, full)  # not run: per-layer scaled
        results[-1]["interleaved"] = args.interleave
        r = results[-1]
        print(f"{backend:>12} {group:>3} {setting:>16}: {r['conversations_per_s']:7.2f} conv/s "
              f"{r['tokens_per_s']:9,.0f} tok/s  peak {(r['peak_memory_bytes'] or 0) / 2**20:7.0f} MiB"
              + (f" (tensors {r['peak_tensor_bytes'] / 2**20:,.0f}, forward+backward "
                 f"{r['peak_forward_backward_bytes'] / 2**20:,.0f} MiB)" if r["peak_tensor_bytes"] else "")
              + (f"  state passing {r['state_passing_fraction_of_step']:.1%} of the step, recurrent "
                 f"mixers {r['recurrent_mixer_fraction_of_step']:.1%} ({r['recurrent_chain_calls']} calls)"
                 if r["recurrent_chain_calls"] else ""), flush=True)
    for trl_setting in trl_settings:  # TRL's defaults; tuned: checkpointing off, onepass's CPU attention
        tuned = trl_setting == bench_trl.TUNED
        trl_backend = "onepass_cpu" if tuned else "sdpa"
        if device.type == "cuda":
            import importlib.util

            trl_backend = "flash_attention_2" if importlib.util.find_spec("flash_attn") else "sdpa"
        job = bench_trl.TrlJob(examples=bench_trl.view_examples(views), vocab=vocab, shape_kwargs=shape_kwargs,
                               dtype=str(dtype).replace("torch.", ""), backend=trl_backend, device=str(device),
                               seed=args.seed, repeats=repeats, threads=torch.get_num_threads(),
                               max_tokens=max_tokens, checkpointing=not tuned)
        timing = bench.time_in_subprocess(job, bench_trl.time_trl)
        n_rows = rows_of("all", "n-pass-packed")
        results.append(bench.summarise(trl_setting, trl_backend, "all", n_rows, timing, len(views),
                                       train_flops(n_rows, shape), peak))
        results[-1]["useful_flops_full_depth"] = train_flops(n_rows, full)
        r = results[-1]
        print(f"{trl_backend:>12} all {trl_setting:>16}: {r['conversations_per_s']:7.2f} conv/s "
              f"{r['tokens_per_s']:9,.0f} tok/s  peak {(r['peak_memory_bytes'] or 0) / 2**20:7.0f} MiB "
              f"(TRL SFTTrainer, packing bfd, completion-only loss, checkpointing {'off' if tuned else 'on'})",
              flush=True)
    bench.add_ratios(results, ideal, ideal_shared)
    summary = {
        **env, "workload": {"name": name, "data": spec, "conversations": len(convs), "views": sum(depth),
                            "seed": args.seed, "model_shape": args.model_shape, "arch": args.arch, "vocab": vocab,
                            "layers": shape.num_layers, "full_layers": full.num_layers, "lm_head": head_mode(),
                            "dtype": str(dtype).replace("torch.", ""), "max_tokens": max_tokens,
                            "repeats": repeats, "depth_histogram": {d: depth.count(d) for d in sorted(set(depth))}},
        "ideal_speedup": ideal, "ideal_speedup_shared": ideal_shared, "matmul_peak_flops": peak, "settings": results,
        "command": "onepass " + " ".join(sys.argv[1:]) if sys.argv and sys.argv[0].endswith("onepass") else None,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "table.md").write_text(markdown(summary))
    pngs = plots(summary, out)
    print(markdown(summary))
    print(f"wrote {out / 'summary.json'}, {out / 'table.md'}, " + ", ".join(str(p) for p in pngs))
    return 0
