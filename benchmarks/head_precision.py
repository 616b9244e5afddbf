"""The half-precision LM head's error against float64, beside a plain HF head in the same dtype (issue 42, item 2).

Why this exists: the chunked head (onepass.head) multiplies half inputs with float32 sums (on CUDA into
float32 outputs on tensor cores, torch.mm's ``out_dtype``; elsewhere the half GEMM and a float32 GEMM for
the weight gradient). The claim is "at the level of a plain HF head": ``nn.Linear`` in the same dtype,
logits upcast, cross entropy. Both run on the same inputs, already representable in the half dtype, so
the error measured is the arithmetic's, against float64 on those inputs: the loss, the hidden states'
gradient ``dh`` and the weight's gradient ``dW`` (each as the norm of the difference over the norm).

    .venv/bin/python benchmarks/head_precision.py                       # CPU, ~1 min
    .venv/bin/python benchmarks/head_precision.py --device cuda --targets 4096 --hidden 4096 --vocab 151936

Writes ``results/head_precision/<device>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from pathlib import Path

import torch

from onepass.bench.head_precision import half_head_errors
from onepass.head import fp32_out_gemm, fp32_sum_gemm

HERE = Path(__file__).resolve().parent


def errors(device: str, dtype: torch.dtype, seed: int, T: int, D: int, V: int, chunk: int) -> dict[str, list[float]]:
    ours, plain = half_head_errors(device, dtype, seed, targets=T, hidden=D, vocab=V, chunk=chunk)
    return {"onepass chunked": ours, "plain HF head": plain}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--targets", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "head_precision")
    args = parser.parse_args(argv)
    rows = []
    for dtype in (torch.bfloat16, torch.float16):
        runs = [errors(args.device, dtype, s, args.targets, args.hidden, args.vocab, args.chunk)
                for s in range(args.seeds)]
        for name in runs[0]:
            loss, dh, dw = (statistics.median(r[name][i] for r in runs) for i in range(3))
            rows.append({"dtype": str(dtype).removeprefix("torch."), "head": name, "loss": loss, "dh": dh, "dW": dw})
    meta = {"device": args.device, "torch": torch.__version__, "python": platform.python_version(),
            "cpu": platform.processor(), "fp32_out_gemm": fp32_out_gemm(torch.device(args.device).type),
            "fp32_sum_gemm": fp32_sum_gemm(torch.device(args.device).type),
            "shape": {"targets": args.targets, "hidden": args.hidden, "vocab": args.vocab, "chunk": args.chunk},
            "seeds": args.seeds, "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None}
    lines = ["| dtype | head | loss | dh | dW |", "|---|---|---|---|---|"]
    lines += [f"| {r['dtype']} | {r['head']} | {r['loss']:.2e} | {r['dh']:.2e} | {r['dW']:.2e} |" for r in rows]
    table = "\n".join(lines)
    args.out.mkdir(parents=True, exist_ok=True)
    name = torch.device(args.device).type
    (args.out / f"{name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    (args.out / f"{name}.md").write_text(f"{json.dumps(meta)}\n\nmedian relative error against float64 over "
                                        f"{args.seeds} seeds\n\n{table}\n")
    print(json.dumps(meta))
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
