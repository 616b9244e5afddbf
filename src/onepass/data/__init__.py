"""Datasets: the bundled sample, synthetic data, the paper's pipeline (``onepass data ...``).

A ``--data`` spec is read by :mod:`onepass.data.sources`; prepare's workers are
:mod:`onepass.prepare.parallel`.

``mathchat``   MathChat (Liang et al. 2024, Apache-2.0) -> records, and the bundled 300-conversation
               sample (:func:`load_sample`); see ``README.md`` here for attribution
``synthetic``  seeded MathChat-shaped conversations with exact token lengths (benchmarks)
``sample``     the paper's depth-balanced sampling       (``onepass data sample``)
``augment``    reasoning for every assistant turn by LLM (``onepass data augment``)
``stats``      depths, segment lengths, ideal speedup    (``onepass data stats``)
``cli``        the ``onepass data`` subcommands

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
