"""Two short GPU measurements of ``make gpu-check``, each a function that ends in one JSON line.

Why this module exists: two questions only a GPU answers, each asked the one way, on CPU first (the
suite runs both with CPU stand-ins, so the GPU run is not their first run):

``varlen``: does torch's flash varlen kernel align causal attention at the *bottom right* when a
segment's queries are shorter than its gathered keys (the gather plan, :mod:`onepass.attention.gather`,
relies on it)? Tree rows through :func:`onepass.attention.varlen.varlen_attention` on the device
against :func:`~onepass.attention.varlen.varlen_attention_reference` on CPU (float32, the same rounded
inputs, the same plan), outputs and gradients; and, to show the check can tell, the same reference
aligned at the *top left* (SDPA's ``is_causal`` when queries and keys differ in length), which must
differ by far more.

``float32``: which float32 training is closer to float64, flex or sdpa, and by how much? Each is
judged against one float64 reference (sdpa, float64 norms) on the same rows from the same weights, not
one against the other: the loss and every gradient at the first step, and the losses of a few AdamW
steps. (The first GPU run saw flex and sdpa differ by up to 6.2e-4 in a float32 step's loss on an H100,
and could not say which was off.)

    python -m onepass.bench.gpu_probes varlen --device cuda
    python -m onepass.bench.gpu_probes float32 --device cuda --backends flex_attention,sdpa
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import numpy as np
import torch

from onepass.attention.cpu import register as register_cpu
from onepass.attention.mask import pad_kv_end
from onepass.attention.varlen import varlen_attention, varlen_attention_mask, varlen_attention_reference
from onepass.data.mathchat import load_sample
from onepass.layout.pack import pack_layouts
from onepass.layout.schedule import parse_schedule, schedule_views
from onepass.layout.tree import build_layout, concat
from onepass.layout.view import View
from onepass.loss import batch_loss, layouts_to_batch
from onepass.model.dtypes import torch_dtype
from onepass.model.precision import float64_norms
from onepass.model.tiny import tiny_model
from onepass.render import render_views
from onepass.render.tokenizer import load_tokenizer
from onepass.verify.check import compact_vocab

VARLEN_TOLERANCE = 3e-2  # bf16/fp16 kernel vs float32 reference: largest difference over the reference's largest value
WINDOWS = (None, 5, 64)


# ---------------------------------------------------------------------------------------------
# varlen: bottom-right alignment


def tree_rows(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(kv_end [1, L], position_ids [1, L]): four views under a 300-token shared head (segments whose
    queries are far shorter than their keys), a 90-token document beside them, 9 pads."""
    rng = np.random.default_rng(seed)
    head = list(rng.integers(0, 9, 300))
    views = [View(tokens=np.array(head + list(rng.integers(0, 9, n))), num_prompt=300, turn=0)
             for n in (200, 129, 64, 7)]
    row = concat([build_layout(views), build_layout([View(tokens=np.arange(90), num_prompt=1, turn=0)])])
    kv_end_BL = pad_kv_end([row.kv_end], len(row) + 9)
    pos_BL = np.zeros(kv_end_BL.shape, dtype=np.int64)
    pos_BL[0, :len(row)] = row.position_ids
    return kv_end_BL, pos_BL


def _scaled_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    """``max |got - want| / max |want|``: one scale for outputs and gradients of any size."""
    got, want = got.detach().float().cpu(), want.detach().float().cpu()
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


def top_left_reference(q_THD: torch.Tensor, k_KJD: torch.Tensor, v_KJD: torch.Tensor, cu_q: np.ndarray,
                       cu_k: np.ndarray, scale: float) -> torch.Tensor:
    """The wrong alignment, for contrast: per segment, SDPA's ``is_causal`` (top left: query j sees keys <= j)."""
    out = []
    for q0, q1, k0, k1 in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(), cu_k[1:].tolist()):
        q, k, v = (x.transpose(0, 1)[None] for x in (q_THD[q0:q1], k_KJD[k0:k1], v_KJD[k0:k1]))
        out.append(torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                                    enable_gqa=True)[0].transpose(0, 1))
    return torch.cat(out)


