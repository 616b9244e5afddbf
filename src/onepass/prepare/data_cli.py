"""``onepass data ...``: the dataset commands, in one place.

Why this module exists: the dataset pipeline (convert, sample, augment,
stats, synthetic) has many options; keeping them here keeps ``onepass.cli``
short. ``onepass.cli`` imports this module: :func:`add_parser` adds ``data``
with its subcommands and :func:`run` as its handler; ``python -m
onepass.prepare.data_cli`` runs the same commands alone (:func:`main`). It sits in ``prepare/``, above the
datasets it runs, because ``data stats`` reads prepare's render flags (:mod:`onepass.prepare.config`).

    onepass data convert-mathchat --input follow_up.jsonl error_correction.jsonl --out mathchat.jsonl
    onepass data sample   --data chats.jsonl --out sampled.jsonl [--budget 8000 --minimum 200 --cap 6=30000]
    onepass data sample   --depth-table paper --cap 6=30000 --dry-run
    onepass data augment  --data sampled.jsonl --out reasoning.jsonl --base-url URL --model NAME
    onepass data stats    --data reasoning.jsonl --tokenizer builtin:qwen3 --out stats.json --plot depths.png
    onepass data synthetic --num 1000 --seed 0 --out synthetic.jsonl

Errors a user can cause raise :class:`onepass.errors.OnePassError` subclasses, which
``onepass.cli.main`` (and :func:`main`) print as one line and exit 2.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from onepass.data import sample as S
from onepass.data.augment import SYSTEM_PROMPT, augment, write_failure_report
from onepass.data.chat_client import ChatClient, ClientConfig
from onepass.data.sources import (DATA_HELP, iter_conversations, limit_arg, load_conversations, print_skipped,
                                          write_records)
from onepass.data.mathchat import convert_mathchat, write_jsonl
from onepass.data.refusal import refusal_check
from onepass.data.stats import compute_stats, depth_histogram, model_shape, plot_depths
from onepass.data.synthetic import iter_records
from onepass.errors import UsageError, run_main
from onepass.prepare.config import RENDER_KEYS, add_data_arguments, data_config_from_args
from onepass.render.single import trl_training_template
from onepass.render.tokenizer import load_tokenizer, read_template


def _data_args(p: argparse.ArgumentParser, *, required: bool = True) -> None:
    p.add_argument("--data", required=required, help=DATA_HELP)
    p.add_argument("--split", help="split of a dataset directory or hub id (default: the only one, or train)")
    p.add_argument("--strict", action="store_true", help="stop at the first bad record instead of skipping it")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``data`` to ``onepass``'s subcommands; ``func`` runs it."""
    p = subparsers.add_parser("data", help="dataset tools: convert-mathchat, sample, augment, stats, synthetic",
                              description=__doc__.split("\n\n")[0])
    add_parsers(p)
    p.set_defaults(func=run)
    return p


