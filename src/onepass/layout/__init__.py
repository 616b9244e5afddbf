"""The layout: views -> one prefix tree per conversation -> rows (numpy, no torch).

``view``       :class:`~onepass.layout.view.View`: one N-pass example and its provenance, the hand-off from
               rendering
``tree``       views -> prefix tree -> :class:`~onepass.layout.tree.Layout`; the row schema
``geometry``   the tree read back from ``kv_end``: depths, parents, ancestors, segments, chains
``schedule``   n-pass / one-pass / k-pass / budget, and the loss weighting
``pack``       best-fit-decreasing rows under a token budget
``share``      trees of conversations that share a prefix merged into one tree per row
``row_check``  every row checked before the first step (ids, weights, ``kv_end`` a tree)
``vocab``      compact token ids for tiny models
``flops``      model shapes, token counts, visible pairs, FLOPs

Previous stage: :mod:`onepass.render` (it builds views); next: :mod:`onepass.prepare` (rows on disk) or
training. By imports the layout sits below both: it is the format every stage hands on (a view, a tree,
a row) and imports nothing above :mod:`onepass.errors` (docs/design.md, "Layers").
"""
