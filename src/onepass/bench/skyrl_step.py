"""gpu-check's ``skyrl`` step: onepass's SkyRL forward on the device, sharded as SkyRL's FSDP workers shard it.

Why this module exists: ``tests/rl/test_skyrl.py`` proves onepass's SkyRL wrapper on CPU against SkyRL's own
code (float64, and float32 under SkyRL's FSDP2 layout on one gloo rank). What only a GPU runs is the worker's
device path: NCCL, ``fully_shard`` with SkyRL's bf16 mixed precision, the forward under
``torch.autocast(bfloat16)`` and onepass's tree on flex_attention. This step runs one micro-batch of SkyRL's
layout ([pad.. prompt response], shared prompts) that way: :func:`onepass.rl.padded.window_token_logprobs` on a
tiny Qwen3 wrapped per decoder layer and at the root (as SkyRL's ``apply_fsdp2``; SkyRL's own when skyrl is
importable), forward and backward, against each row's own plain forward of the same weights in float32; it
prints the largest log-prob difference (bf16 rounding: up to ~0.1) and the seconds. SkyRL's Ray actors need ray
and skyrl, which the GPU image does not have and the 40 MiB bundle cannot carry (ray's wheel alone is larger):
without them this step still runs the sharded device path, and says so in one line.

    PYTHONPATH=src python -m onepass.bench.skyrl_step --device cpu      # the rehearsal (gloo, sdpa)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import socket
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from onepass.attention.backends import supported_backend
from onepass.model.tiny import tiny_model
from onepass.rl.padded import window_token_logprobs

VOCAB, ROWS, PROMPT, RESPONSE = 256, 6, 40, 24
# against a float32 reference: bf16 parameters and activations on CUDA round to ~0.1 (a bound, not exactness);
# float32 on CPU (the rehearsal) to ~1e-6
TOLERANCE = {"cuda": 0.15, "cpu": 1e-4}


def skyrl_batch(seed: int = 0) -> tuple[Any, Any, int]:
    """A micro-batch in SkyRL's layout: groups of rows sharing a prompt, responses of varied length, left-padded."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, VOCAB, (PROMPT,), generator=gen) for _ in range(2)]
    rows = []
    for b in range(ROWS):
        n = int(torch.randint(4, RESPONSE + 1, (1,), generator=gen))
        rows.append(torch.cat([prompts[b % 2][: PROMPT - 5 * (b // 2)], torch.randint(1, VOCAB, (n,), generator=gen)]))
    length = max(len(r) for r in rows)
    sequences = torch.zeros(ROWS, length, dtype=torch.long)
    mask = torch.zeros(ROWS, length, dtype=torch.long)
    for b, r in enumerate(rows):
        sequences[b, length - len(r):], mask[b, length - len(r):] = r, 1
    return sequences, mask, RESPONSE


def _process_group(device: str) -> None:
    if dist.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=0, world_size=1)


def _shard(model: Any, device: str) -> str:
    """``model`` sharded as SkyRL's FSDPStrategy shards it (SkyRL's ``apply_fsdp2`` where importable); which one."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # SkyRL's default param_dtype; CPU: float32
    kwargs = {"mesh": init_device_mesh(device, (1,), mesh_dim_names=["fsdp"]), "reshard_after_forward": True,
              "mp_policy": MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32, cast_forward_inputs=True)}
    try:
        from skyrl.backends.skyrl_train.distributed.fsdp_utils import apply_fsdp2
        from skyrl.train.config.config import FSDPConfig
    except Exception:  # noqa: BLE001 - skyrl absent (the GPU image) or not importable: the same layout by hand
        for layer in model.model.layers:
            fully_shard(layer, **kwargs)
        fully_shard(model.model.embed_tokens, **kwargs)
        fully_shard(model, **kwargs)
        return "fully_shard per decoder layer and embedding, then the model (SkyRL's apply_fsdp2 layout)"
    apply_fsdp2(model, {**kwargs, "offload_policy": None}, FSDPConfig())
    return "skyrl apply_fsdp2"


def run(device: str = "cuda") -> dict[str, Any]:
    """One micro-batch through onepass's sharded forward and backward, against each row's plain forward."""
    have = {m: importlib.util.find_spec(m) is not None for m in ("skyrl", "ray", "flash_attn")}
    _process_group(device)
    sequences, mask, window = skyrl_batch()
    reference = tiny_model("qwen3", VOCAB, dtype=torch.float32, device=device)
    model = tiny_model("qwen3", VOCAB, dtype=torch.float32, device=device)
    layout = _shard(model, device)
    model.set_reshard_after_forward(False, recurse=False)  # as onepass.rl.skyrl does: the head runs after forward
    model.set_attn_implementation(supported_backend(model, device, torch.bfloat16 if device == "cuda" else None))
    sequences, mask = sequences.to(device), mask.to(device)
    t0 = time.perf_counter()
    with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=device == "cuda"):
        logprobs, entropy = window_token_logprobs(model, sequences, mask, window, entropy=True)
    (logprobs.sum() + entropy.sum()).backward()
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    grads = sum(p.grad is not None for p in model.parameters())
    worst = 0.0
    with torch.no_grad():
        for b in range(len(sequences)):
            real = sequences[b][mask[b].bool()][None]
            length, n = real.shape[1], min(window, real.shape[1] - 1)
            logits = reference(input_ids=real).logits[0, length - 1 - n:length - 1].float()
            want = torch.log_softmax(logits, -1).gather(1, real[0, length - n:, None])[:, 0]
            worst = max(worst, (logprobs[b, window - n:].float() - want).abs().max().item())
    backend = model.config._attn_implementation
    status = "passed" if worst <= TOLERANCE[device] and grads == sum(1 for _ in model.parameters()) else "failed"
    missing = [m for m, ok in have.items() if not ok]
    return {"status": status, "device": device, "attention": backend, "sharding": layout,
            "max_abs_logprob_diff": worst, "tolerance": TOLERANCE[device], "parameters_with_grad": grads,
            "forward_backward_seconds": round(seconds, 2),
            "skyrl_workers": ("not run: " + ", ".join(missing) + " not importable here (SkyRL's Ray actors need them)"
                              if missing else "importable; its Ray/FSDP workers need a Ray cluster")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="onepass.bench.skyrl_step", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    result = run(p.parse_args(argv).device)
    print(json.dumps(result))
    return 0 if result["status"] == "passed" else 1


if __name__ == "__main__":
    sys.exit(main())