def add_parsers(data_parser: argparse.ArgumentParser) -> None:
    """Add the ``data`` subcommands to ``data_parser`` (the parser of ``onepass data``)."""
    sub = data_parser.add_subparsers(dest="data_command", required=True)

    c = sub.add_parser("convert-mathchat", help="MathChat benchmark jsonl -> reasoning conversations jsonl")
    c.add_argument("--input", nargs="+", required=True, help="follow_up.jsonl and/or error_correction.jsonl")
    c.add_argument("--out", required=True)
    c.add_argument("--limit", type=limit_arg, help="at most N conversations per input file")
    c.add_argument("--strict", action="store_true")

    s = sub.add_parser("sample", help="depth-balanced sample (the paper's cap + stratified allocation)")
    _data_args(s, required=False)
    s.add_argument("--depth-table", help="dry run on counts instead of data: 'paper' or '1:199,2:5339,...'")
    s.add_argument("--out", help="output .jsonl (records unchanged, input order)")
    s.add_argument("--budget", type=int, default=8000, help="conversations to draw (default 8000)")
    s.add_argument("--minimum", type=int, default=200, help="at least min(MINIMUM, available) per depth")
    s.add_argument("--cap", default="6=30000", help="DEPTH=MAX[,...] applied first, or 'none' (default 6=30000)")
    s.add_argument("--rule", choices=("paper", "exact"), default="paper",
                   help="paper: max(minimum, floor(proportional)), total may exceed the budget (the "
                        "authors' code, 8,797 on their table); exact: the total is the budget")
    s.add_argument("--cap-order", choices=("random", "first"), default="random",
                   help="which conversations a cap keeps: a seeded random sample, or the first in file order")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--dry-run", action="store_true", help="print the allocation table, write nothing")
    s.add_argument("--plot", help="PNG of the depth distribution before and after sampling")
    s.add_argument("--report", help="JSON file for the allocation and skipped records")

    a = sub.add_parser("augment", help="write reasoning for every assistant turn with an LLM endpoint")
    _data_args(a)
    a.add_argument("--out", required=True, help="output .jsonl (complete conversations, OpenAI messages)")
    a.add_argument("--cache", help="results as they arrive, for resuming (default OUT.cache.jsonl)")
    a.add_argument("--failures", help="per-turn failure report (default OUT.failures.json)")
    a.add_argument("--base-url", required=True, help="OpenAI-compatible API root, e.g. http://127.0.0.1:8000/v1")
    a.add_argument("--model", required=True)
    a.add_argument("--api-key-env", default="OPENAI_API_KEY", help="environment variable holding the key")
    a.add_argument("--temperature", type=float, default=0.1)
    a.add_argument("--max-tokens", type=int, help="cap on each reply's tokens")
    a.add_argument("--concurrency", type=int, default=8)
    a.add_argument("--timeout", type=float, default=120.0, help="seconds per request (each socket operation)")
    a.add_argument("--retries", type=int, default=5)
    a.add_argument("--backoff", type=float, default=1.0, help="first retry wait in seconds, doubled each time")
    a.add_argument("--max-backoff", type=float, default=60.0)
    a.add_argument("--no-json-mode", action="store_true", help="do not send response_format json_object")
    a.add_argument("--system-prompt", help="file replacing the built-in instruction (must ask for JSON "
                                           "{\"reasoning\": ...})")
    a.add_argument("--only-missing", action="store_true", help="keep reasoning already in the data")
    a.add_argument("--refusal-pattern", action="append", default=[], metavar="REGEX",
                   help="reasoning matching this (case-insensitive, re.search) is a refusal: a failed attempt, "
                        "retried, then reported; repeatable, added to the defaults (onepass.data.refusal)")
    a.add_argument("--refusal-patterns", metavar="FILE",
                   help="refusal patterns replacing the defaults: one regex a line, # comments")
    a.add_argument("--no-refusal-check", action="store_true", help="accept every reply that parses")
    a.add_argument("--limit", type=limit_arg, help="only the first N valid conversations")
    a.add_argument("--no-progress", action="store_true")

    t = sub.add_parser("stats", help="depths, segment lengths (P95 = l), N-pass vs one-pass, ideal speedup")
    _data_args(t)
    t.add_argument("--tokenizer", default="builtin:qwen3", help="or 'none' for depths only")
    t.add_argument("--chat-template", help="a .jinja file or builtin:NAME replacing the tokenizer's template")
    t.add_argument("--model-shape", "--model", dest="model_shape", default="qwen3-8b",
                   help="qwen3-0.6b|1.7b|4b|8b or a config.json path (FLOPs and the GPU tile cost model)")
    t.add_argument("--max-tokens", type=int, default=32768,
                   help="row budget of the shared-prefix figures: one-pass trees packed into rows of N, one tree "
                        "per conversation vs prefixes shared across conversations (default 32768)")
    t.add_argument("--no-share-prefix", action="store_true", help="leave the shared-prefix figures out")
    t.add_argument("--single-template", default="own", metavar="TEMPLATE",
                   help="the template of the single-rendering figures (what one rendering of each conversation, every "
                        "assistant turn a target, would train): own (default: the model's), trl (the training "
                        "template TRL's SFTTrainer swaps in with assistant_only_loss), or a .jinja file / builtin:NAME")
    add_data_arguments(t, names=RENDER_KEYS)  # --train-turns, --reasoning, --template-kwarg, ...
    t.add_argument("--before", help="data before sampling (depths only), for the --plot comparison")
    t.add_argument("--plot", help="PNG of the depth distribution (before vs after with --before)")
    t.add_argument("--out", help="write the statistics as JSON")
    t.add_argument("--limit", type=limit_arg)
    t.add_argument("--no-progress", action="store_true")

    g = sub.add_parser("synthetic", help="seeded MathChat-shaped conversations with exact token lengths")
    g.add_argument("--out", required=True)
    g.add_argument("--num", type=int, default=1000)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--workload", default="mathchat-sync",
                   help="mathchat-sync | mathchat-sync-long | mathchat-deep-long (6+ turns) | agent (harnesses "
                        "sharing a system prompt and tools)")


