"""Model shapes, token and attention-pair counts, and the FLOPs they cost: one accounting for all.

Why this module exists: the ideal speedup of ``onepass data stats``, the
useful FLOPs of ``onepass bench`` and the visible pairs a training run logs
must count the same things the same way, so they are defined once, here.
numpy only.

Forward FLOPs of a model with ``L`` layers, hidden size ``d``,
``q = heads * head_dim``, ``kv = kv_heads * head_dim``, SwiGLU width ``f`` and
vocabulary ``V`` (the backward pass is ~2x the forward, so training is 3x)::

    linear per token        2 L (d (q + 2 kv) + q d + 3 d f)
    attention per (q, k)    4 L q              (Q K^T and P V, 2 q each)
    LM head per target      2 d V              (targets only: the same in both)

    FLOPs = linear * tokens + attention * pairs + head * targets
    N-pass:   tokens = sum_v n_v      pairs = sum_v n_v (n_v + 1) / 2     (causal views)
    one-pass: tokens = nodes          pairs = visible pairs of the tree mask

Visible pairs of a row: key k is visible to queries k .. kv_end[k]-1, so the
count is ``sum(kv_end - k)``; in a tree that equals ``sum(position_ids + 1)``
(a node sees its ancestors and itself). "Ideal": exactly these pairs are
computed (a perfect block-sparse kernel); a dense kernel computes more.

Worked example: view A = ``1 2 | 3 4`` (trains 3, 4) and view B = ``1 2 5 | 6``
(trains 6) share ``1 2``; the tree has 6 nodes::

    p  token pos kv_end    mask (row q, col k)   1 2 3 4 5 6
    0  1     0   6                            1  x
    1  2     1   6                            2  x x
    2  3     2   4                            3  x x x
    3  4     3   4                            4  x x x x
    4  5     2   6                            5  x x     x
    5  6     3   6                            6  x x     x x

    >>> import numpy as np
    >>> from onepass.layout.view import View
    >>> from onepass.layout.tree import build_layout
    >>> a = View(tokens=np.array([1, 2, 3, 4]), num_prompt=2, turn=0)
    >>> b = View(tokens=np.array([1, 2, 5, 6]), num_prompt=3, turn=1)
    >>> row = build_layout([a, b])
    >>> row.position_ids.tolist(), row.kv_end.tolist()
    ([0, 1, 2, 3, 2, 3], [6, 6, 4, 4, 6, 6])
    >>> visible_pairs(row), causal_pairs(len(a)) + causal_pairs(len(b))
    (17, 20)
    >>> c = conversation_counts([a, b], row)
    >>> (c.n_pass_tokens, c.one_pass_tokens, c.targets, round(c.token_ratio, 3))
    (8, 6, 3, 1.333)
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from onepass.layout.tree import Layout


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
    tied: bool = False  # LM head shares the input embedding (Qwen3 0.6B-4B): memory, not FLOPs

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
                       ffn=c["intermediate_size"], vocab=c["vocab_size"],
                       tied=bool(c.get("tie_word_embeddings", False)))
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


TINY = ModelShape(name="tiny", num_layers=4, hidden=256, num_heads=4, num_kv_heads=2, head_dim=64,
                  ffn=768, vocab=0)  # the benchmark's random model; its vocabulary is set per workload

MODEL_SHAPES: dict[str, ModelShape] = {s.name: s for s in (
    TINY,
    ModelShape(name="qwen3-0.6b", num_layers=28, hidden=1024, num_heads=16, num_kv_heads=8, head_dim=128,
               ffn=3072, vocab=151936, tied=True),
    ModelShape(name="qwen3-1.7b", num_layers=28, hidden=2048, num_heads=16, num_kv_heads=8, head_dim=128,
               ffn=6144, vocab=151936, tied=True),
    ModelShape(name="qwen3-4b", num_layers=36, hidden=2560, num_heads=32, num_kv_heads=8, head_dim=128,
               ffn=9728, vocab=151936, tied=True),
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


def model_kwargs(shape: ModelShape) -> dict[str, int]:
    """HF config sizes of a Qwen3-style model of ``shape`` (the vocabulary is set separately)."""
    return dict(hidden_size=shape.hidden, intermediate_size=shape.ffn, num_hidden_layers=shape.num_layers,
                num_attention_heads=shape.num_heads, num_key_value_heads=shape.num_kv_heads,
                head_dim=shape.head_dim, tie_word_embeddings=shape.tied)


# ---------------------------------------------------------------------------------------------
# counts


def causal_pairs(length: int) -> int:
    """(query, key) pairs of a causal mask over ``length`` tokens: an N-pass view, or a dense row."""
    return length * (length + 1) // 2


def visible_pairs(row: Layout | Any) -> int:
    """(query, key) pairs the tree mask lets attend: ``sum(kv_end - k)``.

    ``row`` is a :class:`~onepass.layout.tree.Layout` or its ``kv_end`` ([L], or [B, L]: summed over
    rows). What a block-skipping kernel must compute at least.
    """
    kv_end = np.asarray(row.kv_end if isinstance(row, Layout) else row)
    return int((kv_end - np.arange(kv_end.shape[-1])).sum())


def token_ratio(n_pass_tokens: int, one_pass_tokens: int) -> float:
    """N-pass tokens per one-pass token (0.0 when there are none)."""
    return n_pass_tokens / one_pass_tokens if one_pass_tokens else 0.0


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

    @property
    def token_ratio(self) -> float:
        return token_ratio(self.n_pass_tokens, self.one_pass_tokens)


def speed_bound(baseline: Mapping[str, float], candidate: Mapping[str, float]) -> float:
    """The most ``candidate`` can be faster than ``baseline``: the largest ratio of their counted work.

    The keys are the quantities a step's cost grows with (tokens through the linear layers,
    attention pairs a kernel computes, rows or steps that carry fixed costs, targets of the LM
    head). When each costs the same per unit on both sides, ``sum(c_k * base_k) / sum(c_k *
    cand_k) <= max_k base_k / cand_k`` whatever the unit costs ``c_k`` are, so a measured
    speedup past this is disturbed timing, not speed (:mod:`onepass.bench.ratio`). Not below 1:
    costs neither side counts (an optimizer step) are the same on both.

    >>> speed_bound({"tokens": 128, "pairs": 900, "rows": 3}, {"tokens": 100, "pairs": 1000, "rows": 3})
    1.28
    """
    ratios = [baseline[k] / candidate[k] for k in baseline if candidate.get(k)]
    return max([1.0, *ratios])


def conversation_counts(views: Sequence[Any], layout: Layout) -> TokenCounts:
    """Token / pair counts of one conversation's views and its one-pass layout."""
    lengths = [len(v) for v in views]
    return TokenCounts(views=len(views), n_pass_tokens=sum(lengths), one_pass_tokens=len(layout),
                       n_pass_pairs=sum(causal_pairs(n) for n in lengths),
                       one_pass_pairs=visible_pairs(layout), targets=layout.num_targets)


