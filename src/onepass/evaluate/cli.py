"""``onepass eval``: does the fine-tuned model reason better over several turns?

Why this module exists: it wires the pieces (data, tokenizer, an engine, the
turn-by-turn loop, the report) into one command, beside the code it drives.

    onepass eval --data builtin:mathchat --model runs/merged --out runs/eval
    onepass eval --data chats.jsonl --model runs/merged --history model --out runs/eval-model
    onepass eval --data chats.jsonl --backend vllm --model runs/merged --out runs/eval
    onepass eval --data chats.jsonl --backend openai --base-url http://127.0.0.1:8000/v1 \\
        --model served-name --tokenizer runs/merged --out runs/eval
    onepass eval --tiny qwen3 --data builtin:mathchat --limit 2 --max-new-tokens 4 --out /tmp/e   # smoke test

The parser and the checks of the flags import no torch; the run is :func:`onepass.evaluate.command.run`.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from onepass.model.dtypes import dtype_names
from onepass.data.sources import limit_arg
from onepass.errors import ConfigError, UsageError
from onepass.evaluate.answers import compile_answer_regex
from onepass.hub import hub_offline, offline_reason

BACKENDS = ("hf", "vllm", "openai")
_DESCRIPTION = ("Generate every assistant turn of held-out conversations turn by turn, exactly as at "
                "inference (the model's own chat template, earlier reasoning dropped by it), extract the "
                "final answers and report accuracy per turn and per conversation depth.")
_EPILOG = """\
History: 'reference' gives the model the dataset's earlier answers (each turn measured alone);
'model' gives it its own earlier answers (errors compound, as in use).
Answers: the last \\boxed{...}, else the last "the answer is X", else --answer-regex instead of both;
numbers compare exactly after removing $, %, commas and LaTeX wrappers ("1,000" = "1000.0").
Outputs in --out: summary.json, predictions.jsonl, accuracy.md, accuracy.png."""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``eval`` to ``onepass``'s subcommands."""
    p = subparsers.add_parser("eval", help="accuracy per turn of a (fine-tuned) model, generated turn by turn",
                              description=_DESCRIPTION, epilog=_EPILOG,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="held-out conversations: any --data spec (a file, a folder, "
                                                 "builtin:mathchat, a hub id when online)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="a local model directory or hub id (the served model name with "
                                     "--backend openai)")
    src.add_argument("--tiny", metavar="ARCH", help="a random tiny model of ARCH (qwen3, llama, ...): smoke tests")
    p.add_argument("--tokenizer", help="tokenizer spec (default: the model's; builtin:qwen3 with --tiny)")
    p.add_argument("--chat-template", help="a .jinja file or builtin:NAME replacing the tokenizer's template")
    p.add_argument("--template-kwarg", action="append", default=[], metavar="KEY=VALUE",
                   help="extra chat template variable, e.g. enable_thinking=true (repeatable)")
    p.add_argument("--history", choices=("reference", "model"), default="reference",
                   help="earlier assistant turns: the dataset's (default) or the model's own replies")
    p.add_argument("--backend", choices=BACKENDS, default="hf",
                   help="hf (transformers generate, CPU/CUDA), vllm (when installed) or openai (a server)")
    p.add_argument("--base-url", help="with --backend openai: the server, e.g. http://127.0.0.1:8000/v1")
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions",
                   help="with --backend openai: /completions gets the rendered prompt (exact, default); "
                        "/chat/completions gets messages and the server's template")
    p.add_argument("--answer-regex", help="extract answers with this regex (group 1 if any) instead of "
                                          "\\boxed{} / 'the answer is'")
    p.add_argument("--limit", type=limit_arg, help="evaluate only the first N valid conversations")
    p.add_argument("--strict", action="store_true", help="stop at the first bad record instead of skipping it")
    p.add_argument("--max-new-tokens", type=int, default=2048, help="per turn (default 2048)")
    p.add_argument("--batch-size", type=int, default=8, help="prompts per generate call (hf) / requests in "
                                                             "flight (openai)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--dtype", default=None, choices=dtype_names(auto=True),
                   help="model weights: auto (default; float32 for --tiny), float32, bfloat16, float16")
    p.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda when available)")
    p.add_argument("--seed", type=int, default=0, help="tiny model initialisation and sampling seed")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func="onepass.evaluate.command:run")
    return p


def check_args(args: argparse.Namespace) -> None:
    """The flags' combinations, a bad ``--answer-regex`` and an offline hub id: one line before any work."""
    if args.backend == "openai":
        if not args.base_url:
            raise UsageError("--backend openai needs --base-url (e.g. http://127.0.0.1:8000/v1)")
        if args.tiny:
            raise UsageError("--backend openai evaluates a served model: pass its name with --model, not --tiny")
    elif args.base_url:
        raise UsageError(f"--base-url is only for --backend openai, not {args.backend}")
    if args.backend == "vllm" and args.tiny:
        raise UsageError("--backend vllm loads a model from disk: save the tiny model or use --backend hf")
    if args.max_new_tokens < 1 or args.batch_size < 1:
        raise UsageError("--max-new-tokens and --batch-size must be >= 1")
    compile_answer_regex(args.answer_regex)  # a bad one fails before any model is loaded
    if args.limit is not None and args.limit < 1:
        raise UsageError(f"--limit must be >= 1, got {args.limit}")
    if args.model and args.backend != "openai" and not Path(args.model).exists() and hub_offline():
        raise ConfigError(f"model {args.model!r} is not a local path and the hub is offline ({offline_reason()})")
