"""Prepare throughput on one core against the tokenizer alone on the same text (issue 13, item 10).

Why this exists: the target is "prepare tokens/s per core >= tokenizer-alone tokens/s / 2". The
tokenizer alone is the fast tokenizer's batched encode of every view's text (prompt + completion:
what one view costs to tokenize, N-pass tokens), one thread. Prepare is the whole per-conversation
pipeline (render with the chat template, tokenize, merge the views into a tree, lay it out), serial,
without start-up. Both are reported per N-pass token (the text tokenized) and per one-pass token
(what prepare writes); the stages show where the time goes.

    .venv/bin/python benchmarks/prepare_speed.py --num 300            # synthetic:mathchat-sync
    .venv/bin/python benchmarks/prepare_speed.py --data chats.jsonl --num 1000
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one core: no rayon threads in encode_batch
os.environ.setdefault("RAYON_NUM_THREADS", "1")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", default="synthetic:mathchat-sync")
    parser.add_argument("--num", type=int, default=300, help="conversations")
    parser.add_argument("--tokenizer", default="builtin:qwen3")
    args = parser.parse_args(argv)

    import tokenizers
    import transformers

    from onepass.data.load import load_conversations
    from onepass.prepare import PrepareConfig, PrepareStats, prepare_conversation
    from onepass.render import render_texts
    from onepass.tokenizer import load_tokenizer

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

    stats = PrepareStats()
    t0 = time.process_time()
    for conv in convs:
        prepare_conversation(conv, tok, PrepareConfig(), stats)
    t_prep = time.process_time() - t0

    tok_rate = n_tokens / t_tok
    print(f"views {len(texts)}, view tokens {n_tokens:,} (N-pass {stats.n_pass_tokens:,}), "
          f"one-pass {stats.one_pass_tokens:,}")
    print(f"render (chat template) alone   {t_render:7.2f} s CPU")
    print(f"tokenizer alone                {t_tok:7.2f} s CPU  {tok_rate:10,.0f} tokens/s per core")
    print(f"prepare (render+encode+tree)   {t_prep:7.2f} s CPU  {stats.n_pass_tokens / t_prep:10,.0f} N-pass "
          f"tokens/s per core, {stats.one_pass_tokens / t_prep:,.0f} one-pass; "
          f"{len(convs) / t_prep:.0f} conversations/s")
    print(f"prepare / tokenizer alone: {stats.n_pass_tokens / t_prep / tok_rate:.2f} (target >= 0.5, N-pass tokens)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
