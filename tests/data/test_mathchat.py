"""MathChat converter: hand-written lines with hand-written outputs, errors, and the bundled sample."""

from __future__ import annotations

import collections
import json
from pathlib import Path

import pytest

from onepass.conversation.parse import parse_record
from onepass.data import MathChatError, convert_mathchat, load_sample, sample_path, write_jsonl
from onepass.data.mathchat import (
    SAMPLE_FILES,
    SAMPLE_PER_FILE,
    build_sample,
    normalise_answers,
    parse_dialogue,
    split_final_answer,
    strip_annotations,
)

SHARED = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "mathchat"
needs_shared = pytest.mark.skipif(not all((SHARED / n).is_file() for n in SAMPLE_FILES),
                                  reason=f"original MathChat files not found under {SHARED}")

FOLLOW_UP = {
    "question": "Janet's ducks lay 16 eggs. She eats 3 and bakes with 4. She sells the rest at $2. How much?",
    "answer": "Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 eggs.\nShe makes 9 * 2 = $<<9*2=18>>18.\n#### 18",
    "followup": "A: If she donates 2 eggs, how much now?\nB: She sells 9 - 2 = 7 eggs. "
                "She makes 7 * $2 = $14. The answer is \\ANSWER{14}.\n\n"
                "A: And at $3 an egg?\n\nB: She makes 7 * $3 = $21.",
}
FOLLOW_UP_EXPECTED = {
    "id": "mathchat-followup-1",
    "messages": [
        {"role": "user", "content": FOLLOW_UP["question"]},
        {"role": "assistant", "content": "The answer is 18.",
         "reasoning_content": "Janet sells 16 - 3 - 4 = 9 eggs.\nShe makes 9 * 2 = $18."},
        {"role": "user", "content": "If she donates 2 eggs, how much now?"},
        {"role": "assistant", "content": "The answer is 14.",
         "reasoning_content": "She sells 9 - 2 = 7 eggs. She makes 7 * $2 = $14."},
        {"role": "user", "content": "And at $3 an egg?"},
        {"role": "assistant", "content": "She makes 7 * $3 = $21.", "reasoning_content": ""},
    ],
    "source": "MathChat follow_up.jsonl line 1",
}
ERROR_CORRECTION = {
    "question": "A robe takes 2 bolts of blue fiber and half that much white. How many in total?",
    "answer": "It takes 2/2=<<2/2=1>>1 bolt of white fiber\nSo 2+1=<<2+1=3>>3\n#### 3",
    "error_correction": "A: A robe takes 2 bolts of blue and half that much white. How many bolts?\n\n"
                        "B: Half of 2 is 0.5. So it takes 2.5 bolts.\n\n"
                        "A: Not quite. Try again?\n\n"
                        "**B:** Half of 2 is 1. So 2 + 1 = 3 bolts. The answer is 3.\n\n---",
}
ERROR_CORRECTION_EXPECTED = {
    "id": "mathchat-error_correction-2",
    "messages": [
        {"role": "user", "content": "A robe takes 2 bolts of blue and half that much white. How many bolts?"},
        {"role": "assistant", "content": "So it takes 2.5 bolts.", "reasoning_content": "Half of 2 is 0.5."},
        {"role": "user", "content": "Not quite. Try again?"},
        {"role": "assistant", "content": "The answer is 3.", "reasoning_content": "Half of 2 is 1. So 2 + 1 = 3 bolts."},
    ],
    "source": "MathChat error_correction.jsonl line 2",
}


def _write(path: Path, lines: list[object]) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines), encoding="utf-8")
    return path


def test_annotations_removed():
    assert strip_annotations("16 - 3 - 4 = <<16-3-4=9>>9 eggs, $<<9*2=18>>18") == "16 - 3 - 4 = 9 eggs, $18"


@pytest.mark.parametrize(("raw", "expected"), [
    (r"The answer is \ANSWER{14}.", "The answer is 14."),
    (r"The answer is \ANSWER{$480}", "The answer is $480"),
    (r"The answer is \ANSWER{62.5\%}.", "The answer is 62.5%."),
    (r"is \ANSWER{170 \text{ miles}}.", "is 170 miles."),
    (r"is \ANSWER{40 cookies in total.}.", "is 40 cookies in total."),
    (r"has \(\ANSWER{25}\) bananas and \ANSWER{\frac{8}{3}} cups", r"has 25 bananas and \frac{8}{3} cups"),
])
def test_answer_markers_normalised(raw, expected):
    assert normalise_answers(raw) == expected


def test_unclosed_answer_marker_is_an_error():
    with pytest.raises(ValueError, match="unclosed"):
        normalise_answers(r"The answer is \ANSWER{14.")


@pytest.mark.parametrize(("text", "reasoning", "response"), [
    ("9 - 2 = 7. 7 * 2 = 14. The answer is 14.", "9 - 2 = 7. 7 * 2 = 14.", "The answer is 14."),
    ("She makes $14.", "", "She makes $14."),  # one sentence: empty reasoning
    ("It costs $2.50 each. Mr. Smith pays $5.", "It costs $2.50 each.", "Mr. Smith pays $5."),
    ("Rows:\n- 6 a day\n- 7 a day", "Rows:\n- 6 a day", "- 7 a day"),
    ("7 eggs. So, the answer is 7. Note: eggs are whole.", "7 eggs.", "So, the answer is 7. Note: eggs are whole."),
    ("It is 40 lb. in all. Thus 40.", "It is 40 lb. in all.", "Thus 40."),
])
def test_split_final_answer(text, reasoning, response):
    assert split_final_answer(text) == (reasoning, response)


