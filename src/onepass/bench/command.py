"""``onepass bench``'s run: the workload laid out under every setting, each timed in a fresh process.

Why this module exists: the run is torch's (devices, dtypes, the harness) and its flags must not be
(``onepass bench --help``): the flags, the workload's spec and loading are :mod:`onepass.bench.cli`'s,
the orchestration around :mod:`onepass.bench.harness` is here.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import torch

from onepass.attention.cpu import register
from onepass.bench import harness as bench
from onepass.bench import trl as bench_trl
from onepass.bench.cli import WORKLOADS, load_workload, workload_spec
from onepass.bench.report import markdown, plots
from onepass.bench.settings import SETTINGS, SHARED_SETTINGS, layout_setting
from onepass.data.sources import conversation_source
from onepass.model.dtypes import torch_dtype
from onepass.errors import UsageError
from onepass.layout.flops import MODEL_SHAPES, model_kwargs, train_flops
from onepass.head import head_mode
from onepass.render import render_views
from onepass.render.tokenizer import load_tokenizer
from onepass.verify.check import compact_vocab


def run(args: argparse.Namespace) -> int:
    if args.model_shape not in MODEL_SHAPES:
        raise UsageError(f"unknown --shape {args.model_shape!r}; use one of {', '.join(MODEL_SHAPES)}")
    if args.layers is not None and args.layers < 1:
        raise UsageError(f"--layers must be >= 1, got {args.layers}")
    if args.arch not in bench.BENCH_ARCHS:
        raise UsageError(f"unknown --arch {args.arch!r}; use one of {', '.join(bench.BENCH_ARCHS)}")
    name, spec = workload_spec(args.data, args.workload)
    conversation_source(spec)  # fails in one line before any work: missing, unrecognised, or prepared rows
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch_dtype(args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    backends = (args.backends or ("sdpa,onepass_cpu" if device.type == "cpu" else "flex_attention,sdpa")).split(",")
    if "onepass_cpu" in backends:
        register()
    if "onepass_varlen" in backends and device.type != "cuda":
        print("onepass_varlen off CUDA runs its reference kernel (SDPA per run of segments): exact, not fast",
              flush=True)
    known = [*SETTINGS, *bench_trl.SETTINGS]
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
    # --quick interleaves its settings in one process, as the demo does: a figure from settings timed minutes
    # apart, each in its own process, carries whatever the machine did in between (issue 42: 134% of the bound)
    interleave = args.interleave or args.quick
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
        return layout_setting([views[i] for i in groups[group]], name, max_tokens)

    results: list[dict[str, Any]] = []
    ideal = {group: train_flops(rows_of(group, "n-pass"), shape)
             / train_flops(rows_of(group, "one-pass"), shape) for group in groups}
    # sharing prefixes across conversations: the FLOP bound against the one-pass packed rows it merges
    shared_settings = [s for s in settings if s in SHARED_SETTINGS]
    ideal_shared = {group: train_flops(rows_of(group, SHARED_SETTINGS[s]), shape)
                    / train_flops(rows_of(group, s), shape) for group in groups for s in shared_settings[:1]}
    planned: list[tuple[str, str, str, list[Any], int]] = []  # backend, group, setting, rows, conversations
    for backend in backends:
        for group, members in groups.items():
            names = settings if group == "all" else ["n-pass-packed", "one-pass-packed", *shared_settings]
            for setting in names:  # not `name`: that is the workload's, written to the summary
                rows = rows_of(group, setting)
                if setting in SHARED_SETTINGS and not args.settings and sum(map(len, rows)) == sum(
                        map(len, rows_of(group, SHARED_SETTINGS[setting]))):
                    print(f"{backend:>12} {group:>3} {setting:>16}: no prefix shared across conversations (the rows "
                          f"are {SHARED_SETTINGS[setting]}'s): not timed", flush=True)
                    continue
                planned.append((backend, group, setting, rows, len(members)))

    def job_of(backend: str, rows: list[Any]) -> Any:
        return bench.Job(rows=rows, vocab=vocab, shape_kwargs=shape_kwargs, dtype=str(dtype).replace("torch.", ""),
                         backend=backend, device=str(device), seed=args.seed, repeats=repeats,
                         threads=torch.get_num_threads(), arch=args.arch,
                         tensor_memory=not args.interleave or args.quick)

    if interleave:
        timings = bench.time_interleaved([job_of(b, rows) for b, _, _, rows, _ in planned],
                                         log=lambda line: print(line, flush=True))
    for i, (backend, group, setting, rows, conversations) in enumerate(planned):
        timing = timings[i] if interleave else bench.time_in_subprocess(job_of(backend, rows))
        if not timing.epoch_seconds:  # failed before timing (reported above)
            continue
        useful = train_flops(rows, shape)
        results.append(bench.summarise(setting, backend, group, rows, timing, conversations, useful, peak))
        results[-1]["useful_flops_full_depth"] = train_flops(rows, full)  # not run: per-layer scaled
        results[-1]["interleaved"] = interleave
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
