"""Compiled attention on static shapes: which length bucket each forward runs in, and the compiles counted per bucket.

Why this module exists: FlexAttention (transformers compiles it with ``torch.compile``) compiles
once per shape it meets. :mod:`onepass.layout.buckets` makes the shapes a few known lengths; this
module runs each forward in its bucket and counts what compiled, so a run says how many compiles it
paid for and a recompile (a shape met twice compiling twice: a guard that failed) is seen, not guessed.

While a forward runs, dynamo's automatic dynamic shapes are off (a second length would otherwise
recompile the kernel for *any* length, a slower kernel, and count as a recompile) and its recompile
limit is at least twice the buckets (training and evaluation compile apart: the kernel's inputs need
gradients in one and not in the other). Compiles are read off dynamo's frame counter
(``torch._dynamo.utils.counters["frames"]["ok"]``, a private name: without it nothing is counted).

    >>> shapes = StaticShapes(buckets=(512, 1024))
    >>> with shapes.forward(1024):  # doctest: +SKIP
    ...     loss = batch_loss(model, batch)   # the first forward of bucket 1024 compiles, later ones do not
    >>> shapes.summary()  # doctest: +SKIP
    {'buckets': [512, 1024], 'compiles': {'1024': 1}, 'recompiles': 0}
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from onepass.layout.buckets import bucket_of, length_buckets
from onepass.model.private_names import find_private
from onepass.train.config import TrainConfig
from onepass.train.run.data import TrainData, forward_lengths

COUNTERS = "torch._dynamo.utils.counters"
CONFIG = "torch._dynamo.config.automatic_dynamic_shapes"


def compiled_frames() -> int | None:
    """Frames dynamo has compiled in this process so far (None where this torch does not say)."""
    counters = find_private(COUNTERS)
    return None if counters is None else int(counters["frames"]["ok"])


@dataclass(kw_only=True)
class StaticShapes:
    """The buckets of a run's forwards and the compiles each has cost so far (mutable: it counts)."""

    buckets: tuple[int, ...]
    compiles: dict[str, int] = field(default_factory=dict)  # "1024" / "1024 eval" -> frames compiled in its forwards

    @contextlib.contextmanager
    def forward(self, length: int, *, training: bool = True) -> Iterator[None]:
        """Run a forward (and its backward) of a row padded to bucket ``length``; its compiles are counted (a
        training and an evaluation forward of one bucket compile apart, counted apart)."""
        config = find_private(CONFIG)
        patch = (config.patch(automatic_dynamic_shapes=False,
                              recompile_limit=max(config.recompile_limit, 2 * len(self.buckets) + 2))
                 if config is not None else contextlib.nullcontext())
        before = compiled_frames()
        try:
            with patch:
                yield
        finally:
            after = compiled_frames()
            if before is not None and after is not None and after > before:
                key = f"{length}" if training else f"{length} eval"
                self.compiles[key] = self.compiles.get(key, 0) + after - before

    @property
    def total(self) -> int:
        """Frames compiled in the forwards so far."""
        return sum(self.compiles.values())

    @property
    def recompiles(self) -> int:
        """Compiles past the first of each bucket (0 when every shape compiled once)."""
        return sum(max(0, n - 1) for n in self.compiles.values())

    def summary(self) -> dict[str, Any]:
        """For the run's metrics: the buckets, the compiles of each met so far, the recompiles."""
        return {"buckets": list(self.buckets), "compiles": dict(sorted(self.compiles.items())),
                "recompiles": self.recompiles}


def run_shapes(config: TrainConfig, data: TrainData, total: int, *, rank: int, world: int, even: bool,
               eval_data: TrainData | None, say: Callable[[str], None]) -> StaticShapes:
    """A run's length buckets (:mod:`onepass.layout.buckets`), chosen from every forward pass this process runs in
    its ``total`` steps and in evaluation: each bucket compiles once, and no pass meets another length."""
    lengths = forward_lengths(data, config, range(total), rank=rank, world=world, even=even, eval_data=eval_data)
    buckets = length_buckets(lengths, most=config.length_buckets)
    padded = sum(bucket_of(n, buckets) for n in lengths)
    say(f"flex_attention: each forward pass padded to one of {len(buckets)} lengths ({', '.join(map(str, buckets))} "
        f"tokens; {padded / max(1, sum(lengths)) - 1:.1%} padding), one compile each")
    return StaticShapes(buckets=buckets)


__all__ = ["StaticShapes", "compiled_frames", "run_shapes"]
