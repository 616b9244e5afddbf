"""Prepare under faults: ``--out`` never loses unrelated files, a replace is atomic even under ``kill -9``,
workers die with their parent, and temporaries of dead processes are cleaned up (issue 13, items 1-3).

Names the fix added (``onepass.files.MARKER``, ``recover_dir``) are imported inside the tests, so each test
also runs, and fails on its own assertions, against the code before the fix (docs/faults.md)."""

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
from onepass.prepare.pipeline import load_rows
import warm

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
    from onepass.files import MARKER

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


@pytest.mark.e2e
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
    proc = warm.run([sys.executable, "-c", script], env=ENV, capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    assert not out.exists() and any(p.name.startswith(".prepared.old-") for p in tmp_path.iterdir())
    from onepass.files import recover_dir

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


@pytest.mark.e2e
def test_kill_9_at_a_random_point_of_a_serial_prepare_loses_nothing(tmp_path):
    out = tmp_path / "prepared"
    assert main(["prepare", *TINY, "--out", str(out)]) == 0
    before = _prepared(out)
    proc = onepass("prepare", "--data", "builtin:mathchat", "--limit", "4", "--no-progress", "--out", str(out))
    wait_for(lambda: proc.poll() is not None, random.Random(os.getpid()).uniform(1.0, 5.0))
    if proc.poll() is None:
        kill9(proc)
    try:
        from onepass.files import recover_dir  # what the next run does first
    except ImportError:  # the code before the fix had no recovery step (docs/faults.md runs it there too)
        recover_dir = lambda _out: None  # noqa: E731
    recover_dir(out)
    assert _prepared(out) in (before, (4, 4))  # the old dataset or the new one, whole
    assert sorted(os.listdir(tmp_path)) == ["prepared"]


_STREAM = ("import sys\nimport onepass.prepare.shards\n"
           "onepass.prepare.shards.BATCH_ROWS = 2  # rows reach disk from the start\n"
           "from onepass.cli import main\nsys.exit(main(sys.argv[1:]))\n")


@pytest.mark.e2e
@pytest.mark.multiprocess
@pytest.mark.parametrize("num_proc", [1, 2])
def test_kill_9_while_rows_stream_keeps_the_old_output_and_leaves_no_workers(tmp_path, num_proc):
    """Rows are written as they are made, into the hidden temporary of --out: a kill -9 then publishes
    nothing, keeps the earlier output whole, takes the workers with it and stages nothing in TMPDIR."""
    tmpdir = Path(tempfile.mkdtemp(prefix="op-"))
    out = tmp_path / "prepared"
    assert main(["prepare", *TINY, "--out", str(out)]) == 0
    before = _prepared(out)
    proc = warm.Popen([sys.executable, "-c", _STREAM, "prepare", "--data", "synthetic:mathchat-sync",
                       "--limit", "400", "--num-proc", str(num_proc), "--no-progress", "--out", str(out)],
                      env={**ENV, "TMPDIR": str(tmpdir)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    def streaming():
        return any(tmp_path.glob(".prepared.tmp-*/.shard-*.arrow"))

    assert wait_for(lambda: streaming() or proc.poll() is not None, 120), "no rows written"
    assert proc.poll() is None, proc.stdout.read()
    children = descendants(proc.pid)
    assert len(children) >= (num_proc if num_proc > 1 else 0)
    kill9(proc)
    assert wait_for(lambda: not alive(children), 10), f"orphans: {alive(children)}"
    assert _prepared(out) == before  # the earlier output, whole
    assert [p.name for p in tmp_path.iterdir() if p.name != "prepared"] == [f".prepared.tmp-{proc.pid}"]
    assert not any(tmpdir.iterdir())  # nothing staged in TMPDIR
    assert main(["prepare", *TINY, "--num-proc", str(num_proc), "--out", str(out)]) == 0
    assert sorted(os.listdir(tmp_path)) == ["prepared"]  # the next run removed the dead run's temporary
    shutil.rmtree(tmpdir)


@pytest.mark.e2e
@pytest.mark.multiprocess
def test_kill_9_of_num_proc_leaves_no_orphan_workers(tmp_path):
    """Item 3 alone, on any prepare (streaming or not, so it runs on the code before the fix too): the
    workers of ``--num-proc`` die with their parent; any survivor is killed here, not left running."""
    tmpdir = Path(tempfile.mkdtemp(prefix="op-"))  # short: the pool's AF_UNIX socket path is at most 107 bytes
    # enough work that a worker left alone would run on for a minute (3 orphans, minutes of CPU, in the issue);
    # the long-reasoning workload: the default one now prepares in ~4 CPU s per worker, too close to the
    # 3 s the test waits for, so the run could end before the kill
    proc = onepass("prepare", "--data", "synthetic:mathchat-sync-long", "--limit", "3000", "--num-proc", "2",
                   "--no-progress", "--out", str(tmp_path / "prepared"), env={"TMPDIR": str(tmpdir)})
    children = []

    def working() -> bool:  # two workers past their start-up, inside their share of the work
        cpu = sorted(p.cpu_times().user for p in alive(descendants(proc.pid)))
        return len(cpu) >= 2 and cpu[-2] >= 3.0

    try:
        assert wait_for(lambda: working() or proc.poll() is not None, 180), "no workers"
        assert proc.poll() is None, proc.stdout.read()
        children = descendants(proc.pid)
        kill9(proc)
        assert wait_for(lambda: not alive(children), 5), f"orphans: {alive(children)}"
    finally:
        for p in alive(children):
            p.kill()
        if proc.poll() is None:
            kill9(proc)
        shutil.rmtree(tmpdir, ignore_errors=True)
