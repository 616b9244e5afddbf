"""Dataset statistics: depths, segment lengths, N-pass vs one-pass tokens, ideal speedup.

Why this module exists: whether one-pass pays off on a data set is a question
of its shape: how deep the conversations are and how long the human,
reasoning and response segments are (the paper's characteristic length
``l`` = the 95th percentile of a segment's tokens). This module measures
that for a tokenizer and turns it into an ideal speedup for a model shape.

The ideal speedup is N-pass FLOPs over one-pass FLOPs of the same views,
counted by :mod:`onepass.layout.flops` (the same accounting ``onepass bench`` uses):
"ideal" means exactly the attended pairs are computed (a perfect
block-sparse kernel). Example: one view of 4 tokens and one of 6 sharing a
3-token prefix -> N-pass 10 tokens, 10 + 21 = 31 pairs; one-pass 7 nodes,
1+2+3+4 + 4+5+6 = 25 pairs.

Shared prefixes (``shared``, :mod:`onepass.layout.share`): the one-pass trees packed into rows of
``max_tokens`` as ``prepare --pack`` packs them, once with one tree per conversation (today's
rows) and once with the trees of conversations that share a prefix merged: the tokens the prefixes
save, and the bound and GPU cost of the shared rows against today's one-pass rows.

What a single rendering would train (``single_rendering``, :mod:`onepass.render.single`): the whole
conversation rendered once, every assistant turn a target (TRL-style SFT), against the views: the turns it
trains without their reasoning, those it conditions on earlier reasoning unseen at inference, and the
reasoning tokens it never trains. ``single_template``: the template of that rendering when it is not the
model's own (TRL's training template: ``onepass data stats --single-template trl``).

GPU cost model (``gpu_cost``): kernels compute whole 128 x 128 tiles, not pairs.
One-pass: the non-empty tiles of each conversation's tree row, from the same
block plan FlexAttention runs (:func:`onepass.attention.blocks.block_plan`).
N-pass: FA2 varlen computes each view's causal lower triangle of tiles
(:func:`onepass.layout.flops.causal_tiles`). The predicted ratios assume one tile
costs the same in both kernels (FlexAttention is usually somewhat slower per
tile than FA2, so read them as an upper bound) and count rows unpacked.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from onepass.attention.blocks import block_plan
from onepass.conversation.parse import Conversation
from onepass.layout.flops import (
    TILE,
    ModelShape,
    TokenCounts,
    causal_tiles,
    conversation_counts,
    flops,
    forward_flops,
    model_shape,
    tile_step_flops,
    token_ratio,
    visible_pairs,
)
from onepass.layout.pack import pack_layouts
from onepass.layout.view import View
from onepass.render import RenderConfig, render_conversation
from onepass.render.single import SingleRendering, add_counts, single_rendering
from onepass.layout.share import share_rows
from onepass.layout.tree import Layout, build_layout

PERCENTILES = (50, 90, 95, 99)


def percentiles(lengths: Iterable[int]) -> dict[str, float]:
    """count, mean, max and P50/P90/P95/P99 (numpy's linear interpolation) of ``lengths``."""
    x = np.asarray(list(lengths), dtype=np.float64)
    if x.size == 0:
        return {"count": 0}
    out = {"count": int(x.size), "mean": round(float(x.mean()), 2), "max": int(x.max())}
    out.update({f"p{p}": round(float(np.percentile(x, p)), 2) for p in PERCENTILES})
    return out


def segment_texts(conv: Conversation) -> dict[str, list[str]]:
    """The text of each segment kind: human (user), reasoning (non-empty), response, tool, system."""
    out: dict[str, list[str]] = {"human": [], "reasoning": [], "response": []}
    for m in conv.messages:
        if m.role == "user":
            out["human"].append(m.content)
        elif m.role == "assistant":
            out["response"].append(m.content)
            if m.reasoning:
                out["reasoning"].append(m.reasoning)
        elif m.role == "tool":
            out.setdefault("tool", []).append(m.content)
    if conv.system:
        out["system"] = [conv.system]
    return out


@dataclass(kw_only=True)
class DataStats:
    """What ``onepass data stats`` prints and writes as JSON."""

    conversations: int = 0
    depths: dict[int, int] = field(default_factory=dict)  # assistant turns -> conversations
    empty_reasoning_turns: int = 0
    segments: dict[str, dict[str, float]] = field(default_factory=dict)  # kind -> percentiles
    characteristic_length: dict[str, float] = field(default_factory=dict)  # kind -> P95 (the paper's l)
    tokens: dict[str, int] = field(default_factory=dict)
    token_ratio: float = 0.0
    model: dict[str, Any] = field(default_factory=dict)
    flops_n_pass: int = 0
    flops_one_pass: int = 0
    ideal_speedup: float = 0.0
    attention_speedup: float = 0.0  # attention pairs alone
    gpu_cost: dict[str, Any] = field(default_factory=dict)  # 128x128 tiles: FlexAttention vs FA2 varlen
    shared: dict[str, Any] = field(default_factory=dict)  # packed rows, prefixes shared vs one tree per conversation
    single_rendering: dict[str, int] = field(default_factory=dict)  # what one rendering of each conversation would
    # train instead of its views (onepass.render.single)
    skipped: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["depths"] = {str(k): v for k, v in sorted(self.depths.items())}
        return d

    def summary(self) -> str:
        depth = " ".join(f"{k}:{v}" for k, v in sorted(self.depths.items()))
        lines = [f"conversations {self.conversations}; depth (assistant turns: conversations) {depth}"]
        for kind, p in self.segments.items():
            if p.get("count"):
                lines.append(f"  {kind:<9} n={p['count']:<6} median {p['p50']:g}  P95 {p['p95']:g}  "
                             f"max {p['max']}  mean {p['mean']:g} tokens")
        if self.empty_reasoning_turns:
            lines.append(f"  {self.empty_reasoning_turns} assistant turns have empty reasoning (trained too)")
        if self.tokens:
            lines.append(f"tokens: N-pass {self.tokens['n_pass_tokens']:,}  one-pass "
                         f"{self.tokens['one_pass_tokens']:,}  ratio {self.token_ratio:.2f}x")
            lines.append(f"ideal speedup for {self.model.get('name')}: {self.ideal_speedup:.2f}x "
                         f"(attention alone {self.attention_speedup:.2f}x)")
        if self.gpu_cost:
            g = self.gpu_cost
            lines.append(f"GPU cost ({g['tile']}x{g['tile']} tiles): FlexAttention one-pass {g['one_pass_tiles']:,} "
                         f"vs FA2 varlen N-pass {g['n_pass_tiles']:,}; predicted attention "
                         f"{g['attention_ratio']:.2f}x, step {g['step_ratio']:.2f}x (equal cost per tile)")
        if self.shared:
            sh, g = self.shared, self.shared["gpu_cost"]
            lines.append(f"shared prefixes, rows of {sh['max_tokens']:,}: {sh['one_pass_row_tokens']:,} tokens in "
                         f"{sh['one_pass_rows']} rows with one tree per conversation -> {sh['shared_row_tokens']:,} "
                         f"in {sh['shared_rows']} ({sh['shared_prefix_tokens']:,} shared-prefix tokens computed "
                         f"once per row; token ratio {sh['token_ratio']:.2f}x)")
            vs_n = f"vs N-pass {sh['ideal_speedup_vs_n_pass']:.2f}x, " if sh["ideal_speedup_vs_n_pass"] else ""
            lines.append(f"  bound vs one-pass rows {sh['ideal_speedup']:.2f}x ({vs_n}"
                         f"attention alone {sh['attention_speedup']:.2f}x); GPU cost ({g['tile']}x{g['tile']} tiles) "
                         f"{g['one_pass_tiles']:,} -> {g['shared_tiles']:,}: predicted attention "
                         f"{g['attention_ratio']:.2f}x, step {g['step_ratio']:.2f}x")
            if sh["trees_over_max_tokens"]:
                lines.append(f"  {sh['trees_over_max_tokens']} one-pass trees are longer than {sh['max_tokens']:,} "
                             "tokens: left out of both (prepare skips them, or splits them with --schedule budget)")
        if self.single_rendering:
            lines.append(SingleRendering(**self.single_rendering).summary())
        if self.skipped:
            lines.append(f"SKIPPED {len(self.skipped)}; first: {self.skipped[0]}")
        return "\n".join(lines)


def depth_histogram(conversations: Iterable[Conversation]) -> dict[int, int]:
    return dict(sorted(Counter(c.num_assistant_turns for c in conversations).items()))


def compute_stats(conversations: Iterable[Conversation], tokenizer: Any = None, *,
                  shape: ModelShape | str = "qwen3-8b", render: Any = None, progress: bool = False,
                  total: int | None = None, max_tokens: int | None = 32768,
                  single_template: str | None = None) -> DataStats:
    """Statistics of ``conversations``. Without a ``tokenizer``: depths only.

    A conversation the template cannot render is counted in ``skipped`` (its segments and
    depth still count; its tokens do not). ``max_tokens``: the row budget of the shared-prefix
    figures (:func:`shared_cost`); None leaves them out. ``single_rendering``: what one rendering of
    each conversation would train instead of its views (:mod:`onepass.render.single`, every view's prompt
    checked against the inference prompt), by the tokenizer's template or ``single_template``.
    """
    shape = model_shape(shape) if isinstance(shape, str) else shape
    stats = DataStats()
    depths: Counter[int] = Counter()
    lengths: dict[str, list[int]] = {}
    counts = TokenCounts()
    tiles = {"one_pass": 0, "n_pass": 0}
    trees: list[Layout] = []  # one per conversation: the shared-prefix rows are made of them
    single: dict[str, int] = {}
    items: Iterable[Conversation] = conversations
    if progress:
        from tqdm.auto import tqdm

        items = tqdm(conversations, total=total, desc="stats", unit="conv")
    for conv in items:
        stats.conversations += 1
        depths[conv.num_assistant_turns] += 1
        stats.empty_reasoning_turns += sum(m.role == "assistant" and not m.reasoning for m in conv.messages)
        if tokenizer is None:
            continue
        texts = segment_texts(conv)
        flat = [t for kind in texts for t in texts[kind]]
        ids = tokenizer(flat, add_special_tokens=False)["input_ids"] if flat else []
        k = 0
        for kind, group in texts.items():
            lengths.setdefault(kind, []).extend(len(x) for x in ids[k:k + len(group)])
            k += len(group)
        config = render or RenderConfig()
        rendered = render_conversation(conv, tokenizer, config, keep_texts=True)
        single = add_counts(single, single_rendering(conv, tokenizer, config, rendered, template=single_template,
                                                     check_prompts=True))
        if rendered.skipped:
            stats.skipped.append(str(rendered.skipped[0]))
            continue
        views = [v for v in rendered.views if isinstance(v, View)]  # all of them: no max_tokens
        if views:
            layout = build_layout(views)
            counts.add(conversation_counts(views, layout))
            plan = block_plan(layout.kv_end, TILE)
            tiles["one_pass"] += plan.num_partial + plan.num_full
            tiles["n_pass"] += sum(causal_tiles(len(v)) for v in views)
            if max_tokens is not None:
                trees.append(layout)
    stats.depths = dict(sorted(depths.items()))
    if tokenizer is None:
        return stats
    stats.single_rendering = single
    stats.segments = {kind: percentiles(v) for kind, v in lengths.items()}
    stats.characteristic_length = {kind: p["p95"] for kind, p in stats.segments.items() if p.get("count")}
    stats.tokens = asdict(counts)
    stats.token_ratio = counts.token_ratio
    stats.model = asdict(shape)
    stats.flops_n_pass, stats.flops_one_pass = flops(counts, shape)
    stats.ideal_speedup = stats.flops_n_pass / stats.flops_one_pass if stats.flops_one_pass else 0.0
    stats.attention_speedup = counts.n_pass_pairs / counts.one_pass_pairs if counts.one_pass_pairs else 0.0
    stats.gpu_cost = gpu_cost(counts, tiles["n_pass"], tiles["one_pass"], shape)
    if max_tokens is not None and trees:
        stats.shared = shared_cost(trees, max_tokens, shape, counts)
    return stats


def _tiles(rows: Sequence[Layout]) -> int:
    return sum(int(plan.num_partial + plan.num_full) for plan in (block_plan(r.kv_end, TILE) for r in rows))


def shared_cost(trees: Sequence[Layout], max_tokens: int, shape: ModelShape,
                counts: TokenCounts | None = None) -> dict[str, Any]:
    """One-pass ``trees`` (one per conversation) packed into rows of ``max_tokens``, without and with
    shared prefixes (:func:`onepass.layout.share.share_rows`): tokens, FLOP bounds (visible pairs) and the
    GPU tile cost of both, and the predicted step-time ratio (today's rows / shared rows). Trees longer
    than ``max_tokens`` are left out of both (counted). ``counts``: the N-pass counts, for the bound
    against N-pass."""
    fits = [t for t in trees if len(t) <= max_tokens]
    today = pack_layouts(fits, max_tokens)
    shared = share_rows(fits, None, max_tokens)

    def totals(rows: Sequence[Layout]) -> dict[str, int]:
        return {"tokens": sum(len(r) for r in rows), "pairs": sum(visible_pairs(r) for r in rows),
                "targets": sum(r.num_targets for r in rows)}

    a, b = totals(today), totals(shared)
    one_flops, shared_flops = forward_flops(shape, **a), forward_flops(shape, **b)
    tiles_a, tiles_b = _tiles(today), _tiles(shared)
    step_a = tile_step_flops(shape, tokens=a["tokens"], tiles=tiles_a, targets=a["targets"])
    step_b = tile_step_flops(shape, tokens=b["tokens"], tiles=tiles_b, targets=b["targets"])
    n_flops = flops(counts, shape)[0] if counts is not None and len(fits) == len(trees) else None
    return {
        "max_tokens": max_tokens, "trees": len(fits), "trees_over_max_tokens": len(trees) - len(fits),
        "one_pass_rows": len(today), "one_pass_row_tokens": a["tokens"],
        "shared_rows": len(shared), "shared_row_tokens": b["tokens"],
        "shared_prefix_tokens": a["tokens"] - b["tokens"], "token_ratio": token_ratio(a["tokens"], b["tokens"]),
        "ideal_speedup": one_flops / shared_flops if shared_flops else 0.0,
        "ideal_speedup_vs_n_pass": n_flops / shared_flops if n_flops and shared_flops else 0.0,
        "attention_speedup": a["pairs"] / b["pairs"] if b["pairs"] else 0.0,
        "gpu_cost": {"tile": TILE, "one_pass_tiles": tiles_a, "shared_tiles": tiles_b,
                     "attention_ratio": tiles_a / tiles_b if tiles_b else 0.0,
                     "step_ratio": step_a / step_b if step_b else 0.0,
                     "assumes": "equal cost per tile; both packed best-fit decreasing into rows of max_tokens"},
    }


def gpu_cost(counts: TokenCounts, n_pass_tiles: int, one_pass_tiles: int, shape: ModelShape) -> dict[str, Any]:
    """Tiles each kernel computes and the attention and step ratios they predict (N-pass / one-pass)."""
    if not one_pass_tiles:
        return {}
    n_step = tile_step_flops(shape, tokens=counts.n_pass_tokens, tiles=n_pass_tiles, targets=counts.targets)
    one_step = tile_step_flops(shape, tokens=counts.one_pass_tokens, tiles=one_pass_tiles, targets=counts.targets)
    return {"tile": TILE, "one_pass_tiles": one_pass_tiles, "n_pass_tiles": n_pass_tiles,
            "attention_ratio": n_pass_tiles / one_pass_tiles, "step_ratio": n_step / one_step,
            "assumes": "equal cost per tile (FlexAttention vs FA2); one conversation per row"}


def plot_depths(after: Mapping[int, int], out: str | Path, *, before: Mapping[int, int] | None = None,
                labels: tuple[str, str] = ("before sampling", "after sampling"), title: str | None = None
                ) -> Path:
    """A bar chart of conversations per depth (log scale), before vs after when both are given
    (the paper's figure 4). Returns the PNG path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    depths = sorted(set(after) | set(before or {}))
    x = np.arange(len(depths))
    fig, ax = plt.subplots(figsize=(max(6.0, 0.42 * len(depths) + 2), 3.8), dpi=120)
    series = ([(before, labels[0], "#9e9e9e")] if before is not None else []) + [(after, labels[1], "#1f77b4")]
    width = 0.8 / len(series)
    for j, (counts, label, color) in enumerate(series):
        values = [counts.get(d, 0) for d in depths]
        offset = (j - (len(series) - 1) / 2) * width
        ax.bar(x + offset, values, width, label=f"{label} ({sum(values):,})", color=color)
    ax.set_yscale("log")
    ax.set_xticks(x, [str(d) for d in depths])
    ax.set_xlabel("conversation depth (assistant turns)")
    ax.set_ylabel("conversations (log scale)")
    ax.set_title(title or "Conversation depth" + (" before and after sampling" if before is not None else ""))
    ax.legend(frameon=False)
    ax.grid(axis="y", alpha=0.3, which="both")
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out
