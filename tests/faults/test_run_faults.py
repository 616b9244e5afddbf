"""A training run under faults (issue 37): a real full disk, a kill while checkpoints are pruned or saved,
tampered or foreign checkpoints, another number of processes on resume, a read-only folder, and the cost
of logging a step late in a long run.

Before the fix: a full disk during a checkpoint was a raw ``RuntimeError`` (``torch.save``) or
``SafetensorError`` with a ``.step-N.tmp`` folder left forever and metrics.json left "finishing"; a kill
while pruning left a ``step-N`` folder with an ``optimizer.pt`` and no ``state.json``, never cleaned nor
named; ``state.json`` saying ``step: 1000000000`` exited 0 having trained nothing; a checkpoint of 2
processes resumed on 1 (some conversations trained twice, others never); a read-only output folder was a
raw traceback after the data and model were loaded; metrics.json was rewritten whole at every logged step
(253 ms a write at 10k steps, 2.5 s at 100k).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from onepass.errors import OnePassError
from onepass.train.checkpoint import list_checkpoints
from onepass.train.config import load_config
from onepass.train.run.loop import train
import warm

pytestmark = pytest.mark.usefixtures("one_thread")


def _config(out, **overrides):
    values = dict(tiny="qwen3", data="builtin:mathchat", limit=2, max_steps=2, save_steps=1, save_total_limit=1,
                  progress=False, save_model=False, output_dir=str(out))
    return load_config(None, values | overrides)


def _run(out, resume=None, log=lambda _m: None, anyway=False, **overrides):
    return train(_config(out, **overrides), resume=resume, log=log, resume_anyway=anyway)


@contextlib.contextmanager
def _tmpfs(path, size):
    """A tmpfs of ``size`` mounted at ``path`` (root only: else the test is skipped)."""
    path.mkdir(parents=True)
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                                           capture_output=True).returncode:
        pytest.skip("mounting a tmpfs needs root")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


# ---------------------------------------------------------------------------------------------
# a full disk


@pytest.mark.e2e
@pytest.mark.parametrize("size", ["300k", "700k"], ids=["safetensors fails", "torch.save fails"])
def test_a_real_full_disk_at_the_final_checkpoint_is_one_line_and_leaves_nothing_half_written(tmp_path, size):
    """A tmpfs too small for the checkpoint (1.4 MB: 450 KB of weights, 900 KB of optimizer state): the weights'
    writer (safetensors) or the optimizer's (torch.save) hits ENOSPC for real. The only save is the final one."""
    with _tmpfs(tmp_path / "disk", size) as disk:
        out = disk / "run"
        with pytest.raises(OnePassError) as raised:
            _run(out, save_steps=None)
        line = str(raised.value)
        assert "\n" not in line and "No space left on device" in line and "checkpoint" in line, line
        leftovers = [p.name for p in (out / "checkpoints").iterdir()] if (out / "checkpoints").exists() else []
        assert leftovers == []  # no step-000002, no .step-000002.tmp
        status = json.loads((out / "metrics.json").read_text())["status"]
        assert status.startswith("stopped at step 2 while finishing") and "No space left" in status, status


def test_what_torch_save_raises_on_a_full_disk_is_one_line(tmp_path, monkeypatch):
    """The same without root: torch.save's own error on a full disk (a RuntimeError, the OSError as its context)."""
    real = torch.save

    def full(obj, f, *a, **kw):
        if "optimizer" in str(getattr(f, "name", f)):
            try:
                raise OSError(errno.ENOSPC, "No space left on device")
            except OSError:
                raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")  # noqa: B904
        return real(obj, f, *a, **kw)

    monkeypatch.setattr(torch, "save", full)
    out = tmp_path / "run"
    with pytest.raises(OnePassError, match=r"cannot write checkpoint .*step-000001 \(No space left on device\)"):
        _run(out)
    assert [p.name for p in (out / "checkpoints").iterdir()] == []
    assert json.loads((out / "metrics.json").read_text())["status"] == "stopped at step 1"


