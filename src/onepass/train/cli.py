"""``onepass train``: a YAML config plus flag overrides -> :func:`onepass.train.train`.

Why this module exists: the training command has many options; keeping its
parser here keeps ``cli.py`` small. Every flag overrides the config key of
the same name (dashes for underscores), so the YAML and the command line say
the same things:

    onepass train --config configs/qwen3-8b-qlora.yaml --data chats.jsonl --max-steps 100
    onepass train --tiny qwen3 --data builtin:mathchat --max-steps 50 --lr 1e-3 --output-dir runs/t
    onepass train --config configs/qwen3-8b-qlora.yaml --resume          # latest checkpoint

Also runnable alone (``python -m onepass.train.cli ...``), which is what
``torchrun`` / ``accelerate launch`` start on every process.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from onepass.errors import run_main
from onepass.render import parse_key_value

_DESCRIPTION = "Fine-tune a HF causal LM on one-pass rows: a YAML config (--config) plus flag overrides."
_EPILOG = """\
Every flag overrides the config key of the same name (--max-steps -> max_steps).
The step covers batch_size * grad_accum * processes conversations (or prepared rows);
its loss is divided by the step's total target weight, so one-pass and n-pass take
the same steps. Outputs in --output-dir: metrics.json, loss.png, checkpoints/, final/
(save_pretrained: full model or LoRA adapter, with the tokenizer and chat template)."""


def _pairs(value: str) -> tuple[str, Any]:
    try:
        return parse_key_value(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _csv(value: str) -> list[str] | str:
    parts = [p.strip() for p in value.split(",") if p.strip()]
    return parts[0] if len(parts) == 1 else parts


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="a YAML file of config keys (see configs/); flags override it")
    p.add_argument("--resume", nargs="?", const=True, default=None, metavar="CHECKPOINT",
                   help="continue from the latest checkpoint in --output-dir, or from CHECKPOINT")

    g = p.add_argument_group("model")
    src = g.add_mutually_exclusive_group()
    src.add_argument("--model", help="a hub id or a local directory of a HF causal LM")
    src.add_argument("--tiny", metavar="ARCH", help="a random tiny model of ARCH (qwen3, llama, ...): tests, demos")
    g.add_argument("--tokenizer", help="tokenizer spec (default: the model's; builtin:qwen3 with --tiny)")
    g.add_argument("--chat-template", help="a .jinja file or builtin:NAME replacing the tokenizer's template")
    g.add_argument("--completion-format", help="deepseek-r1, think-tags or a format string (see prepare)")
    g.add_argument("--template-kwarg", dest="template_kwargs", action="append", type=_pairs, metavar="KEY=VALUE",
                   help="extra chat template variable (repeatable)")

    g = p.add_argument_group("data")
    g.add_argument("--data", help="conversations (.jsonl/.json/.parquet, a folder of them, a saved dataset, "
                                  "builtin:mathchat, synthetic:NAME, a hub id) or rows written by onepass prepare")
    g.add_argument("--eval-data", help="held-out data in the same forms; eval loss at the end (and --eval-steps)")
    g.add_argument("--limit", type=int, help="use only the first N conversations (rows for a prepared dir)")
    g.add_argument("--schedule", help="one-pass (default) | n-pass | k-pass:K | budget")
    g.add_argument("--max-tokens", type=int, help="tree / row token budget")
    g.add_argument("--pack", action=argparse.BooleanOptionalAction, default=None,
                   help="pack each micro-batch's trees into rows of <= --max-tokens")
    g.add_argument("--weighting", help="token (default) | turn | conversation")
    g.add_argument("--max-batch-tokens", type=int,
                   help="split a micro-batch into forward passes of <= N padded tokens (same loss)")
    g.add_argument("--allow-inexact", action="store_true", default=None,
                   help="train even when the exactness guard finds that one-pass is not the N-pass loss "
                        "for this model (the guard's result is recorded in metrics.json)")

    g = p.add_argument_group("fine-tuning")
    g.add_argument("--finetune", help="full (default) | lora | qlora (4-bit NF4, CUDA only)")
    g.add_argument("--lora-r", type=int)
    g.add_argument("--lora-alpha", type=float)
    g.add_argument("--lora-dropout", type=float)
    g.add_argument("--lora-target-modules", type=_csv, help="all-linear (default) or a comma list: q_proj,v_proj")

    g = p.add_argument_group("optimisation")
    g.add_argument("--optimizer", help="adamw (default) | sgd | adamw_8bit | paged_adamw_8bit")
    g.add_argument("--lr", type=float)
    g.add_argument("--weight-decay", type=float)
    g.add_argument("--lr-scheduler", help="linear (default) | cosine | constant")
    g.add_argument("--warmup-ratio", type=float)
    g.add_argument("--warmup-steps", type=int)
    g.add_argument("--epochs", type=float)
    g.add_argument("--max-steps", type=int, help="optimizer steps (overrides --epochs)")
    g.add_argument("--batch-size", type=int, help="conversations per micro-batch per process")
    g.add_argument("--grad-accum", type=int, help="micro-batches per optimizer step")
    g.add_argument("--max-grad-norm", type=float)

    g = p.add_argument_group("numerics and hardware")
    g.add_argument("--dtype", help="weights: float32 (default) | bfloat16 | float64")
    g.add_argument("--mixed-precision", help="no (default) | bf16 (autocast)")
    g.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=None)
    g.add_argument("--attention", "--backend", dest="attention",
                   help="auto (flex_attention on CUDA, else sdpa) | sdpa | eager | flex_attention")
    g.add_argument("--device", help="auto (default) | cpu | cuda | cuda:N")

    g = p.add_argument_group("outputs")
    g.add_argument("--output-dir", "--out", dest="output_dir")
    g.add_argument("--seed", type=int)
    g.add_argument("--logging-steps", type=int)
    g.add_argument("--save-steps", type=int, help="checkpoint every N steps (and at the end)")
    g.add_argument("--save-total-limit", type=int)
    g.add_argument("--eval-steps", type=int)
    g.add_argument("--report-to", type=_csv, help="tensorboard, or none")
    g.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None)
    g.add_argument("--save-model", action=argparse.BooleanOptionalAction, default=None,
                   help="save_pretrained into OUTPUT_DIR/final at the end (default on)")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``train`` to ``onepass``'s subcommands."""
    p = subparsers.add_parser("train", help="fine-tune a model on one-pass rows (YAML config + flags)",
                              description=_DESCRIPTION, epilog=_EPILOG,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=run)
    return p


_NOT_CONFIG = ("config", "resume", "command", "func")


def overrides_from_args(args: argparse.Namespace) -> dict[str, Any]:
    values = {k: v for k, v in vars(args).items() if k not in _NOT_CONFIG and v is not None}
    if "template_kwargs" in values:
        values["template_kwargs"] = dict(values["template_kwargs"])
    return values


def run(args: argparse.Namespace) -> int:
    """``onepass train``: returns 0 when the run finished. Bad settings raise a OnePassError (one line)."""
    from onepass.train.loop import train
    from onepass.train.config import load_config

    config = load_config(args.config, overrides_from_args(args))
    train(config, resume=args.resume)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m onepass.train.cli``: the same command without the other subcommands."""
    import os

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    parser = argparse.ArgumentParser(prog="onepass train", description=_DESCRIPTION,
                                     epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run_main(run, parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
