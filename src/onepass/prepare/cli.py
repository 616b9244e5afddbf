"""``onepass prepare``: conversations -> one-pass rows (Arrow) + ``stats.json``, streamed to disk.

Why this module exists: the command's flags and its few steps of wiring (resolve ``--data`` once,
check the output folder and the template before any work, stream the rows, print the counts) live
beside the pipeline they drive (:mod:`onepass.prepare.pipeline`, :mod:`onepass.prepare.parallel`), not in the
command registry (:mod:`onepass.cli`). No torch here.

    onepass prepare --data chats.jsonl --tokenizer Qwen/Qwen3-8B --out prepared/ --max-tokens 16384 --pack
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from onepass.data.sources import DATA_HELP, conversation_source, limit_arg, print_skipped
from onepass.prepare.parallel import exit_on_sigterm, iter_prepared
from onepass.prepare.config import add_data_arguments, data_config_from_args
from onepass.errors import UsageError
from onepass.files import check_output_dir, output_lock
from onepass.prepare.pipeline import INVALID, PrepareStats, write_prepared
from onepass.render.tokenizer import load_tokenizer

def add_input_arguments(p: argparse.ArgumentParser, *, data_required: bool = True,
                        limit_help: str = "use only the first N valid conversations") -> None:
    """``--data``, ``--tokenizer``, ``--chat-template``, ``--limit``, ``--strict``: how prepare, verify
    and show read conversations."""
    p.add_argument("--data", required=data_required, help=DATA_HELP)
    p.add_argument("--tokenizer", default="builtin:qwen3",
                   help="builtin:qwen3 (offline), a local tokenizer directory or a hub id")
    p.add_argument("--chat-template", help="a .jinja file or builtin:NAME replacing the tokenizer's template")
    p.add_argument("--limit", type=limit_arg, help=limit_help)
    p.add_argument("--strict", action="store_true", help="stop at the first bad record instead of skipping it")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``prepare`` to ``onepass``'s subcommands."""
    p = subparsers.add_parser("prepare", help="conversations -> one-pass rows (Arrow) + stats.json")
    add_input_arguments(p)
    add_data_arguments(p)  # every DataConfig field: --schedule, --max-tokens, --pack, --weighting, ...
    p.add_argument("--out", required=True, help="output directory (new, empty, or an earlier prepare output)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace --out even when it holds files that are not an earlier onepass output")
    p.add_argument("--num-proc", type=int, default=1,
                   help="render and tokenise on N processes (forked workers); same rows and stats")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """``onepass prepare``. SIGTERM unwinds (temporaries removed, an earlier output kept whole); one
    prepare per ``--out`` at a time."""
    with exit_on_sigterm(), output_lock(args.out, command="prepare"):
        return _prepare(args)


def _prepare(args: argparse.Namespace) -> int:
    config = data_config_from_args(args)  # the schedule was parsed with the flags, not again
    if args.num_proc < 1:
        raise UsageError(f"--num-proc must be >= 1, got {args.num_proc}")
    source = conversation_source(args.data)  # once, one line before any work: missing, unrecognised, or rows
    check_output_dir(args.out, overwrite=args.overwrite)  # a file, unrelated files, or not writable: before the work
    tokenizer = load_tokenizer(args.tokenizer, chat_template=args.chat_template)  # compiles: before data is read
    stats = PrepareStats()
    trees = iter_prepared(source, tokenizer, config, stats, num_proc=args.num_proc, limit=args.limit,
                          strict=args.strict, progress=not args.no_progress, units=True)
    out = write_prepared(trees, stats, config, args.out)  # streams: rows are written as they are made
    print_skipped(stats.skipped[:stats.skipped_by_reason.get(INVALID, 0)])  # invalid records: listed first
    print(stats.summary())
    if out is None:
        print(f"onepass: error: nothing to write: {stats.none_trained()}", file=sys.stderr)
        return 1
    print(f"wrote {stats.rows} rows to {out} (stats in {out / 'stats.json'})")
    return 0