# ---------------------------------------------------------------------------------------------
# kill -9 while checkpoints are pruned or written

_KILL_IN_PRUNING = """
import os, shutil, signal, sys
import onepass.train.checkpoint as checkpoint
from onepass.train.config import load_config
from onepass.train.run.loop import train

real = shutil.rmtree
def rmtree(path, *a, **kw):  # pruning an older checkpoint: its state.json goes first, then the process is killed
    if ".tmp" in os.path.basename(path) or not os.path.isfile(os.path.join(path, "state.json")):
        return real(path, *a, **kw)  # a save's temporary, not a pruning
    os.remove(os.path.join(path, "state.json"))
    os.kill(os.getpid(), signal.SIGKILL)
checkpoint.shutil.rmtree = rmtree
train(load_config(None, dict(tiny="qwen3", data="builtin:mathchat", limit=2, max_steps=3, save_steps=1,
                             save_total_limit=1, progress=False, save_model=False, output_dir=sys.argv[1])))
"""


@pytest.mark.e2e
def test_a_kill_while_pruning_leaves_no_half_checkpoint_and_the_next_run_cleans_up(tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}
    proc = warm.run([sys.executable, "-c", _KILL_IN_PRUNING, str(out)], env=env, capture_output=True, text=True,
                    timeout=300)
    assert proc.returncode == -9, proc.stderr[-3000:]
    names = sorted(p.name for p in (out / "checkpoints").iterdir())
    half = [n for n in names if n.startswith("step-") and not (out / "checkpoints" / n / "state.json").exists()]
    assert half == [], names  # the old code: step-000001 with optimizer.pt and no state.json, forever
    said = []
    assert _run(out, resume=True, max_steps=3, log=said.append).steps == 3
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-000003"]  # the leftover is gone
    assert any("removed" in m and ".step-000001" in m for m in said), said


def test_a_folder_without_state_json_is_named_and_left_in_place(tmp_path):
    """What an older onepass left when killed while pruning: never a checkpoint, never deleted, now named."""
    out = tmp_path / "run"
    _run(out)
    half = out / "checkpoints" / "step-000001"
    half.mkdir()
    (half / "optimizer.pt").write_bytes(b"\0" * 10)
    said = []
    _run(out, resume=True, max_steps=3, log=said.append)
    assert any(str(half) in m and "no state.json" in m for m in said), said
    assert (half / "optimizer.pt").is_file()


def test_a_kill_while_saving_leaves_a_temporary_the_next_run_removes(tmp_path):
    out = tmp_path / "run"
    _run(out)
    tmp = out / "checkpoints" / ".step-000003.tmp"  # what a kill -9 inside save_checkpoint leaves
    tmp.mkdir()
    (tmp / "trainable.safetensors").write_bytes(b"\0" * 100)
    said = []
    _run(out, resume=True, max_steps=3, log=said.append)
    assert not tmp.exists() and any(".step-000003.tmp" in m for m in said), said


# ---------------------------------------------------------------------------------------------
# tampered and foreign checkpoints


@pytest.fixture
def run(tmp_path):
    out = tmp_path / "run"
    _run(out)
    return out


@pytest.mark.parametrize("edit", [{"step": 10**9}, {"step": -1}, {"step": 5}, {"history": [1, 2]}, {"config": None}],
                         ids=["step 1e9", "step -1", "step 5", "history not records", "config null"])
def test_a_tampered_state_json_is_one_line(run, edit):
    (ckpt,) = list_checkpoints(run)
    state = json.loads((ckpt / "state.json").read_text())
    (ckpt / "state.json").write_text(json.dumps({**state, **edit}))
    with pytest.raises(OnePassError, match="is damaged: state.json"):  # the old code: step 1e9 exits 0, nothing trained
        _run(run, resume=str(ckpt), max_steps=4)


def test_a_checkpoint_past_this_runs_last_step_is_one_line(run):
    with pytest.raises(OnePassError, match=r"is at step 2, past this run's 1 steps"):  # the old code: "done: 2 steps"
        _run(run, resume=True, max_steps=1)


