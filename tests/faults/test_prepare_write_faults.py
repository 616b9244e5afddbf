"""``onepass prepare`` on a machine that refuses the write (issue 44, item 13): one line, nothing half-written.

Before the fix (b757769): a file-size limit (``ulimit -f``, a real one: the kernel refuses the write with
EFBIG, which Python raises as it ignores SIGXFSZ) or a full disk while the rows were written was a raw
``OSError`` traceback, with or without ``--pack``; training already said the same faults in one line.
"""

from __future__ import annotations

import contextlib
import errno
import json
import resource

import pytest

from onepass.cli import main

LIMIT = 32 * 1024  # bytes: the rows of the sample's 20 conversations are several times more


@contextlib.contextmanager
def file_size_limit(limit: int):
    """The kernel's file-size limit (``ulimit -f``) on this process for the block: its soft value only, so it is
    put back after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


@pytest.fixture(scope="module")
def earlier(tmp_path_factory, qwen3_tokenizer):  # the tokenizer is cached before any limit is set
    """An earlier output of a few conversations, that a failed prepare must keep whole."""
    root = tmp_path_factory.mktemp("write")
    assert main(["prepare", "--data", "builtin:mathchat", "--limit", "2", "--tokenizer", "builtin:qwen3", "--out",
                 str(root / "out"), "--no-progress"]) == 0
    return root


@pytest.mark.parametrize("pack", [False, True])
def test_a_file_size_limit_is_one_line_and_keeps_the_earlier_output(earlier, pack, capsys):
    out = earlier / "out"
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    flags = ["--pack", "--max-tokens", "4096"] if pack else []
    with file_size_limit(LIMIT):
        code = main(["prepare", "--data", "builtin:mathchat", "--limit", "20", "--tokenizer", "builtin:qwen3", "--out",
                     str(out), "--no-progress", *flags])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2, last
    assert last.startswith(f"onepass: error: cannot write the prepared rows to {out} (File too large); the earlier "
                           "output there is kept: free space (or raise the file-size limit) and prepare again"), last
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # the earlier output, whole
    assert sorted(p.name for p in earlier.iterdir()) == ["out"]  # no temporary left beside it


def test_a_full_disk_is_one_line_and_leaves_nothing(tmp_path, qwen3_tokenizer, monkeypatch, capsys):
    from onepass.prepare import shards

    real = shards.RowWriter.write

    def full(self, *a, **kw):
        if self.num_rows >= 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, *a, **kw)

    monkeypatch.setattr(shards.RowWriter, "write", full)
    code = main(["prepare", "--data", "builtin:mathchat", "--limit", "4", "--tokenizer", "builtin:qwen3", "--out",
                 str(tmp_path / "out"), "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2 and err == (f"onepass: error: cannot write the prepared rows to {tmp_path / 'out'} (No space left "
                                 "on device); nothing was written there: free space (or raise the file-size limit) "
                                 "and prepare again"), err
    assert list(tmp_path.iterdir()) == []


def test_an_unreadable_data_file_is_not_called_a_full_disk(tmp_path, qwen3_tokenizer, monkeypatch, capsys):
    # reference (an OSError of the data is the data's, passes on the old tree too): the read error comes through
    from onepass.prepare import cli

    def unreadable(*a, **kw):
        raise OSError(errno.EIO, "Input/output error")
        yield

    monkeypatch.setattr(cli, "iter_prepared", unreadable)  # the data, read as the rows are written
    with pytest.raises(OSError, match="Input/output error"):
        main(["prepare", "--data", "builtin:mathchat", "--limit", "4", "--tokenizer", "builtin:qwen3", "--out",
              str(tmp_path / "out"), "--no-progress"])
    assert json.dumps([p.name for p in tmp_path.iterdir()]) == "[]"