def varlen_alignment(device: str, dtypes: tuple[str, ...] = ("bfloat16", "float16")) -> dict[str, Any]:
    """Every (dtype, window) case: the kernel's output and gradient differences from the bottom-right
    reference, and the output's from the top-left one (each :func:`_scaled_diff`); ``aligned`` when every
    case is within :data:`VARLEN_TOLERANCE` of the first and at least 10x that away from the second."""
    kv_end_BL, pos_BL = tree_rows()
    T = kv_end_BL.size
    cases = []
    for dtype_name in dtypes:
        dtype = torch_dtype(dtype_name)
        for window in WINDOWS:
            gen = torch.Generator().manual_seed(0)
            q, k, v = (torch.randn(T, h, 128, generator=gen).to(dtype).float() for h in (8, 2, 2))
            g = torch.randn(T, 8, 128, generator=gen).to(dtype).float()
            mask = varlen_attention_mask(kv_end_BL, position_ids=pos_BL, window=window, device=device)
            plan = getattr(mask, "onepass_varlen_plan")
            dq, dk, dv = (x.to(device, dtype).requires_grad_() for x in (q, k, v))
            out = varlen_attention(dq, dk, dv, plan, scale=0.1)
            got = torch.autograd.grad(out, (dq, dk, dv), g.to(device, dtype))
            rq, rk, rv = (x.clone().requires_grad_() for x in (q, k, v))
            index = plan.key_index.cpu()
            ref = varlen_attention_reference(rq, rk.index_select(0, index), rv.index_select(0, index),
                                             plan.plan.cu_seqlens_q, plan.plan.cu_seqlens_k, scale=0.1, window=window)
            want = torch.autograd.grad(ref, (rq, rk, rv), g)
            wrong = top_left_reference(q, k.index_select(0, index), v.index_select(0, index), plan.plan.cu_seqlens_q,
                                       plan.plan.cu_seqlens_k, 0.1) if window is None else None
            case = {"dtype": dtype_name, "window": window, "segments": plan.plan.num_segments,
                    "keys": plan.plan.num_keys, "max_q": plan.plan.max_q, "max_k": plan.plan.max_k,
                    "out_diff": _scaled_diff(out, ref),
                    "grad_diff": max(_scaled_diff(a, b) for a, b in zip(got, want)),
                    "top_left_out_diff": None if wrong is None else _scaled_diff(out, wrong)}
            case["ok"] = (case["out_diff"] <= VARLEN_TOLERANCE and case["grad_diff"] <= VARLEN_TOLERANCE
                          and (wrong is None or case["top_left_out_diff"] > 10 * VARLEN_TOLERANCE))
            print(f"varlen {dtype_name} window {window}: output {case['out_diff']:.2e}, gradients "
                  f"{case['grad_diff']:.2e} from the bottom-right reference"
                  + (f"; {case['top_left_out_diff']:.2e} from top-left" if wrong is not None else "")
                  + ("" if case["ok"] else "  FAILED"), flush=True)
            cases.append(case)
    return {"probe": "varlen", "device": device, "tolerance": VARLEN_TOLERANCE, "cases": cases,
            "aligned": all(c["ok"] for c in cases)}


# ---------------------------------------------------------------------------------------------
# float32: flex and sdpa, each against float64


def _rows(limit: int, max_tokens: int) -> tuple[list[Any], int]:
    tokenizer = load_tokenizer("builtin:qwen3")
    views, vocab = compact_vocab([render_views(c, tokenizer) for c in load_sample(limit)])
    trees = [t for v in views for t in schedule_views(v, parse_schedule("one-pass"), max_tokens=max_tokens).layouts]
    return pack_layouts(trees, max_tokens), vocab


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300))


