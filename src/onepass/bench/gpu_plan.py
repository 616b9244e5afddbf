"""The speed step of ``make gpu-check``: what it times, laid out and costed before any GPU is touched.

Why this module exists: onepass exists for long multi-turn reasoning and agent conversations at real
widths, and a GPU is lent for minutes. So the step's whole plan (workloads, rows, the FLOP bound of each
setting, the table's columns, and whether the time boxes add up at a conservative rate) is built here,
with no torch, and the suite runs it on CPU (the dry run: ``python -m onepass.bench.gpu_speed --dry-run``).
:mod:`onepass.bench.gpu_speed` times the same plan on CUDA.

The plan (issue 42): Qwen3-8B width (:data:`LAYERS` of its 36 layers, the full 151,936-id vocabulary,
bf16), rows of :data:`ROW_TOKENS` tokens, four workloads of about two one-pass rows each::

    mathchat             builtin:mathchat: MathChat as users have it, 2-3 turns (ships with onepass)
    mathchat-deep-long   synthetic:mathchat-deep-long: 6-16 turns, long reasoning (seeded, made there)
    tau-bench-airline    benchmarks/data/gpu-check/taubench_airline.jsonl (7 conversations, real)
    bfcl                 benchmarks/data/gpu-check/bfcl_base.jsonl (11 conversations, real)

and per workload the settings of :data:`TIMED`: N-pass packed on torch's flash varlen kernel (the
FA2-class baseline every ratio is against), one-pass packed on flex and on the gathered varlen path
(:mod:`onepass.attention.gather`), and the same sharing prefixes across conversations (the agent sets;
MathChat conversations share none, so that row says so instead of being timed).

Each setting's FLOP bound is N-pass FLOPs over its FLOPs (:func:`onepass.layout.flops.train_flops`:
tokens, visible pairs, targets of the model run). Flex rows are padded to :data:`ROW_TOKENS` when run
(flex compiles once per row length: one compile, not one per row); varlen rows run at their own length
(nothing compiles). Padding is counted as waste, never as useful work.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from onepass.bench.ratio import speed_ratio
from onepass.bench.settings import SHARED_SETTINGS, layout_setting
from onepass.data.sources import load_conversations
from onepass.layout.flops import MODEL_SHAPES, ModelShape, speed_bound, train_flops, visible_pairs
from onepass.layout.tree import Layout
from onepass.layout.view import View
from onepass.render.views import render_conversation

ROOT = Path(__file__).resolve().parents[3]  # the repository (src/onepass/bench/gpu_plan.py)
ROW_TOKENS = 32768
SHAPE = "qwen3-8b"
LAYERS = 4
FLEX, VARLEN = "flex_attention", "onepass_varlen"
BASELINE = ("n-pass-packed", VARLEN)  # N-pass packed on torch's flash varlen kernel: the FA2-class baseline
TIMED = (BASELINE, ("one-pass-packed", FLEX), ("one-pass-packed", VARLEN),
         ("one-pass-packed-shared", FLEX), ("one-pass-packed-shared", VARLEN))
# the dry run's cost model: a rate an H100 or H200 beats at this width (bf16, ~40% of an H100's dense peak),
# flex's compile, building the data, the model and the masks, a fixed cost per step (optimizer, launches)
ASSUMED_FLOPS = 300e12
ASSUMED_COMPILE_SECONDS = 60.0
ASSUMED_SETUP_SECONDS = 30.0
STEP_OVERHEAD_SECONDS = 0.03
MAX_ROUNDS = 3  # timed rounds (every setting once, interleaved) after the warm-up step of each


@dataclass(frozen=True, kw_only=True, slots=True)
class Workload:
    """Conversations the speed step times: a ``--data`` spec (a relative path is from the repository root)."""

    name: str
    data: str
    conversations: int
    what: str


WORKLOADS = (
    Workload(name="mathchat", data="builtin:mathchat", conversations=100,
             what="MathChat, 2-3 turns (the workload issue 42's cost model predicts 1.24x for)"),
    Workload(name="mathchat-deep-long", data="synthetic:mathchat-deep-long", conversations=9,
             what="MathChat-shaped, 6-16 turns, long reasoning (synthetic, seeded)"),
    Workload(name="tau-bench-airline", data="benchmarks/data/gpu-check/taubench_airline.jsonl", conversations=7,
             what="tau-bench airline: GPT-4o agent, simulated user, 14 tools, one shared policy prompt"),
    Workload(name="bfcl", data="benchmarks/data/gpu-check/bfcl_base.jsonl", conversations=11,
             what="BFCL v4 multi_turn_base: tool calls, tool schemas per tool-class combination"),
)


@dataclass(frozen=True, kw_only=True, slots=True)
class Timed:
    """One setting of one workload: its rows (each padded to the row length when run) and its FLOP bound."""

    workload: str
    setting: str
    backend: str
    rows: tuple[Layout, ...]
    conversations: int
    useful_flops: float  # train_flops of the rows, padding excluded
    bound: float  # N-pass packed FLOPs / this setting's FLOPs (1.0 for the baseline)

    @property
    def key(self) -> str:
        return f"{self.workload}/{self.setting}/{self.backend}"

    @property
    def tokens(self) -> int:
        return sum(len(r) for r in self.rows)

    @property
    def padded(self) -> bool:
        """Whether its rows run padded to the row length (flex: one compile for every row)."""
        return self.backend == FLEX

    def run_tokens(self, row: Layout, row_tokens: int) -> int:
        return row_tokens if self.padded else len(row)

    def work(self, row_tokens: int) -> dict[str, int]:
        """What an epoch's cost grows with (:func:`onepass.layout.flops.speed_bound`), padding included."""
        return {"rows": len(self.rows), "tokens": sum(self.run_tokens(r, row_tokens) for r in self.rows),
                "visible_pairs": sum(visible_pairs(r) for r in self.rows),
                "targets": sum(r.num_targets for r in self.rows)}


