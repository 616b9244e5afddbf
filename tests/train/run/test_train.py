"""Training: one-pass and N-pass take the same optimizer steps; resume, LoRA and outputs work.

The data is a small synthetic set of multi-turn reasoning conversations
(rendered with the real Qwen3 template and vocabulary, then compacted to the
ids that occur), so a step costs milliseconds and 20 float64 steps of both
schedules fit in a few seconds.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from onepass.train.run.evaluation import eval_loss
from onepass.train.run.loop import train, train_steps
from onepass.train.config import load_config
from onepass.train.run.data import (
    TrainData,
    epoch_order,
    eval_passes,
    forward_groups,
    rank_slots,
    step_passes,
    step_units,
    units_per_step,
)
from onepass.layout.tree import Layout

from strategies import synthetic_conversations  # noqa: E402


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models run fastest on one thread


@pytest.fixture(scope="module")
def chats(tmp_path_factory, qwen3_tokenizer):
    path = tmp_path_factory.mktemp("data") / "chats.jsonl"
    path.write_text("\n".join(json.dumps(c) for c in synthetic_conversations(12)) + "\n")
    return path


@pytest.fixture(scope="module")
def held_out(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "eval.jsonl"
    path.write_text("\n".join(json.dumps(c) for c in synthetic_conversations(4, seed=1)) + "\n")
    return path


@pytest.fixture
def exact_norms(monkeypatch):
    """Training models get float64 RMSNorms (transformers upcasts them to float32; see onepass.model.precision)."""
    import onepass.train.run.loop as loop  # the run's loop calls load_model by the name it imported
    from onepass.model.precision import float64_norms

    original = loop.load_model

    def load(*args, **kwargs):
        model = original(*args, **kwargs)
        assert float64_norms(model)[0] > 0
        return model

    monkeypatch.setattr(loop, "load_model", load)


def config_of(tmp_path, name, **overrides):
    values = dict(tiny="qwen3", per_device_train_batch_size=2, learning_rate=3e-3, progress=False, save_model=False,
                  output_dir=str(tmp_path / name), seed=0)
    values.update(overrides)
    return load_config(None, values)


def run(tmp_path, name, **overrides):
    return train(config_of(tmp_path, name, **overrides), log=lambda _m: None)


def final_weights(result):
    from safetensors.torch import load_file

    (last,) = sorted((result.output_dir / "checkpoints").iterdir())[-1:]
    return load_file(str(last / "trainable.safetensors"))


def rel(a, b):
    return abs(a - b) / max(abs(a), abs(b), 1e-300)


# ---------------------------------------------------------------------------------------------
# the theorem, as training


def test_one_pass_and_n_pass_take_the_same_20_steps_float64(tmp_path, chats, exact_norms):
    common = dict(data=str(chats), dtype="float64", max_steps=20, lr_scheduler="linear", warmup_steps=2)
    one = run(tmp_path, "one", schedule="one-pass", **common)
    n = run(tmp_path, "n", schedule="n-pass", **common)
    assert len(one.losses) == len(n.losses) == 20
    assert max(rel(a, b) for a, b in zip(one.losses, n.losses)) <= 1e-9
    assert one.losses[-1] < one.losses[0] - 0.5  # it trains
    w1, wn = final_weights(one), final_weights(n)
    assert w1.keys() == wn.keys()
    for k in w1:
        assert (w1[k] - wn[k]).norm() <= 1e-9 * w1[k].norm(), k
    # and one-pass did it with fewer tokens
    m1, mn = (json.loads(r.metrics_path.read_text()) for r in (one, n))
    assert sum(h["tokens"] for h in m1["history"]) < sum(h["tokens"] for h in mn["history"])


def test_two_runs_advanced_in_turn_take_the_steps_each_takes_alone(tmp_path, chats, exact_norms):
    """``make demo`` times one-pass and N-pass interleaved, two train_steps generators in one process:
    neither run may see the other's state (accelerate's shared state, the optimizer, the data order)."""
    common = dict(data=str(chats), dtype="float64", max_steps=6, lr_scheduler="linear", warmup_steps=2)
    alone = run(tmp_path, "alone", schedule="one-pass", **common)
    runs = {s: train_steps(config_of(tmp_path, s, schedule=s, **common), log=lambda _m: None)
            for s in ("one-pass", "n-pass")}
    losses = {s: [] for s in runs}
    for block in range(3):  # two steps each, in turn, who goes first alternating
        for s in (("one-pass", "n-pass") if block % 2 == 0 else ("n-pass", "one-pass")):
            losses[s] += [next(runs[s])["loss"] for _ in range(2)]
    results = {}
    for s, steps in runs.items():
        with pytest.raises(StopIteration) as done:
            next(steps)
        results[s] = done.value.value
    assert results["one-pass"].losses == losses["one-pass"] and len(losses["n-pass"]) == 6
    assert max(rel(a, b) for a, b in zip(losses["one-pass"], alone.losses)) <= 1e-12
    assert max(rel(a, b) for a, b in zip(losses["one-pass"], losses["n-pass"])) <= 1e-9


def test_float32_curves_agree_closely(tmp_path, chats):
    common = dict(data=str(chats), dtype="float32", max_steps=10)
    one = run(tmp_path, "one", schedule="one-pass", **common)
    k = run(tmp_path, "k", schedule="k-pass:2", **common)
    assert max(rel(a, b) for a, b in zip(one.losses, k.losses)) <= 1e-4


@pytest.mark.parametrize("layout", [
    dict(per_device_train_batch_size=1, gradient_accumulation_steps=2),  # accumulation: same conversations per step
    dict(per_device_train_batch_size=2, pack=True, max_tokens=1024),  # packed rows
    dict(per_device_train_batch_size=2, max_batch_tokens=64, schedule="n-pass"),  # a micro-batch in several forwards
    dict(per_device_train_batch_size=2, gradient_checkpointing=True),
])
def test_micro_batching_does_not_change_the_steps(tmp_path, chats, layout, exact_norms):
    base = dict(data=str(chats), dtype="float64", max_steps=4)
    ref = run(tmp_path, "ref", per_device_train_batch_size=2, **base)
    other = run(tmp_path, "other", **{**base, **layout})
    assert max(rel(a, b) for a, b in zip(ref.losses, other.losses)) <= 1e-10


# ---------------------------------------------------------------------------------------------
# data order: every unit exactly once per epoch, on exactly one rank


@pytest.mark.parametrize("world,batch_size,grad_accum", [(1, 2, 1), (2, 1, 1), (2, 2, 3), (3, 1, 2)])
def test_every_unit_lands_once_per_epoch_on_one_rank(world, batch_size, grad_accum):
    num = 23
    per_step = batch_size * grad_accum * world
    seen = []
    for step in range(-(-num // per_step)):
        units = step_units(num, step, seed=5, per_step=per_step)
        for rank in range(world):
            for slot in rank_slots(units, rank=rank, world=world, batch_size=batch_size, grad_accum=grad_accum):
                seen.extend(int(u) for u in slot)
    assert sorted(seen) == list(range(num))
    assert list(step_units(num, 0, seed=5, per_step=per_step)) == list(epoch_order(num, seed=5, epoch=0)[:per_step])
    assert list(epoch_order(num, seed=5, epoch=1)) != list(epoch_order(num, seed=5, epoch=0))


def test_one_process_and_two_processes_see_the_same_step():
    one = load_config(None, dict(tiny="qwen3", data="x", per_device_train_batch_size=2,
                                 gradient_accumulation_steps=1))
    two = load_config(None, dict(tiny="qwen3", data="x", per_device_train_batch_size=1,
                                 gradient_accumulation_steps=1))
    assert units_per_step(one, 1) == units_per_step(two, 2) == 2
    units = step_units(10, 3, seed=0, per_step=2)
    (a,) = rank_slots(units, rank=0, world=1, batch_size=2, grad_accum=1)
    b = np.concatenate([rank_slots(units, rank=r, world=2, batch_size=1, grad_accum=1)[0] for r in (0, 1)])
    assert list(a) == list(b)


def _row(n: int) -> Layout:
    z = np.zeros(n, dtype=np.int64)
    return Layout(input_ids=z, position_ids=np.arange(n), kv_end=np.full(n, n), targets=z, weights=z + 1.0)


def test_forward_groups_respect_the_padded_token_budget():
    rows = [_row(n) for n in (10, 40, 25, 5, 60)]
    groups = forward_groups(rows, 80)
    assert sorted(len(r) for g in groups for r in g) == [5, 10, 25, 40, 60]
    assert all(len(g) * max(len(r) for r in g) <= 80 or len(g) == 1 for g in groups)
    assert forward_groups(rows, None) == [rows]


def test_a_rank_without_data_runs_a_zero_weight_row():
    data = TrainData(units=[[_row(4)]], kind="row", source="x", stats={})
    config = load_config(None, dict(tiny="qwen3", data="x", per_device_train_batch_size=1))
    passes, real = step_passes(data, np.array([0]), config, rank=1, world=2)
    assert real == 0 and len(passes) == 1 and passes[0][0].weights.sum() == 0
    passes, real = step_passes(data, np.array([0]), config, rank=0, world=2)
    assert real == 1 and passes[0][0] is data.units[0][0]


def test_sharded_ranks_run_as_many_passes_as_the_busiest():
    """FSDP gathers parameters in every forward: every process must run the same number of them."""
    data = TrainData(units=[[_row(4), _row(5), _row(6)], [_row(3)]], kind="conversation", source="x", stats={})
    config = load_config(None, dict(tiny="qwen3", data="x", per_device_train_batch_size=1, max_batch_tokens=4))
    busy, real_busy = step_passes(data, np.array([0, 1]), config, rank=0, world=2, even=True)
    idle, real_idle = step_passes(data, np.array([0, 1]), config, rank=1, world=2, even=True)
    assert len(busy) == len(idle) == 3 and (real_busy, real_idle) == (3, 1)
    assert all(p[0].weights.sum() == 0 for p in idle[1:])


def test_eval_takes_every_world_th_unit_and_pads_only_sharded_ranks():
    data = TrainData(units=[[_row(4), _row(5)], [_row(3)], [_row(6)]], kind="conversation", source="x", stats={})
    config = load_config(None, dict(tiny="qwen3", data="x", per_device_train_batch_size=1, max_batch_tokens=6))
    rank0, rank1 = (eval_passes(data, config, rank=r, world=2) for r in (0, 1))
    assert sorted(len(r) for p in rank0 for r in p) == [4, 5, 6] and [len(r) for p in rank1 for r in p] == [3]
    assert len(rank1) == 1  # a forward of the unwrapped model joins no collective: nothing to even out
    even = eval_passes(data, config, rank=1, world=2, even=True)
    assert len(even) == len(rank0) == 3 and all(p[0].weights.sum() == 0 for p in even[1:])


# ---------------------------------------------------------------------------------------------
# resume, crash, LoRA, outputs


def test_resume_from_a_checkpoint_continues_the_identical_losses(tmp_path, chats):
    import shutil

    common = dict(data=str(chats), max_steps=6, save_steps=3, finetune="lora", lora_r=4, lora_dropout=0.2,
                  save_total_limit=None)
    full = run(tmp_path, "full", **common)
    assert (full.output_dir / "checkpoints" / "step-000003").is_dir()
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(full.output_dir / "checkpoints" / "step-000003", resumed_dir / "checkpoints" / "step-000003")
    config = load_config(None, dict(tiny="qwen3", per_device_train_batch_size=2, learning_rate=3e-3, progress=False,
                                    save_model=False, output_dir=str(resumed_dir), seed=0, **common))
    resumed = train(config, resume=True, log=lambda _m: None)
    assert resumed.losses == full.losses  # bit for bit, dropout included (RNG restored)


def test_a_crash_leaves_a_checkpoint_to_resume_from(tmp_path, chats, monkeypatch):
    import onepass.train.run.step as tr

    common = dict(data=str(chats), max_steps=5)
    ref = run(tmp_path, "ref", **common)

    original = tr.step_units

    def crash_at_step_3(num, step, **kw):
        if step == 3:
            raise KeyboardInterrupt
        return original(num, step, **kw)

    monkeypatch.setattr(tr, "step_units", crash_at_step_3)
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path, "crashed", **common)
    out = tmp_path / "crashed"
    assert (out / "checkpoints" / "step-000003").is_dir()
    assert len(json.loads((out / "metrics.json").read_text())["history"]) == 3
    monkeypatch.setattr(tr, "step_units", original)
    config = load_config(None, dict(tiny="qwen3", per_device_train_batch_size=2, learning_rate=3e-3, progress=False,
                                    save_model=False, output_dir=str(out), seed=0, **common))
    assert train(config, resume=True, log=lambda _m: None).losses == ref.losses


def test_resume_refuses_different_settings(tmp_path, chats):
    from onepass.train.config import TrainConfigError

    run(tmp_path, "a", data=str(chats), max_steps=1)
    config = load_config(None, dict(tiny="qwen3", data=str(chats), per_device_train_batch_size=3,
                                    output_dir=str(tmp_path / "a"), progress=False))
    with pytest.raises(TrainConfigError, match="per_device_train_batch_size was 2, now 3"):
        train(config, resume=True, log=lambda _m: None)


def test_lora_adapter_reloads_and_reproduces_the_eval_loss(tmp_path, chats, held_out, qwen3_tokenizer):
    from peft import PeftModel

    from onepass.conversation.parse import read_conversations
    from onepass.prepare.pipeline import PrepareConfig, prepare
    from onepass.model.tiny import tiny_model

    result = run(tmp_path, "lora", data=str(chats), eval_data=str(held_out), max_steps=4, finetune="lora",
                 lora_r=4, lora_alpha=8, lora_target_modules=["q_proj", "v_proj"], save_model=True,
                 dtype="float64")
    final = result.final_dir
    assert (final / "adapter_model.safetensors").is_file() and (final / "adapter_config.json").is_file()
    assert not (final / "model.safetensors").exists()
    used = np.asarray(json.loads((final / "compact_vocab.json").read_text())["original_ids"])
    rows, _ = prepare(read_conversations(held_out).conversations, qwen3_tokenizer, PrepareConfig())
    rows = [Layout(input_ids=np.searchsorted(used, r.input_ids), position_ids=r.position_ids, kv_end=r.kv_end,
                   targets=np.where(r.targets < 0, r.targets, np.searchsorted(used, r.targets)),
                   weights=r.weights) for r in rows]
    base = tiny_model("qwen3", len(used), dtype=torch.float64, seed=0)
    model = PeftModel.from_pretrained(base, str(final))
    assert rel(eval_loss(model, rows), result.eval_loss) <= 1e-12
    bare = tiny_model("qwen3", len(used), dtype=torch.float64, seed=0)
    assert rel(eval_loss(bare, rows), result.eval_loss) > 1e-4  # the adapter is what changed it


def test_outputs_metrics_plot_tensorboard_and_model_with_tokenizer(tmp_path, chats):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    result = run(tmp_path, "out", data=str(chats), eval_data=str(chats), max_steps=2, report_to=["tensorboard"],
                 save_model=True, compact_vocab=False, tiny_config={"hidden_size": 32, "intermediate_size": 64})
    out = result.output_dir
    events = EventAccumulator(str(out / "tensorboard")).Reload()  # through accelerate's tracker
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2]
    (final_eval,) = events.Scalars("eval/loss")  # logged before the writer closed
    assert final_eval.step == 2 and abs(final_eval.value - result.eval_loss) < 1e-5
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["status"] == "finished" and [h["step"] for h in metrics["history"]] == [1, 2]
    assert metrics["data_stats"]["conversations"] == 12
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert (out / "train_config.yaml").is_file()
    final = result.final_dir
    assert (final / "model.safetensors").is_file() and (final / "config.json").is_file()
    assert (final / "tokenizer.json").is_file() and (final / "chat_template.jinja").is_file()


def test_a_prepared_directory_trains_row_by_row(tmp_path, chats):
    from onepass.cli import main

    prepared = tmp_path / "prepared"
    assert main(["prepare", "--data", str(chats), "--out", str(prepared), "--max-tokens", "512", "--pack",
                 "--no-progress"]) == 0
    result = run(tmp_path, "rows", data=str(prepared), num_train_epochs=2, per_device_train_batch_size=1)
    metrics = json.loads(result.metrics_path.read_text())
    assert metrics["unit"] == "row" and result.steps == 2 * metrics["units"]


def test_bf16_autocast_on_cpu_trains(tmp_path, chats):
    result = run(tmp_path, "bf16", data=str(chats), max_steps=3, mixed_precision="bf16")
    assert all(np.isfinite(result.losses))


# ---------------------------------------------------------------------------------------------
# several processes


@pytest.mark.multiprocess
@pytest.mark.slow
def test_torchrun_two_processes_give_the_same_losses_as_one(tmp_path, chats):
    import os
    import sys

    from ranks import run_ranks

    steps = 4
    one = run(tmp_path, "one", data=str(chats), dtype="float64", per_device_train_batch_size=2, max_steps=steps,
              gradient_accumulation_steps=1)
    out = tmp_path / "two"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "onepass.train.cli", "--tiny", "qwen3", "--data", str(chats), "--dtype", "float64",
           "--per-device-train-batch-size", "1", "--max-steps", str(steps), "--learning-rate", "3e-3", "--seed", "0",
           "--device", "cpu",
           "--output-dir", str(out), "--no-progress", "--no-save-model"]
    # one try; a hang is a failure with every process's stacks. torch's own launcher: the one test of `torchrun
    # onepass train` as a user runs it (the other torchrun tests start their ranks warm: tests/ranks.py)
    proc = run_ranks(cmd, env, timeout=300, launcher=True)
    assert proc.returncode == 0, proc.stderr[-6000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["world_size"] == 2 and metrics["units_per_step"] == 2
    two = [h["loss"] for h in metrics["history"]]
    assert len(two) == steps
    assert max(rel(a, b) for a, b in zip(one.losses, two)) <= 1e-12
    from safetensors.torch import load_file

    w1 = final_weights(one)
    w2 = load_file(str(out / "checkpoints" / f"step-{steps:06d}" / "trainable.safetensors"))
    for k in w1:
        assert (w1[k] - w2[k]).norm() <= 1e-12 * w1[k].norm(), k
