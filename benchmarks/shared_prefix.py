"""Trained tokens with prefixes shared across conversations, on the real agent sets (issue 35).

Why this exists: issue 35's table measured, on tau-bench airline and BFCL multi-turn (with and without
per-turn reasoning, Qwen3 template), how many tokens a packed row needs with one tree per conversation
("today") and with one prefix tree over the conversations that share a harness, cut into 32k rows. This
runs ``onepass prepare --pack --max-tokens 32768`` the default way (prefixes shared) and with
``--no-share-prefix`` (today's rows) on each set, and checks that the two hold the same views and
losses: the same loss terms (context, target, weight: :func:`onepass.share.loss_terms`) read off the
rows. It also runs ``onepass data stats --model qwen3-8b`` (the GPU cost model: the step-time ratio at
8B width of the shared rows against today's), and writes JSON, Markdown and a plot.

    .venv/bin/python benchmarks/shared_prefix.py --out benchmarks/results/shared-prefix    # ~5 min on 2 cores
    .venv/bin/python benchmarks/shared_prefix.py --limit 50 --out /tmp/shared              # a quick look
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import sys
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

AGENT = Path(__file__).resolve().parents[2] / "shared" / "data" / "agent"
# issue 35's table: N-pass, one tree per conversation (today, in 32k rows), one trie in 32k rows, the ratio
TABLE = {
    "taubench_airline": {"label": "tau-bench airline, as recorded", "today_over_32k": 1.82},
    "taubench_airline_reasoning": {"label": "tau-bench airline, per-turn reasoning", "today_over_32k": 1.23},
    "bfcl_base": {"label": "BFCL multi-turn base, as recorded", "today_over_32k": 4.31},
    "bfcl_base_reasoning": {"label": "BFCL multi-turn base, per-turn reasoning", "today_over_32k": 2.35},
}


def run_one(name: str, out: Path, max_tokens: int, limit: int | None, schedule: str) -> dict:
    from onepass.cli import main
    from onepass.prepare import load_rows
    from onepass.share import loss_terms, same_terms

    data = str(AGENT / f"{name}.jsonl")
    result: dict = {"data": data, "schedule": schedule}
    rows = {}
    for flag in ("--share-prefix", "--no-share-prefix"):
        folder = out / "prepared" / f"{name}-{schedule}{flag.replace('--', '-')}"
        argv = ["prepare", "--data", data, "--pack", "--max-tokens", str(max_tokens), flag, "--schedule", schedule,
                "--no-progress", "--out", str(folder)] + (["--limit", str(limit)] if limit else [])
        t0 = time.process_time()
        with contextlib.redirect_stdout(io.StringIO()):
            assert main(argv) == 0
        stats = json.loads((folder / "stats.json").read_text())
        result[flag.strip("-")] = {"cpu_seconds": time.process_time() - t0, "rows": stats["rows"],
                                   "row_tokens": stats["row_tokens"], "n_pass_tokens": stats["n_pass_tokens"],
                                   "one_pass_tokens": stats["one_pass_tokens"], "views_trained": stats["views_trained"],
                                   "views_skipped": stats["views_skipped"], "shared": stats.get("shared")}
        rows[flag] = load_rows(folder)
    a, b = (loss_terms(rows[f]) for f in ("--share-prefix", "--no-share-prefix"))
    result["same_loss_terms"] = same_terms(a, b)
    result["loss_terms"] = len(a)
    today, shared = result["no-share-prefix"]["row_tokens"], result["share-prefix"]["row_tokens"]
    result["today_over_shared"] = today / shared
    result["table"] = TABLE[name]["today_over_32k"]
    result["fraction_of_table"] = result["today_over_shared"] / result["table"]
    return result


def data_stats(name: str, out: Path, max_tokens: int, limit: int | None) -> dict:
    from onepass.cli import main

    path = out / "data-stats" / f"{name}.json"
    argv = ["data", "stats", "--data", str(AGENT / f"{name}.jsonl"), "--model", "qwen3-8b", "--max-tokens",
            str(max_tokens), "--no-progress", "--out", str(path)] + (["--limit", str(limit)] if limit else [])
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        assert main(argv) == 0
    stats = json.loads(path.read_text())
    return {"printed": [line for line in text.getvalue().splitlines() if "shared" in line or "bound" in line],
            "shared": stats["shared"], "gpu_cost_n_pass": stats["gpu_cost"]}


def markdown(results: dict) -> str:
    lines = [f"{results['platform']}; python {results['python']}; rows of {results['max_tokens']:,} tokens, "
             f"Qwen3 template and vocabulary (builtin:qwen3); schedule {results['schedule']}"
             + (f"; first {results['limit']} conversations" if results["limit"] else ""), "",
             "| data | N-pass | today (one tree per conversation, 32k rows) | shared (32k rows) | today / shared | "
             "issue table | fraction | same loss terms | views trained (skipped) | 8B step ratio (GPU cost model) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in results["sets"].items():
        s, t = r["share-prefix"], r["no-share-prefix"]
        g = r.get("data_stats", {}).get("shared", {}).get("gpu_cost", {})
        lines.append(f"| {TABLE[name]['label']} | {s['n_pass_tokens'] / 1e6:.2f}M | {t['row_tokens']:,} in {t['rows']} | "
                     f"{s['row_tokens']:,} in {s['rows']} | **{r['today_over_shared']:.2f}x** | {r['table']:.2f}x | "
                     f"{r['fraction_of_table']:.0%} | {'yes' if r['same_loss_terms'] else 'NO'} ({r['loss_terms']:,}) | "
                     f"{s['views_trained']:,} ({s['views_skipped']}) | "
                     + (f"{g['step_ratio']:.2f}x (attention {g['attention_ratio']:.2f}x)" if g else "-") + " |")
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    names = list(results["sets"])
    fig = Figure(figsize=(8, 4))
    ax = fig.add_subplot()
    x = range(len(names))
    today = [results["sets"][n]["no-share-prefix"]["row_tokens"] / 1e6 for n in names]
    shared = [results["sets"][n]["share-prefix"]["row_tokens"] / 1e6 for n in names]
    ax.bar([i - 0.2 for i in x], today, 0.4, label="one tree per conversation (today)", color="#9e9e9e")
    ax.bar([i + 0.2 for i in x], shared, 0.4, label="prefixes shared across conversations", color="#1f77b4")
    for i, n in enumerate(names):
        r = results["sets"][n]
        ax.text(i + 0.2, shared[i], f"{r['today_over_shared']:.2f}x\n(table {r['table']:.2f}x)", ha="center",
                va="bottom", fontsize=8)
    ax.set_xticks(list(x), [TABLE[n]["label"].replace(", ", "\n") for n in names], fontsize=8)
    ax.set_ylabel(f"tokens in rows of {results['max_tokens']:,} (millions)")
    ax.set_title("Trained tokens, onepass prepare --pack (same views, same loss)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--sets", default=",".join(TABLE))
    parser.add_argument("--max-tokens", type=int, default=32768)
    parser.add_argument("--schedule", default="one-pass", help="one-pass (the default way) or budget")
    parser.add_argument("--limit", type=int, default=None, help="first N conversations of each set")
    parser.add_argument("--no-data-stats", action="store_true", help="skip onepass data stats (the 8B cost model)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {"platform": platform.platform(), "python": sys.version.split()[0], "max_tokens": args.max_tokens,
               "schedule": args.schedule, "limit": args.limit, "sets": {}}
    for name in args.sets.split(","):
        r = run_one(name, out, args.max_tokens, args.limit, args.schedule)
        if not args.no_data_stats:
            r["data_stats"] = data_stats(name, out, args.max_tokens, args.limit)
        results["sets"][name] = r
        print(f"{name}: today {r['no-share-prefix']['row_tokens']:,} -> shared {r['share-prefix']['row_tokens']:,} "
              f"tokens: {r['today_over_shared']:.2f}x (table {r['table']:.2f}x, {r['fraction_of_table']:.0%}); "
              f"same loss terms: {r['same_loss_terms']}; prepare CPU {r['share-prefix']['cpu_seconds']:.1f} s shared, "
              f"{r['no-share-prefix']['cpu_seconds']:.1f} s not", flush=True)
        for line in r.get("data_stats", {}).get("printed", []):
            print("   ", line.strip(), flush=True)
    (out / "summary.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "table.md").write_text(markdown(results))
    print(markdown(results))
    print(f"wrote {out / 'summary.json'}, {out / 'table.md'}, {plot(results, out / 'shared_prefix.png')}")
    return 0 if all(r["same_loss_terms"] for r in results["sets"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
