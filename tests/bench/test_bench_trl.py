"""The TRL baseline of the benchmark trains exactly the N-pass targets, and shows up in the outputs."""

from __future__ import annotations

import json

import pytest
import torch

trl = pytest.importorskip("trl")

from onepass.bench import harness as bench  # noqa: E402
from onepass.bench import trl as bench_trl  # noqa: E402
from onepass.cli import main  # noqa: E402
from onepass.data.mathchat import load_sample  # noqa: E402
from onepass.loss import view_loss_reference  # noqa: E402
from onepass.render import render_views  # noqa: E402
from onepass.tiny import tiny_model  # noqa: E402
from onepass.verify import compact_vocab  # noqa: E402


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


@pytest.mark.slow  # a whole benchmark run in fresh processes (still run by make test)
def test_bench_with_trl_reports_the_ratio(tmp_path):
    out = tmp_path / "bench"
    assert main(["bench", "--out", str(out), "--conversations", "3", "--repeats", "1", "--backends",
                 "onepass_cpu", "--settings", "n-pass-packed,one-pass-packed,trl-sft-packed",
                 "--max-tokens", "2048"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    by = {s["setting"]: s for s in summary["settings"]}
    assert by["trl-sft-packed"]["backend"] == "sdpa" and by["trl-sft-packed"]["conversations_per_s"] > 0
    ratio = by["one-pass-packed"]["conversations_per_s"] / by["trl-sft-packed"]["conversations_per_s"]
    assert by["one-pass-packed"]["speedup_vs_trl"] == pytest.approx(ratio)
    assert "vs TRL SFTTrainer packed N-pass" in (out / "table.md").read_text()


def test_unknown_setting_names_the_choices(tmp_path):
    from onepass.bench.cli import run
    from onepass.cli import build_parser

    args = build_parser().parse_args(["bench", "--settings", "nope", "--backends", "sdpa", "--conversations", "1",
                                      "--out", str(tmp_path / "x")])
    with pytest.raises(ValueError, match="trl-sft-packed"):
        run(args)


def test_settings_are_known():
    assert bench_trl.SETTING not in bench.SETTINGS