def cmd_convert(args: argparse.Namespace) -> int:
    records, skipped = convert_mathchat([Path(p) for p in args.input], strict=args.strict, limit=args.limit)
    print_skipped(skipped, "lines")
    if not records:  # an empty file would read as success to the next step of a pipeline
        first = skipped[0] if skipped else "the input has no records"
        print(f"onepass: error: nothing to write, every line was skipped; first: {first}", file=sys.stderr)
        return 1
    write_jsonl(records, args.out)
    print(f"wrote {len(records)} conversations to {args.out}; skipped {len(skipped)}")
    return 0


def cmd_sample(args: argparse.Namespace) -> int:
    caps = S.parse_caps(args.cap)
    if (args.data is None) == (args.depth_table is None):
        raise UsageError("give --data (to sample it) or --depth-table (a dry run on counts), not both")
    if args.depth_table is not None:
        if not args.dry_run:
            raise UsageError("--depth-table has no conversations to write: add --dry-run")
        report = S.SampleReport(allocation=S.allocate(S.parse_depth_table(args.depth_table), budget=args.budget,
                                                      minimum=args.minimum, caps=caps, rule=args.rule))
    else:
        if not args.dry_run and not args.out:
            raise UsageError("--out is required unless --dry-run")
        report = S.sample_dataset(args.data, None if args.dry_run else args.out, budget=args.budget,
                                  minimum=args.minimum, caps=caps, rule=args.rule, seed=args.seed,
                                  cap_order=args.cap_order, strict=args.strict, split=args.split)
        print_skipped(report.skipped)
    print(report.allocation.table())
    if args.plot:
        before = {r.depth: r.available for r in report.allocation.rows}
        print(f"wrote {plot_depths(report.allocation.counts(), args.plot, before=before)}")
    if args.report:
        Path(args.report).write_text(json.dumps(report.to_dict(), indent=1) + "\n", encoding="utf-8")
    if not args.dry_run:
        print(f"wrote {report.selected:,} of {report.num_records:,} records to {args.out} (seed {args.seed}); "
              f"skipped {len(report.skipped)} invalid")
    return 0


