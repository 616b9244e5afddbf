"""Data: loading any ``--data`` spec, the bundled sample, synthetic data, the paper's pipeline.

``load``       any spec (file, dataset directory, hub id, builtin:mathchat, synthetic:NAME), streaming
``parallel``   prepare as a stream, on one process or many (forked workers), identical to the serial pipeline
``mathchat``   MathChat (Liang et al. 2024, Apache-2.0) -> records, and the bundled 300-conversation
               sample (:func:`load_sample`); see ``README.md`` here for attribution
``synthetic``  seeded MathChat-shaped conversations with exact token lengths (benchmarks)
``sample``     the paper's depth-balanced sampling       (``onepass data sample``)
``augment``    reasoning for every assistant turn by LLM (``onepass data augment``)
``stats``      depths, segment lengths, ideal speedup    (``onepass data stats``)
``cli``        the ``onepass data`` subcommands

Heavy modules (``parallel``, ``augment``, ``stats``) are imported only when used.
"""

from onepass.data.load import iter_conversation_records, load_conversations
from onepass.data.mathchat import (
    MathChatError,
    convert_mathchat,
    load_sample,
    sample_path,
    write_jsonl,
)

__all__ = ["MathChatError", "convert_mathchat", "iter_conversation_records", "load_conversations", "load_sample",
           "sample_path", "write_jsonl"]
