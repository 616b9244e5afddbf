"""Outputs (issue 24, items 3 and 6): nothing we did not write is deleted or overwritten, a failed write
leaves no half folder, and two commands never write one output at once.

Before the fix: ``export --out`` onto another model's folder overwrote its ``config.json`` and
``model.safetensors`` (rc 0); ``prepare --out`` onto a prepared folder that a run had trained into deleted
``final/``, ``checkpoints/`` and ``metrics.json`` (the folder-wide marker said the folder was all its own);
a full disk during export left a half model; two ``prepare`` into one ``--out`` both reported "wrote" and
two ``train`` into one ``--output-dir`` both ran.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess

import pytest
from fault_helpers import onepass, wait_for

from onepass.cli import main


def _snapshot(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_export_never_overwrites_another_models_folder(tmp_path, tiny_adapter, capsys):
    base_dir, adapter_dir, _ = tiny_adapter
    other = tmp_path / "other-model"
    other.mkdir()
    (other / "config.json").write_text('{"model_type": "mine"}')
    (other / "model.safetensors").write_bytes(b"my weights")
    before = _snapshot(other)
    assert main(["export", "--base", str(base_dir), "--adapter", str(adapter_dir), "--out", str(other)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("onepass: error: --out") and "\n" not in err  # refused before anything loads
    assert _snapshot(other) == before
    # its own earlier export is replaced; --overwrite replaces the other folder on purpose
    out = tmp_path / "merged"
    for _ in range(2):
        assert main(["export", "--base", str(base_dir), "--adapter", str(adapter_dir), "--out", str(out)]) == 0
    assert (out / "model.safetensors").is_file()
    assert main(["export", "--base", str(base_dir), "--adapter", str(adapter_dir), "--out", str(other),
                 "--overwrite"]) == 0
    assert (other / "model.safetensors").read_bytes() != b"my weights"


def test_a_full_disk_during_export_leaves_no_half_folder(tmp_path, tiny_adapter, capsys, monkeypatch):
    from transformers import PreTrainedModel

    base_dir, adapter_dir, _ = tiny_adapter

    def full(self, path, **_kw):
        (__import__("pathlib").Path(path) / "model.safetensors").write_bytes(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", full)
    out = tmp_path / "merged"
    assert main(["export", "--base", str(base_dir), "--adapter", str(adapter_dir), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after the loading bars
    assert err.startswith("onepass: error:") and "No space left" in err
    assert sorted(os.listdir(tmp_path)) == []  # no half folder, no temporary


def _prepare(data, out, *extra):
    proc = onepass("prepare", "--data", data, "--tokenizer", "builtin:qwen3", "--out", str(out), "--no-progress",
                   *extra)
    text, _ = proc.communicate(timeout=300)
    return proc.returncode, text


@pytest.mark.e2e
def test_prepare_never_deletes_a_training_run_in_its_out(tmp_path):
    out = tmp_path / "data"
    rc, text = _prepare("builtin:mathchat", out, "--limit", "2")
    assert rc == 0, text
    # a run trained into the same folder (train --data data --output-dir data)
    for name in ("checkpoints/step-000001/state.json", "final/config.json", "metrics.json"):
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text("{}")
    before = _snapshot(out)
    rc, text = _prepare("builtin:mathchat", out, "--limit", "3")
    assert rc == 2 and text.strip().splitlines()[-1].startswith("onepass: error: --out"), text
    assert _snapshot(out) == before
    rc, text = _prepare("builtin:mathchat", tmp_path / "again", "--limit", "2")  # ours alone: replaced, as before
    rc2, text2 = _prepare("builtin:mathchat", tmp_path / "again", "--limit", "3")
    assert rc == rc2 == 0, text + text2


def _held(lock):
    try:
        import fcntl

        with open(lock) as f:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return False
    except (BlockingIOError, FileNotFoundError):
        return lock.exists()


@pytest.mark.e2e
def test_two_prepares_into_one_out_the_second_is_one_line(tmp_path):
    out = tmp_path / "data"
    first = onepass("prepare", "--data", "builtin:mathchat", "--tokenizer", "builtin:qwen3", "--out", str(out),
                    "--no-progress", "--max-tokens", "64")
    from onepass.files import lock_path

    lock = lock_path(out)
    assert wait_for(lambda: _held(lock) or first.poll() is not None, 120)
    rc, text = _prepare("builtin:mathchat", out, "--limit", "1")
    first_text, _ = first.communicate(timeout=300)
    assert first.returncode in (0, 1), first_text
    assert rc == 2 and "being written by onepass prepare (PID" in text and "Traceback" not in text, text


@pytest.mark.e2e
def test_two_trains_into_one_output_dir_the_second_is_one_line(tmp_path):
    out = tmp_path / "run"
    first = onepass("train", "--tiny", "qwen3", "--data", "builtin:mathchat", "--limit", "4", "--max-steps", "400",
                    "--save-steps", "1", "--save-total-limit", "1", "--no-progress", "--no-save-model",
                    "--output-dir", str(out))
    try:
        assert wait_for(lambda: (out / "checkpoints").is_dir() or first.poll() is not None, 120)
        assert first.poll() is None, first.stdout.read()
        second = onepass("train", "--tiny", "qwen3", "--data", "builtin:mathchat", "--limit", "4", "--max-steps",
                         "400", "--save-steps", "1", "--save-total-limit", "1", "--no-progress", "--no-save-model",
                         "--output-dir", str(out), "--resume")  # the same run, resumed while it still runs
        try:
            text, _ = second.communicate(timeout=150)
        except subprocess.TimeoutExpired:
            second.kill()
            text = second.communicate()[0]
            pytest.fail(f"the second run trained alongside the first: {text[-500:]}")
        assert second.returncode == 2 and "being written by onepass train (PID" in text, text
        assert "Traceback" not in text
    finally:
        first.kill()
        first.communicate(timeout=30)
    runs = {json.loads(p.read_text())["run_id"] for p in out.glob("checkpoints/*/state.json")}
    assert len(runs) == 1
