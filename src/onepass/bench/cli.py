"""``onepass bench``: run every setting on one workload and write JSON, Markdown and PNGs.

Why this module exists: it is the orchestration around ``harness.py`` (workload,
model, backends, depth groups) and the command line for it. ``--quick`` is
sized to finish in a few minutes on 2 CPU cores and times its settings interleaved in one
process (epochs A B C A B C, as the demo takes turns), so a ratio never spans minutes of a
machine's drift. The workload is any ``--data`` spec of conversations, resolved like every other command's
(:func:`onepass.data.sources.resolve_data`); ``--workload mathchat|synthetic`` are
names for ``builtin:mathchat`` and ``synthetic:mathchat-sync``.

    onepass bench --quick --out runs/bench
    onepass bench --quick --data chats.jsonl --out runs/bench-mine
    onepass bench --quick --shape qwen3-0.6b --layers 2 --out runs/bench-0.6b   # real widths, 2 of 28 layers
    onepass bench --quick --arch qwen3.5 --settings n-pass-packed,one-pass-packed --out runs/bench-hybrid

``--shape`` builds a random-weight Qwen3 of a real model's widths, heads, MLP
and vocabulary; ``--layers N`` cuts its depth. Useful FLOPs are those of the
model run; ``useful_flops_full_depth`` (per-layer FLOPs at the full depth, not
run) is reported beside them. ``--arch qwen3.5`` builds a Gated DeltaNet hybrid at the shape's sizes
(:func:`onepass.bench.harness.arch_kwargs`) and reports the share of each step its recurrent layers
spend passing states between chains (:func:`onepass.mixers.tree.timing`).

The parser imports no torch; the run is :func:`onepass.bench.command.run`.
"""

from __future__ import annotations

import sys
from typing import Any

from onepass.data.sources import load_conversations
from onepass.model.dtypes import dtype_names
from onepass.errors import DataError
from onepass.layout.flops import MODEL_SHAPES

WORKLOADS = {"mathchat": "builtin:mathchat", "synthetic": "synthetic:mathchat-sync",  # --workload NAME: --data SPEC
             "agent": "synthetic:agent"}


def add_parser(sub: Any) -> None:
    p = sub.add_parser("bench", help="training throughput and memory of every schedule, side by side")
    p.add_argument("--out", required=True, help="output directory (summary.json, table.md, *.png)")
    p.add_argument("--quick", action="store_true", help="small workload and few repeats (minutes on CPU), its "
                                                          "settings interleaved in one process (--interleave)")
    data = p.add_mutually_exclusive_group()
    data.add_argument("--data", help="conversations to time: any --data spec of onepass prepare (a file, a "
                                     "folder, a saved dataset, builtin:mathchat, synthetic:NAME, a hub id)")
    data.add_argument("--workload", choices=tuple(WORKLOADS),
                      help="a named workload: " + ", ".join(f"{k} = --data {v}" for k, v in WORKLOADS.items())
                           + " (default mathchat)")
    p.add_argument("--conversations", type=int, help="how many conversations (default: 24 quick, 300 full)")
    p.add_argument("--seed", type=int, default=0, help="model initialisation seed")
    p.add_argument("--tokenizer", default="builtin:qwen3")
    p.add_argument("--shape", "--model-shape", dest="model_shape", default="tiny",
                   help=f"model shape, random weights: {' | '.join(MODEL_SHAPES)} (real widths, heads, MLP and "
                        "vocabulary; default tiny)")
    p.add_argument("--arch", default="qwen3",
                   help="architecture at the shape's sizes: qwen3 (default) or qwen3.5 (Gated DeltaNet hybrid, "
                        "three linear-attention layers to one attention layer; reports the share of the step "
                        "spent passing recurrent states between chains; FLOPs still counted as Qwen3's)")
    p.add_argument("--layers", type=int, default=None,
                   help="cut the shape to N layers so a CPU run fits in minutes (FLOPs are counted for the model "
                        "run; the full depth's are reported beside them, labelled)")
    vocab_group = p.add_mutually_exclusive_group()
    vocab_group.add_argument("--full-vocab", action="store_true",
                             help="keep the tokenizer's whole vocabulary (default for every shape but tiny: the real "
                                  "model's; tiny compacts it to the ids that occur)")
    vocab_group.add_argument("--compact-vocab", action="store_true",
                             help="compact a real shape's vocabulary too, to the ids that occur: the LM head (the "
                                  "same work in every setting) no longer dominates a CPU run of a cut model")
    p.add_argument("--dtype", default=None, choices=dtype_names(),
                   help="float32 (CPU default) or bfloat16 (CUDA default)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--backends", default=None,
                   help="comma-separated attention backends (default: sdpa,onepass_cpu on CPU; flex_attention,sdpa on "
                        "CUDA; onepass_varlen: torch's flash varlen kernel, the FA2-class baseline on N-pass rows "
                        "and the gathered tree path on one-pass rows, CUDA)")
    p.add_argument("--settings", default=None, help="comma-separated settings (default: all)")
    p.add_argument("--max-tokens", type=int, default=None, help="row budget (default 4096; 16384 for --workload agent)")
    p.add_argument("--repeats", type=int, default=None, help="timed epochs per setting (default 2 quick, 5 full)")
    p.add_argument("--depth-groups", action="store_true", help="also time G1/G2/G3 separately")
    p.add_argument("--interleave", action="store_true",
                   help="time every backend x setting in this one process, their epochs interleaved (A B C A B C: "
                        "drift lands on all alike, ratios paired); all models stay resident (GPU)")
    p.set_defaults(func="onepass.bench.command:run")


def workload_spec(data: str | None, workload: str | None) -> tuple[str, str]:
    """``(name, spec)`` of the workload: ``--data SPEC`` as given, or a ``--workload`` name's spec."""
    if data is not None:
        return data, data
    name = workload or "mathchat"
    return name, WORKLOADS[name]


def load_workload(spec: str, n: int) -> list[Any]:
    """The first ``n`` valid conversations of ``spec``; invalid records are counted on stderr, never dropped
    silently. Prepared rows are refused (bench lays the conversations out under every schedule)."""
    report = load_conversations(spec, strict=False, limit=n)
    if report.skipped:
        print(f"skipped {len(report.skipped)} invalid records of {spec}; first: {report.skipped[0]}",
              file=sys.stderr, flush=True)
    if not report.conversations:
        first = f"; first skip: {report.skipped[0]}" if report.skipped else ""
        raise DataError(f"{spec} has no valid conversations to time{first}")
    return report.conversations
