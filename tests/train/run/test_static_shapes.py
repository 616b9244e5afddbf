"""flex_attention compiles per shape: `onepass train` runs each forward in one of a few length buckets, each compiled
once, counted in metrics.json; no recompile during the run.

flex_attention has no backward on CPU, so here the bucketing is switched on for sdpa and a part of the model
(its final norm) is compiled (dynamo, eager backend: seconds): what compiles per shape is then ours to count,
as flex's is on CUDA (tests/train/run/test_host_syncs.py runs flex itself there, and counts its compiles).
"""

from __future__ import annotations

import json

import pytest
import torch

import onepass.train.run.loop as loop
import onepass.train.run.step as step_mod
from onepass.train.config import load_config

pytestmark = pytest.mark.usefixtures("one_thread")


def _config(out, **overrides):
    values = dict(tiny="qwen3", data="builtin:mathchat", limit=6, max_steps=3, per_device_train_batch_size=2,
                  progress=False, save_model=False, output_dir=str(out), device="cpu", dtype="float64",
                  attention="sdpa", length_buckets=2)
    return load_config(None, values | overrides)


def _shapes_seen(monkeypatch):
    seen = []
    real = step_mod.batch_loss

    def batch_loss(view, batch, **kwargs):
        seen.append(tuple(batch["input_ids"].shape))
        return real(view, batch, **kwargs)

    monkeypatch.setattr(step_mod, "batch_loss", batch_loss)
    return seen


def test_forwards_run_in_length_buckets_each_compiled_once(tmp_path, monkeypatch):
    monkeypatch.setattr(loop, "COMPILED_BACKENDS", ("sdpa",))
    real_load = loop.load_model

    def load_model(*args, **kwargs):  # a compiled part of the forward, as flex is on CUDA
        model = real_load(*args, **kwargs)
        model.model.norm = torch.compile(model.model.norm, backend="eager")
        return model

    monkeypatch.setattr(loop, "load_model", load_model)
    torch._dynamo.reset()
    seen = _shapes_seen(monkeypatch)
    result = loop.train(_config(tmp_path / "run"), log=lambda _m: None)
    metrics = json.loads(result.metrics_path.read_text())
    buckets = metrics["length_buckets"]
    assert 1 <= len(buckets) <= 2 and all(b % 128 == 0 for b in buckets)
    assert {s[0] for s in seen} == {1} and {s[1] for s in seen} <= set(buckets), seen  # one row, a bucket long
    compiles = metrics["compiles"]
    assert compiles["recompiles"] == 0 and compiles["compiles"] == {str(L): 1 for L in sorted({s[1] for s in seen})}
    assert [r.get("compiles") for r in metrics["history"]][0] >= 1 and sum(
        r["compiles"] for r in metrics["history"]) == len(compiles["compiles"])


def test_length_buckets_keep_every_loss(tmp_path, monkeypatch):
    """float64: the bucketed run's losses are the plain run's (rows side by side, pads that train nothing)."""
    plain = loop.train(_config(tmp_path / "plain"), log=lambda _m: None).losses
    monkeypatch.setattr(loop, "COMPILED_BACKENDS", ("sdpa",))
    seen = _shapes_seen(monkeypatch)
    bucketed = loop.train(_config(tmp_path / "bucketed"), log=lambda _m: None).losses
    assert {s[0] for s in seen} == {1}
    assert max(abs(a - b) for a, b in zip(plain, bucketed)) <= 1e-10, (plain, bucketed)
