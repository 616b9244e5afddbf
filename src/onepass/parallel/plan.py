"""How a row and an attention layer's heads are cut over S sequence-parallel ranks, and what that moves.

Why this module exists: Ulysses sequence parallelism (:mod:`onepass.parallel`) is a layout
decision before it is communication: which tokens a rank holds, which heads it computes inside
attention, what padding makes the shards equal, and how many elements each all-to-all moves.
Those are pure functions of the row length, the head counts and the degree, written once here
(numpy only, no torch) and read by the model code, the refusals and the benchmark alike.

A row of L tokens (padded to a multiple of S, pads seeing only themselves) is cut into S
contiguous shards; rank r holds positions ``[r * L / S, (r + 1) * L / S)`` for every layer that
is not attention. Inside attention one all-to-all gives each rank every position for H / S of
the H query heads, so the tree mask (``k <= q < kv_end[k]``, windows, sinks) runs unchanged on
the whole row; another all-to-all brings each rank back its own positions, all heads::

    L = 8, S = 2, H = 4 heads                 before attention        inside attention
    rank 0  positions 0..3  heads 0 1 2 3      q [B, 4, 4, D]    ->    q [B, 2, 8, D]  heads 0 1
    rank 1  positions 4..7  heads 0 1 2 3      q [B, 4, 4, D]    ->    q [B, 2, 8, D]  heads 2 3

Key/value heads (grouped-query attention, J of them) follow their query heads: split when J is
a multiple of S; when S is a multiple of J (more ranks than key/value heads) each key/value head
is repeated S / J times before the all-to-all, so each rank gets the one its query heads read
(what DeepSpeed's Ulysses does); anything else is refused in one line (:func:`head_split`).

    >>> head_split(32, 8, 4)
    HeadSplit(degree=4, heads=32, kv_heads=8, kv_repeat=1)
    >>> head_split(32, 2, 8).kv_repeat, head_split(32, 2, 8).local_kv_heads
    (4, 1)
"""

from __future__ import annotations

from dataclasses import dataclass

from onepass.errors import ConfigError


class SequenceParallelError(ConfigError):
    """A sequence-parallel degree this model or launch cannot run exactly (one line, says what to do)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class HeadSplit:
    """Which heads each of ``degree`` ranks computes inside attention."""

    degree: int
    heads: int  # query heads H
    kv_heads: int  # key/value heads J
    kv_repeat: int = 1  # each key/value head repeated this often before the all-to-all (S > J)

    @property
    def local_heads(self) -> int:
        return self.heads // self.degree

    @property
    def local_kv_heads(self) -> int:
        return self.kv_heads * self.kv_repeat // self.degree

    def head_range(self, rank: int) -> tuple[int, int]:
        """The query heads ``[start, stop)`` rank ``rank`` computes."""
        return rank * self.local_heads, (rank + 1) * self.local_heads


def head_split(heads: int, kv_heads: int, degree: int, *, where: str = "the model") -> HeadSplit:
    """The head split of H query and J key/value heads over ``degree`` ranks, or one line why there is none.

    Query heads must divide: each rank computes H / S of them on the whole row. Key/value heads
    split when S divides J; when J divides S each is repeated S / J times (a rank's query heads all
    read one key/value head). A ring over key shards would lift both limits, but our tree mask is
    a segment plan over the whole row (:mod:`onepass.attention.segments`): not built (docs/distributed.md).
    """
    if degree < 1:
        raise SequenceParallelError(f"sp_size must be >= 1, got {degree}")
    if heads % degree:
        raise SequenceParallelError(f"sp_size {degree} does not divide the {heads} attention heads of {where}: "
                                    "each rank computes heads / sp_size heads on the whole row; pick a divisor")
    if kv_heads < 1 or heads % kv_heads:
        raise SequenceParallelError(f"{where} has {heads} attention heads and {kv_heads} key/value heads, which "
                                    "do not group")
    if kv_heads % degree == 0:
        return HeadSplit(degree=degree, heads=heads, kv_heads=kv_heads)
    if degree % kv_heads == 0:
        return HeadSplit(degree=degree, heads=heads, kv_heads=kv_heads, kv_repeat=degree // kv_heads)
    raise SequenceParallelError(f"sp_size {degree} and the {kv_heads} key/value heads of {where} do not divide "
                                "one another: each rank needs whole key/value heads; pick a divisor or a multiple "
                                f"of {kv_heads}")


def padded_length(length: int, degree: int) -> int:
    """A row length rounded up to a multiple of ``degree`` (the shards are equal)."""
    return -(-length // degree) * degree


def shard_range(length: int, degree: int, rank: int) -> tuple[int, int]:
    """Positions ``[start, stop)`` of rank ``rank``'s shard of a row of ``length`` (a multiple of degree)."""
    assert length % degree == 0, "pad the row to a multiple of the degree first (padded_length)"
    size = length // degree
    return rank * size, (rank + 1) * size


@dataclass(frozen=True, kw_only=True, slots=True)
class LayerShapes:
    """What one decoder layer moves: its attention (None: no attention) and whether it has a recurrent mixer."""

    heads: int = 0
    kv_heads: int = 0
    qk_dim: int = 0  # query/key head size
    v_dim: int = 0  # value head size (latent attention: differs)
    mixer_width: int = 0  # hidden size of a recurrent mixer's input (0: none), gathered along the sequence


@dataclass(frozen=True, kw_only=True, slots=True)
class Volume:
    """Elements one rank sends per forward pass of one row of ``length`` tokens (padded), all layers.

    ``attention``: the two all-to-alls around every attention layer (q, k, v out; the output back);
    ``mixers``: the all-gather of every recurrent mixer's input. A backward pass sends as much again
    (the transposed collectives); gradient checkpointing repeats the forward's.
    """

    attention: int
    mixers: int

    @property
    def total(self) -> int:
        return self.attention + self.mixers


def forward_volume(layers: list[LayerShapes], *, length: int, degree: int, batch: int = 1) -> Volume:
    """:class:`Volume` of a forward pass with sequence parallelism of ``degree`` (0 when degree is 1).

    An all-to-all of a rank's E local elements keeps E / S and sends the rest; an all-gather sends
    its E elements to each of the S - 1 other ranks.
    """
    if degree == 1:
        return Volume(attention=0, mixers=0)
    local = padded_length(length, degree) // degree * batch
    attention = mixers = 0
    for layer in layers:
        if layer.heads:
            split = head_split(layer.heads, layer.kv_heads, degree)
            kv = layer.kv_heads * split.kv_repeat
            per_token = layer.heads * layer.qk_dim + kv * (layer.qk_dim + layer.v_dim) + layer.heads * layer.v_dim
            attention += local * per_token * (degree - 1) // degree
        if layer.mixer_width:
            mixers += local * layer.mixer_width * (degree - 1)
    return Volume(attention=attention, mixers=mixers)
