"""Atomic writes: the target is the old version or the new one, never half of one, and no temporary is left."""

from __future__ import annotations

import doctest
import os

import pytest

import onepass.files
from onepass.files import atomic_dir, atomic_file, atomic_write_text, publish_dir, temp_sibling


def test_docstring_example():
    result = doctest.testmod(onepass.files)
    assert result.attempted >= 4 and result.failed == 0


def test_temporaries_are_hidden_siblings(tmp_path):
    assert temp_sibling(tmp_path / "m.json") == tmp_path / f".m.json.tmp-{os.getpid()}"
    assert temp_sibling(tmp_path / "step-1", per_process=False) == tmp_path / ".step-1.tmp"


def test_a_failed_file_write_keeps_the_old_content(tmp_path):
    path = atomic_write_text(tmp_path / "records.jsonl", "old\n")
    with pytest.raises(RuntimeError), atomic_file(path) as f:
        f.write("new, half")
        assert path.read_text() == "old\n"  # nothing visible while writing
        raise RuntimeError("crash")
    assert path.read_text() == "old\n" and os.listdir(tmp_path) == ["records.jsonl"]
    with atomic_file(path) as f:
        f.write("new\n")
    assert path.read_text() == "new\n" and os.listdir(tmp_path) == ["records.jsonl"]


def test_a_directory_replaces_the_old_one_only_when_complete(tmp_path):
    out = tmp_path / "prepared"
    with atomic_dir(out) as tmp:
        (tmp / "a").write_text("1")
    with pytest.raises(RuntimeError), atomic_dir(out) as tmp:
        (tmp / "b").write_text("2")
        raise RuntimeError("crash")
    assert sorted(os.listdir(out)) == ["a"] and os.listdir(tmp_path) == ["prepared"]
    with atomic_dir(out) as tmp:
        (tmp / "b").write_text("2")
    assert sorted(os.listdir(out)) == ["b"] and os.listdir(tmp_path) == ["prepared"]


def test_a_cache_keeps_the_copy_published_first(tmp_path):
    out = tmp_path / "tokenizer"
    with atomic_dir(out, replace=False) as tmp:
        (tmp / "first").write_text("1")
    with atomic_dir(out, replace=False) as tmp:
        (tmp / "second").write_text("2")
    assert os.listdir(out) == ["first"] and os.listdir(tmp_path) == ["tokenizer"]
    late = tmp_path / ".late"
    late.mkdir()
    assert not publish_dir(late, out, replace=False) and not late.exists()
