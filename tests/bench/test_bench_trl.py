"""The TRL baseline of the benchmark trains exactly the N-pass targets, and shows up in the outputs."""

from __future__ import annotations

import json

import pytest
import torch

trl = pytest.importorskip("trl")

import warm  # noqa: E402
from onepass.bench import harness as bench  # noqa: E402
from onepass.bench import trl as bench_trl  # noqa: E402
from onepass.bench.settings import SETTINGS  # noqa: E402
from onepass.cli import main  # noqa: E402
from onepass.data.mathchat import load_sample  # noqa: E402
from onepass.loss import view_loss_reference  # noqa: E402
from onepass.render import render_views  # noqa: E402
from onepass.model.tiny import tiny_model  # noqa: E402
from onepass.verify.check import compact_vocab  # noqa: E402


def test_trl_packed_loss_is_the_n_pass_mean(tmp_path, qwen3_tokenizer):
    """All views of two conversations in one BFD-packed row: TRL's loss = N-pass mean over their targets."""
    views = [render_views(c, qwen3_tokenizer) for c in load_sample(limit=2)]
    views, vocab = compact_vocab(views)
    shape = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8)
    job = bench_trl.TrlJob(examples=bench_trl.view_examples(views), vocab=vocab, shape_kwargs=shape,
                           dtype="float64", backend="sdpa", device="cpu", seed=0, repeats=1, threads=1,
                           max_tokens=8192)
    trainer = bench_trl.make_trainer(job, str(tmp_path))
    batches = list(trainer.get_train_dataloader())
    assert len(batches) == 1  # every view packed into one row
    batch = batches[0]
    flat = [v for conv in views for v in conv]
    assert batch["input_ids"].numel() == sum(len(v.tokens) for v in flat)
    model = trainer.model.eval()
    with torch.no_grad():
        ours = float(model(**{k: batch[k] for k in ("input_ids", "position_ids", "labels")}).loss)
        reference_model = tiny_model("qwen3", vocab, dtype=torch.float64, seed=0, **shape)
        targets = sum(len(v.tokens) - max(v.num_prompt, 1) for v in flat)
        reference = sum(float(view_loss_reference(reference_model, v)) for v in flat) / targets
    # HF's causal-LM loss casts logits to float32, so float32 rounding is all that may differ;
    # a wrong target, a shifted completion or attention across packed views is far larger
    assert abs(ours - reference) <= 1e-6 * reference


