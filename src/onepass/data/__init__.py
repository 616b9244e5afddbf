"""Datasets: every ``--data`` spec resolved, the bundled sample, synthetic data, the paper's pipeline
(``onepass data ...``,
whose parsers are :mod:`onepass.prepare.data_cli`: a command sits above what it calls).

``sources``    a ``--data`` spec resolved once to a :class:`~onepass.data.sources.DataSource` (file, folder,
               saved dataset, ``builtin:``, ``synthetic:``, hub id); records streamed, skips reported
``mathchat``   MathChat (Liang et al. 2024, Apache-2.0) -> records, and the bundled 300-conversation
               sample (:func:`load_sample`); see ``README.md`` here for attribution
``synthetic``  seeded MathChat-shaped conversations with exact token lengths (benchmarks)
``sample``     the paper's depth-balanced sampling       (``onepass data sample``)
``augment``    reasoning for every assistant turn by LLM (``onepass data augment``)
``stats``      depths, segment lengths, ideal speedup    (``onepass data stats``)

Prepare's workers are :mod:`onepass.prepare.parallel`.

Heavy modules (``augment``, ``stats``) are imported only when used.
"""

from onepass.data.mathchat import (
    MathChatError,
    convert_mathchat,
    load_sample,
    sample_path,
    write_jsonl,
)

__all__ = ["MathChatError", "convert_mathchat", "load_sample", "sample_path", "write_jsonl"]
