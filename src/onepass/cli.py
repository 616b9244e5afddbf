"""``onepass``: one command-line entry point, ``main(argv) -> int``.

Subcommands::

    onepass prepare --data FILE --tokenizer SPEC --out DIR [--schedule ...] [--max-tokens N] [--pack]
    onepass verify  --data FILE --tokenizer SPEC [--model PATH | --tiny ARCH] [--dtype float64]
    onepass show    --data FILE --tokenizer SPEC --index I --out mask.png
    onepass train   --config FILE.yaml [--model ID|PATH | --tiny ARCH] [--data ...] [--resume] [flags]
    onepass data convert-mathchat|sample|augment|stats ...   (see onepass.data.cli)
    onepass bench --quick --out DIR                                  (see onepass.bench.cli)

``--data builtin:mathchat`` is the bundled MathChat sample; ``--tokenizer
builtin:qwen3`` is the real Qwen3 vocabulary and template, offline. Errors a
user can cause print one line (``onepass: error: ...``) and exit 2; set
``ONEPASS_DEBUG=1`` to see the traceback instead.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from onepass.render import COMPLETION_FORMATS, RenderConfig
from onepass.schedule import WEIGHTINGS, parse_schedule

DTYPES = ("float64", "float32", "bfloat16")
EXTENSIONS = ("onepass.train.cli", "onepass.data.cli", "onepass.bench.cli")


class UsageError(ValueError):
    """A bad command-line value."""


def _schedule(value: str) -> str:
    try:
        parse_schedule(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return value


def _template_kwargs(pairs: Sequence[str]) -> dict[str, Any]:
    """``KEY=VALUE`` pairs; VALUE is parsed as JSON when it can be (true, 3, "x")."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise UsageError(f"--template-kwarg expects KEY=VALUE, got {pair!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def resolve_data(spec: str) -> Path:
    if spec == "builtin:mathchat":
        from onepass.data.mathchat import sample_path

        return sample_path()
    path = Path(spec)
    if not path.exists():
        raise FileNotFoundError(f"data file not found: {spec}")
    return path


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", required=True, help="conversations (.jsonl/.json/.parquet) or builtin:mathchat")
    p.add_argument("--tokenizer", default="builtin:qwen3",
                   help="builtin:qwen3 (offline), a local tokenizer directory or a hub id")
    p.add_argument("--chat-template", help="a .jinja file or builtin:NAME replacing the tokenizer's template")
    p.add_argument("--completion-format",
                   help="build completions from a format instead of the template: "
                        + ", ".join(COMPLETION_FORMATS) + " or a format string")
    p.add_argument("--template-kwarg", action="append", default=[], metavar="KEY=VALUE",
                   help="extra chat template variable, e.g. enable_thinking=true (repeatable)")
    p.add_argument("--limit", type=int, help="use only the first N valid conversations")
    p.add_argument("--strict", action="store_true", help="stop at the first bad record instead of skipping it")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="onepass", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("prepare", help="conversations -> one-pass rows (Arrow) + stats.json")
    _add_common(p)
    p.add_argument("--schedule", type=_schedule, default="one-pass", help="one-pass | n-pass | k-pass:K | budget")
    p.add_argument("--max-tokens", type=int, help="row / tree token budget")
    p.add_argument("--pack", action="store_true", help="pack trees into rows of <= --max-tokens")
    p.add_argument("--weighting", choices=WEIGHTINGS, default="token")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--num-proc", type=int, default=1,
                   help="render and tokenise on N processes (datasets.map); same rows and stats")
    p.add_argument("--no-progress", action="store_true")

    p = sub.add_parser("verify", help="one-pass vs N-pass loss and gradients on the same conversations")
    _add_common(p)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="a local model directory or hub id")
    src.add_argument("--tiny", default="qwen3", help="random tiny model of this architecture (default qwen3)")
    p.add_argument("--dtype", choices=DTYPES, default="float64")
    p.add_argument("--schedule", type=_schedule, default="one-pass")
    p.add_argument("--weighting", choices=WEIGHTINGS, default="token")
    p.add_argument("--attn", default="sdpa", choices=("sdpa", "eager"), help="attention backend")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tolerance", type=float, default=None,
                   help="exit 1 when the relative loss or gradient difference exceeds this "
                        "(default 1e-9 for float64, 1e-4 for float32, 2e-2 for bfloat16)")
    p.set_defaults(limit=8)

    p = sub.add_parser("show", help="draw one conversation's tree mask as a PNG")
    _add_common(p)
    p.add_argument("--index", type=int, default=0, help="which valid conversation (0-based)")
    p.add_argument("--schedule", type=_schedule, default="one-pass")
    p.add_argument("--out", required=True, help="output .png")


    for module in EXTENSIONS:  # subcommands that live beside their code: add_parser(sub) sets func
        importlib.import_module(module).add_parser(sub)
    return parser


def _render_config(args: argparse.Namespace) -> RenderConfig:
    return RenderConfig(template_kwargs=_template_kwargs(args.template_kwarg),
                        completion_format=args.completion_format)