@dataclass(frozen=True, kw_only=True, slots=True)
class SpeedPlan:
    """Everything the speed step runs, in the order it runs (rounds interleave :attr:`timed`)."""

    shape: ModelShape  # the model run: SHAPE's widths, LAYERS layers, the full vocabulary
    full_layers: int
    row_tokens: int
    timed: tuple[Timed, ...]
    notes: tuple[str, ...]  # what was not timed, and why

    def step_seconds(self, t: Timed, row: Layout, rate: float = ASSUMED_FLOPS) -> float:
        """A training step's seconds on one row of ``t`` at ``rate`` FLOP/s (the cost model)."""
        s = self.shape
        flops = 3.0 * (s.linear_flops_per_token * t.run_tokens(row, self.row_tokens)
                       + s.attention_flops_per_pair * visible_pairs(row) + s.head_flops_per_target * row.num_targets)
        return flops / rate + STEP_OVERHEAD_SECONDS

    def round_seconds(self, rate: float = ASSUMED_FLOPS) -> float:
        """One timed round: every setting's rows once."""
        return sum(self.step_seconds(t, r, rate) for t in self.timed for r in t.rows)

    def budget(self, seconds: float, rate: float = ASSUMED_FLOPS) -> dict[str, float]:
        """How ``seconds`` are spent at ``rate``: setup, compile, one warm-up step per setting, then as many
        timed rounds as fit (at most :data:`MAX_ROUNDS`)."""
        warm = sum(self.step_seconds(t, t.rows[0], rate) for t in self.timed if t.rows)
        left = seconds - ASSUMED_SETUP_SECONDS - ASSUMED_COMPILE_SECONDS - warm
        per_round = self.round_seconds(rate)
        rounds = max(0, min(MAX_ROUNDS, math.floor(left / per_round))) if per_round else 0
        return {"seconds": seconds, "rate": rate, "setup": ASSUMED_SETUP_SECONDS, "compile": ASSUMED_COMPILE_SECONDS,
                "warm_up": warm, "round": per_round, "rounds": rounds,
                "total": ASSUMED_SETUP_SECONDS + ASSUMED_COMPILE_SECONDS + warm + rounds * per_round}


def workload_views(workload: Workload, tokenizer: Any, root: Path = ROOT,
                   limit: int | None = None) -> tuple[list[list[View]], list[str]]:
    """The rendered views of ``workload``'s first conversations (``limit`` overrides their number), and a
    line per record or view skipped (counted, never silently)."""
    data = workload.data
    if not data.startswith(("synthetic:", "builtin:")):
        data = str(root / data)
    report = load_conversations(data, strict=False, limit=limit or workload.conversations)
    notes = [f"{workload.name}: record skipped: {s}" for s in report.skipped]
    views = []
    for conversation in report.conversations:
        rendered = render_conversation(conversation, tokenizer)
        notes += [f"{workload.name}: view skipped: {e}" for e in rendered.skipped]
        views.append([v for v in rendered.views if isinstance(v, View)])
    return views, notes


