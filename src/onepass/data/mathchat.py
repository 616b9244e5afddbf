"""MathChat -> OpenAI-style ``messages`` records with ``reasoning_content``.

Why this module exists: MathChat (Liang et al. 2024, Apache-2.0) is the only
real multi-turn math data reachable offline, and its turns hold worked
reasoning *and* a final answer, which is what one-pass training needs. Its
files are not chat records, though: each line holds a GSM8K ``question`` and
``answer`` plus a free-text ``A: ... / B: ...`` dialogue (``followup`` or
``error_correction``). This module turns each line into one conversation
that :func:`onepass.conversation.parse.parse_record` accepts, and bundles a small
converted sample (:func:`load_sample`) so tests and demos have real data.

Worked example (one ``follow_up.jsonl`` line, shortened)::

    question: "Janet's ducks lay 16 eggs ... How much does she make?"
    answer:   "Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 duck eggs a day.\\n...\\n#### 18"
    followup: "A: If Janet donates 2 ...?\\nB: She sells 9 - 2 = 7 eggs. ...
               The answer is \\\\ANSWER{14}.\\n\\nA: ...\\nB: ..."

becomes::

    user       "Janet's ducks lay 16 eggs ... How much does she make?"
    assistant  reasoning "Janet sells 16 - 3 - 4 = 9 duck eggs a day.\\n..."
               content   "The answer is 18."
    user       "If Janet donates 2 ...?"
    assistant  reasoning "She sells 9 - 2 = 7 eggs. ..."   content "The answer is 14."
    user / assistant  (the second follow-up round, the same way)

Rules: ``<<a=b>>`` calculator annotations are removed everywhere;
``\\ANSWER{x}`` becomes ``x`` (``\\%``, ``\\$``, ``\\text{}`` unescaped inside it);
an assistant turn's content is its final-answer sentence (from the last
sentence that says "the answer is" to the end), or else its last sentence,
and its reasoning is everything before (possibly "", which is still trained);
separator lines (``---``, "Follow-up Round 2:") trailing a turn are dropped.
A line whose dialogue cannot be read as alternating A/B turns (text before the
first ``A:``, a stray ``####`` line, a missing turn) is malformed: an error
naming file and line, or counted and reported with ``strict=False``.

No torch here: this is pure data.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from importlib import resources
from pathlib import Path
from typing import Any

from onepass.conversation.parse import Conversation, ConversationError, parse_record, read_conversations
from onepass.errors import DataNotFound

DIALOGUE_FIELDS = ("followup", "error_correction")
SAMPLE_NAME = "mathchat_sample.jsonl"
SAMPLE_FILES = ("follow_up.jsonl", "error_correction.jsonl")
SAMPLE_PER_FILE = 150

_ANNOTATION = re.compile(r"<<[^<>\n]*>>")
_FINAL_GSM8K = re.compile(r"\n?[ \t]*####[ \t]*([^\n]*?)\s*\Z")
_SPEAKER = re.compile(r"(?m)^[ \t]*(?:\*\*)?([AB]):(?:\*\*)?[ \t]*")
_STRAY_HASHES = re.compile(r"(?m)^[ \t]*####")
_TRAILING_SEPARATOR = re.compile(
    r"(?:\s*\n[ \t]*(?:-{3,}|\*{3,}|_{3,}|\**follow-?up (?:round|question) \d+:?\**)[ \t]*)+\Z", re.IGNORECASE)
_SENTENCE_END = re.compile(r"[.!?][\"'\u201d\u2019)\]]*[ \t]+(?=\S)")
_LINE_START = re.compile(r"\n\s*(?=\S)")
_ABBREVIATIONS = frozenset({"mr", "mrs", "ms", "dr", "st", "jr", "sr", "vs", "e.g", "i.e", "approx"})
_ANSWER_PHRASE = re.compile(r"\bthe answer is\b", re.IGNORECASE)
_LATEX_SPACE = re.compile(r"\\[ :,;]")
_LATEX_TEXT = re.compile(r"\\text\{([^{}]*)\}")


class MathChatError(ConversationError):
    """A MathChat line that cannot be converted; the message names file and line."""


def strip_annotations(text: str) -> str:
    """Remove GSM8K calculator annotations: ``16-3-4 = <<16-3-4=9>>9`` -> ``16-3-4 = 9``."""
    return _ANNOTATION.sub("", text)


def _answer_value(raw: str) -> str:
    value = _LATEX_TEXT.sub(r"\1", raw)
    value = value.replace("\\%", "%").replace("\\$", "$")
    value = _LATEX_SPACE.sub(" ", value)
    return " ".join(value.split()).rstrip(".")


def normalise_answers(text: str) -> str:
    r"""Replace every ``\ANSWER{x}`` (and ``\(\ANSWER{x}\)``) by ``x``.

    >>> normalise_answers(r"The answer is \ANSWER{62.5\%}.")
    'The answer is 62.5%.'

    Raises ``ValueError`` when a brace is left open.
    """
    out, i = [], 0
    while (j := text.find("\\ANSWER{", i)) >= 0:
        start = j + len("\\ANSWER{")
        depth, k = 1, start
        while depth and k < len(text):
            depth += {"{": 1, "}": -1}.get(text[k], 0)
            k += 1
        if depth:
            raise ValueError(f"unclosed \\ANSWER{{ at character {j}")
        value = _answer_value(text[start:k - 1])
        head = text[i:j]
        inline = re.search(r"\\\(\s*\Z", head)
        close = re.match(r"\s*\\\)", text[k:])
        if inline and close:  # \(\ANSWER{x}\) -> x
            head, k = head[:inline.start()], k + close.end()
        elif k < len(text) and text[k] == "." and value.endswith("."):
            value = value[:-1]
        out += [head, value]
        i = k
    out.append(text[i:])
    return "".join(out)


def _sentence_starts(text: str) -> list[int]:
    """Offsets where a sentence or a line starts (a sentence never starts lowercase)."""
    starts = {0}
    for m in _SENTENCE_END.finditer(text):
        word = re.search(r"[\w.]*\Z", text[:m.start()]).group(0).lower()
        if word in _ABBREVIATIONS or text[m.end()].islower():
            continue
        starts.add(m.end())
    starts.update(m.end() for m in _LINE_START.finditer(text))
    return sorted(starts)


def split_final_answer(text: str) -> tuple[str, str]:
    """One assistant turn -> ``(reasoning, response)``.

    The response starts at the last sentence that says "the answer is" (and runs
    to the end); without one it is the last sentence. Reasoning is the rest.

    >>> split_final_answer("9 - 2 = 7 eggs. 7 * 2 = 14. The answer is 14.")
    ('9 - 2 = 7 eggs. 7 * 2 = 14.', 'The answer is 14.')
    >>> split_final_answer("She makes $14.")
    ('', 'She makes $14.')
    """
    text = text.strip()
    starts = _sentence_starts(text)
    phrase = [m.start() for m in _ANSWER_PHRASE.finditer(text)]
    cut = max(s for s in starts if s <= phrase[-1]) if phrase else starts[-1]
    return text[:cut].rstrip(), text[cut:].strip()


def parse_dialogue(text: str) -> list[tuple[str, str]]:
    """``"A: q\\nB: r\\n\\nA: ..."`` -> ``[("A", "q"), ("B", "r"), ...]``; ``**A:**`` also accepted.

    Raises ``ValueError`` (with what was wrong) unless the turns alternate
    A, B, A, B, ..., end with B, and none is empty.
    """
    parts = _SPEAKER.split(text)
    lead = parts[0].strip()
    if lead:
        raise ValueError(f"text before the first 'A:' turn ({_clip(lead)!r})")
    turns = [(who, body.strip()) for who, body in zip(parts[1::2], parts[2::2])]
    if not turns:
        raise ValueError("no 'A:'/'B:' turns")
    for n, (who, body) in enumerate(turns):
        if who != "AB"[n % 2]:
            raise ValueError(f"turn {n + 1} is by {who} but {'AB'[n % 2]} was expected (turns must alternate A, B)")
        if not body:
            raise ValueError(f"turn {n + 1} ({who}) is empty")
        if _STRAY_HASHES.search(body):
            raise ValueError(f"turn {n + 1} ({who}) holds a stray '####' line")
    if turns[-1][0] != "B":
        raise ValueError(f"the last turn ({_clip(turns[-1][1])!r}) is by A and has no answer from B")
    return turns


def _clip(s: str, n: int = 60) -> str:
    return s if len(s) <= n else s[:n] + "..."


def _assistant(text: str) -> dict[str, str]:
    text = _TRAILING_SEPARATOR.sub("", normalise_answers(strip_annotations(text)).strip()).strip()
    reasoning, response = split_final_answer(text)
    return {"role": "assistant", "content": response, "reasoning_content": reasoning}


def _string_field(raw: Mapping[str, Any], key: str) -> str:
    value = raw.get(key)
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"field {key!r} must be a non-empty string, got {type(value).__name__}")
    return value


def convert_record(raw: Any, *, name: str, line: int) -> dict[str, Any]:
    """One parsed MathChat line -> ``{"id", "messages", "source"}``; ``ValueError`` if malformed.

    ``follow_up`` lines open with the GSM8K question and its worked solution;
    ``error_correction`` lines open with A's first message (the dialogue
    restates the question). Each A/B round is then one user/assistant turn.
    """
    if not isinstance(raw, Mapping):
        raise ValueError(f"expected a JSON object, got {type(raw).__name__}")
    present = [f for f in DIALOGUE_FIELDS if f in raw]
    if len(present) != 1:
        raise ValueError(f"expected exactly one of the fields {', '.join(DIALOGUE_FIELDS)}; "
                         f"keys are {', '.join(sorted(map(str, raw)))}")
    field = present[0]
    messages: list[dict[str, str]] = []
    if field == "followup":
        answer = _string_field(raw, "answer")
        final = _FINAL_GSM8K.search(answer)
        if final is None or not final.group(1):
            raise ValueError("field 'answer' has no final '#### N' line")
        messages.append({"role": "user", "content": _string_field(raw, "question").strip()})
        messages.append({"role": "assistant", "content": f"The answer is {final.group(1)}.",
                         "reasoning_content": strip_annotations(answer[:final.start()]).strip()})
    try:
        turns = parse_dialogue(_string_field(raw, field))
        for who, body in turns:
            messages.append({"role": "user", "content": strip_annotations(body)} if who == "A" else _assistant(body))
    except ValueError as e:
        raise ValueError(f"field {field!r}: {e}") from None
    return {"id": f"mathchat-{field}-{line}", "messages": messages, "source": f"MathChat {name} line {line}"}


def _paths(paths: str | Path | Iterable[str | Path]) -> list[Path]:
    return [Path(paths)] if isinstance(paths, (str, Path)) else [Path(p) for p in paths]


def convert_mathchat(paths: str | Path | Iterable[str | Path], *, strict: bool = True,
                     limit: int | None = None) -> tuple[list[dict[str, Any]], list[str]]:
    """Convert MathChat ``.jsonl`` files -> ``(records, skipped)``.

    ``records`` are OpenAI-style dicts, each checked with ``parse_record``.
    ``strict`` raises :class:`MathChatError` (naming file and line) at the first
    malformed line; otherwise each malformed line is skipped and its error
    appended to ``skipped``. ``limit`` keeps at most that many records from
    *each* file. Blank lines are ignored; line numbers count them.
    """
    records: list[dict[str, Any]] = []
    skipped: list[str] = []
    for path in _paths(paths):
        if not path.is_file():
            raise DataNotFound(f"MathChat file not found: {path}")
        kept = 0
        with path.open(encoding="utf-8") as f:
            for lineno, text in enumerate(f, start=1):
                if limit is not None and kept >= limit:
                    break
                if not text.strip():
                    continue
                try:
                    try:
                        raw = json.loads(text)
                    except json.JSONDecodeError as e:
                        raise ValueError(f"not valid JSON ({e.msg} at column {e.colno})") from None
                    except RecursionError:
                        raise ValueError("JSON nested too deeply to read") from None
                    record = convert_record(raw, name=path.name, line=lineno)
                    parse_record(record, source=str(path), index=lineno, unit="line")
                except ValueError as e:
                    error = MathChatError(f"{path} line {lineno}: {e}. Fix or delete the line, "
                                          "or convert with strict=False to skip it (it is counted)")
                    if strict:
                        raise error from None
                    skipped.append(str(error))
                    continue
                records.append(record)
                kept += 1
    return records, skipped


def write_jsonl(records: Iterable[Mapping[str, Any]], path: str | Path) -> int:
    """Write one JSON object per line (UTF-8, not ASCII-escaped); returns how many."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with path.open("w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
            n += 1
    return n


def build_sample(mathchat_dir: str | Path) -> list[dict[str, Any]]:
    """The bundled sample, rebuilt: the first 150 lines of follow_up then of error_correction."""
    records, skipped = convert_mathchat([Path(mathchat_dir) / name for name in SAMPLE_FILES],
                                        limit=SAMPLE_PER_FILE)
    assert not skipped
    return records


def sample_path() -> Path:
    """Path of the bundled converted sample (300 conversations, see ``README.md`` beside it)."""
    path = resources.files(__package__).joinpath(SAMPLE_NAME)
    if not isinstance(path, Path):
        raise RuntimeError(f"onepass is installed as an archive; {SAMPLE_NAME} is not a plain file ({path})")
    return path


def load_sample(limit: int | None = None) -> list[Conversation]:
    """The bundled MathChat sample as validated conversations (the first ``limit`` if given)."""
    return read_conversations(sample_path(), strict=True, limit=limit).conversations
