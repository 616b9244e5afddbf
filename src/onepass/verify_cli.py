"""``onepass verify``: the flags of the equivalence check, on conversations or on RL rollouts.

Why this module exists: ``verify`` runs models (torch), but its ``--help`` must not load torch, so
its parser lives here, beside :mod:`onepass.verify`, and names the runner: :func:`onepass.verify.run`
for ``--data`` (conversations), :func:`onepass.rl.cli.verify_rollouts` for ``--rollouts`` (token
ids; docs/rl.md). Both load the model the one way (:func:`onepass.verify.verify_model`).

    onepass verify --data chats.jsonl --tokenizer builtin:qwen3 --tiny qwen3 --dtype float64
    onepass verify --data chats.jsonl --tokenizer Qwen/Qwen3-8B --model Qwen/Qwen3-8B --dtype bfloat16
    onepass verify --rollouts rollouts.jsonl --tiny qwen3
"""

from __future__ import annotations

import argparse
from typing import Any

from onepass.data_config import RENDER_KEYS, add_data_arguments
from onepass.dtypes import dtype_names
from onepass.errors import UsageError
from onepass.lazy import resolve
from onepass.prepare_cli import add_input_arguments

VERIFY_KEYS = ("schedule", "weighting", *RENDER_KEYS)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``verify`` to ``onepass``'s subcommands."""
    p = subparsers.add_parser("verify", help="one-pass vs N-pass loss and gradients on the same conversations")
    add_input_arguments(p, data_required=False)
    p.add_argument("--rollouts", help="RL rollouts (.jsonl, token ids; see docs/rl.md) instead of --data: "
                                      "per-token log-probs and policy-loss gradients vs per-turn forwards")
    p.add_argument("--max-tokens", type=int, help="--rollouts: row token budget (groups split and packed)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="a local model directory or hub id")
    src.add_argument("--tiny", default="qwen3",
                     help="random tiny model of this architecture (default qwen3; see onepass.tiny.TINY_ARCHS)")
    p.add_argument("--dtype", choices=dtype_names(verified=True), default="float64")
    add_data_arguments(p, names=VERIFY_KEYS)
    p.add_argument("--attn", default="auto", choices=("auto", "onepass_cpu", "sdpa", "eager", "flex_attention"),
                   help="attention backend (auto: one the model supports exactly on --device; flex_attention: "
                        "CUDA only)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda: where both sides run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tolerance", type=float, default=None,
                   help="exit 1 when the relative loss or gradient difference exceeds this "
                        "(default 1e-9 for float64, 1e-4 for float32, 2e-2 for bfloat16)")
    p.set_defaults(limit=8, func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Conversations (``--data``) or rollouts (``--rollouts``): one of them, each to its runner."""
    if args.rollouts and args.data:
        raise UsageError("give --data (conversations) or --rollouts (RL token ids), not both")
    if not (args.rollouts or args.data):
        raise UsageError("verify needs --data FILE (conversations) or --rollouts FILE (RL rollouts)")
    return resolve("onepass.rl.cli:verify_rollouts" if args.rollouts else "onepass.verify:run")(args)
