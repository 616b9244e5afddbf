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
import torch.nn.functional as F
from torch import nn

from onepass.head import chunked_lm_head_loss, fp32_out_gemm, fp32_sum_gemm

HERE = Path(__file__).resolve().parent


def errors(device: str, dtype: torch.dtype, seed: int, T: int, D: int, V: int, chunk: int) -> dict[str, list[float]]:
    gen = torch.Generator().manual_seed(seed)
    weight_VD = (torch.randn(V, D, generator=gen, dtype=torch.float64) * 3 / D ** 0.5).to(dtype).double()
    hidden_TD = torch.randn(T, D, generator=gen, dtype=torch.float64).to(dtype).double()
    targets_T = torch.randint(0, V, (T,), generator=gen)
    weights_T = torch.rand(T, generator=gen, dtype=torch.float64)

    def run(loss_fn, dt):
        head = nn.Linear(D, V, bias=False, dtype=dt, device=device)
        with torch.no_grad():
            head.weight.copy_(weight_VD)
        h_TD = hidden_TD.detach().to(device, dt).requires_grad_(True)
        loss = loss_fn(h_TD, head, targets_T.to(device), weights_T.to(device))
        loss.backward()
        return [x.detach().double().cpu() for x in (loss, h_TD.grad, head.weight.grad)]

    def chunked(h, head, t, w):
        return chunked_lm_head_loss(h, head, t, w, chunk=chunk)

    def plain(h, head, t, w):
        return (F.cross_entropy(head(h).float(), t, reduction="none") * w.float()).sum()

    want = run(chunked, torch.float64)
    return {name: [float((g - r).norm() / r.norm()) for g, r in zip(run(fn, dtype), want)]
            for name, fn in (("onepass chunked", chunked), ("plain HF head", plain))}


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