def build_plan(views_by_workload: Mapping[str, Sequence[Sequence[View]]], *, shape: ModelShape | None = None,
               layers: int = LAYERS, row_tokens: int = ROW_TOKENS, vocab: int | None = None,
               timed: Sequence[tuple[str, str]] = TIMED) -> SpeedPlan:
    """The plan for these workloads' views: rows of every setting in ``timed`` (a conversation with a view
    or tree over ``row_tokens`` is left out, said in a note), bounds against N-pass packed."""
    full = shape or MODEL_SHAPES[SHAPE]
    run = dataclasses.replace(full, num_layers=min(layers, full.num_layers),
                              vocab=vocab if vocab is not None else full.vocab)
    out: list[Timed] = []
    notes: list[str] = []
    for name, views in views_by_workload.items():
        fits = [v for v in views if v and max(len(x) for x in v) <= row_tokens]
        if len(fits) < len(views):
            notes.append(f"{name}: {len(views) - len(fits)} conversations left out (a view over {row_tokens} tokens "
                         "or none)")
        rows: dict[str, tuple[Layout, ...]] = {}
        for setting in dict.fromkeys([BASELINE[0], *(s for s, _ in timed), *SHARED_SETTINGS.values()]):
            rows[setting] = tuple(layout_setting(fits, setting, row_tokens))
        n_pass = train_flops(rows[BASELINE[0]], run)
        for setting, backend in timed:
            base = SHARED_SETTINGS.get(setting)
            if base and sum(map(len, rows[setting])) == sum(map(len, rows[base])):
                note = (f"{name}: {setting}: no prefix shared across conversations (its rows are {base}'s): "
                        "not timed")
                notes += [] if note in notes else [note]
                continue
            flops = train_flops(rows[setting], run)
            out.append(Timed(workload=name, setting=setting, backend=backend, rows=rows[setting],
                             conversations=len(fits), useful_flops=flops, bound=n_pass / flops if flops else 1.0))
    return SpeedPlan(shape=run, full_layers=full.num_layers, row_tokens=row_tokens, timed=tuple(out),
                     notes=tuple(notes))


# ---------------------------------------------------------------------------------------------
# the table: the same columns for the dry run (no measurements) and the GPU run

COLUMNS = ("workload", "setting", "backend", "rows", "tokens", "FLOP bound", "tokens/s", "vs flash N-pass",
           "fraction of bound", "useful-FLOP utilisation", "peak memory GiB", "memory vs flash N-pass", "compile s")


def figures(plan: SpeedPlan, measured: Mapping[str, Mapping[str, Any]] | None = None,
            matmul_flops: float | None = None) -> list[dict[str, Any]]:
    """One record per timed setting, :data:`COLUMNS` as keys (None where nothing was measured).

    ``measured[key]``: ``epoch_seconds`` (one per timed round, interleaved with every other setting's),
    ``peak_memory_bytes``, ``compile_seconds``. The speedup is the median of the per-round ratios against
    the baseline's epoch of the same round (:func:`onepass.bench.ratio.speed_ratio`, checked against the
    counted work), the fraction of the bound that speedup over the FLOP bound, the utilisation the useful
    FLOPs per second over ``matmul_flops`` (a dense 8B-layer matmul's rate, measured in the same run).
    """
    measured = measured or {}
    out = []
    for t in plan.timed:
        m = measured.get(t.key) or {}
        base_t = next((b for b in plan.timed if b.workload == t.workload and (b.setting, b.backend) == BASELINE), None)
        base = measured.get(base_t.key) if base_t else None
        epochs = list(m.get("epoch_seconds") or [])
        median = sorted(epochs)[len(epochs) // 2] if epochs else None
        ratio = None
        if epochs and base and base.get("epoch_seconds") and base_t is not t:
            n = min(len(epochs), len(base["epoch_seconds"]))
            ratio = speed_ratio(base["epoch_seconds"][:n], epochs[:n], paired=True,
                                bound=speed_bound(base_t.work(plan.row_tokens), t.work(plan.row_tokens)))
        peak, base_peak = m.get("peak_memory_bytes"), (base or {}).get("peak_memory_bytes")
        out.append({
            "key": t.key, "workload": t.workload, "setting": t.setting, "backend": t.backend, "rows": len(t.rows),
            "tokens": t.tokens, "conversations": t.conversations, "useful_flops": t.useful_flops,
            "FLOP bound": t.bound,
            "tokens/s": t.tokens / median if median else None,
            "vs flash N-pass": ratio.median if ratio else (1.0 if base_t is t and epochs else None),
            "speed_ratio": {**dataclasses.asdict(ratio), "disturbed": ratio.disturbed} if ratio else None,
            "fraction of bound": ratio.median / t.bound if ratio and t.bound else None,
            "useful-FLOP utilisation": t.useful_flops / median / matmul_flops if median and matmul_flops else None,
            "peak memory GiB": peak / 2**30 if peak else None,
            "memory vs flash N-pass": peak / base_peak if peak and base_peak else None,
            "compile s": m.get("compile_seconds"),
            "epoch_seconds": epochs,
        })
    return out


def _cell(value: Any, column: str) -> str:
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    if column in ("rows", "tokens"):
        return f"{value:,}"
    if column == "tokens/s":
        return f"{value:,.0f}"
    if column in ("fraction of bound", "useful-FLOP utilisation"):
        return f"{value:.0%}"
    if column in ("FLOP bound", "vs flash N-pass", "memory vs flash N-pass"):
        return f"{value:.2f}x"
    return f"{value:.1f}"


def table(rows: Sequence[Mapping[str, Any]]) -> str:
    """:func:`figures` as a Markdown table of :data:`COLUMNS`."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_cell(r[c], c) for c in COLUMNS) + " |" for r in rows]
    return "\n".join(lines) + "\n"
