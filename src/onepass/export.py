"""``onepass export``: a LoRA adapter merged into its base model, ready to serve.

Why this module exists: ``onepass train --finetune lora|qlora`` saves an
adapter (a few MB); vLLM, SGLang, llama.cpp converters and ``onepass eval
--backend vllm`` want one plain model directory. This merges the adapter into
the base weights (peft's ``merge_and_unload``: W + B A * alpha/r, once), saves
the result as safetensors with the tokenizer and its chat template beside it,
and optionally uploads it to the hub (only when online).

    onepass export --base Qwen/Qwen3-8B --adapter runs/qwen3-8b/final --out runs/qwen3-8b-merged
    onepass export --adapter runs/qwen3-8b/final --out merged --push-to-hub me/qwen3-8b-mathchat

The merged model computes what base + adapter computes (the test checks the
logits in float64 to 1e-10). A QLoRA adapter is merged into the base loaded in
``--dtype`` (bfloat16 is what most serve), not into 4-bit weights.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from onepass.errors import ConfigError, DataNotFound, UsageError
from onepass.files import atomic_dir, check_output_dir, write_marker
from onepass.hub import hub_offline, offline_reason

DTYPES = ("auto", "float32", "bfloat16", "float16", "float64")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


_DESCRIPTION = ("Merge a LoRA adapter into its base model (peft merge_and_unload) and save one plain model "
                "directory (safetensors, tokenizer, chat template) that transformers, vLLM, SGLang or "
                "onepass eval can load.")


class ExportError(ConfigError):
    """An adapter, base model or destination that cannot be exported; says which and what to do."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ExportResult:
    out: Path
    base: str
    adapter: Path
    tokenizer: str
    pushed_to: str | None = None


def adapter_base(adapter: Path) -> str | None:
    """The base model an adapter was trained on, as its ``adapter_config.json`` records it."""
    config = json.loads((adapter / "adapter_config.json").read_text(encoding="utf-8"))
    base = config.get("base_model_name_or_path")
    return base if isinstance(base, str) and base else None


def _has_tokenizer(path: str | Path) -> bool:
    return any((Path(path) / name).is_file() for name in TOKENIZER_FILES)


def export_merged(*, adapter: str | Path, out: str | Path, base: str | None = None, tokenizer: str | None = None,
                  chat_template: str | None = None, dtype: str = "auto", push_to_hub: str | None = None,
                  private: bool = True, overwrite: bool = False) -> ExportResult:
    """Merge ``adapter`` into ``base`` and ``save_pretrained`` the model (safetensors) and tokenizer to ``out``.

    ``base`` defaults to the adapter's recorded base; ``tokenizer`` to the adapter directory when it holds
    one (``onepass train`` saves it there), else the base's. ``chat_template`` (a file or ``builtin:NAME``)
    replaces the tokenizer's. ``push_to_hub``: a repo id to upload to; refused while the hub is offline.
    ``out`` must be new, empty or an earlier export (``overwrite``: any folder); it is written under a
    temporary name and renamed when complete, so a failure (a full disk) leaves no half model there.
    """
    adapter = Path(adapter)
    if push_to_hub and hub_offline():
        raise UsageError(f"--push-to-hub needs the hub, which is offline ({offline_reason()}); "
                         "export without it and upload later")
    if not (adapter / "adapter_config.json").is_file():
        raise DataNotFound(f"{adapter} is not a peft adapter directory (no adapter_config.json); "
                           "onepass train --finetune lora writes one to OUTPUT_DIR/final")
    if (adapter / "compact_vocab.json").is_file():
        raise ExportError(f"{adapter} was trained on a compacted vocabulary (a tiny test model): its ids "
                          "match no tokenizer, so there is nothing to export")
    base = base or adapter_base(adapter)
    if base is None:
        raise UsageError(f"{adapter}/adapter_config.json names no base model: pass --base")
    if not Path(base).exists() and hub_offline():
        raise ExportError(f"base model {base!r} is not a local path and the hub is offline ({offline_reason()})")
    if dtype not in DTYPES:
        raise UsageError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    out = Path(out)
    if out.resolve() in (adapter.resolve(), Path(base).resolve()):
        raise UsageError(f"--out {out} would overwrite the adapter or the base model; pick a new directory")
    check_output_dir(out, overwrite=overwrite)  # another model's folder is never overwritten

    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from onepass.tokenizer import load_tokenizer

    tok_spec = tokenizer or (str(adapter) if _has_tokenizer(adapter) else base)
    tok = load_tokenizer(tok_spec, chat_template=chat_template)  # fails early, before the big load
    torch_dtype: Any = dtype if dtype == "auto" else getattr(torch, dtype)
    try:
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch_dtype)
    except (OSError, ValueError) as e:
        raise ExportError(f"base model {base!r} cannot be loaded: {str(e).splitlines()[0]}") from None
    model = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    try:
        with atomic_dir(out) as tmp:
            model.save_pretrained(str(tmp), safe_serialization=True)
            tok.save_pretrained(str(tmp))
            write_marker(tmp, "export")
    except OSError as e:
        raise ExportError(f"cannot write the merged model to {out} ({e.strerror or e}); nothing was left there"
                          ) from None
    if push_to_hub:
        model.push_to_hub(push_to_hub, private=private, safe_serialization=True)
        tok.push_to_hub(push_to_hub, private=private)
    return ExportResult(out=out, base=base, adapter=adapter, tokenizer=tok_spec, pushed_to=push_to_hub)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``export`` to ``onepass``'s subcommands."""
    p = subparsers.add_parser("export", help="merge a LoRA adapter into its base model and save it (safetensors)",
                              description=_DESCRIPTION)
    p.add_argument("--adapter", required=True, help="the adapter directory (onepass train's OUTPUT_DIR/final)")
    p.add_argument("--base", help="the base model: local directory or hub id (default: the adapter's recorded base)")
    p.add_argument("--out", required=True, help="output directory for the merged model")
    p.add_argument("--tokenizer", help="tokenizer spec (default: the adapter's, else the base's)")
    p.add_argument("--chat-template", help="a .jinja file or builtin:NAME to save as the chat template")
    p.add_argument("--dtype", choices=DTYPES, default="auto", help="weights of the merged model (default: the base's)")
    p.add_argument("--push-to-hub", metavar="REPO_ID", help="also upload to this hub repo (online only)")
    p.add_argument("--public", action="store_true", help="with --push-to-hub: a public repo (default private)")
    p.add_argument("--overwrite", action="store_true", help="replace --out even when it holds files onepass did "
                                                            "not write (another model)")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    result = export_merged(adapter=args.adapter, out=args.out, base=args.base, tokenizer=args.tokenizer,
                           chat_template=args.chat_template, dtype=args.dtype, push_to_hub=args.push_to_hub,
                           private=not args.public, overwrite=args.overwrite)
    pushed = f"; pushed to {result.pushed_to}" if result.pushed_to else ""
    print(f"merged {result.adapter} into {result.base}; wrote {result.out} (safetensors, tokenizer from "
          f"{result.tokenizer} with its chat template){pushed}")
    return 0
