"""``onepass eval``: does the fine-tuned model reason better over several turns?

Why this module exists: it wires the pieces (data, tokenizer, an engine, the
turn-by-turn loop, the report) into one command, beside the code it drives.

    onepass eval --data builtin:mathchat --model runs/merged --out runs/eval
    onepass eval --data chats.jsonl --model runs/merged --history model --out runs/eval-model
    onepass eval --data chats.jsonl --backend vllm --model runs/merged --out runs/eval
    onepass eval --data chats.jsonl --backend openai --base-url http://127.0.0.1:8000/v1 \\
        --model served-name --tokenizer runs/merged --out runs/eval
    onepass eval --tiny qwen3 --data builtin:mathchat --limit 2 --max-new-tokens 4 --out /tmp/e   # smoke test
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from onepass.data.load import limit_arg
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
    p.add_argument("--dtype", default=None, help="model weights: auto (default; float32 for --tiny), float32, "
                                                 "bfloat16, float16")
    p.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda when available)")
    p.add_argument("--seed", type=int, default=0, help="tiny model initialisation and sampling seed")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run)
    return p


def _check_args(args: argparse.Namespace) -> None:
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


def _generator(args: argparse.Namespace, tokenizer: Any) -> tuple[Any, str]:
    from onepass.evaluate import generate as gen

    progress = not args.no_progress
    if args.backend == "openai":
        from onepass.data.augment import Cache

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
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    sampling = dict(max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                    do_sample=args.temperature > 0, temperature=args.temperature or 1.0, seed=args.seed,
                    progress=progress)
    if args.tiny:
        from onepass.tiny import tiny_model

        dtype = getattr(torch, args.dtype or "float32")
        model = tiny_model(args.tiny, len(tokenizer), dtype=dtype, seed=args.seed, device=device)
        return gen.HFGenerator(model, tokenizer, **sampling), f"tiny {args.tiny} (random, seed {args.seed})"
    try:
        generator = gen.HFGenerator.from_pretrained(args.model, tokenizer, device=device,
                                                    dtype=args.dtype or "auto", **sampling)
    except (OSError, ValueError) as e:
        raise ConfigError(f"model {args.model!r} cannot be loaded: {str(e).splitlines()[0]}") from None
    return generator, args.model


def run(args: argparse.Namespace) -> int:
    """``onepass eval``: writes the report and prints the per-turn table."""
    from onepass.key_value import template_kwargs as _template_kwargs
    from onepass.data.load import load_conversations
    from onepass.evaluate.report import write_report
    from onepass.evaluate.run import evaluate, template_message_options, template_prompt
    from onepass.render.template import check_template_kwargs
    from onepass.tokenizer import load_tokenizer

    _check_args(args)
    kwargs = _template_kwargs(args.template_kwarg)
    check_template_kwargs(kwargs)  # apply_chat_template's own names: one line before any data is read
    report = load_conversations(args.data, strict=args.strict, limit=args.limit)
    for line in report.skipped[:5]:
        print(f"skipped: {line}", file=sys.stderr)
    if len(report.skipped) > 5:
        print(f"... and {len(report.skipped) - 5} more skipped records", file=sys.stderr)
    if not report.conversations:
        raise UsageError(f"no valid conversations in {args.data}")
    spec = args.tokenizer or ("builtin:qwen3" if args.tiny else args.model)
    tokenizer = load_tokenizer(spec, chat_template=args.chat_template)
    generator, label = _generator(args, tokenizer)
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
