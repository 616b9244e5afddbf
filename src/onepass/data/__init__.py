"""Converters for public data sets and the small real samples bundled with onepass.

``mathchat``: MathChat (Liang et al. 2024, Apache-2.0) -> OpenAI-style records,
and a 300-conversation converted sample (:func:`load_sample`). See ``README.md``
in this folder for attribution and what was changed.
"""

from onepass.data.mathchat import (
    MathChatError,
    convert_mathchat,
    load_sample,
    sample_path,
    write_jsonl,
)

__all__ = ["MathChatError", "convert_mathchat", "load_sample", "sample_path", "write_jsonl"]
