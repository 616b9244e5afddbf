"""Bad text is a counted skip naming file, line and message (an error under ``--strict``), in every command
and on the ``--num-proc`` path; a template that raises for one conversation is a counted skip, one that
does not compile a one-line error before any data is read; conflicting reasoning fields are never dropped
silently (issue 13, items 4, 5, 6 and 8)."""

from __future__ import annotations

import json

import pytest

from onepass.cli import main
from onepass.conversation.parse import ConversationError, parse_record
from onepass.data.sources import load_conversations

GOOD = {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}


def _jsonl(path, lines: list[bytes]):
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def _bad_file(tmp_path, bad: bytes):
    good = json.dumps(GOOD).encode()
    return _jsonl(tmp_path / "chats.jsonl", [good, bad, good])


SURROGATE = json.dumps({"messages": [{"role": "user", "content": "hi \\ud800"},
                                     {"role": "assistant", "content": "4"}]}).replace("\\\\", "\\").encode()
BAD = {
    "lone surrogate": (SURROGATE, "line 2, message 0: messages[0].content: a lone surrogate U+D800"),
    "NUL": (json.dumps({"messages": [GOOD["messages"][0], {"role": "assistant", "content": "a\x00"}]}).encode(),
            "line 2, message 1: messages[1].content: a NUL character"),
    "invalid UTF-8": (b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', "line 2: not valid UTF-8"),
}


@pytest.mark.parametrize("kind", BAD)
def test_bad_text_is_a_counted_skip_naming_the_line(tmp_path, kind):
    bad, where = BAD[kind]
    data = _bad_file(tmp_path, bad)
    report = load_conversations(str(data), strict=False)  # the reader of prepare, verify, train, data stats
    assert len(report.conversations) == 2 and len(report.skipped) == 1 and where in report.skipped[0]
    with pytest.raises(ConversationError, match=where.split(":")[0]):
        load_conversations(str(data), strict=True)


@pytest.mark.parametrize("num_proc", ["1", "2"])
def test_prepare_skips_bad_text_serial_and_parallel(tmp_path, capsys, num_proc):
    data = _bad_file(tmp_path, SURROGATE + b"\n" + BAD["invalid UTF-8"][0])
    argv = ["prepare", "--data", str(data), "--no-progress", "--num-proc", num_proc]
    assert main([*argv, "--out", str(tmp_path / "o")]) == 0
    stats = json.loads((tmp_path / "o" / "stats.json").read_text())
    assert stats["conversations"] == 2 and stats["skipped_by_reason"] == {"invalid record": 2}
    assert "line 2" in stats["skipped"][0] and "line 3: not valid UTF-8" in stats["skipped"][1]
    assert main([*argv, "--out", str(tmp_path / "s"), "--strict"]) == 2
    assert "line 2, message 0" in capsys.readouterr().err


def test_data_stats_skips_a_lone_surrogate(tmp_path, capsys):
    data = _bad_file(tmp_path, SURROGATE)
    assert main(["data", "stats", "--data", str(data)]) == 0
    captured = capsys.readouterr()
    assert "line 2, message 0: messages[0].content: a lone surrogate" in captured.err + captured.out


# Raises for a turn whose content is "boom", as real templates raise for roles that do not alternate.
RAISING_TEMPLATE = ("{% for m in messages %}{% if m.content == 'boom' %}\n"
                    "{{ raise_exception('roles must alternate') }}{% endif %}"
                    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_template_that_raises_for_one_conversation_is_a_counted_skip(tmp_path, capsys):
    boom = {"messages": [*GOOD["messages"], {"role": "user", "content": "q2"}, {"role": "assistant", "content": "boom"}]}
    data = _jsonl(tmp_path / "chats.jsonl", [json.dumps(r).encode() for r in (GOOD, boom, GOOD)])
    template = tmp_path / "strict.jinja"
    template.write_text(RAISING_TEMPLATE, encoding="utf-8")
    argv = ["prepare", "--data", str(data), "--chat-template", str(template), "--no-progress"]
    assert main([*argv, "--out", str(tmp_path / "o")]) == 0
    stats = json.loads((tmp_path / "o" / "stats.json").read_text())
    assert stats["conversations"] == 3 and stats["skipped_by_reason"] == {"template error": 1}
    assert stats["skipped"] == [f"{data} line 2, message 3: the chat template raised at line 2 rendering the "
                                "conversation: TemplateError: roles must alternate"]
    assert main([*argv, "--strict", "--out", str(tmp_path / "s")]) == 2
    assert "line 2, message 3" in capsys.readouterr().err


def test_a_template_that_does_not_compile_is_one_line_before_any_data_is_read(tmp_path, capsys):
    bad_last = json.dumps({"messages": [{"role": "bot", "content": "x"}]}).encode()  # found only by reading it all
    data = _jsonl(tmp_path / "chats.jsonl", [json.dumps(GOOD).encode(), bad_last])
    template = tmp_path / "broken.jinja"
    template.write_text("{% for m in messages %}\n{{ m.content }\n", encoding="utf-8")
    assert main(["prepare", "--data", str(data), "--chat-template", str(template), "--strict", "--no-progress",
                 "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"onepass: error: the chat template of {template} does not compile: line 2: ")
    assert len(err.splitlines()) == 1


def test_conflicting_reasoning_fields_name_the_record():
    msgs = [GOOD["messages"][0], {"role": "assistant", "content": "4", "reasoning_content": "2+2=4",
                                  "reasoning": "four", "thinking": "2+2=4"}]
    with pytest.raises(ConversationError, match="x.jsonl line 7, message 1: conflicting reasoning fields "
                                                 "reasoning_content, reasoning, thinking"):
        parse_record({"messages": msgs}, source="x.jsonl", index=7, unit="line")
    msgs[1]["reasoning"] = "2+2=4"  # the same text in several fields is fine
    assert parse_record({"messages": msgs}).messages[1].reasoning == "2+2=4"


def test_augment_failures_never_hold_the_api_key(monkeypatch):
    from onepass.data.augment import scrub

    monkeypatch.setenv("OPENAI_API_KEY", "sk-secret-123")
    assert "sk-secret" not in scrub("401 Unauthorized: header 'Authorization: Bearer sk-secret-123'",
                                    "sk-secret-123")
