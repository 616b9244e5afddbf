"""``onepass export``: the flags of merging a LoRA adapter into its base model (:mod:`onepass.export`).

Why this module exists: the export loads models (torch); its ``--help`` must not, so the flags live
here, beside :mod:`onepass.export`, and name its runner (:func:`onepass.export.run`). No torch here.

    onepass export --adapter runs/qwen3-8b/final --out runs/qwen3-8b-merged [--base Qwen/Qwen3-8B]
"""

from __future__ import annotations

import argparse
from typing import Any

from onepass.dtypes import dtype_names

_DESCRIPTION = ("Merge a LoRA adapter into its base model (peft merge_and_unload) and save one plain model "
                "directory (safetensors, tokenizer, chat template) that transformers, vLLM, SGLang or "
                "onepass eval can load.")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``export`` to ``onepass``'s subcommands."""
    p = subparsers.add_parser("export", help="merge a LoRA adapter into its base model and save it (safetensors)",
                              description=_DESCRIPTION)
    p.add_argument("--adapter", required=True, help="the adapter directory (onepass train's OUTPUT_DIR/final)")
    p.add_argument("--base", help="the base model: local directory or hub id (default: the adapter's recorded base)")
    p.add_argument("--out", required=True, help="output directory for the merged model")
    p.add_argument("--tokenizer", help="tokenizer spec (default: the adapter's, else the base's)")
    p.add_argument("--chat-template", help="a .jinja file or builtin:NAME to save as the chat template")
    p.add_argument("--dtype", choices=dtype_names(auto=True), default="auto",
                   help="weights of the merged model (default: the base's)")
    p.add_argument("--push-to-hub", metavar="REPO_ID", help="also upload to this hub repo (online only)")
    p.add_argument("--public", action="store_true", help="with --push-to-hub: a public repo (default private)")
    p.add_argument("--overwrite", action="store_true", help="replace --out even when it holds files onepass did "
                                                            "not write (another model)")
    p.set_defaults(func="onepass.export:run")
    return p