# ---------------------------------------------------------------------------------------------
# FLOPs


def forward_flops(shape: ModelShape, *, tokens: int, pairs: int, targets: int) -> int:
    """Forward FLOPs of ``tokens`` through the linear layers, ``pairs`` attended, ``targets`` LM-head rows."""
    return (shape.linear_flops_per_token * tokens + shape.attention_flops_per_pair * pairs
            + shape.head_flops_per_target * targets)


def flops(counts: TokenCounts, shape: ModelShape) -> tuple[int, int]:
    """(N-pass, one-pass) forward FLOPs of ``counts``: the same targets, their own tokens and pairs."""
    return (forward_flops(shape, tokens=counts.n_pass_tokens, pairs=counts.n_pass_pairs, targets=counts.targets),
            forward_flops(shape, tokens=counts.one_pass_tokens, pairs=counts.one_pass_pairs,
                          targets=counts.targets))


# ---------------------------------------------------------------------------------------------
# GPU tiles: what a block-sparse kernel actually computes

TILE = 128  # FlexAttention's default block, and FA2's query block


def causal_tiles(length: int, block: int = TILE) -> int:
    """``block x block`` tiles a causal kernel (FA2 varlen, one sequence) computes: the lower triangle.

    >>> causal_tiles(128), causal_tiles(129), causal_tiles(300)
    (1, 3, 6)
    """
    m = -(-length // block)
    return m * (m + 1) // 2


def tile_step_flops(shape: ModelShape, *, tokens: int, tiles: int, targets: int, block: int = TILE) -> float:
    """Training FLOPs (3x forward) when attention costs whole tiles, not visible pairs."""
    return 3.0 * forward_flops(shape, tokens=tokens, pairs=tiles * block * block, targets=targets)


def train_flops(rows: Sequence[Layout], shape: ModelShape, *, dense: bool = False) -> float:
    """Forward + backward FLOPs of ``rows`` (3x the forward).

    ``dense`` counts every causal pair of a row as computed (what a dense mask costs) instead
    of the visible ones.
    """
    pairs = sum(causal_pairs(len(r)) if dense else visible_pairs(r) for r in rows)
    return 3.0 * forward_flops(shape, tokens=sum(len(r) for r in rows), pairs=pairs,
                               targets=sum(r.num_targets for r in rows))