def float32_question(device: str, backends: tuple[str, ...] = ("flex_attention", "sdpa"), *, steps: int = 4,
                     conversations: int = 8, max_tokens: int = 2048, lr: float = 1e-3) -> dict[str, Any]:
    """Each float32 backend against one float64 reference (sdpa, float64 norms) from the same weights on the
    same rows: relative loss and gradient differences at the first step (per parameter ``|g - g64| /
    |g64|``: the largest and the median), and the losses of ``steps`` AdamW steps."""
    register_cpu()
    rows, vocab = _rows(conversations, max_tokens)
    batches = [layouts_to_batch([r], device=device) for r in rows]
    size = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=64)

    start = tiny_model("qwen3", vocab, dtype=torch.float64, seed=0, device=device, **size).state_dict()

    def train(backend: str, dtype: torch.dtype) -> dict[str, Any]:
        model = tiny_model("qwen3", vocab, dtype=dtype, seed=0, attn_implementation=backend, device=device, **size)
        model.load_state_dict({k: v.to(dtype) for k, v in start.items()})  # the same weights, rounded once
        if dtype == torch.float64:
            float64_norms(model)
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        losses, grads = [], {}
        for step in range(steps):
            opt.zero_grad(set_to_none=True)
            total = sum(float(b["weights"].sum()) for b in batches)
            loss = sum(batch_loss(model, b) for b in batches) / total
            loss.backward()
            losses.append(float(loss.detach()))
            if step == 0:
                grads = {n: p.grad.detach().double().cpu() for n, p in model.named_parameters()}
            opt.step()
        return {"losses": losses, "grads": grads}

    reference = train("sdpa", torch.float64)
    judged = {}
    for backend in backends:
        run = train(backend, torch.float32)
        per_param = {n: _relative(g, reference["grads"][n]) for n, g in run["grads"].items()}
        worst = max(per_param, key=per_param.get)
        judged[backend] = {
            "first_loss_rel_diff": abs(run["losses"][0] - reference["losses"][0]) / abs(reference["losses"][0]),
            "max_rel_grad_diff": per_param[worst], "worst_parameter": worst,
            "median_rel_grad_diff": float(np.median(list(per_param.values()))),
            "max_loss_rel_diff_over_steps": max(abs(a - b) / abs(b) for a, b in zip(run["losses"],
                                                                                  reference["losses"])),
            "losses": run["losses"]}
        j = judged[backend]
        print(f"float32 {backend} vs float64: first loss {j['first_loss_rel_diff']:.2e}, gradients max "
              f"{j['max_rel_grad_diff']:.2e} ({worst}), median {j['median_rel_grad_diff']:.2e}, losses over "
              f"{steps} steps {j['max_loss_rel_diff_over_steps']:.2e}", flush=True)
    ranked = sorted(judged, key=lambda b: judged[b]["max_rel_grad_diff"])
    verdict = None
    if len(ranked) >= 2:
        best, other = ranked[0], ranked[1]
        factor = judged[other]["max_rel_grad_diff"] / max(judged[best]["max_rel_grad_diff"], 1e-300)
        verdict = (f"{best} is closer to float64: its largest gradient difference "
                   f"{judged[best]['max_rel_grad_diff']:.2e} "
                   f"is {factor:.1f}x smaller than {other}'s {judged[other]['max_rel_grad_diff']:.2e} (first-step "
                   f"loss {judged[best]['first_loss_rel_diff']:.1e} vs {judged[other]['first_loss_rel_diff']:.1e})")
        print(f"float32: {verdict}", flush=True)
    precision = {"float32_matmul_precision": torch.get_float32_matmul_precision(),
                 "cuda_matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
                 "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32}
    return {"probe": "float32", "device": device, "reference": "sdpa float64", "rows": len(rows),
            "tokens": sum(len(r) for r in rows), "vocab": vocab, "steps": steps, "lr": lr, "model": size,
            "reference_losses": reference["losses"], "backends": judged, "closer": ranked[0] if ranked else None,
            "verdict": verdict, **precision}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m onepass.bench.gpu_probes", description=__doc__.split("\n\n")[0])
    p.add_argument("probe", choices=("varlen", "float32"))
    p.add_argument("--device", default="cuda")
    p.add_argument("--backends", default="flex_attention,sdpa", help="float32: the backends judged")
    p.add_argument("--dtypes", default="bfloat16,float16", help="varlen: the kernel's input dtypes")
    p.add_argument("--conversations", type=int, default=8, help="float32: MathChat sample conversations")
    p.add_argument("--steps", type=int, default=4, help="float32: AdamW steps")
    args = p.parse_args(argv)
    if args.probe == "varlen":
        result = varlen_alignment(args.device, tuple(args.dtypes.split(",")))
        ok = result["aligned"]
    else:
        result = float32_question(args.device, tuple(args.backends.split(",")), steps=args.steps,
                                  conversations=args.conversations)
        ok = result["closer"] is not None
    print(json.dumps(result), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
