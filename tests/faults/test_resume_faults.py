"""Resume under faults (issue 24, items 4 and 7): a checkpoint is refused when its tensors do not fit
(a broadcastable wrong shape, NaN) or its files are cut short; a run is refused when what it learns from
changed behind the same names (learning rate, data content, chat template), naming the key, unless
``--resume-anyway``; the same data by a relative or an absolute path is the same run; a damaged *older*
checkpoint never kills a healthy run when pruning reads it; a full disk at a checkpoint is one line.

Before the fix: the wrong shape was ``copy_``-ed into the parameter, NaN weights resumed, a changed
learning rate was kept from the scheduler while train_config.yaml recorded the new one, changed data or
template was accepted, the absolute path was refused, cut files and a full disk were raw tracebacks.
"""

from __future__ import annotations

import errno
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from onepass.errors import OnePassError
from onepass.train.checkpoint import list_checkpoints
from onepass.train.config import load_config
from onepass.train.run.loop import train


def _run(out, resume=None, anyway=False, log=lambda _m: None, **overrides):
    values = dict(tiny="qwen3", data="builtin:mathchat", limit=2, max_steps=1, save_steps=1, save_total_limit=1,
                  progress=False, save_model=False, output_dir=str(out))
    kw = {"resume_anyway": True} if anyway else {}
    return train(load_config(None, values | overrides), resume=resume, log=log, **kw)


@pytest.fixture(scope="module")
def first_run(tmp_path_factory, one_thread):
    out = tmp_path_factory.mktemp("resume") / "run"
    _run(out)
    return out


@pytest.fixture
def run(first_run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(first_run, out)
    return out


def _edit_weights(run, edit):
    (ckpt,) = list_checkpoints(run)
    weights = load_file(str(ckpt / "trainable.safetensors"))
    edit(weights)
    save_file(weights, str(ckpt / "trainable.safetensors"))


def test_a_broadcastable_wrong_shape_is_refused(run):
    def shrink(w):
        name = next(n for n, t in w.items() if t.ndim == 1 and t.shape[0] > 1)  # a norm's weight
        w[name] = w[name][:1].clone()  # (H,) -> (1,): copy_ would fill every entry with one value

    _edit_weights(run, shrink)
    with pytest.raises(OnePassError, match=r"has shape \(1,\), the model's is"):
        _run(run, resume=True, max_steps=2)


def test_nan_weights_are_refused(run):
    def poison(w):
        name = sorted(w)[0]
        w[name] = w[name].clone()
        w[name].view(-1)[0] = float("nan")

    _edit_weights(run, poison)
    with pytest.raises(OnePassError, match="NaN or infinite"):
        _run(run, resume=True, max_steps=2)


@pytest.mark.parametrize("name", ["trainable.safetensors", "optimizer.pt", "scheduler.pt", "state.json"])
def test_a_cut_checkpoint_file_is_one_line(run, name):
    (ckpt,) = list_checkpoints(run)
    data = (ckpt / name).read_bytes()
    (ckpt / name).write_bytes(data[: len(data) // 2])
    with pytest.raises(OnePassError, match="damaged"):
        _run(run, resume=str(ckpt), max_steps=2)


def test_a_changed_learning_rate_is_refused_naming_the_key(run):
    with pytest.raises(OnePassError, match="learning_rate was"):
        _run(run, resume=True, max_steps=2, learning_rate=1.0)
    said = []
    result = _run(run, resume=True, anyway=True, max_steps=2, learning_rate=1.0, log=said.append)  # deliberate
    assert result.steps == 2
    warning = next(m for m in said if "--resume-anyway" in m)
    assert "carry their own learning_rate, so those keep the checkpoint's values" in warning  # as happens:
    step_two = json.loads((run / "metrics.json").read_text())["history"][-1]
    assert step_two["step"] == 2 and step_two["lr"] < 0.5  # the checkpoint's rate, not 1.0


def _jsonl(path, limit):
    from onepass.data.sources import load_conversations

    records = [c.to_dict() if hasattr(c, "to_dict") else None for c in
               load_conversations("builtin:mathchat", strict=False, limit=limit).conversations]
    if None in records:  # no to_dict: copy the bundled file's first lines
        from onepass.data.sources import resolve_data

        lines = resolve_data("builtin:mathchat").path.read_text().splitlines()[:limit]
        path.write_text("\n".join(lines) + "\n")
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_changed_data_behind_the_same_path_is_refused(tmp_path, one_thread):
    data = tmp_path / "chats.jsonl"
    _jsonl(data, 2)
    same = dict(data=str(data), limit=None, compact_vocab=False)  # the model's vocabulary does not follow the data
    _run(tmp_path / "run", **same)
    _jsonl(data, 3)  # more conversations, same name
    with pytest.raises(OnePassError, match=r"data \(content changed\)"):
        _run(tmp_path / "run", resume=True, max_steps=2, **same)
    assert _run(tmp_path / "run", resume=True, anyway=True, max_steps=2, **same).steps == 2


def test_a_changed_chat_template_behind_the_same_path_is_refused(tmp_path, one_thread):
    from onepass.render.tokenizer import builtin_template

    template = tmp_path / "chat.jinja"
    template.write_text(builtin_template("qwen3"))
    _run(tmp_path / "run", chat_template=str(template))
    template.write_text(builtin_template("qwen3").replace("<|im_start|>", "<|im_start|> "))
    with pytest.raises(OnePassError, match=r"tokenizer \(vocabulary or chat template changed\)"):
        _run(tmp_path / "run", resume=True, chat_template=str(template), max_steps=2)


def test_the_same_data_by_an_absolute_path_is_the_same_run(tmp_path, monkeypatch, one_thread):
    data = tmp_path / "chats.jsonl"
    _jsonl(data, 2)
    monkeypatch.chdir(tmp_path)
    _run("run", data="chats.jsonl", limit=None)
    assert _run(tmp_path / "run", resume=True, data=str(data), limit=None, max_steps=2).steps == 2


def test_a_damaged_older_checkpoint_does_not_kill_the_run_at_pruning(run):
    older = run / "checkpoints" / "step-000000"
    older.mkdir()
    (older / "state.json").write_text('{"step": 0, "run_id": ')  # cut short
    assert _run(run, resume=True, max_steps=2).steps == 2
    assert older.is_dir()  # not known to be this run's: left in place


def test_a_full_disk_at_a_checkpoint_is_one_line_and_leaves_no_half_checkpoint(tmp_path, monkeypatch, one_thread):
    real = torch.save

    def full(obj, f, *a, **kw):
        if str(getattr(f, "name", f)).endswith("scheduler.pt"):  # a path, or the file object it is written through
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(obj, f, *a, **kw)

    monkeypatch.setattr(torch, "save", full)
    out = tmp_path / "run"
    with pytest.raises(OnePassError, match="No space left on device"):
        _run(out, max_steps=2)
    assert [p.name for p in (out / "checkpoints").iterdir()] == []  # no half checkpoint, no temporary
    assert "finished" not in json.loads((out / "metrics.json").read_text())["status"]