def test_resuming_on_another_number_of_processes_is_refused_naming_world_size(run):
    """A checkpoint of a 2-process run (state.json says world_size 2, and there is a second rank's RNG) resumed
    on 1 process: each later step would take 1 x 1 x 1 conversations from an order made for 2 per step."""
    (ckpt,) = list_checkpoints(run)
    state = json.loads((ckpt / "state.json").read_text())
    (ckpt / "state.json").write_text(json.dumps({**state, "world_size": 2}))
    shutil.copy(ckpt / "rng-rank0.pt", ckpt / "rng-rank1.pt")
    with pytest.raises(OnePassError, match=r"world_size was 2, now 1 .*resume on 2 process"):
        _run(run, resume=True, max_steps=3)
    said = []
    assert _run(run, resume=True, max_steps=3, anyway=True, log=said.append).steps == 3  # deliberate: said, goes on
    assert any("--resume-anyway" in m and "world_size was 2, now 1" in m for m in said), said


_RANK_DATA = """
import os, sys
at = sys.argv.index("--data") + 1
sys.argv[at] = sys.argv[at].replace("RANK", os.environ["RANK"])  # each rank its own file: a node-local path
from onepass.train.cli import main
sys.exit(main())
"""


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("rank1_limit", [2, 1], ids=["same count, other content", "fewer conversations"])
def test_ranks_given_different_data_stop_in_one_line_before_step_1(tmp_path, rank1_limit):
    from onepass.data.sources import resolve_data
    from ranks import run_ranks

    lines = resolve_data("builtin:mathchat").path.read_text().splitlines()
    (tmp_path / "d0.jsonl").write_text("\n".join(lines[:2]) + "\n")
    (tmp_path / "d1.jsonl").write_text("\n".join(lines[2:2 + rank1_limit]) + "\n")
    (tmp_path / "launch.py").write_text(_RANK_DATA)
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(tmp_path / "launch.py"), "--tiny", "qwen3", "--data", str(tmp_path / "dRANK.jsonl"),
           "--no-compact-vocab", "--max-steps", "2", "--device", "cpu", "--output-dir", str(out), "--no-progress",
           "--no-save-model"]
    proc = run_ranks(cmd, env, timeout=240)  # the old code: rc 0 (inconsistent steps) or a hang (one rank ahead)
    assert proc.returncode != 0, proc.stderr[-3000:]
    assert "onepass: error: the processes read different training data" in proc.stderr, proc.stderr[-3000:]
    assert not list_checkpoints(out)


# ---------------------------------------------------------------------------------------------
# a read-only output folder


def _read_only(path):
    """``path`` made read-only for this process: a read-only remount as root (root ignores permissions)."""
    if os.geteuid() == 0:
        if subprocess.run(["mount", "-o", "remount,ro", str(path)], capture_output=True).returncode:
            pytest.skip("cannot remount read-only")
    else:
        for p in [path, *path.rglob("*")]:
            if p.is_dir():
                p.chmod(0o555)


@pytest.mark.e2e
@pytest.mark.parametrize("resume", [False, True], ids=["new run", "resume"])
def test_a_read_only_output_folder_is_one_line_before_any_work(tmp_path, resume):
    with contextlib.ExitStack() as stack:
        if os.geteuid() == 0:
            disk = stack.enter_context(_tmpfs(tmp_path / "disk", "20m"))
        else:
            disk = tmp_path / "disk"
            disk.mkdir()
            stack.callback(lambda: [p.chmod(0o755) for p in [disk, *disk.rglob("*")] if p.is_dir()])
        out = disk / "run"
        if resume:
            _run(out)
        _read_only(disk)
        said = []
        with pytest.raises(OnePassError, match=r"--output-dir .*run: cannot write there \((Read-only file system|"
                                               r"Permission denied)\)"):
            _run(out, resume=True if resume else None, max_steps=3, log=said.append)
        assert said == []  # refused before the run said anything (no data, no model loaded)


# ---------------------------------------------------------------------------------------------
# metrics: a step's cost does not grow with the run, nothing lost on a kill