def _read(args: argparse.Namespace):
    from onepass.data.load import load_conversations

    report = load_conversations(args.data, strict=args.strict, limit=args.limit)
    for line in report.skipped[:5]:
        print(f"skipped: {line}", file=sys.stderr)
    if len(report.skipped) > 5:
        print(f"... and {len(report.skipped) - 5} more skipped records", file=sys.stderr)
    return report


def _tokenizer(args: argparse.Namespace):
    from onepass.tokenizer import load_tokenizer

    return load_tokenizer(args.tokenizer, chat_template=args.chat_template)


def cmd_prepare(args: argparse.Namespace) -> int:
    from onepass.prepare import PrepareConfig, PrepareStats, prepare, write_dataset

    config = PrepareConfig(schedule=args.schedule, max_tokens=args.max_tokens, pack=args.pack,
                           weighting=args.weighting, render=_render_config(args))
    if args.num_proc > 1:
        from onepass.data.parallel import prepare_parallel

        rows, stats = prepare_parallel(args.data, _tokenizer(args), config, num_proc=args.num_proc,
                                       limit=args.limit, strict=args.strict, progress=not args.no_progress)
    else:
        report = _read(args)
        tokenizer = _tokenizer(args)
        stats = PrepareStats()
        for line in report.skipped:
            stats.skip("invalid record", line)
        rows, stats = prepare(report.conversations, tokenizer, config, stats=stats, strict=args.strict,
                              progress=not args.no_progress, total=len(report.conversations))
    print(stats.summary())
    if not rows:
        first = stats.skipped[0] if stats.skipped else "the data has no conversations"
        print(f"onepass: error: nothing to write, every conversation was skipped; first: {first}",
              file=sys.stderr)
        return 1
    out = write_dataset(rows, stats, args.out)
    print(f"wrote {stats.rows} rows to {out} (stats in {out / 'stats.json'})")
    return 0


def _default_tolerance(dtype: str) -> float:
    return {"float64": 1e-9, "float32": 1e-4, "bfloat16": 2e-2}[dtype]


def cmd_verify(args: argparse.Namespace) -> int:
    import torch

    from onepass.render import render_views
    from onepass.verify import compact_vocab, run_verify

    report = _read(args)
    tokenizer = _tokenizer(args)
    config = _render_config(args)
    views = [render_views(c, tokenizer, config) for c in report.conversations]
    dtype = getattr(torch, args.dtype)
    if args.model:
        from transformers import AutoModelForCausalLM

        if not Path(args.model).exists() and os.environ.get("HF_HUB_OFFLINE") == "1":
            raise UsageError(f"model {args.model!r} is not a local path and the hub is offline")
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, attn_implementation=args.attn)
        model.eval()
        label = args.model
    else:
        from onepass.tiny import tiny_model

        views, vocab = compact_vocab(views)
        model = tiny_model(args.tiny, vocab, dtype=dtype, seed=args.seed, attn_implementation=args.attn)
        label = f"tiny {args.tiny} (random, vocabulary compacted to {vocab} ids)"
    if dtype == torch.float64:
        from onepass.precision import float64_norms

        patched, left = float64_norms(model)
        print(f"float64: {patched} RMSNorm modules run in float64 (transformers upcasts them to float32)"
              + (f"; left alone: {', '.join(left[:3])}" if left else ""))
    result = run_verify(views, model, schedule=args.schedule, weighting=args.weighting)
    tol = args.tolerance if args.tolerance is not None else _default_tolerance(args.dtype)
    ok = result.rel_loss_diff <= tol and result.max_rel_grad_diff <= tol
    print(f"model: {label}, {args.dtype}, attention {args.attn}")
    print(f"{result.num_conversations} conversations, {result.num_views} views: "
          f"N-pass {result.n_pass_tokens} tokens vs {result.schedule} {result.one_pass_tokens} tokens "
          f"in {result.num_trees} trees")
    print(f"loss N-pass {result.loss_n_pass:.12g}  {result.schedule} {result.loss_one_pass:.12g}  "
          f"rel diff {result.rel_loss_diff:.3g}  max rel grad diff {result.max_rel_grad_diff:.3g}  "
          f"-> {'EQUAL' if ok else 'DIFFERENT'} within {tol:g}")
    print(json.dumps({**result.to_dict(), "tolerance": tol, "equal": ok}))
    return 0 if ok else 1


def cmd_show(args: argparse.Namespace) -> int:
    from onepass.show import show

    args.limit = None if args.limit is None else max(args.limit, args.index + 1)
    report = _read(args)
    if not 0 <= args.index < len(report.conversations):
        raise UsageError(f"--index {args.index} is out of range: {len(report.conversations)} valid conversations")
    out = show(report.conversations[args.index], _tokenizer(args), args.out,
               config=_render_config(args), schedule=args.schedule)
    print(f"wrote {out}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handler = getattr(args, "func", None) or {"prepare": cmd_prepare, "verify": cmd_verify,
                                              "show": cmd_show}[args.command]

    try:
        return handler(args)
    except ValueError as e:  # our errors are ValueErrors (ConversationError, RenderError, ...)
        if os.environ.get("ONEPASS_DEBUG"):
            raise
        print(f"onepass: error: {e}", file=sys.stderr)
        return 2
    except FileNotFoundError as e:
        if os.environ.get("ONEPASS_DEBUG"):
            raise
        print(f"onepass: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
