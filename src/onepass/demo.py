"""``make demo``: the main job on the embedded default, offline, in a few minutes on 2 CPU cores.

Why this module exists: a new user should see the whole claim on their own
machine before reading any code: the bundled real MathChat conversations are
rendered with the real Qwen3 template and vocabulary, laid out one-pass
(fewer tokens than N-pass), verified against plain per-view HF forward passes
in float64 (same loss, same gradients), one tree's mask is drawn, and a small
random-init Qwen3-architecture model is fine-tuned one-pass and N-pass on the
same conversations, interleaved in one process (blocks of steps, taking turns)
so both are timed under the same load: same loss curve, fewer tokens, and a
speed ratio checked against the FLOP/token bound (past it: disturbed timing).

    python -m onepass.demo --out runs/demo
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from onepass.bench.ratio import speed_ratio
from onepass.cli import main as cli
from onepass.errors import run_main
from onepass.layout.flops import speed_bound
from onepass.train.cli import setup_logging
from onepass.train.config import load_config
from onepass.train.run.loop import train_steps
from onepass.train.core.report import log as train_log, plot_losses


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    parser = argparse.ArgumentParser(prog="python -m onepass.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/demo")
    parser.add_argument("--verify-conversations", type=int, default=16)
    parser.add_argument("--train-steps", type=int, default=75,
                        help="optimizer steps of each training run, 8 conversations packed into rows of 4096 "
                             "tokens each (75: two epochs of the 300 bundled conversations); 0 skips training")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: torch's choice; 1 is faster when other processes "
                             "share the cores)")
    args = parser.parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def step(title: str, argv: list[str]) -> int:
        print(f"\n== {title}\n$ onepass {' '.join(argv)}", flush=True)
        t0 = time.perf_counter()
        code = cli(argv)
        print(f"({time.perf_counter() - t0:.1f} s)", flush=True)
        if code != 0:
            print(f"demo: step failed with exit code {code}", file=sys.stderr)
        return code

    data, tok = "builtin:mathchat", "builtin:qwen3"
    steps = [
        ("prepare: bundled MathChat sample -> one-pass trees (real Qwen3 template + vocabulary)",
         ["prepare", "--data", data, "--tokenizer", tok, "--out", str(out / "one-pass"), "--no-progress"]),
        ("prepare: the same, packed into rows of 4096 tokens",
         ["prepare", "--data", data, "--tokenizer", tok, "--out", str(out / "one-pass-packed"),
          "--max-tokens", "4096", "--pack", "--no-progress"]),
        ("verify: one-pass vs N-pass loss and gradients, tiny Qwen3 model, float64",
         ["verify", "--data", data, "--tokenizer", tok, "--tiny", "qwen3", "--dtype", "float64",
          "--limit", str(args.verify_conversations)]),
        ("show: the mask of the first conversation",
         ["show", "--data", data, "--tokenizer", tok, "--index", "0", "--out", str(out / "mask.png")]),
    ]
    for title, argv_ in steps:
        if step(title, argv_) != 0:
            return 1

    stats = json.loads((out / "one-pass" / "stats.json").read_text())
    print("\n== summary")
    print(f"{stats['conversations']} conversations, {stats['views']} assistant turns (views)")
    print(f"N-pass tokens {stats['n_pass_tokens']:,} -> one-pass tokens {stats['one_pass_tokens']:,} "
          f"({stats['token_ratio']:.2f}x fewer), same loss and gradients (see verify above)")
    print(f"outputs in {out}/: one-pass/ and one-pass-packed/ (Arrow + stats.json), mask.png")
    if args.train_steps > 0:
        return run_main(lambda steps: train_side_by_side(out, steps), args.train_steps)  # one line on an error
    return 0


DEMO_MODEL = {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 64}


BLOCK_STEPS = 5  # steps per timed block; the two runs alternate blocks


def train_side_by_side(out: Path, steps: int, *, block_steps: int = BLOCK_STEPS) -> int:
    """Fine-tune the same random tiny Qwen3 one-pass and N-pass on the same conversations, interleaved.

    Both runs live in this process and take turns, ``block_steps`` optimizer steps at a time
    (ABBA order: who goes first alternates), so load from anything else on the machine lands on
    both sides alike; the speed ratio of the paired blocks is checked against the FLOP/token
    bound (:func:`onepass.bench.ratio.speed_ratio`), and the loss-vs-time panel plots these times.
    """
    import torch
    import yaml

    out.mkdir(parents=True, exist_ok=True)
    config = out / "train-demo.yaml"
    config.write_text(yaml.safe_dump({
        "tiny": "qwen3", "tiny_config": DEMO_MODEL, "data": "builtin:mathchat", "per_device_train_batch_size": 8,
        "pack": True, "max_tokens": 4096, "max_batch_tokens": 4096, "max_steps": steps, "learning_rate": 3.0e-3,
        "lr_scheduler_type": "linear", "warmup_steps": 5, "seed": 0, "device": "cpu", "logging_steps": 10,
        "progress": False, "overwrite_output_dir": True}, sort_keys=False))
    # overwrite: these run folders are the demo's own; a second `make demo` starts them anew
    # max_batch_tokens = max_tokens: every packed row is a forward pass of its own, so neither schedule pads
    # its rows to a longer one's (N-pass, with more rows per step, would pay for padding one-pass never has)
    schedules = ("one-pass", "n-pass")
    print(f"\n== train: one-pass and N-pass interleaved in this process, {block_steps} steps at a time, the same "
          f"random-init Qwen3-architecture model ({DEMO_MODEL['hidden_size']} wide, "
          f"{DEMO_MODEL['num_hidden_layers']} layers, vocabulary compacted to the ids that occur), "
          f"{steps} steps x 8 conversations packed into rows of 4096 tokens; each run alone:", flush=True)
    setup_logging()
    runs = {}
    for schedule in schedules:
        run_dir = out / f"train-{schedule}"
        print(f"$ onepass train --config {config} --schedule {schedule} --output-dir {run_dir}", flush=True)
        runs[schedule] = train_steps(load_config(config, {"schedule": schedule, "output_dir": str(run_dir)}),
                                     log=lambda msg, name=schedule: train_log.info(f"[{name}] {msg}"))
    t0 = time.perf_counter()
    blocks: dict[str, list[float]] = {s: [] for s in schedules}  # seconds of each block's optimizer steps
    try:
        for block in range(-(-steps // block_steps)):
            for schedule in schedules if block % 2 == 0 else schedules[::-1]:  # ABBA: who goes first alternates
                seconds = 0.0
                for _ in range(min(block_steps, steps - block * block_steps)):
                    seconds += next(runs[schedule])["seconds"]
                blocks[schedule].append(seconds)
    except StopIteration:  # max_steps = steps: each run has exactly that many
        print("demo: a training ended before its last step", file=sys.stderr)
        return 1
    for run in runs.values():  # past the last step: the run writes its metrics and saves its model
        next(run, None)
    print(f"({time.perf_counter() - t0:.1f} s for both)", flush=True)
    metrics = {s: json.loads((out / f"train-{s}" / "metrics.json").read_text()) for s in schedules}
    one, n = metrics["one-pass"], metrics["n-pass"]
    curves = {name: m["history"] for name, m in metrics.items()}
    both = plot_losses([], [], out / "train-loss.png",
                       title="one-pass vs N-pass, same conversations per step (timed interleaved)",
                       curves=curves, by_time=True)
    diff = max(abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(one["history"], n["history"]))

    def total(m: dict, key: str) -> int:
        return sum(h[key] for h in m["history"])

    dense_backend = one["attention"] in ("sdpa", "eager")  # they compute every pair of a row
    # what a step's cost grows with; both pair counts (a dense and a block-skipping kernel): the bound is the larger
    work = {name: {key: total(m, key) for key in ("tokens", "padded_tokens", "dense_pairs", "visible_pairs",
                                                  "target_weight")} | {"steps": len(m["history"])}
            for name, m in metrics.items()}
    ratio = speed_ratio(blocks["n-pass"], blocks["one-pass"], bound=speed_bound(work["n-pass"], work["one-pass"]),
                        paired=True)
    print(f"\n== training report (same random init, same conversations in every step, "
          f"{torch.get_num_threads()} CPU thread(s), attention {one['attention']})")
    for name, m in metrics.items():
        h = m["history"]
        print(f"{name:9s} {len(h)} steps in {m['train_seconds']:5.1f} s: {m['train_tokens']:7,} tokens, "
              + (f"{total(m, 'dense_pairs') / 1e6:6.1f}M attention pairs computed "
                 f"({total(m, 'visible_pairs') / 1e6:.1f}M visible), " if dense_backend
                 else f"{total(m, 'visible_pairs') / 1e6:.1f}M attention pairs, ")
              + f"loss {h[0]['loss']:.3f} -> {h[-1]['loss']:.3f}")
    print(f"{n['train_tokens'] / one['train_tokens']:.2f}x fewer tokens through the linear layers, "
          f"{total(n, 'visible_pairs') / total(one, 'visible_pairs'):.2f}x fewer visible attention pairs"
          + (f"; dense {one['attention']} also computes the masked pairs "
             f"({total(one, 'dense_pairs') / total(n, 'dense_pairs'):.2f}x N-pass's here), which a block-skipping "
             "kernel (flex_attention on CUDA) does not" if dense_backend else "")
          + f"; so one-pass can be at most {ratio.bound:.2f}x faster here (the FLOP/token bound: the largest "
          "ratio of N-pass's work to one-pass's in tokens, padded tokens, attention pairs and targets)")
    print(ratio.describe())
    print(f"the bundled MathChat conversations have 2-3 turns, so one-pass can save at most the "
          f"{n['train_tokens'] / one['train_tokens']:.2f}x in tokens; deeper conversations save more "
          "(onepass data stats; onepass bench --workload synthetic --depth-groups; benchmarks/RESULTS.md)")
    print(f"losses agree at every step to {diff:.1e} (float32 rounding, compounded over the steps; "
          "in float64 they agree to 1e-9: tests/train/run/test_train.py)")
    print(f"loss curves: {both} (both; time axis: the interleaved blocks), {out / 'train-one-pass' / 'loss.png'}, "
          f"{out / 'train-n-pass' / 'loss.png'}")
    print(f"models: {out / 'train-one-pass' / 'final'}, {out / 'train-n-pass' / 'final'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