def test_logging_a_step_writes_as_much_at_step_3000_as_at_step_10(tmp_path, monkeypatch):
    """Bytes written per logged step, counted at the writers (no clock): the old Reporter rewrote metrics.json
    with the whole history each time (31 MB a write at 100k steps)."""
    import builtins

    import onepass.train.core.report as report

    written = {"n": 0}
    real_atomic, real_open = report.atomic_write_text, builtins.open

    def atomic(path, text, **kw):
        written["n"] += len(text)
        return real_atomic(path, text, **kw)

    class Counted:
        def __init__(self, f):
            self.f = f

        def write(self, text):
            written["n"] += len(text)
            return self.f.write(text)

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return self.f.__exit__(*a)

    def counted_open(file, mode="r", *a, **kw):
        f = real_open(file, mode, *a, **kw)
        return Counted(f) if "a" in mode and str(file).endswith("metrics.jsonl") else f

    monkeypatch.setattr(report, "atomic_write_text", atomic)
    monkeypatch.setattr(builtins, "open", counted_open)
    r = report.Reporter(tmp_path, main=True, progress=False, total=3000, header={"config": {"lr": 1}}, log=lambda _m: None)
    cost = {}
    for step in range(1, 3001):
        before = written["n"]
        r.log_step({"step": step, "loss": 1.0, "lr": 1e-4, "grad_norm": 1.0, "tokens_per_s": 1.0}, write=True)
        cost[step] = written["n"] - before
    monkeypatch.setattr(builtins, "open", real_open)
    assert cost[3000] <= 1.2 * cost[10], (cost[10], cost[3000])  # the old code: ~300x
    metrics = report.read_metrics(tmp_path)  # a run still going (or killed): the history is in the log
    assert [h["step"] for h in metrics["history"]] == list(range(1, 3001)) and metrics["status"] == "running"


def test_a_killed_run_keeps_every_logged_step_and_a_resume_drops_the_ones_past_its_checkpoint(tmp_path):
    from onepass.train.run.loop import train_steps
    from onepass.train.core.report import read_metrics

    out = tmp_path / "run"
    steps = train_steps(_config(out, max_steps=6, save_steps=2, save_total_limit=5))
    for _ in range(3):  # step 3 logged, checkpoint of step 2: then the run is abandoned (it writes nothing more)
        next(steps)
    steps.close()
    assert [h["step"] for h in read_metrics(out)["history"]] == [1, 2, 3]
    with open(out / "metrics.jsonl", "a") as f:  # a line cut by a kill
        f.write('{"step": 4, "lo')
    assert [h["step"] for h in read_metrics(out)["history"]] == [1, 2, 3]
    result = _run(out, resume=True, max_steps=6, save_steps=2, save_total_limit=5)
    history = read_metrics(out)["history"]
    assert [h["step"] for h in history] == [1, 2, 3, 4, 5, 6] and result.steps == 6
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2, 3, 4, 5, 6]  # step 3 of the killed run: not twice


def test_prepared_rows_are_reported_with_the_schedule_they_were_prepared_with(tmp_path, capsys):
    """Rows prepared n-pass, trained with the default config (schedule one-pass): the old run said and recorded
    "schedule one-pass" for rows that are n-pass (the setting does not apply to prepared rows)."""
    from onepass.cli import main as onepass_main

    assert onepass_main(["prepare", "--data", "builtin:mathchat", "--tokenizer", "builtin:qwen3", "--limit", "2",
                         "--schedule", "n-pass", "--out", str(tmp_path / "rows")]) == 0
    said = []
    result = train(load_config(None, dict(tiny="qwen3", data=str(tmp_path / "rows"), max_steps=1, progress=False,
                                          save_model=False, output_dir=str(tmp_path / "run"))), log=said.append)
    assert json.loads(result.metrics_path.read_text())["schedule"] == "n-pass"
    assert any("holds rows prepared with schedule n-pass" in m for m in said), said
    assert any(m.endswith("schedule n-pass") and m.startswith("data ") for m in said), said
