"""Host time and host syncs of an `onepass train` step on CPU, this tree against another (issue 42, item 1).

Why this exists: on a GPU a step that reads a device tensor (``.item()``, ``.cpu()``, ``nonzero``, a
boolean index) waits there for everything queued before it, and the GPU then idles while the host
plans the next step. Issue 42 measured at least 3 such waits per step and 884-983 ms of epoch against
444-467 ms of GPU work. No GPU here, so this measures the two things a CPU can:

- **syncs per step**: the ops of each step (after the first) that would wait on CUDA, counted by
  ``tests/host_syncs.py``'s dispatch mode (the test suite's counter): this tree's ``Stepper.launch``,
  or the baseline's whole ``Stepper.__call__`` (it had no launch). Reads of torch's non-fused AdamW step
  counters (``_get_value``: CPU tensors, no wait on CUDA) are counted apart;
- **host CPU time per step**: process CPU time of steps 3.. of a tiny Qwen3 (every matmul small, so the
  step's time is mostly the host's: Python, planning, optimizer), both trees in fresh processes taking
  turns (``--repeats``), so load on the machine slows neither side's figure much.

    git archive b757769 src | tar -x -C /tmp/onepass-b757769
    .venv/bin/python benchmarks/host_step.py --baseline-src /tmp/onepass-b757769/src --repeats 3

Writes ``results/host_step/host_step.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def worker(args: argparse.Namespace) -> dict:
    """One run of ``args.steps`` steps in this process: CPU seconds per step (steps 3..), or syncs per step."""
    import tempfile

    import torch

    from onepass.train.config import load_config

    try:
        from onepass.train.run.loop import train_steps
        from onepass.train.run.step import Stepper
    except ImportError:  # a baseline from before train/run/ (issue 47.3)
        from onepass.train.loop import train_steps
        from onepass.train.step import Stepper

    torch.set_num_threads(1)
    out = tempfile.mkdtemp(prefix="host-step-")
    config = load_config(None, dict(tiny="qwen3", data="builtin:mathchat", limit=args.conversations,
                                    max_steps=args.steps, per_device_train_batch_size=2, progress=False,
                                    save_model=False, output_dir=out, device="cpu", attention=args.attention,
                                    save_steps=10 ** 6))
    counted: list[int] = []
    if args.syncs:
        sys.path.insert(0, str(ROOT / "tests"))
        import traceback

        from host_syncs import SyncCounter

        class Split(SyncCounter):  # torch's non-fused AdamW reads its step counters, CPU tensors: no CUDA wait
            def _flag(self, name):
                cpu = any(f.name == "_get_value" and "torch/optim" in f.filename for f in traceback.extract_stack())
                self.ops["cpu step counters" if cpu else "syncs"] += 1

        name = "launch" if hasattr(Stepper, "launch") else "__call__"
        real = getattr(Stepper, name)

        def launch(self, step):
            counter = Split()
            with counter.counting():
                result = real(self, step)
            counted.append((counter.ops["syncs"], counter.ops["cpu step counters"]))
            return result

        setattr(Stepper, name, launch)
    steps = train_steps(config, log=lambda _m: None)
    cpu, wall = [], []
    while True:
        c0, w0 = time.process_time(), time.perf_counter()
        try:
            next(steps)
        except StopIteration:
            break
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - w0)
    return {"cpu_per_step": statistics.mean(cpu[2:]), "wall_per_step": statistics.mean(wall[2:]),
            "syncs_per_step": counted[1:]}


def run(src: Path, args: argparse.Namespace, *, syncs: bool) -> dict:
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, __file__, "--worker", "--steps", str(args.steps), "--conversations",
           str(args.conversations), "--attention", args.attention] + (["--syncs"] if syncs else [])
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline-src", type=Path, required=False, help="another onepass's src folder")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--conversations", type=int, default=24)
    parser.add_argument("--attentions", default="onepass_cpu,sdpa")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "host_step")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--syncs", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--attention", default="onepass_cpu", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)))
        return 0
    import torch

    trees = {"this tree": ROOT / "src"} | ({"baseline": args.baseline_src} if args.baseline_src else {})
    rows = []
    for attention in args.attentions.split(","):
        args.attention = attention
        cpu: dict[str, list[float]] = {name: [] for name in trees}
        syncs = {name: run(src, args, syncs=True)["syncs_per_step"] for name, src in trees.items()}
        for _ in range(args.repeats):  # taking turns: both see the same machine
            for name, src in trees.items():
                cpu[name].append(run(src, args, syncs=False)["cpu_per_step"])
        for name in trees:
            rows.append({"attention": attention, "tree": name, "syncs_per_step": syncs[name],
                         "cpu_ms_per_step": 1e3 * statistics.median(cpu[name]),
                         "cpu_ms_runs": [1e3 * c for c in cpu[name]]})
    meta = {"python": platform.python_version(), "torch": torch.__version__, "cpu": platform.processor(),
            "threads": 1, "workload": f"onepass train, tiny qwen3 (float32), builtin:mathchat first "
            f"{args.conversations} conversations, batch 2, {args.steps} steps (CPU time of steps 3..)",
            "baseline": str(args.baseline_src) if args.baseline_src else None, "repeats": args.repeats}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "host_step.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    lines = ["| attention | tree | syncs per step (steps 2..) | + CPU step-counter reads | host CPU ms / step "
             "(median) | runs |", "|---|---|---|---|---|---|"]
    for r in rows:
        syncs = sorted({s for s, _ in r["syncs_per_step"]})
        cpu_reads = sorted({c for _, c in r["syncs_per_step"]})
        lines.append(f"| {r['attention']} | {r['tree']} | {', '.join(map(str, syncs))} | "
                     f"{', '.join(map(str, cpu_reads))} | {r['cpu_ms_per_step']:.1f} | "
                     f"{', '.join(f'{c:.1f}' for c in r['cpu_ms_runs'])} |")
    table = "\n".join(lines)
    (args.out / "host_step.md").write_text(f"{meta['workload']}; torch {meta['torch']}\n\n{table}\n")
    print(json.dumps(meta))
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
