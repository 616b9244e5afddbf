"""``make demo``: the main job on the embedded default, offline, in about a minute.

Why this module exists: a new user should see the whole claim on their own
machine before reading any code: the bundled real MathChat conversations are
rendered with the real Qwen3 template and vocabulary, laid out one-pass
(fewer tokens than N-pass), verified against plain per-view HF forward passes
in float64 (same loss, same gradients), and one tree's mask is drawn.

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


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    parser = argparse.ArgumentParser(prog="python -m onepass.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/demo")
    parser.add_argument("--verify-conversations", type=int, default=16)
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    from .cli import main as cli

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
    print("training on these rows is `onepass train` (coming with the training issue)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
