"""Hyper-parameters out of range (issue 37): one table (``onepass.train.hyperparams``) read by ``onepass train``'s
flags, its YAML files and ``OnePassConfig``, so a bad value is the same one line from each, before anything is
loaded; ``max_grad_norm`` <= 0 means no clipping (transformers' meaning), never gradient ascent; no checkpoint
holds non-finite weights.

Before the fix: ``--max-grad-norm -1`` made the clip coefficient negative (the loss climbed, 5.72 -> 7.10,
"finished"); an infinite learning rate or weight decay trained NaN weights and the "last good step"
checkpoint held them; ``--adam-beta1 2``, ``--seed -1``, ``--num-train-epochs inf`` passed the config and
raised raw ``ValueError`` / ``OverflowError`` once the data and model were loaded.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from onepass.errors import OnePassError
from onepass.train.cli import main
from onepass.train.config import load_config
from onepass.train.run.loop import train

# flag, value, the key the line names
BAD = [("--max-grad-norm", "nan", "max_grad_norm"), ("--learning-rate", "inf", "learning_rate"),
       ("--learning-rate", "nan", "learning_rate"), ("--learning-rate", "-1e-4", "learning_rate"),
       ("--weight-decay", "inf", "weight_decay"), ("--weight-decay", "nan", "weight_decay"),
       ("--adam-beta1", "2", "adam_beta1"), ("--adam-beta2", "1", "adam_beta2"), ("--adam-epsilon", "-1", "adam_epsilon"),
       ("--seed", "-1", "seed"), ("--seed", str(2**32), "seed"), ("--num-train-epochs", "inf", "num_train_epochs"),
       ("--warmup-steps", "-3", "warmup_steps"), ("--lora-alpha", "nan", "lora_alpha")]


@pytest.mark.parametrize("flag,value,key", BAD, ids=[f"{f}={v}" for f, v, _ in BAD])
def test_an_out_of_range_flag_is_one_line_before_anything_is_loaded(flag, value, key, capsys, tmp_path, monkeypatch,
                                                                    one_thread):
    monkeypatch.chdir(tmp_path)
    extra = ["--finetune", "lora"] if key == "lora_alpha" else []
    steps = [] if key == "num_train_epochs" else ["--max-steps", "3"]  # epochs count only without max_steps
    rc = main(["--tiny", "qwen3", "--data", "builtin:mathchat", "--limit", "2", *steps, "--no-progress",
               "--no-save-model", "--output-dir", "run", f"{flag}={value}", *extra])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith(f"onepass: error: {key} must be"), (rc, err[-3:])
    assert not (tmp_path / "run").exists()  # refused before the run started (nothing written)


@pytest.mark.parametrize("flag,value,key", BAD[:11], ids=[f"{f}={v}" for f, v, _ in BAD[:11]])
def test_the_same_value_is_the_same_line_from_yaml_and_from_onepassconfig(flag, value, key, tmp_path, capsys,
                                                                          monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.yaml").write_text(f"tiny: qwen3\ndata: builtin:mathchat\n{key}: {value}\n")
    assert main(["--config", "c.yaml"]) == 2
    from_yaml = capsys.readouterr().err.strip().removeprefix("onepass: error: ")
    from onepass.train.hf_config import OnePassConfig

    typed = int(value) if key == "seed" else float(value)
    with pytest.raises(OnePassError) as raised:  # the TRL drop-in: the same table, the same line
        OnePassConfig(str(tmp_path / "out"), report_to="none", use_cpu=True, **{key: typed})
    assert str(raised.value) == from_yaml and from_yaml.startswith(f"{key} must be"), (str(raised.value), from_yaml)


def _run(out, **overrides):
    values = dict(tiny="qwen3", data="builtin:mathchat", limit=4, max_steps=4, learning_rate=1e-2, progress=False,
                  save_model=False, output_dir=str(out))
    return train(load_config(None, values | overrides), log=lambda _m: None)


def test_a_negative_max_grad_norm_is_no_clipping_not_gradient_ascent(tmp_path, one_thread):
    ascent = _run(tmp_path / "minus", max_grad_norm=-1.0).losses
    off = _run(tmp_path / "zero", max_grad_norm=0.0).losses  # transformers' meaning: no clipping
    assert ascent == off, (ascent, off)  # the old code: the negative coefficient climbed the loss
    assert off[-1] < off[0]
    from onepass.train.hyperparams import clip_norm

    assert clip_norm(-1.0) is None and clip_norm(None) is None and clip_norm(0.0) is None and clip_norm(2.0) == 2.0


def test_no_checkpoint_ever_holds_non_finite_weights(tmp_path, monkeypatch, one_thread):
    """An update that makes a weight NaN (here forced after step 2's update): the next step's loss is NaN and the
    run stops; the checkpoint "of the last good step" must not be written from NaN weights (before: it was)."""
    real = torch.optim.AdamW.step
    calls = {"n": 0}

    def poisoned(self, *a, **kw):
        out = real(self, *a, **kw)
        calls["n"] += 1
        if calls["n"] == 2:
            with torch.no_grad():
                self.param_groups[0]["params"][0].view(-1)[0] = float("inf")
        return out

    monkeypatch.setattr(torch.optim.AdamW, "step", poisoned)
    out = tmp_path / "run"
    with pytest.raises(OnePassError):
        _run(out, save_steps=1, save_total_limit=5)
    for ckpt in sorted((out / "checkpoints").glob("step-*")):
        weights = load_file(str(ckpt / "trainable.safetensors"))
        assert all(bool(torch.isfinite(t).all()) for t in weights.values()), f"{ckpt.name} holds non-finite weights"
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-000001"]
    assert json.loads((out / "metrics.json").read_text())["status"].startswith("stopped at step 2")


@pytest.mark.parametrize("argv,message", [
    (["--template-kwarg", "messages=1"], "--template-kwarg messages is reserved (onepass passes the record's)"),
    (["--template-kwarg", "add_generation_prompt=true"], "--template-kwarg add_generation_prompt is reserved "
                                                         "(onepass sets it for each view)"),
    (["--template-kwarg", "tools=x"], "--template-kwarg tools is reserved (onepass passes the record's)"),
    (["--eval-steps", "1"], "eval_steps needs eval_data"),
    (["--tiny-config", "hidden_sizes=64"], "tiny_config: 'hidden_sizes' is not a setting of Qwen3Config (qwen3); did "
                                           "you mean 'hidden_size'?"),
    (["--finetune", "lora", "--lora-target-modules", "qproj"], "lora_target_modules 'qproj': no such module in "
                                                                "Qwen3ForCausalLM; its linear layers are"),
], ids=["template kwarg messages", "template kwarg add_generation_prompt", "template kwarg tools",
        "eval_steps without eval_data", "unknown tiny_config key", "no such LoRA target"])
def test_a_setting_that_cannot_mean_what_it_says_is_one_line(argv, message, capsys, tmp_path, monkeypatch, one_thread):
    """Before: ``messages=1`` / ``tools=x`` raised a raw TypeError mid-render, ``add_generation_prompt=true`` changed
    every prompt silently, ``--eval-steps`` without eval data never evaluated, an unknown ``--tiny-config`` key
    trained the default model, an unknown LoRA target was peft's traceback."""
    monkeypatch.chdir(tmp_path)
    rc = main(["--tiny", "qwen3", "--data", "builtin:mathchat", "--limit", "2", "--max-steps", "1", "--no-progress",
               "--no-save-model", "--output-dir", "run", *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err and err[-1].startswith("onepass: error: ") and message in err[-1], (rc, err[-3:])
    assert not any("Traceback" in line for line in err)
    assert not (tmp_path / "run" / "checkpoints").exists()  # nothing trained
