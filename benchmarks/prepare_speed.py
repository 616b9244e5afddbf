"""Prepare throughput on one core against the tokenizer alone on the same text (issue 13, item 10), and
against another source tree on the same data (issue 35: prepare on agent data no slower per conversation).

Why this exists: the target is "prepare tokens/s per core >= tokenizer-alone tokens/s / 2". The
tokenizer alone is the fast tokenizer's batched encode of every view's text (prompt + completion:
what one view costs to tokenize, N-pass tokens), one thread. Prepare is the whole per-conversation
pipeline (render with the chat template, tokenize, merge the views into a tree, lay it out), serial,
without start-up; with ``--pack`` also the packing of every tree into rows of ``--max-tokens`` (and,
where the code shares prefixes across conversations, the merging: onepass.layout.share), timed per
conversation. Both are reported per N-pass token (the text tokenized) and per one-pass token (what
prepare writes); the stages show where the time goes.

``--baseline-src DIR`` (a ``src`` folder of another onepass, e.g. ``git archive a125e18 src``) times
the same prepare of the same conversations in fresh processes, the baseline's and this tree's taking
turns (``--repeats`` each), and reports CPU seconds per conversation of both and their ratio: process
CPU time, so other load on the machine slows neither side's figure much.

    .venv/bin/python benchmarks/prepare_speed.py --num 300            # synthetic:mathchat-sync
    .venv/bin/python benchmarks/prepare_speed.py --data chats.jsonl --num 1000
    .venv/bin/python benchmarks/prepare_speed.py --data ../shared/data/agent/taubench_airline.jsonl --num 200 \\
        --pack --max-tokens 32768 --baseline-src /tmp/onepass-a125e18/src --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one core: no rayon threads in encode_batch
os.environ.setdefault("RAYON_NUM_THREADS", "1")


def time_prepare(data: str, num: int, tokenizer: str, *, pack: bool, max_tokens: int | None) -> dict:
    """CPU seconds of prepare over the conversations (after a warm-up on the first), with its counts."""
    from onepass.data.sources import load_conversations
    from onepass.prepare.pipeline import PrepareConfig, PrepareStats, finalize, prepare_conversation
    from onepass.render.tokenizer import load_tokenizer

    tok = load_tokenizer(tokenizer)
    convs = load_conversations(data, strict=False, limit=num).conversations
    config = PrepareConfig(max_tokens=max_tokens, pack=pack)
    prepare_conversation(convs[0], tok, config, PrepareStats())  # warm-up: template compiled, probes cached
    stats = PrepareStats()
    t0 = time.process_time()
    trees = [t for conv in convs for t in prepare_conversation(conv, tok, config, stats)]
    t_trees = time.process_time() - t0
    rows, stats = finalize(trees, stats, config)
    t_all = time.process_time() - t0
    return {"conversations": len(convs), "seconds": t_all, "seconds_trees": t_trees, "rows": len(rows),
            "n_pass_tokens": stats.n_pass_tokens, "one_pass_tokens": stats.one_pass_tokens,
            "row_tokens": stats.row_tokens}


def compare(args: argparse.Namespace) -> int:
    here = Path(__file__).resolve().parents[1] / "src"
    sides = {"baseline": Path(args.baseline_src).resolve(), "this": here}
    runs: dict[str, list[dict]] = {k: [] for k in sides}
    for r in range(args.repeats):
        for name in (sides if r % 2 == 0 else list(sides)[::-1]):  # who goes first alternates
            env = dict(os.environ, PYTHONPATH=str(sides[name]))
            cmd = [sys.executable, __file__, "--json", "--data", args.data, "--num", str(args.num),
                   "--tokenizer", args.tokenizer] + (["--pack", "--max-tokens", str(args.max_tokens)] if args.pack else [])
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
            runs[name].append(json.loads(out.strip().splitlines()[-1]))
    per = {k: [x["seconds"] / x["conversations"] for x in v] for k, v in runs.items()}
    first = runs["this"][0]
    print(f"{args.data}: {first['conversations']} conversations, N-pass {first['n_pass_tokens']:,} tokens, "
          f"one-pass {first['one_pass_tokens']:,}, rows {first['rows']} of {first['row_tokens']:,} tokens "
          f"(baseline rows {runs['baseline'][0]['rows']} of {runs['baseline'][0]['row_tokens']:,})")
    for name, values in per.items():
        print(f"{name:>8} ({sides[name]}): {statistics.median(values) * 1e3:7.2f} ms CPU per conversation "
              f"(median of {len(values)}; best {min(values) * 1e3:.2f}, runs " +
              ", ".join(f"{v * 1e3:.2f}" for v in values) + ")")
    ratio = statistics.median(per["baseline"]) / statistics.median(per["this"])
    best = min(per["baseline"]) / min(per["this"])
    print(f"this tree is {ratio:.2f}x the baseline's speed per conversation (median; fastest runs {best:.2f}x)")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"data": args.data, "num": args.num, "pack": args.pack,
                                              "max_tokens": args.max_tokens, "runs": runs,
                                              "ms_per_conversation": {k: [v * 1e3 for v in vs] for k, vs in per.items()},
                                              "speed_ratio_median": ratio, "speed_ratio_fastest": best,
                                              "platform": platform.platform(), "python": sys.version.split()[0]},
                                             indent=1) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", default="synthetic:mathchat-sync")
    parser.add_argument("--num", type=int, default=300, help="conversations")
    parser.add_argument("--tokenizer", default="builtin:qwen3")
    parser.add_argument("--pack", action="store_true", help="pack the trees into rows of --max-tokens, timed too")
    parser.add_argument("--max-tokens", type=int, default=None)
    parser.add_argument("--baseline-src", help="another onepass src folder: time both, side by side")
    parser.add_argument("--repeats", type=int, default=3, help="with --baseline-src: runs per side")
    parser.add_argument("--out", help="with --baseline-src: write the runs as JSON")
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # one side's run, for compare
    args = parser.parse_args(argv)
    if args.pack and args.max_tokens is None:
        parser.error("--pack needs --max-tokens")
    if args.json:
        print(json.dumps(time_prepare(args.data, args.num, args.tokenizer, pack=args.pack, max_tokens=args.max_tokens)))
        return 0
    if args.baseline_src:
        return compare(args)

    import tokenizers
    import transformers

    from onepass.data.sources import load_conversations
    from onepass.render import render_texts
    from onepass.render.tokenizer import load_tokenizer

    tok = load_tokenizer(args.tokenizer)
    convs = load_conversations(args.data, strict=False, limit=args.num).conversations
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores (load {os.getloadavg()[0]:.1f}); "
          f"python {sys.version.split()[0]}, transformers {transformers.__version__}, "
          f"tokenizers {tokenizers.__version__}; {args.data}, {len(convs)} conversations, {args.tokenizer}")

    t0 = time.process_time()
    texts = [p + c for conv in convs for _, p, c in render_texts(conv, tok)]
    t_render = time.process_time() - t0

    t0 = time.process_time()
    n_tokens = sum(len(e.ids) for e in tok.backend_tokenizer.encode_batch(texts, add_special_tokens=False))
    t_tok = time.process_time() - t0

    result = time_prepare(args.data, args.num, args.tokenizer, pack=args.pack, max_tokens=args.max_tokens)
    t_prep = result["seconds"]
    tok_rate = n_tokens / t_tok
    print(f"views {len(texts)}, view tokens {n_tokens:,} (N-pass {result['n_pass_tokens']:,}), "
          f"one-pass {result['one_pass_tokens']:,}" + (f", rows {result['rows']} of {result['row_tokens']:,} tokens"
                                                         if args.pack else ""))
    print(f"render (chat template) alone   {t_render:7.2f} s CPU")
    print(f"tokenizer alone                {t_tok:7.2f} s CPU  {tok_rate:10,.0f} tokens/s per core")
    print(f"prepare (render+encode+tree{'+pack' if args.pack else ''}) {t_prep:7.2f} s CPU  "
          f"{result['n_pass_tokens'] / t_prep:10,.0f} N-pass tokens/s per core, "
          f"{result['one_pass_tokens'] / t_prep:,.0f} one-pass; {len(convs) / t_prep:.0f} conversations/s")
    print(f"prepare / tokenizer alone: {result['n_pass_tokens'] / t_prep / tok_rate:.2f} (target >= 0.5, N-pass tokens)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
