"""The cost of logging one step late in a long run: metrics.json rewritten whole (before issue 37) vs appended.

Before, ``onepass train`` rewrote ``metrics.json`` with the whole history at every logged step, so the cost of
a step's log grew with the step number (issue 37: 253 ms a write at 10k steps, 2.5 s at 100k). Now each logged
step appends one line to ``metrics.jsonl`` and rewrites a bounded summary (:mod:`onepass.train.core.report`). This
times one logged step at steps 1k, 10k and 100k for both, with records like a real run's (15 fields) and the
real header of a tiny run, in a temporary folder on the given disk.

    python benchmarks/metrics_log.py [--dir /tmp] [--out benchmarks/results/metrics-log.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from onepass.files import atomic_write_text
from onepass.train.core.report import Reporter

RECORD = {"step": 0, "epoch": 0.1, "loss": 5.7193, "grad_norm": 1.4611, "lr": 1.9e-05, "target_weight": 321.0,
          "tokens": 757, "padded_tokens": 757, "dense_pairs": 573049, "visible_pairs": 198402,
          "seconds": 0.231, "tokens_per_s": 3277.1}
HEADER = {"config": {f"key_{i}": i for i in range(60)}, "world_size": 1, "device": "cpu", "attention": "sdpa",
          "data_stats": {f"stat_{i}": i for i in range(40)}}


def old_write(out: Path, history: list[dict]) -> None:
    """What the Reporter did before: the whole payload, atomically, at every logged step."""
    atomic_write_text(out / "metrics.json", json.dumps({**HEADER, "history": history, "evals": []}, indent=1) + "\n")


def time_at(steps: int, repeats: int, folder: Path) -> dict[str, float]:
    history = [{**RECORD, "step": s + 1} for s in range(steps)]
    old = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        old_write(folder, history)
        old.append(time.perf_counter() - t0)
    r = Reporter(folder / "new", main=True, progress=False, total=steps + repeats, header=HEADER,
                 history=history, log=lambda _m: None)  # a resumed run: its log holds `steps` lines already
    new = []
    for i in range(repeats):
        t0 = time.perf_counter()
        r.log_step({**RECORD, "step": steps + i + 1}, write=True)
        new.append(time.perf_counter() - t0)
    return {"old_ms": 1000 * statistics.median(old), "new_ms": 1000 * statistics.median(new),
            "old_bytes": (folder / "metrics.json").stat().st_size,
            "new_summary_bytes": (folder / "new" / "metrics.json").stat().st_size}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default=None, help="where the files are written (default: the system temp folder)")
    p.add_argument("--steps", default="1000,10000,100000")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    args = p.parse_args()
    import numpy

    import onepass

    env = {"python": platform.python_version(), "platform": platform.platform(), "cpu_count": os.cpu_count(),
           "numpy": numpy.__version__, "onepass": getattr(onepass, "__version__", "dev")}
    print(f"# metrics logging cost per logged step; {env}")
    rows = {}
    for steps in (int(s) for s in args.steps.split(",")):
        with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
            rows[steps] = time_at(steps, args.repeats, Path(tmp))
        r = rows[steps]
        print(f"step {steps:>7,}: rewrite whole {r['old_ms']:8.1f} ms ({r['old_bytes'] / 1e6:6.1f} MB)   "
              f"append + summary {r['new_ms']:6.2f} ms ({r['new_summary_bytes'] / 1e3:.1f} kB summary)", flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"env": env, "by_steps": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
