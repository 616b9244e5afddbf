"""Dataset statistics: depths, segment lengths, N-pass vs one-pass tokens, ideal speedup.

Why this module exists: whether one-pass pays off on a data set is a question
of its shape: how deep the conversations are and how long the human,
reasoning and response segments are (the paper's characteristic length
``l`` = the 95th percentile of a segment's tokens). This module measures
that for a tokenizer and turns it into an ideal speedup for a model shape.

Ideal speedup (forward FLOPs; the backward pass is ~2x the forward for both,
so the ratio is that of training). For a model with ``L`` layers, hidden
size ``d``, ``q = heads * head_dim``, ``kv = kv_heads * head_dim``, SwiGLU
width ``f`` and vocabulary ``V``::

    linear per token        2 L (d (q + 2 kv) + q d + 3 d f)
    attention per (q, k)    4 L q              (Q K^T and P V, 2 q each)
    LM head per target      2 d V              (targets only: the same in both)

    FLOPs = linear * tokens + attention * pairs + head * targets
    N-pass:   tokens = sum_v n_v      pairs = sum_v n_v (n_v + 1) / 2    (causal views)
    one-pass: tokens = nodes          pairs = sum_p (position_ids[p] + 1) (a node sees its
                                                                          ancestors and itself)
    ideal speedup = FLOPs_N / FLOPs_one

"Ideal": exactly the attended pairs are computed (a perfect block-sparse
kernel); real kernels compute whole blocks. Example: one view of 4 tokens and
one of 6 sharing a 3-token prefix -> N-pass 10 tokens, 10 + 21 = 31 pairs;
one-pass 7 nodes, 1+2+3+4 + 4+5+6 = 25 pairs.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from onepass.conversation import Conversation

PERCENTILES = (50, 90, 95, 99)


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelShape:
    """What FLOPs depend on. ``from_config`` reads a HF ``config.json``."""

    name: str
    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn: int
    vocab: int

    @classmethod
    def from_config(cls, path: str | Path) -> ModelShape:
        path = Path(path)
        file = path / "config.json" if path.is_dir() else path
        try:
            c = json.loads(file.read_text(encoding="utf-8"))
            heads = c["num_attention_heads"]
            return cls(name=str(path), num_layers=c["num_hidden_layers"], hidden=c["hidden_size"],
                       num_heads=heads, num_kv_heads=c.get("num_key_value_heads", heads),
                       head_dim=c.get("head_dim") or c["hidden_size"] // heads,
                       ffn=c["intermediate_size"], vocab=c["vocab_size"])
        except (OSError, json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"{file}: not a usable HF model config ({e!r})") from None

    @property
    def linear_flops_per_token(self) -> int:
        q, kv, d = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.hidden
        return 2 * self.num_layers * (d * (q + 2 * kv) + q * d + 3 * d * self.ffn)

    @property
    def attention_flops_per_pair(self) -> int:
        return 4 * self.num_layers * self.num_heads * self.head_dim

    @property
    def head_flops_per_target(self) -> int:
        return 2 * self.hidden * self.vocab


MODEL_SHAPES: dict[str, ModelShape] = {s.name: s for s in (
    ModelShape(name="qwen3-0.6b", num_layers=28, hidden=1024, num_heads=16, num_kv_heads=8, head_dim=128,
               ffn=3072, vocab=151936),
    ModelShape(name="qwen3-1.7b", num_layers=28, hidden=2048, num_heads=16, num_kv_heads=8, head_dim=128,
               ffn=6144, vocab=151936),
    ModelShape(name="qwen3-4b", num_layers=36, hidden=2560, num_heads=32, num_kv_heads=8, head_dim=128,
               ffn=9728, vocab=151936),
    ModelShape(name="qwen3-8b", num_layers=36, hidden=4096, num_heads=32, num_kv_heads=8, head_dim=128,
               ffn=12288, vocab=151936),
)}


def model_shape(spec: str) -> ModelShape:
    """A preset name (``qwen3-8b``) or a path to a HF ``config.json`` / model directory."""
    if spec in MODEL_SHAPES:
        return MODEL_SHAPES[spec]
    if Path(spec).exists():
        return ModelShape.from_config(spec)
    raise ValueError(f"unknown model shape {spec!r}; use one of {', '.join(MODEL_SHAPES)} "
                     "or a path to a config.json")


@dataclass(kw_only=True)
class TokenCounts:
    """Additive counts over conversations (views, tokens, attended pairs, targets)."""

    views: int = 0
    n_pass_tokens: int = 0
    one_pass_tokens: int = 0
    n_pass_pairs: int = 0
    one_pass_pairs: int = 0
    targets: int = 0

    def add(self, other: TokenCounts) -> None:
        for k in asdict(self):
            setattr(self, k, getattr(self, k) + getattr(other, k))


def flops(counts: TokenCounts, shape: ModelShape) -> tuple[int, int]:
    """(N-pass, one-pass) forward FLOPs of ``counts`` (formula in the module docstring)."""
    head = shape.head_flops_per_target * counts.targets
    n = shape.linear_flops_per_token * counts.n_pass_tokens + shape.attention_flops_per_pair * counts.n_pass_pairs
    one = shape.linear_flops_per_token * counts.one_pass_tokens + \
        shape.attention_flops_per_pair * counts.one_pass_pairs
    return n + head, one + head


def conversation_counts(views: list, layout: Any) -> TokenCounts:
    """Token / pair counts of one conversation's views and its one-pass layout."""
    lengths = [len(v) for v in views]
    return TokenCounts(views=len(views), n_pass_tokens=sum(lengths), one_pass_tokens=len(layout),
                       n_pass_pairs=sum(n * (n + 1) // 2 for n in lengths),
                       one_pass_pairs=int((layout.position_ids + 1).sum()), targets=layout.num_targets)


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
        if self.skipped:
            lines.append(f"SKIPPED {len(self.skipped)}; first: {self.skipped[0]}")
        return "\n".join(lines)


def depth_histogram(conversations: Iterable[Conversation]) -> dict[int, int]:
    return dict(sorted(Counter(c.num_assistant_turns for c in conversations).items()))


def compute_stats(conversations: Iterable[Conversation], tokenizer: Any = None, *,
                  shape: ModelShape | str = "qwen3-8b", render: Any = None, progress: bool = False,
                  total: int | None = None) -> DataStats:
    """Statistics of ``conversations``. Without a ``tokenizer``: depths only.

    A conversation the template cannot render is counted in ``skipped`` (its segments and
    depth still count; its tokens do not).
    """
    from onepass.render import RenderConfig, RenderError, render_views
    from onepass.tree import build_layout

    shape = model_shape(shape) if isinstance(shape, str) else shape
    stats = DataStats()
    depths: Counter[int] = Counter()
    lengths: dict[str, list[int]] = {}
    counts = TokenCounts()
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
        try:
            views = render_views(conv, tokenizer, render or RenderConfig())
        except RenderError as e:
            stats.skipped.append(str(e))
            continue
        if views:
            counts.add(conversation_counts(views, build_layout(views)))
    stats.depths = dict(sorted(depths.items()))
    if tokenizer is None:
        return stats
    stats.segments = {kind: percentiles(v) for kind, v in lengths.items()}
    stats.characteristic_length = {kind: p["p95"] for kind, p in stats.segments.items() if p.get("count")}
    stats.tokens = asdict(counts)
    stats.token_ratio = counts.n_pass_tokens / counts.one_pass_tokens if counts.one_pass_tokens else 0.0
    stats.model = asdict(shape)
    stats.flops_n_pass, stats.flops_one_pass = flops(counts, shape)
    stats.ideal_speedup = stats.flops_n_pass / stats.flops_one_pass if stats.flops_one_pass else 0.0
    stats.attention_speedup = counts.n_pass_pairs / counts.one_pass_pairs if counts.one_pass_pairs else 0.0
    return stats


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
