"""``onepass verify``: the flags of the equivalence check, on conversations or on RL rollouts.

Why this module exists: ``verify`` runs models (torch), but its ``--help`` must not load torch, so
its parser lives here, beside :mod:`onepass.verify.check`, and names the runner: :func:`onepass.verify.check.run`
for ``--data`` (conversations), :func:`onepass.rl.cli.verify_rollouts` for ``--rollouts`` (token
ids; docs/rl.md). Both load the model the one way (:func:`onepass.verify.check.verify_model`).

    onepass verify --data chats.jsonl --tokenizer builtin:qwen3 --tiny qwen3 --dtype float64
    onepass verify --data chats.jsonl --tokenizer Qwen/Qwen3-8B --model Qwen/Qwen3-8B --dtype bfloat16
    onepass verify --rollouts rollouts.jsonl --tiny qwen3
"""

from __future__ import annotations

import argparse
import math
from typing import Any

from onepass.prepare.config import RENDER_KEYS, add_data_arguments
from onepass.model.dtypes import dtype_names
from onepass.errors import UsageError
from onepass.lazy import resolve
from onepass.prepare.cli import add_input_arguments

VERIFY_KEYS = ("schedule", "weighting", *RENDER_KEYS)
VERIFY_ROW_KEYS = ("pack", "share_prefix")  # verify --data: packed rows of --max-tokens (one row when unset)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``verify`` to ``onepass``'s subcommands."""
    p = subparsers.add_parser("verify", help="one-pass vs N-pass loss and gradients on the same conversations")
    add_input_arguments(p, data_required=False, limit_help="check the first N valid conversations (or trajectories); "
                                                           "default 8 (each view is a forward of its own)")
    p.add_argument("--rollouts", help="RL rollouts (.jsonl, token ids; see docs/rl.md) instead of --data: "
                                      "per-token log-probs and policy-loss gradients vs per-turn forwards")
    p.add_argument("--max-tokens", type=int, help="row token budget: --rollouts (groups split and packed), "
                                                  "--pack (the conversations' trees packed; one row when unset)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="a local model directory or hub id")
    src.add_argument("--tiny", default="qwen3",
                     help="random tiny model of this architecture (default qwen3; see onepass.model.tiny.TINY_ARCHS)")
    p.add_argument("--dtype", choices=dtype_names(verified=True), default="float64")
    add_data_arguments(p, names=VERIFY_KEYS + VERIFY_ROW_KEYS)
    p.add_argument("--attn", default="auto",
                   choices=("auto", "onepass_cpu", "sdpa", "eager", "flex_attention", "onepass_varlen"),
                   help="attention backend (auto: one the model supports exactly on --device; flex_attention: "
                        "CUDA only; onepass_varlen: torch's flash varlen kernel on CUDA, its CPU reference on CPU)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda: where both sides run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tolerance", type=float, default=None,
                   help="exit 1 when the relative loss or gradient difference exceeds this "
                        "(default 1e-9 for float64, 1e-4 for float32, 2e-2 for bfloat16)")
    p.set_defaults(func=run)
    return p


VERIFY_LIMIT = 8
"""``verify`` checks the first 8 valid conversations unless ``--limit`` says otherwise: every view is a forward
of its own (float64 by default), so a whole corpus would take hours; it says so when the limit cut the data."""


def verify_limit(args: argparse.Namespace) -> bool:
    """Set ``args.limit`` (:data:`VERIFY_LIMIT` when not given) and say whether it was given; below 1 is an error
    (a check of nothing is no check)."""
    given = args.limit is not None
    if given and args.limit < 1:
        raise UsageError(f"--limit must be at least 1, got {args.limit}: verify checks the first N valid "
                         f"conversations ({VERIFY_LIMIT} unless --limit says otherwise)")
    args.limit = args.limit if given else VERIFY_LIMIT
    return given


def run(args: argparse.Namespace) -> int:
    """Conversations (``--data``) or rollouts (``--rollouts``): one of them, each to its runner."""
    if args.tolerance is not None and not (math.isfinite(args.tolerance) and 0 < args.tolerance < 1):
        raise UsageError(f"--tolerance must be a relative difference above 0 and below 1, got {args.tolerance:g}: "
                         "a tolerance of 1 or more (or inf) calls any difference EQUAL")
    if args.rollouts and args.data:
        raise UsageError("give --data (conversations) or --rollouts (RL token ids), not both")
    if not (args.rollouts or args.data):
        raise UsageError("verify needs --data FILE (conversations) or --rollouts FILE (RL rollouts)")
    return resolve("onepass.rl.cli:verify_rollouts" if args.rollouts else "onepass.verify.check:run")(args)
