"""``onepass export``: a LoRA adapter merged into its base model, ready to serve.

Why this module exists: ``onepass train --finetune lora|qlora`` saves an
adapter (a few MB); vLLM, SGLang, llama.cpp converters and ``onepass eval
--backend vllm`` want one plain model directory. This merges the adapter into
the base weights (peft's ``merge_and_unload``: W + B A * alpha/r, once), saves
the result as safetensors with the tokenizer and its chat template beside it,
and optionally uploads it to the hub (only when online).

    onepass export --base Qwen/Qwen3-8B --adapter runs/qwen3-8b/final --out runs/qwen3-8b-merged
    onepass export --adapter runs/qwen3-8b/final --out merged --push-to-hub me/qwen3-8b-mathchat

Its flags are :mod:`onepass.export.cli`'s (no torch for ``--help``); :func:`run` runs it. The model is
loaded by the one loader (:func:`onepass.model.load.load_causal_lm`, the adapter merged there).

The merged model computes what base + adapter computes (the test checks the
logits in float64 to 1e-10). A QLoRA adapter is merged into the base loaded in
``--dtype`` (bfloat16 is what most serve), not into 4-bit weights.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

from onepass.model.dtypes import dtype_names
from onepass.errors import ConfigError, DataNotFound, UsageError
from onepass.files import atomic_dir, check_output_dir, write_marker
from onepass.hub import hub_offline, offline_reason
from onepass.model.load import ModelSpec, load_causal_lm, load_model_config
from onepass.render.tokenizer import load_tokenizer

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


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
    load_model_config(base, label="base model")  # not a saved model, not a local path while offline: one line, early
    if dtype not in dtype_names(auto=True):
        raise UsageError(f"--dtype must be one of {', '.join(dtype_names(auto=True))}, got {dtype!r}")
    out = Path(out)
    if out.resolve() in (adapter.resolve(), Path(base).resolve()):
        raise UsageError(f"--out {out} would overwrite the adapter or the base model; pick a new directory")
    check_output_dir(out, overwrite=overwrite)  # another model's folder is never overwritten

    tok_spec = tokenizer or (str(adapter) if _has_tokenizer(adapter) else base)
    tok = load_tokenizer(tok_spec, chat_template=chat_template)  # fails early, before the big load
    model = load_causal_lm(ModelSpec(model=base, dtype=dtype, adapter=str(adapter), merge_adapter=True,
                                     label="base model"))
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


def run(args: argparse.Namespace) -> int:
    result = export_merged(adapter=args.adapter, out=args.out, base=args.base, tokenizer=args.tokenizer,
                           chat_template=args.chat_template, dtype=args.dtype, push_to_hub=args.push_to_hub,
                           private=not args.public, overwrite=args.overwrite)
    pushed = f"; pushed to {result.pushed_to}" if result.pushed_to else ""
    print(f"merged {result.adapter} into {result.base}; wrote {result.out} (safetensors, tokenizer from "
          f"{result.tokenizer} with its chat template){pushed}")
    return 0
