"""The command line as a user meets it: outputs on disk, one-line errors, nothing lost silently."""

from __future__ import annotations

import json

import numpy as np
import pytest

from onepass.cli import main
from onepass.conversation import read_conversations
from onepass.data.mathchat import sample_path
from onepass.prepare import PrepareConfig, load_rows, prepare
from onepass.tree import COLUMNS

GOOD = {"messages": [{"role": "user", "content": "2+2?"},
                     {"role": "assistant", "content": "4", "reasoning_content": "add"},
                     {"role": "user", "content": "and 3+3?"},
                     {"role": "assistant", "content": "6", "reasoning_content": ""}]}
BAD_ROLE = {"messages": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "yo"}]}


def write_jsonl(path, lines):
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return path


def test_prepare_writes_exactly_the_columns_and_stats(tmp_path, qwen3_tokenizer):
    out = tmp_path / "prepared"
    assert main(["prepare", "--data", "builtin:mathchat", "--limit", "12", "--out", str(out),
                 "--no-progress"]) == 0
    import datasets

    ds = datasets.load_from_disk(str(out))
    assert ds.column_names == list(COLUMNS)
    stats = json.loads((out / "stats.json").read_text())
    assert stats["conversations"] == 12 and stats["rows"] == stats["trees"] == len(ds) == 12
    assert stats["n_pass_tokens"] > stats["one_pass_tokens"] == stats["row_tokens"]
    assert stats["token_ratio"] == pytest.approx(stats["n_pass_tokens"] / stats["one_pass_tokens"])
    assert stats["skipped"] == []
    # what is on disk is what prepare computed in memory
    convs = read_conversations(sample_path(), limit=12).conversations
    rows, _ = prepare(convs, qwen3_tokenizer, PrepareConfig())
    for a, b in zip(rows, load_rows(out)):
        for c in COLUMNS:
            np.testing.assert_allclose(getattr(a, c), getattr(b, c), rtol=1e-7)


def test_prepare_packed_rows_fit_the_budget(tmp_path):
    out = tmp_path / "packed"
    assert main(["prepare", "--data", "builtin:mathchat", "--limit", "20", "--out", str(out),
                 "--max-tokens", "2048", "--pack", "--schedule", "budget", "--no-progress"]) == 0
    stats = json.loads((out / "stats.json").read_text())
    assert stats["rows"] < stats["trees"]
    assert all(len(r) <= 2048 for r in load_rows(out))
    assert stats["padding_tokens"] == stats["rows"] * 2048 - stats["row_tokens"]


def test_prepare_counts_every_skip(tmp_path, capsys):
    data = write_jsonl(tmp_path / "mixed.jsonl", [GOOD, BAD_ROLE, "{not json", GOOD])
    out = tmp_path / "out"
    assert main(["prepare", "--data", str(data), "--out", str(out), "--max-tokens", "30",
                 "--schedule", "n-pass", "--no-progress"]) == 0
    stats = json.loads((out / "stats.json").read_text())
    assert stats["conversations"] == 2
    assert stats["skipped_by_reason"]["invalid record"] == 2
    assert any("line 2, message 1: unknown role 'bot'" in s for s in stats["skipped"])
    assert any("line 3: not valid JSON" in s for s in stats["skipped"])
    # the second view of each conversation is longer than 30 tokens: counted, not dropped silently
    assert stats["skipped_by_reason"]["over max_tokens"] == stats["views_skipped"] == 2
    assert "SKIPPED 4" in capsys.readouterr().out


def test_strict_stops_at_the_first_bad_record_with_one_line(tmp_path, capsys):
    data = write_jsonl(tmp_path / "bad.jsonl", [GOOD, BAD_ROLE])
    assert main(["prepare", "--data", str(data), "--out", str(tmp_path / "o"), "--strict"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"onepass: error: {data} line 2, message 1: unknown role 'bot'; "
                   "expected one of system, user, assistant, tool"]
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("argv,message", [
    (["prepare", "--data", "missing.jsonl", "--out", "o"], "data file not found: missing.jsonl"),
    (["prepare", "--data", "builtin:mathchat", "--out", "o", "--pack"], "packing needs a row budget"),
    (["verify", "--data", "builtin:mathchat", "--model", "no/such-model"], "is not a local path"),
    (["prepare", "--data", "builtin:mathchat", "--out", "o", "--chat-template", "nope.jinja"],
     "chat template file not found: nope.jinja"),
    (["prepare", "--data", "builtin:mathchat", "--out", "o", "--template-kwarg", "oops"], "KEY=VALUE"),
])
def test_user_errors_are_one_line(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("onepass: error: ") and message in err[0]


def test_unknown_schedule_is_rejected_by_the_parser(capsys):
    with pytest.raises(SystemExit) as e:
        main(["prepare", "--data", "x", "--out", "o", "--schedule", "two-pass"])
    assert e.value.code == 2 and "unknown schedule 'two-pass'" in capsys.readouterr().err


def test_template_that_cannot_split_names_the_turn(tmp_path, capsys):
    template = tmp_path / "r1.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}|{% endfor %}"
                        "{% if add_generation_prompt %}<think>\n{% endif %}")
    data = write_jsonl(tmp_path / "d.jsonl", [GOOD])
    argv = ["prepare", "--data", str(data), "--out", str(tmp_path / "o"), "--chat-template", str(template)]
    assert main(argv) == 1  # lenient: counted, then nothing left to write
    assert "nothing to write" in capsys.readouterr().err
    assert main(argv + ["--strict"]) == 2
    assert f"{data} line 1, message 1: the chat template's rendering" in capsys.readouterr().err
    assert main(argv + ["--completion-format", "deepseek-r1"]) == 0


def test_verify_prints_json_last(capsys):
    assert main(["verify", "--data", "builtin:mathchat", "--limit", "2", "--tiny", "llama"]) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("loss_n_pass", "loss_one_pass", "max_abs_loss_diff", "max_rel_grad_diff"):
        assert key in last
    assert last["equal"] and last["rel_loss_diff"] <= 1e-9 and last["num_views"] == 6


def test_show_writes_a_png(tmp_path):
    out = tmp_path / "mask.png"
    assert main(["show", "--data", "builtin:mathchat", "--index", "3", "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_show_index_out_of_range(tmp_path, capsys):
    data = write_jsonl(tmp_path / "d.jsonl", [GOOD])
    assert main(["show", "--data", str(data), "--index", "5", "--out", str(tmp_path / "m.png")]) == 2
    assert "--index 5 is out of range: 1 valid conversations" in capsys.readouterr().err


def test_data_convert_mathchat(tmp_path, capsys):
    src = tmp_path / "follow_up.jsonl"
    write_jsonl(src, [{"question": "Q?", "answer": "2+2=<<2+2=4>>4\n#### 4",
                       "followup": "A: Q2?\nB: 4+1=5. The answer is \\ANSWER{5}."}])
    out = tmp_path / "conv.jsonl"
    assert main(["data", "convert-mathchat", "--input", str(src), "--out", str(out)]) == 0
    (record,) = [json.loads(x) for x in out.read_text().splitlines()]
    assert [m["role"] for m in record["messages"]] == ["user", "assistant", "user", "assistant"]
    assert main(["prepare", "--data", str(out), "--out", str(tmp_path / "p"), "--no-progress"]) == 0
