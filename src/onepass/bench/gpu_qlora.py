"""``gpu-check``'s QLoRA step: ``onepass train --finetune qlora`` at a real model's shape, no download.

Why this module exists: QLoRA is the paper's setup (Qwen3-8B, 4-bit NF4 + LoRA), and
the only QLoRA test runs a tiny model; the GPU machines have no hub. So a model of a
real shape (default Qwen3-4B: widths, layers and vocabulary, random weights,
bfloat16) is written to disk once, then loaded 4-bit by bitsandbytes and trained a
few steps on the bundled MathChat sample: loss finite, adapter saved, the step time
and peak GPU memory in ``OUT/metrics.json`` (``onepass train``'s own).

    python -m onepass.bench.gpu_qlora --shape qwen3-4b --out gpu-check-results/qlora-4b \
        --model-dir gpu-check-models/random-qwen3-4b
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from onepass.flops import MODEL_SHAPES, model_kwargs
from onepass.tiny import tiny_config
from onepass.train.cli import main as train_main


def write_model(shape_name: str, path: Path) -> Path:
    """A random bfloat16 Qwen3 of ``shape_name`` saved with ``save_pretrained`` (built on the GPU: seconds)."""
    import torch
    from transformers import AutoModelForCausalLM

    if (path / "config.json").is_file():
        return path
    shape = MODEL_SHAPES[shape_name]
    config = tiny_config("qwen3", shape.vocab, **model_kwargs(shape))
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(str(path), safe_serialization=True)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gpu-qlora", description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen3-4b")
    p.add_argument("--out", default="gpu-check-results/qlora-4b")
    p.add_argument("--model-dir", default="gpu-check-models/random-qwen3-4b",
                   help="where the random model is written once (outside the results: it is GBs)")
    p.add_argument("--max-steps", type=int, default=5)
    args = p.parse_args(argv)

    out = Path(args.out)
    model = write_model(args.shape, Path(args.model_dir))
    return train_main(["--model", str(model), "--tokenizer", "builtin:qwen3", "--data", "builtin:mathchat",
                       "--limit", "16", "--finetune", "qlora", "--lora-r", "16", "--dtype", "bfloat16",
                       "--mixed-precision", "bf16", "--gradient-checkpointing", "--max-steps", str(args.max_steps),
                       "--learning-rate", "1e-4", "--no-progress", "--overwrite", "--output-dir", str(out)])


if __name__ == "__main__":
    sys.exit(main())
