"""The evaluation's outputs: accuracy per turn and per conversation depth, as JSON, Markdown and a plot.

Why this module exists: "did fine-tuning help multi-turn reasoning" is a
question about later turns, so the one overall accuracy hides the answer. The
report splits it two ways:

- **per turn**: accuracy at assistant turn 1, 2, 3, ... over every conversation
  that has that turn;
- **per depth**: conversations grouped by how many assistant turns they have
  (G1, G2, ... as in the data statistics), each with its per-turn accuracy and
  the share of conversations whose scored turns are *all* correct.

Only scored turns count (a turn whose reference has no final answer is listed
under ``unscored``); a reply without a final answer counts as wrong and is
also counted under ``no_answer``, so a model that rambles past
``--max-new-tokens`` is visible as such. A reply with no reasoning, or an empty
``<think></think>`` block, is counted under ``no_reasoning``, every turn (scored or
not): what a model trained on one rendering of each conversation learns to do
at the turns whose reasoning that rendering dropped (docs/policy.md).

Files written by :func:`write_report`: ``summary.json`` (settings + the
numbers), ``predictions.jsonl`` (every turn: reply, extracted and reference
answers, note), ``accuracy.md`` (the tables) and ``accuracy.png``.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from onepass.evaluate.run import TurnResult


def _cell(results: Iterable[TurnResult]) -> dict[str, Any]:
    results = list(results)
    scored = [r for r in results if r.correct is not None]
    correct = sum(bool(r.correct) for r in scored)
    return {"turns": len(results), "scored": len(scored), "correct": correct,
            "accuracy": correct / len(scored) if scored else None,
            "no_answer": sum(r.correct is not None and r.predicted is None for r in results),
            "unscored": len(results) - len(scored),
            "no_reasoning": sum(not (r.reasoning or "").strip() for r in results)}


def summarize(results: Sequence[TurnResult]) -> dict[str, Any]:
    """Overall, per-turn and per-depth counts and accuracies (``accuracy`` None where nothing is scored)."""
    by_turn: dict[int, list[TurnResult]] = defaultdict(list)
    by_depth: dict[int, list[TurnResult]] = defaultdict(list)
    for r in results:
        by_turn[r.turn].append(r)
        by_depth[r.depth].append(r)
    per_depth = []
    for depth in sorted(by_depth):
        rs = by_depth[depth]
        convs: dict[int, list[TurnResult]] = defaultdict(list)
        for r in rs:
            convs[r.conversation].append(r)
        judged = [c for c in convs.values() if any(r.correct is not None for r in c)]
        all_correct = sum(all(r.correct is not False for r in c) for c in judged)
        turns: dict[int, list[TurnResult]] = defaultdict(list)
        for r in rs:
            turns[r.turn].append(r)
        per_depth.append({"depth": depth, "conversations": len(convs), **_cell(rs),
                          "all_correct": all_correct / len(judged) if judged else None,
                          "per_turn": [{"turn": t, **_cell(turns[t])} for t in sorted(turns)]})
    return {"conversations": len({r.conversation for r in results}), **_cell(results),
            "per_turn": [{"turn": t, **_cell(by_turn[t])} for t in sorted(by_turn)],
            "per_depth": per_depth}


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def markdown(summary: Mapping[str, Any], settings: Mapping[str, Any] | None = None) -> str:
    """Two tables: accuracy by turn (with counts), and by depth x turn."""
    lines = []
    if settings:
        lines += ["Settings: " + ", ".join(f"{k} {v}" for k, v in settings.items() if v is not None), ""]
    lines += [f"Overall: {_pct(summary['accuracy'])} ({summary['correct']}/{summary['scored']} scored turns "
              f"of {summary['conversations']} conversations; {summary['no_answer']} replies without a final "
              f"answer, counted wrong; {summary['unscored']} turns unscored: no reference answer)", "",
              "| turn | accuracy | correct | scored | no answer | unscored | no reasoning |",
              "|---|---|---|---|---|---|---|"]
    for c in summary["per_turn"]:
        lines.append(f"| {c['turn']} | {_pct(c['accuracy'])} | {c['correct']} | {c['scored']} | "
                     f"{c['no_answer']} | {c['unscored']} | {c['no_reasoning']} of {c['turns']} |")
    turns = [c["turn"] for c in summary["per_turn"]]
    lines += ["", "| depth | conversations | " + " | ".join(f"turn {t}" for t in turns)
              + " | all turns | all correct |", "|---" * (len(turns) + 4) + "|"]
    for d in summary["per_depth"]:
        cells = {c["turn"]: c for c in d["per_turn"]}
        row = [_pct(cells[t]["accuracy"]) if t in cells else "" for t in turns]
        lines.append(f"| {d['depth']} | {d['conversations']} | " + " | ".join(row)
                     + f" | {_pct(d['accuracy'])} | {_pct(d['all_correct'])} |")
    return "\n".join(lines) + "\n"


def plot(summary: Mapping[str, Any], out: str | Path, title: str = "accuracy by turn") -> Path:
    """Accuracy against turn: one line over all conversations, one per depth."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)

    def line(cells: Sequence[Mapping[str, Any]], **style: Any) -> None:
        xs = [c["turn"] for c in cells if c["accuracy"] is not None]
        ys = [100 * c["accuracy"] for c in cells if c["accuracy"] is not None]
        ax.plot(xs, ys, marker="o", **style)

    line(summary["per_turn"], color="black", linewidth=2.5, label="all conversations")
    for d in summary["per_depth"]:
        line(d["per_turn"], linestyle="--", label=f"depth {d['depth']} ({d['conversations']} conv.)")
    turns = [c["turn"] for c in summary["per_turn"]]
    ax.set_xticks(turns or [1])
    ax.set_ylim(-2, 102)
    ax.set_xlabel("assistant turn")
    ax.set_ylabel("accuracy (%)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out)
    plt.close(fig)
    return out


def write_report(results: Sequence[TurnResult], out_dir: str | Path,
                 settings: Mapping[str, Any] | None = None) -> dict[str, Path]:
    """Write summary.json, predictions.jsonl, accuracy.md and accuracy.png into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary = summarize(results)
    paths = {"summary": out / "summary.json", "predictions": out / "predictions.jsonl",
             "table": out / "accuracy.md", "plot": out / "accuracy.png"}
    paths["summary"].write_text(json.dumps({"settings": dict(settings or {}), **summary}, indent=2) + "\n")
    with paths["predictions"].open("w", encoding="utf-8") as f:
        for r in results:
            f.write(json.dumps(r.to_dict(), ensure_ascii=False) + "\n")
    paths["table"].write_text(markdown(summary, settings))
    plot(summary, paths["plot"], title=f"accuracy by turn ({(settings or {}).get('history', 'reference')} history)")
    return paths