def test_convert_hand_written_lines(tmp_path):
    fu = _write(tmp_path / "follow_up.jsonl", [FOLLOW_UP])
    ec = _write(tmp_path / "error_correction.jsonl", ["", ERROR_CORRECTION])  # blank line 1 still counts
    records, skipped = convert_mathchat([fu, ec])
    assert skipped == []
    assert records == [FOLLOW_UP_EXPECTED, ERROR_CORRECTION_EXPECTED]
    for r in records:
        parse_record(r)


def test_write_jsonl_round_trips(tmp_path):
    out = tmp_path / "sub" / "out.jsonl"
    assert write_jsonl([FOLLOW_UP_EXPECTED, ERROR_CORRECTION_EXPECTED], out) == 2
    lines = out.read_text(encoding="utf-8").splitlines()
    assert [json.loads(x) for x in lines] == [FOLLOW_UP_EXPECTED, ERROR_CORRECTION_EXPECTED]


@pytest.mark.parametrize(("dialogue", "problem"), [
    ("Preface.\nA: q?\nB: r.", "text before the first 'A:'"),
    ("A: q?\nB: r.\nA: q2?", "has no answer from B"),
    ("A: q?\nA: q2?\nB: r.", "turns must alternate"),
    ("A: q?\nB:\nA: q2?\nB: r.", "is empty"),
    ("A: q?\nB: r.\n#### 2\nA: q2?\nB: r2.", "stray '####'"),
    ("no speakers at all", "text before the first 'A:'"),
])
def test_malformed_dialogues(dialogue, problem):
    with pytest.raises(ValueError, match=problem):
        parse_dialogue(dialogue)


def test_malformed_line_names_file_and_line(tmp_path):
    bad = dict(FOLLOW_UP, followup="A: q?\nB: r.\nA: unanswered?")
    path = _write(tmp_path / "follow_up.jsonl", [FOLLOW_UP, bad, "{not json", dict(FOLLOW_UP, answer="no hashes")])
    with pytest.raises(MathChatError, match=r"follow_up\.jsonl line 2: field 'followup'.*no answer from B"):
        convert_mathchat([path])
    with pytest.raises(ValueError):  # MathChatError is a ValueError: one except clause in the CLI
        convert_mathchat(path)
    records, skipped = convert_mathchat([path], strict=False)
    assert [r["id"] for r in records] == ["mathchat-followup-1"]
    assert len(skipped) == 3
    assert "line 2:" in skipped[0] and "line 3: not valid JSON" in skipped[1] and "line 4:" in skipped[2]
    assert "'#### N'" in skipped[2]


def test_limit_counts_kept_records_per_file(tmp_path):
    path = _write(tmp_path / "follow_up.jsonl", [FOLLOW_UP, "{bad", FOLLOW_UP, FOLLOW_UP])
    records, skipped = convert_mathchat([path, path], strict=False, limit=2)
    assert [r["id"] for r in records] == ["mathchat-followup-1", "mathchat-followup-3"] * 2
    assert len(skipped) == 2


def test_missing_file_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        convert_mathchat([tmp_path / "nope.jsonl"])


def test_bundled_sample_every_record_parses():
    lines = sample_path().read_text(encoding="utf-8").splitlines()
    assert len(lines) == 2 * SAMPLE_PER_FILE == 300
    assert sample_path().stat().st_size < 1_500_000
    for n, line in enumerate(lines, start=1):
        parse_record(json.loads(line), source=str(sample_path()), index=n, unit="line")


def test_bundled_sample_depths_are_two_and_three_turns():
    conversations = load_sample()
    depths = collections.Counter(c.num_assistant_turns for c in conversations)
    assert depths == {3: SAMPLE_PER_FILE, 2: SAMPLE_PER_FILE}
    assert all(m.reasoning is not None for c in conversations for m in c.messages if m.role == "assistant")
    assert any(m.reasoning == "" for c in conversations for m in c.messages)  # empty-reasoning turns occur
    assert [c.id for c in load_sample(limit=2)] == ["mathchat-followup-1", "mathchat-followup-2"]


@needs_shared
def test_first_lines_of_the_real_files_match_the_sample(tmp_path):
    sample = [json.loads(x) for x in sample_path().read_text(encoding="utf-8").splitlines()]
    for k, name in enumerate(SAMPLE_FILES):
        head = "".join((SHARED / name).read_text(encoding="utf-8").splitlines(keepends=True)[:5])
        (tmp_path / name).write_text(head, encoding="utf-8")
        records, skipped = convert_mathchat([tmp_path / name])
        assert skipped == []
        assert records == sample[k * SAMPLE_PER_FILE:k * SAMPLE_PER_FILE + 5]


@needs_shared
def test_sample_rebuilds_byte_for_byte(tmp_path):
    out = tmp_path / "sample.jsonl"
    write_jsonl(build_sample(SHARED), out)
    assert out.read_bytes() == sample_path().read_bytes()