def cmd_augment(args: argparse.Namespace) -> int:
    refusal = refusal_check(extra=args.refusal_pattern, patterns_file=args.refusal_patterns,
                            off=args.no_refusal_check)
    config = ClientConfig(base_url=args.base_url, model=args.model, api_key_env=args.api_key_env,
                          temperature=args.temperature, max_tokens=args.max_tokens, timeout=args.timeout,
                          retries=args.retries, backoff=args.backoff, max_backoff=args.max_backoff,
                          json_mode=not args.no_json_mode)
    if config.api_key() is None:
        print(f"note: ${args.api_key_env} is not set; sending no API key", file=sys.stderr)
    if args.system_prompt and not Path(args.system_prompt).is_file():
        raise UsageError(f"--system-prompt file not found: {args.system_prompt}")
    prompt = Path(args.system_prompt).read_text(encoding="utf-8") if args.system_prompt else SYSTEM_PROMPT
    report = load_conversations(args.data, strict=args.strict, limit=args.limit, split=args.split)
    out = Path(args.out)
    cache = args.cache or str(out.with_name(out.name + ".cache.jsonl"))
    result = augment(report.conversations, ChatClient(config), cache, concurrency=args.concurrency,
                     system_prompt=prompt, only_missing=args.only_missing, progress=not args.no_progress,
                     refusal=refusal)
    result.skipped = report.skipped
    write_records(result.records, out)
    failures = write_failure_report(result, args.failures or out.with_name(out.name + ".failures.json"))
    print_skipped(report.skipped)
    print(result.summary())
    print(f"wrote {len(result.records)} conversations to {out}; cache {cache}"
          + (f"; FAILURES in {failures}" if failures else ""))
    return 1 if result.failures else 0


def cmd_stats(args: argparse.Namespace) -> int:
    try:
        shape = model_shape(args.model_shape)
    except ValueError as e:  # model_shape raises for the spec only: a user error
        raise UsageError(f"--model-shape: {e}") from None
    render = data_config_from_args(args, names=RENDER_KEYS).render  # a bad flag: one line, before any work
    report = load_conversations(args.data, strict=args.strict, limit=args.limit, split=args.split)
    tokenizer = single = None
    if args.tokenizer != "none":
        tokenizer = load_tokenizer(args.tokenizer, chat_template=args.chat_template)
        if args.single_template == "trl":
            single = trl_training_template(tokenizer)
        elif args.single_template != "own":
            single = read_template(args.single_template)
    if args.max_tokens < 2:
        raise UsageError(f"--max-tokens must be >= 2, got {args.max_tokens}")
    stats = compute_stats(report.conversations, tokenizer, shape=shape, render=render,
                          progress=not args.no_progress, total=len(report.conversations),
                          max_tokens=None if args.no_share_prefix else args.max_tokens, single_template=single)
    stats.skipped = report.skipped + stats.skipped
    print_skipped(stats.skipped, "records or conversations")
    print(stats.summary())
    out: dict[str, Any] = stats.to_dict()
    before = None
    if args.before:
        skipped: list[str] = []
        before = depth_histogram(iter_conversations(args.before, strict=False, split=args.split, skipped=skipped))
        out["depths_before"] = {str(k): v for k, v in before.items()}
        out["skipped_before"] = len(skipped)
    if args.plot:
        print(f"wrote {plot_depths(stats.depths, args.plot, before=before)}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {args.out}")
    return 0


def cmd_synthetic(args: argparse.Namespace) -> int:
    if args.num < 0:
        raise UsageError(f"--num must be >= 0, got {args.num}")
    n = write_records(itertools.islice(iter_records(args.workload, args.seed), args.num), args.out)
    print(f"wrote {n} synthetic conversations ({args.workload}, seed {args.seed}) to {args.out}")
    return 0


COMMANDS = {"convert-mathchat": cmd_convert, "sample": cmd_sample, "augment": cmd_augment,
            "stats": cmd_stats, "synthetic": cmd_synthetic}


def run(args: argparse.Namespace) -> int:
    """Run the parsed ``onepass data ...`` command; its exit status."""
    return COMMANDS[args.data_command](args)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m onepass.prepare.data_cli SUBCOMMAND ...``: the ``onepass data`` commands alone."""
    parser = argparse.ArgumentParser(prog="onepass data", description=__doc__.split("\n\n")[0])
    add_parsers(parser)
    return run_main(run, parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
