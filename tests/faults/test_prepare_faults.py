"""Prepare under faults: ``--out`` never loses unrelated files, a replace is atomic even under ``kill -9``,
workers die with their parent, and temporaries of dead processes are cleaned up (issue 13, items 1-3)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import shutil
import tempfile
from pathlib import Path

import pytest
from fault_helpers import ENV, alive, dead_pid, descendants, kill9, onepass, wait_for

from onepass.cli import main
from onepass.files import MARKER, recover_dir
from onepass.prepare import load_rows

TINY = ["--data", "builtin:mathchat", "--limit", "2", "--no-progress"]


def _prepared(path):
    return json.loads((path / "stats.json").read_text())["conversations"], len(load_rows(path))


def test_out_refuses_a_folder_of_unrelated_files(tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("precious")
    assert main(["prepare", *TINY, "--out", str(out)]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert (out / "notes.txt").read_text() == "precious"
    assert main(["prepare", *TINY, "--out", str(out), "--overwrite"]) == 0
    assert not (out / "notes.txt").exists() and (out / MARKER).is_file()
    assert main(["prepare", *TINY, "--out", str(out)]) == 0  # an earlier output is replaced without asking


@pytest.mark.parametrize("where", ["file", "under-a-file"])
def test_out_that_cannot_be_written_fails_in_one_line_before_the_work(tmp_path, capsys, where):
    blocker = tmp_path / "blocker"
    blocker.write_text("x")
    out = blocker if where == "file" else blocker / "out"
    assert main(["prepare", *TINY, "--out", str(out)]) == 2
    err = capsys.readouterr()
    assert "onepass: error: --out" in err.err and "conversations" not in err.out  # no work was done
    assert blocker.read_text() == "x"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_out_in_a_read_only_folder_fails_before_the_work(tmp_path, capsys):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        assert main(["prepare", *TINY, "--out", str(ro / "out")]) == 2
        assert "cannot write" in capsys.readouterr().err
    finally:
        ro.chmod(0o700)


def test_kill_between_the_two_renames_keeps_the_old_dataset(tmp_path):
    """State 2 of onepass.files: the old output renamed aside, the new one not yet in place."""
    out = tmp_path / "prepared"
    assert main(["prepare", *TINY, "--out", str(out)]) == 0
    before = _prepared(out)
    script = ("import os, signal, sys\nimport onepass.files as f\nreal, calls = os.replace, []\n"
              "def replace(a, b):\n    calls.append(a)\n    if len(calls) == 2: os.kill(os.getpid(), signal.SIGKILL)\n"
              "    real(a, b)\nf.os.replace = replace\nfrom onepass.cli import main\n"
              f"sys.exit(main(['prepare', '--data', 'builtin:mathchat', '--limit', '3', '--no-progress', "
              f"'--out', {str(out)!r}]))\n")
    proc = subprocess.run([sys.executable, "-c", script], env=ENV, capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    assert not out.exists() and any(p.name.startswith(".prepared.old-") for p in tmp_path.iterdir())
    assert recover_dir(out)  # what the next run does first
    assert _prepared(out) == before and sorted(os.listdir(tmp_path)) == ["prepared"]


def test_stale_leftovers_of_dead_processes_are_cleaned(tmp_path):
    out = tmp_path / "prepared"
    assert main(["prepare", *TINY, "--out", str(out)]) == 0
    pid = dead_pid()
    (tmp_path / f".prepared.tmp-{pid}").mkdir()
    (tmp_path / f".prepared.old-{pid}").mkdir()
    (tmp_path / f".prepared.tmp-{os.getppid()}").mkdir()  # a live process's: left alone
    assert main(["prepare", *TINY, "--out", str(out)]) == 0
    assert sorted(os.listdir(tmp_path)) == [f".prepared.tmp-{os.getppid()}", "prepared"]


def test_kill_9_at_a_random_point_of_a_serial_prepare_loses_nothing(tmp_path):
    out = tmp_path / "prepared"
    assert main(["prepare", *TINY, "--out", str(out)]) == 0
    before = _prepared(out)
    proc = onepass("prepare", "--data", "builtin:mathchat", "--limit", "4", "--no-progress", "--out", str(out))
    wait_for(lambda: proc.poll() is not None, random.Random(os.getpid()).uniform(1.0, 5.0))
    if proc.poll() is None:
        kill9(proc)
    recover_dir(out)
    assert _prepared(out) in (before, (4, 4))  # the old dataset or the new one, whole
    assert sorted(os.listdir(tmp_path)) == ["prepared"]


def test_kill_9_of_num_proc_leaves_no_workers_and_no_temporaries(tmp_path, monkeypatch):
    # A short TMPDIR: the pool's manager puts an AF_UNIX socket there (at most 107 bytes of path),
    # and pytest's tmp_path under xdist is already long.
    tmpdir = Path(tempfile.mkdtemp(prefix="op-"))
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "prepared"
    proc = onepass("prepare", "--data", "synthetic:mathchat-sync", "--limit", "400", "--num-proc", "2",
                   "--no-progress", "--out", str(out), env={"TMPDIR": str(tmpdir)})
    assert wait_for(lambda: len(descendants(proc.pid)) >= 2 or proc.poll() is not None, 60), "no workers"
    assert proc.poll() is None, proc.stdout.read()
    children = descendants(proc.pid)
    kill9(proc)
    assert wait_for(lambda: not alive(children), 10), f"orphans: {alive(children)}"
    assert any(tmpdir.iterdir()) and not out.exists()  # a kill -9 leaves its temporary folder...
    monkeypatch.setattr(tempfile, "tempdir", str(tmpdir))  # the next run, in this process
    assert main(["prepare", *TINY, "--num-proc", "2", "--out", str(out)]) == 0
    assert not any(p.name.startswith("onepass-prepare-") for p in tmpdir.iterdir())  # ...the next run removes it
    assert sorted(os.listdir(tmp_path)) == ["prepared"]
    shutil.rmtree(tmpdir)