@pytest.mark.e2e
@pytest.mark.slow  # a whole benchmark run in fresh processes (still run by make test)
def test_bench_with_trl_reports_the_ratio(tmp_path, monkeypatch):
    """TRL's first setting timed in a spawned fresh process, as ``onepass bench`` times each one (trl imported
    there from nothing); the other three in warm processes (tests/warm.py: torch, transformers and trl already
    imported, the same function and job pickled there), which leaves out three cold imports (about 6 s of CPU
    each) and nothing the spawn tests."""
    spawn, timed = bench.time_in_subprocess, []

    def time_in_subprocess(job, timer=None):
        timed.append(timer)
        if timer is bench_trl.time_trl and timed.count(timer) == 1:
            return spawn(job, timer)
        return warm.call(timer or bench.time_training, job, timeout=600)

    monkeypatch.setattr(bench, "time_in_subprocess", time_in_subprocess)
    out = tmp_path / "bench"
    assert main(["bench", "--out", str(out), "--conversations", "3", "--repeats", "1", "--backends",
                 "onepass_cpu", "--settings", "n-pass-packed,one-pass-packed,trl-sft-packed,trl-sft-packed-tuned",
                 "--max-tokens", "2048"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    by = {s["setting"]: s for s in summary["settings"]}
    assert by["trl-sft-packed"]["backend"] == "sdpa" and by["trl-sft-packed"]["conversations_per_s"] > 0
    assert by["trl-sft-packed-tuned"]["backend"] == "onepass_cpu"
    ratio = by["one-pass-packed"]["conversations_per_s"] / by["trl-sft-packed"]["conversations_per_s"]
    assert by["one-pass-packed"]["speedup_vs_trl"] == pytest.approx(ratio)
    tuned = by["one-pass-packed"]["conversations_per_s"] / by["trl-sft-packed-tuned"]["conversations_per_s"]
    assert by["one-pass-packed"]["speedup_vs_trl_tuned"] == pytest.approx(tuned)
    assert len(timed) == 4 and bench_trl.time_trl in timed  # each setting timed apart, the TRL ones by TRL's timer
    table = (out / "table.md").read_text()
    assert "vs TRL SFTTrainer packed N-pass" in table and "vs TRL tuned (checkpointing off, onepass_cpu)" in table


def test_unknown_setting_names_the_choices(tmp_path):
    from onepass.bench.command import run
    from onepass.cli import build_parser

    args = build_parser().parse_args(["bench", "--settings", "nope", "--backends", "sdpa", "--conversations", "1",
                                      "--out", str(tmp_path / "x")])
    with pytest.raises(ValueError, match="trl-sft-packed"):
        run(args)


def test_settings_are_known():
    assert not set(bench_trl.SETTINGS) & set(SETTINGS)


def test_kv_end_from_position_ids_is_one_causal_block_per_sequence():
    got = bench_trl.kv_end_from_position_ids(torch.tensor([0, 1, 2, 0, 1, 0]))
    assert got.tolist() == [3, 3, 3, 5, 5, 6]
    pos = torch.tensor([0, 1, 2, 3, 0, 1, 2, 0])
    kv_end = bench_trl.kv_end_from_position_ids(pos)
    doc = torch.cumsum((pos == 0).long(), 0)
    q, k = torch.arange(8)[:, None], torch.arange(8)[None, :]
    reference = (doc[:, None] == doc[None, :]) & (k <= q)  # block-diagonal causal, what transformers builds
    assert torch.equal((k <= q) & (q < kv_end[None, :]), reference)
    with pytest.raises(ValueError, match="position_ids"):
        bench_trl.kv_end_from_position_ids(torch.tensor([1, 0]))


def test_tuned_trl_trains_the_same_loss_on_onepass_cpu(tmp_path, qwen3_tokenizer, monkeypatch):
    """The tuned TRL setting (onepass_cpu fed TRL's packed position_ids, no checkpointing) = TRL on sdpa."""
    from onepass.attention import cpu

    real_plan_of, plans = cpu.plan_of, []

    def counting_plan_of(mask):
        plans.append(mask)
        return real_plan_of(mask)

    monkeypatch.setattr(cpu, "plan_of", counting_plan_of)
    views = [render_views(c, qwen3_tokenizer) for c in load_sample(limit=2)]
    views, vocab = compact_vocab(views)
    shape = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8)
    losses = {}
    for backend, checkpointing in (("sdpa", True), ("onepass_cpu", False)):
        job = bench_trl.TrlJob(examples=bench_trl.view_examples(views), vocab=vocab, shape_kwargs=shape,
                               dtype="float64", backend=backend, device="cpu", seed=0, repeats=1, threads=1,
                               max_tokens=8192, checkpointing=checkpointing)
        trainer = bench_trl.make_trainer(job, str(tmp_path / backend))
        assert trainer.args.gradient_checkpointing is checkpointing
        batch = next(iter(trainer.get_train_dataloader()))
        model = trainer.model.train()
        loss = model(**{k: batch[k] for k in ("input_ids", "position_ids", "labels")}).loss
        loss.backward()
        losses[backend] = (float(loss.detach()), model.model.layers[0].self_attn.q_proj.weight.grad.clone())
    assert len(plans) == shape["num_hidden_layers"]  # onepass_cpu ran its tree path (sdpa never builds a plan)
    assert abs(losses["sdpa"][0] - losses["onepass_cpu"][0]) <= 1e-10 * losses["sdpa"][0]
    torch.testing.assert_close(losses["onepass_cpu"][1], losses["sdpa"][1], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("checkpointing", [True, False])
def test_the_trl_baseline_sets_checkpointing_without_a_v6_future_warning(tmp_path, checkpointing):
    """transformers 5.24 renamed TrainingArguments.gradient_checkpointing to activation_checkpointing (the old
    name warns, and goes in v6): the baseline's own SFTConfig uses the name the installed release takes."""
    import warnings

    from onepass.model.couplings import checkpointing_on

    job = bench_trl.TrlJob(examples=[([1, 2, 3], 1)], vocab=8, shape_kwargs={}, dtype="float32", backend="sdpa",
                           device="cpu", seed=0, repeats=0, threads=1, max_tokens=64, checkpointing=checkpointing)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = bench_trl.sft_config(job, str(tmp_path))
    assert not [w for w in caught if "removed in v6" in str(w.message)], [str(w.message) for w in caught]
    assert checkpointing_on(config) is checkpointing and config.gradient_checkpointing is checkpointing
