"""Train under faults: a used output folder is never mixed with a new run, pruning touches only this run's
checkpoints, ``--resume`` never unpickles code, and ``kill -9`` leaves only complete checkpoints
(issue 13, items 7 and 9).

Names the fix added (``_load``, ``prune_checkpoints``) are imported inside the tests, so each test also
runs, and fails on its own assertions, against the code before the fix (docs/faults.md)."""

from __future__ import annotations

import json

import pytest
import torch
from fault_helpers import kill9, onepass, wait_for

from onepass.train.checkpoint import list_checkpoints, read_state
from onepass.train.config import TrainConfigError, load_config
from onepass.train.run.loop import train


def _run(out, resume=None, **overrides):
    # keys every release since the first checkpoints knows, so this runs on the code before the fix too
    values = dict(tiny="qwen3", data="builtin:mathchat", limit=2, max_steps=1, save_steps=1, save_total_limit=1,
                  progress=False, save_model=False, output_dir=str(out))
    return train(load_config(None, values | overrides), resume=resume, log=lambda _m: None)


def test_a_used_output_dir_is_refused_without_resume(tmp_path, one_thread):
    out = tmp_path / "run"
    _run(out)
    with pytest.raises(TrainConfigError, match="--resume"):
        _run(out)
    first = read_state(list_checkpoints(out)[-1])["run_id"]
    _run(out, overwrite_output_dir=True)
    runs = {read_state(p)["run_id"] for p in list_checkpoints(out)}
    assert len(runs) == 1 and first not in runs  # the earlier run's checkpoints went with --overwrite


def _fake_checkpoint(out, step, run_id):
    path = out / "checkpoints" / f"step-{step:06d}"
    path.mkdir(parents=True)
    # the least a state must hold to be read as a checkpoint's (read_state refuses a tampered one)
    (path / "state.json").write_text(json.dumps({"step": step, "run_id": run_id, "config": {}}))


def test_pruning_touches_only_this_runs_checkpoints(tmp_path):
    from onepass.train.checkpoint import prune_checkpoints

    for step, run in [(1, "a"), (2, "b"), (3, "a"), (9, "b"), (4, "a")]:
        _fake_checkpoint(tmp_path, step, run)
    removed = prune_checkpoints(tmp_path, 1, "a")
    assert [p.name for p in removed] == ["step-000001", "step-000003"]
    assert [(p.name, read_state(p)["run_id"]) for p in list_checkpoints(tmp_path)] == [
        ("step-000002", "b"), ("step-000004", "a"), ("step-000009", "b")]


class _Evil:
    def __reduce__(self):
        return (exec, ("open(__import__('os').environ['EVIL_MARK'], 'w').write('ran')",))


def test_a_checkpoint_cannot_run_code(tmp_path, monkeypatch):
    from onepass.train.checkpoint import _load

    mark = tmp_path / "ran"
    monkeypatch.setenv("EVIL_MARK", str(mark))
    torch.save({"lr": 1.0, "x": _Evil()}, tmp_path / "scheduler.pt")
    with pytest.raises(TrainConfigError, match="weights_only"):
        _load(tmp_path / "scheduler.pt")
    assert not mark.exists()
    torch.save({"lr": 1.0, "t": torch.ones(2)}, tmp_path / "ok.pt")
    assert _load(tmp_path / "ok.pt")["lr"] == 1.0


def test_resume_from_a_tampered_checkpoint_runs_no_code(tmp_path, monkeypatch, one_thread):
    out = tmp_path / "run"
    _run(out)
    mark = tmp_path / "ran"
    monkeypatch.setenv("EVIL_MARK", str(mark))
    (checkpoint,) = list_checkpoints(out)
    torch.save({"lr": 1.0, "x": _Evil()}, checkpoint / "scheduler.pt")  # what a stranger's checkpoint may hold
    with pytest.raises(Exception) as raised:  # noqa: PT011 (checked below, after the mark)
        _run(out, resume=str(checkpoint), max_steps=2)
    assert not mark.exists(), f"resuming ran the checkpoint's code (then: {raised.value!r})"
    assert isinstance(raised.value, TrainConfigError) and "weights_only" in str(raised.value)


@pytest.mark.e2e
def test_kill_9_during_training_leaves_only_complete_checkpoints(tmp_path):
    from safetensors.torch import load_file

    from onepass.train.checkpoint import _load

    out = tmp_path / "run"
    proc = onepass("train", "--tiny", "qwen3", "--data", "builtin:mathchat", "--limit", "4", "--max-steps", "400",
                   "--save-steps", "1", "--save-total-limit", "2", "--no-progress", "--no-save-model",
                   "--output-dir", str(out))
    assert wait_for(lambda: len(list_checkpoints(out)) >= 2 or proc.poll() is not None, 120), "no checkpoints"
    assert proc.poll() is None, proc.stdout.read()
    kill9(proc)
    found = list_checkpoints(out)
    assert found
    for path in found:  # every published checkpoint is whole and loads safely
        load_file(str(path / "trainable.safetensors"))
        for name in ("optimizer.pt", "scheduler.pt", "rng-rank0.pt"):
            _load(path / name)
        assert read_state(path)["run_id"] == read_state(found[-1])["run_id"]
