"""``make gpu-check``: everything the first CUDA machine should run, in one command.

Why this module exists: the CPU suite skips every ``requires_cuda`` test and the
benchmark's GPU settings have never run, so the first GPU hour must not be spent
working out what to run. On a machine without CUDA it refuses in one line (exit 1)
before doing anything. On CUDA, in order, each step logged and never fatal to
the next:

1. What the CUDA tests and baselines need, where missing: bitsandbytes (QLoRA
   tests) and deepspeed (ZeRO-2 test); flash-attn for TRL's FA2 N-pass baseline
   from a prebuilt wheel only (``pip install --only-binary=:all:``; never a
   source build). A failed install is a note, not a failure: the tests that
   need the package skip, and TRL's baseline falls back to sdpa.
2. ``pytest -m requires_cuda``: every CUDA test of the suite.
3. ``onepass bench`` at the Qwen3-0.6B shape (real widths and vocabulary, random
   weights, bfloat16): flex one-pass packed vs flex N-pass packed vs TRL N-pass
   packed (FA2 varlen when flash-attn is there), then Qwen3-4B when the GPU has
   the memory for a full fine-tune of it.

Results go to ``benchmarks/results/gpu-<date>/``: ``gpu-check.json`` (each step,
its command, exit status and seconds), the pytest log, and one bench folder per
shape (summary.json, table.md, plots). Exit status: 0 when every step passed.

    make gpu-check                      # = python -m onepass.bench.gpu_check
    python -m onepass.bench.gpu_check --out benchmarks/results/gpu-mine --shapes qwen3-0.6b
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REFUSAL = "gpu-check: no CUDA device here (torch.cuda.is_available() is False); run it on a CUDA machine"
BENCH_SETTINGS = "n-pass-packed,one-pass-packed,trl-sft-packed,trl-sft-packed-tuned"
# GPU memory (GiB) a bf16 full fine-tune of the shape needs (weights, grads, AdamW states, activations)
SHAPE_MEMORY_GIB = {"qwen3-0.6b": 16, "qwen3-1.7b": 32, "qwen3-4b": 70, "qwen3-8b": 140}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gpu-check", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="results folder (default benchmarks/results/gpu-<date>)")
    p.add_argument("--shapes", default=None,
                   help="comma-separated bench shapes (default: qwen3-0.6b, plus qwen3-4b if it fits)")
    p.add_argument("--quick", action="store_true", help="pass --quick to the benchmark (minutes, not hours)")
    p.add_argument("--skip-install", action="store_true", help="do not try to install flash-attn and the rest")
    return p.parse_args(argv)


def _run(step: str, cmd: list[str], log: Path | None, steps: list[dict[str, Any]]) -> int:
    print(f"gpu-check: {step}: {' '.join(cmd)}", flush=True)
    t0 = time.perf_counter()
    if log is None:
        rc = subprocess.call(cmd)
    else:
        with log.open("w") as f:
            rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT)
    steps.append({"step": step, "command": cmd, "returncode": rc, "seconds": round(time.perf_counter() - t0, 1),
                  "log": str(log) if log else None})
    print(f"gpu-check: {step}: exit {rc}", flush=True)
    return rc


# module -> pip requirement; all wheel-only (flash-attn's PyPI release is a source build: never run here)
OPTIONAL = {"flash_attn": "flash-attn", "bitsandbytes": "bitsandbytes>=0.43", "deepspeed": "deepspeed>=0.15"}


def ensure_installed(module: str, steps: list[dict[str, Any]], out: Path) -> bool:
    """``module`` importable, after a wheel-only install attempt; a failed install is a note, not a failure."""
    if importlib.util.find_spec(module):
        steps.append({"step": f"install {module}", "note": "already installed"})
        return True
    rc = _run(f"install {module} (wheel only)", [sys.executable, "-m", "pip", "install", "--only-binary=:all:",
                                                 OPTIONAL[module]], out / f"pip-{module}.log", steps)
    if rc:
        steps[-1]["returncode"] = None  # not a failure: what needs it skips or falls back
        steps[-1]["note"] = f"no {OPTIONAL[module]} wheel fits this machine; its tests skip (nothing built from source)"
        print(f"gpu-check: {steps[-1]['note']}", flush=True)
    importlib.invalidate_caches()
    return bool(importlib.util.find_spec(module))


def default_shapes(total_gib: float) -> list[str]:
    """Qwen3-0.6B always; the larger shapes whose full fine-tune fits in ``total_gib``."""
    return ["qwen3-0.6b"] + [s for s in ("qwen3-4b",) if SHAPE_MEMORY_GIB[s] <= total_gib]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print(REFUSAL, file=sys.stderr)
        return 1
    out = Path(args.out or f"benchmarks/results/gpu-{datetime.date.today().isoformat()}")
    out.mkdir(parents=True, exist_ok=True)
    props = torch.cuda.get_device_properties(0)
    total_gib = props.total_memory / 2**30
    shapes = args.shapes.split(",") if args.shapes else default_shapes(total_gib)
    steps: list[dict[str, Any]] = []
    record = {"gpu": props.name, "memory_gib": round(total_gib, 1), "torch": torch.__version__,
              "cuda": torch.version.cuda, "shapes": shapes, "steps": steps}
    print(f"gpu-check: {props.name}, {total_gib:.0f} GiB, torch {torch.__version__}; results in {out}", flush=True)
    for module in () if args.skip_install else OPTIONAL:
        ensure_installed(module, steps, out)
    record["flash_attn"] = bool(importlib.util.find_spec("flash_attn"))
    _run("pytest -m requires_cuda", [sys.executable, "-m", "pytest", "-q", "-m", "requires_cuda", "-rs"],
         out / "pytest-requires-cuda.log", steps)
    for shape in shapes:
        cmd = [sys.executable, "-m", "onepass", "bench", "--shape", shape, "--device", "cuda", "--dtype", "bfloat16",
               "--backends", "flex_attention", "--settings", BENCH_SETTINGS, "--out", str(out / shape)]
        _run(f"bench {shape}", cmd + (["--quick"] if args.quick else []), out / f"bench-{shape}.log", steps)
    (out / "gpu-check.json").write_text(json.dumps(record, indent=2) + "\n")
    failed = [s["step"] for s in steps if s.get("returncode")]
    print(f"gpu-check: {'FAILED: ' + ', '.join(failed) if failed else 'all steps passed'}; wrote {out}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
