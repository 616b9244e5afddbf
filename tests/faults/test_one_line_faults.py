"""Damaged inputs are one ``onepass: error:`` line or a counted skip, never a traceback (issue 24, item 7):
a cut Arrow shard, a garbage ``stats.json``, a record nested thousands deep, ``verify --model`` on a folder
that is not a model, ``convert-mathchat`` whose every line is skipped (no longer rc 0 with an empty file).
"""

from __future__ import annotations

import json

import pytest
from fault_helpers import onepass


def _last_line(text: str) -> str:
    return text.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    out = tmp_path_factory.mktemp("prep") / "rows"
    proc = onepass("prepare", "--data", "builtin:mathchat", "--limit", "4", "--tokenizer", "builtin:qwen3", "--out",
                   str(out), "--no-progress")
    text, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, text
    return out


def _train(data, out):
    proc = onepass("train", "--tiny", "qwen3", "--data", str(data), "--max-steps", "1", "--no-progress",
                   "--no-save-model", "--output-dir", str(out))
    text, _ = proc.communicate(timeout=300)
    return proc.returncode, text


@pytest.mark.e2e
@pytest.mark.parametrize("damage", ["cut arrow shard", "garbage stats.json"])
def test_a_damaged_prepared_folder_is_one_line(tmp_path, prepared, damage):
    import shutil

    data = tmp_path / "rows"
    shutil.copytree(prepared, data)
    if damage == "cut arrow shard":
        (shard,) = data.glob("*.arrow")
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    else:
        (data / "stats.json").write_text("{not json")
    rc, text = _train(data, tmp_path / "run")
    assert rc == 2 and "Traceback" not in text, text
    assert _last_line(text).startswith("onepass: error:") and str(data) in _last_line(text)


def test_a_deeply_nested_record_is_a_counted_skip(tmp_path):
    from onepass.data.sources import load_conversations

    good = {"messages": [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"}]}
    deep = {"messages": [{"role": "user", "content": "[" * 100_000 + "]" * 100_000}]}
    data = tmp_path / "chats.jsonl"
    data.write_text(json.dumps(good) + "\n" + '{"x": ' + "[" * 100_000 + "]" * 100_000 + "}\n"
                    + json.dumps(deep) + "\n" + json.dumps(good) + "\n")
    report = load_conversations(str(data), strict=False)
    assert len(report.conversations) == 2  # the nested line is skipped, the others read
    assert any("line 2" in s and "nested too deeply" in s for s in report.skipped), report.skipped


@pytest.mark.e2e
def test_verify_model_on_a_folder_that_is_not_a_model_is_one_line(tmp_path):
    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "config.json").write_text('{"hello": "world"}')
    proc = onepass("verify", "--data", "builtin:mathchat", "--limit", "1", "--tokenizer", "builtin:qwen3",
                   "--model", str(folder))
    text, _ = proc.communicate(timeout=300)
    assert proc.returncode == 2 and "Traceback" not in text, text
    assert _last_line(text).startswith(f"onepass: error: --model {folder} cannot be loaded")


@pytest.mark.e2e
def test_convert_mathchat_with_every_line_skipped_fails(tmp_path):
    bad = tmp_path / "mathchat.jsonl"
    bad.write_text('{"not": "mathchat"}\nnot json\n')
    out = tmp_path / "out.jsonl"
    proc = onepass("convert-mathchat", "--input", str(bad), "--out", str(out), module="onepass.prepare.data_cli")
    text, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0 and "Traceback" not in text, text
    assert "every line was skipped" in text and not out.exists()
