"""Peak memory and wall time of `onepass prepare` as the dataset grows (issue 13, item 10).

Why this exists: prepare used to hold every row and merge in the parent, so its peak memory grew
with the dataset (2.2 GiB at 5k synthetic conversations, 7.7 GiB at 20k). Streaming prepare writes
rows to Arrow shards as they are made; this script shows that the peak stays flat. For each size it
writes seeded synthetic MathChat-shaped conversations, runs the real CLI in a fresh process and
reads that process's own peak RSS and its largest worker's (`getrusage`, RUSAGE_SELF /
RUSAGE_CHILDREN), CPU seconds and wall time. Writes JSON + a Markdown table + a PNG plot.

    .venv/bin/python benchmarks/prepare_memory.py --sizes 5000,20000,100000 --num-proc 2 \
        --out benchmarks/results/prepare-memory
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _child(argv: list[str]) -> int:
    """Run `onepass ARGV` here and print one JSON line with this process's resource usage."""
    from onepass.cli import main

    t0 = time.perf_counter()
    code = main(argv)
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    print("USAGE " + json.dumps({
        "wall_s": time.perf_counter() - t0, "peak_rss_mib": own.ru_maxrss / 1024,
        "largest_worker_rss_mib": kids.ru_maxrss / 1024,
        "cpu_s": own.ru_utime + own.ru_stime, "worker_cpu_s": kids.ru_utime + kids.ru_stime}), flush=True)
    return code


def _measure(size: int, num_proc: int, work: Path) -> dict:
    data, out = work / f"synthetic-{size}.jsonl", work / f"prepared-{size}"
    subprocess.run([sys.executable, "-m", "onepass", "data", "synthetic", "--out", str(data), "--num", str(size)],
                   check=True, stdout=subprocess.DEVNULL)
    argv = ["prepare", "--data", str(data), "--tokenizer", "builtin:qwen3", "--out", str(out), "--no-progress"]
    if num_proc > 1:
        argv += ["--num-proc", str(num_proc)]
    proc = subprocess.run([sys.executable, __file__, "--child", *argv], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"prepare failed at {size} conversations:\n{proc.stderr[-2000:]}")
    usage = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("USAGE "))[6:])
    stats = json.loads((out / "stats.json").read_text())
    size_mib = sum(p.stat().st_size for p in out.rglob("*") if p.is_file()) / 2**20
    return {"conversations": size, "one_pass_tokens": stats.get("one_pass_tokens"),
            "n_pass_tokens": stats.get("n_pass_tokens"), "output_mib": size_mib, **usage}


def _table(rows: list[dict]) -> str:
    lines = ["| conversations | one-pass tokens | wall (s) | peak RSS parent (MiB) | largest worker (MiB) "
             "| CPU s parent + workers | output (MiB) |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['conversations']:,} | {r['one_pass_tokens'] or 0:,} | {r['wall_s']:.0f} "
                     f"| {r['peak_rss_mib']:.0f} | {r['largest_worker_rss_mib']:.0f} "
                     f"| {r['cpu_s']:.0f} + {r['worker_cpu_s']:.0f} | {r['output_mib']:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        return _child(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="500,2000", help="comma-separated numbers of conversations")
    parser.add_argument("--num-proc", type=int, default=2)
    parser.add_argument("--out", required=True, help="folder for summary.json, results.md, memory.png")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import transformers

    header = (f"device: CPU ({os.cpu_count()} cores, {platform.processor() or platform.machine()}); "
              f"python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}; "
              f"workload: synthetic mathchat-sync (seed 0), builtin:qwen3, --num-proc {args.num_proc}")
    print(header, flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="onepass-prepare-memory-") as tmp:
        for size in (int(s) for s in args.sizes.split(",")):
            rows.append(_measure(size, args.num_proc, Path(tmp)))
            print(_table(rows[-1:]).splitlines()[-1], flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps({"header": header, "rows": rows}, indent=2))
    (out / "results.md").write_text(header + "\n\n" + _table(rows) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    sizes = [r["conversations"] for r in rows]
    ax.plot(sizes, [r["peak_rss_mib"] for r in rows], "o-", label="parent")
    ax.plot(sizes, [r["largest_worker_rss_mib"] for r in rows], "s-", label="largest worker")
    ax.set_xscale("log")
    ax.set_xlabel("conversations")
    ax.set_ylabel("peak RSS (MiB)")
    ax.set_ylim(bottom=0)
    ax.legend()
    ax.set_title("onepass prepare: peak memory vs dataset size")
    fig.tight_layout()
    fig.savefig(out / "memory.png", dpi=120)
    print(_table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
