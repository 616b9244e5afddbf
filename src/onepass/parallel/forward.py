"""The forward contract: what a one-pass forward carries past the model's own inputs, in one record.

Why this module exists: a HF model takes ``input_ids``, ``position_ids`` and ``attention_mask``; a
one-pass row needs more, and only a few layers read it. The tree mask goes to every attention layer
(as ``attention_mask``: HF passes a 4D mask or a BlockMask through untouched), the rows' chains to
every recurrent mixer (:mod:`onepass.mixers.tree`: each chain scanned from its parent chain's end
state), and under sequence parallelism this rank's :class:`~onepass.parallel.comm.SequenceShard` to
the attention wrapper (:mod:`onepass.parallel.attention`) and the mixers (they gather the row). All
three are planned once per batch from the host rows (:func:`onepass.loss.forward_plan`) and travel
as one :class:`ForwardPlan` under one model keyword, :data:`KWARG`, which HF hands through the decoder
layers' ``**kwargs`` to every attention function and mixer. This module is the only one that knows
that name: a builder attaches the plan with :meth:`ForwardPlan.model_kwargs`, a layer reads it with
:func:`take`.

    >>> from onepass.layout.geometry import batch_chains
    >>> plan = ForwardPlan(mask="MASK", chains=batch_chains([[3, 3, 3]]))
    >>> sorted(plan.model_kwargs())
    ['attention_mask', 'onepass_forward']
    >>> kwargs = plan.model_kwargs(); take(kwargs) is plan, sorted(kwargs)
    (True, ['attention_mask'])
    >>> sorted(ForwardPlan(mask="MASK").model_kwargs())   # nothing to read but the mask: a plain HF call
    ['attention_mask']

A forward without the keyword (the plain N-pass reference, generation, a model used elsewhere) runs
every layer unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from onepass.layout.geometry import Chain
from onepass.parallel.comm import SequenceShard

KWARG = "onepass_forward"  # the one model keyword of a one-pass forward: HF hands it to every attention layer and mixer


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class ForwardPlan:
    """One batch of rows' forward, as the layers that need more than their inputs read it.

    ``mask``: the attention mask object of the model's backend for the whole rows
    (:func:`onepass.attention.attention_mask_for`; under sequence parallelism too: attention runs
    on every position). ``chains``: each row's chains (:func:`onepass.layout.geometry.batch_chains`),
    None for a model without recurrent mixers. ``shard``: this rank's place in a sequence-parallel
    group, None in one process. ``options``: what every forward of the model passes besides
    (flex_attention's kernel choice, :func:`onepass.attention.backends.forward_kwargs`).
    """

    mask: Any
    chains: Sequence[Sequence[Chain]] | None = None
    shard: SequenceShard | None = None
    options: Mapping[str, Any] = field(default_factory=dict)

    @property
    def read_by_layers(self) -> bool:
        """Whether any layer reads the record itself (mixers: the chains; the attention wrapper: the shard)."""
        return self.chains is not None or self.shard is not None

    def model_kwargs(self) -> dict[str, Any]:
        """The keywords of the model call: the mask, the options, and the record under :data:`KWARG` when a
        layer reads it (else none: the call is a plain HF call, as before this record existed)."""
        return {"attention_mask": self.mask, **self.options, **({KWARG: self} if self.read_by_layers else {})}


def take(kwargs: MutableMapping[str, Any]) -> ForwardPlan | None:
    """The plan a layer was called with, removed from ``kwargs`` (what the layer's own code must not see);
    None for a call outside a one-pass forward."""
    return kwargs.pop(KWARG, None)


__all__ = ["KWARG", "ForwardPlan", "take"]
