"""``onepass eval``'s run: conversations, tokenizer, the engine, the turn-by-turn loop, the report.

Why this module exists: the run loads a model (torch) and its flags must not (``onepass eval --help``),
so the flags and their checks are :mod:`onepass.evaluate.cli`'s and the run is here; the model is
loaded by the one loader (:func:`onepass.model.load.load_causal_lm`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

from onepass.data.augment import Cache
from onepass.data.sources import load_conversations, print_skipped
from onepass.errors import UsageError
from onepass.evaluate import generate as gen
from onepass.evaluate.cli import check_args
from onepass.evaluate.report import write_report
from onepass.evaluate.run import evaluate, template_message_options, template_prompt
from onepass.key_value import template_kwargs
from onepass.model.load import ModelSpec, load_causal_lm
from onepass.render.template import check_template_kwargs
from onepass.render.tokenizer import load_tokenizer


def make_generator(args: argparse.Namespace, tokenizer: Any) -> tuple[Any, str]:
    """The engine ``--backend`` names, and how the report calls the model."""
    progress = not args.no_progress
    if args.backend == "openai":
        cls = gen.OpenAIGenerator if args.endpoint == "completions" else gen.OpenAIChatGenerator
        cache = Cache(Path(args.out) / "answers.jsonl", value="reply")  # paid replies survive an interrupted run
        if cache.results:
            print(f"{len(cache.results)} replies cached in {cache.path} by an earlier run: not requested again",
                  file=sys.stderr)
        return (cls(args.base_url, args.model, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                    concurrency=args.batch_size, cache=cache), f"{args.model} at {args.base_url} (/{args.endpoint})")
    if args.backend == "vllm":
        return (gen.VLLMGenerator(args.model, tokenizer, max_new_tokens=args.max_new_tokens,
                                  temperature=args.temperature, seed=args.seed, dtype=args.dtype or "auto",
                                  progress=progress), f"{args.model} (vLLM)")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    sampling = dict(max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                    do_sample=args.temperature > 0, temperature=args.temperature or 1.0, seed=args.seed,
                    progress=progress)
    if args.tiny:
        spec = ModelSpec(tiny=args.tiny, vocab_size=len(tokenizer), dtype=args.dtype or "float32", seed=args.seed,
                         device=device)
    else:  # sdpa: generation runs plain sequences (no tree), with a cache
        spec = ModelSpec(model=args.model, dtype=args.dtype or "auto", device=device, attention="sdpa")
    label = f"tiny {args.tiny} (random, seed {args.seed})" if args.tiny else args.model
    return gen.HFGenerator(load_causal_lm(spec), tokenizer, **sampling), label


def run(args: argparse.Namespace) -> int:
    """``onepass eval``: writes the report and prints the per-turn table."""
    check_args(args)
    kwargs = template_kwargs(args.template_kwarg)
    check_template_kwargs(kwargs)  # apply_chat_template's own names: one line before any data is read
    report = load_conversations(args.data, strict=args.strict, limit=args.limit)
    print_skipped(report.skipped)
    if not report.conversations:
        raise UsageError(f"no valid conversations in {args.data}")
    spec = args.tokenizer or ("builtin:qwen3" if args.tiny else args.model)
    tokenizer = load_tokenizer(spec, chat_template=args.chat_template)
    generator, label = make_generator(args, tokenizer)
    results = evaluate(report.conversations, generator, template_prompt(tokenizer, kwargs), history=args.history,
                       answer_regex=args.answer_regex, progress=not args.no_progress,
                       message_options=template_message_options(tokenizer, kwargs))
    settings = {"model": label, "data": args.data, "tokenizer": spec, "history": args.history,
                "backend": args.backend, "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
                "answer_regex": args.answer_regex, "template_kwargs": kwargs or None,
                "skipped_records": len(report.skipped)}
    paths = write_report(results, args.out, settings)
    print(paths["table"].read_text(), end="")
    print(f"wrote {', '.join(str(p) for p in paths.values())}")
    return 0
