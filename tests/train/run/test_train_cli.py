"""``onepass train`` as a user meets it: configs, flag overrides, one-line errors, outputs, CUDA paths."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from onepass.train.cli import add_parser, main, overrides_from_args
from onepass.train.config import DEPRECATED_KEYS, config_keys, load_config

CONFIGS = Path(__file__).resolve().parents[3] / "configs"


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def one_line_error(argv, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("onepass: error: "), err
    return err[0]


@pytest.mark.parametrize("argv,message", [
    (["--tiny", "qwen3", "--data", "missing.jsonl"], "data file not found: missing.jsonl"),
    (["--tiny", "qwen3", "--data", "builtin:mathchat", "--eval-data", "nope/"], "data file not found: nope/"),
    (["--tiny", "qwen3", "--data", "builtin:mathchat", "--attention", "nope"], "unknown attention backend 'nope'"),
    (["--tiny", "qwen3", "--data", "builtin:mathchat", "--attention", "flash_attention_2"],
     "flash_attention_2 cannot apply a tree mask"),
    (["--tiny", "qwen3", "--data", "builtin:mathchat", "--attention", "flex_attention", "--device", "cpu"],
     "flex_attention has no backward pass on CPU"),
    (["--model", "some-org/some-model", "--data", "builtin:mathchat", "--finetune", "qlora", "--device", "cpu"],
     "qlora (4-bit NF4 through bitsandbytes) needs a CUDA GPU"),
    (["--model", "./no/such/model", "--data", "builtin:mathchat"], "model path not found: ./no/such/model"),
    (["--model", "no-such-org/no-such-model", "--data", "builtin:mathchat"], "hub is offline"),
    (["--data", "builtin:mathchat"], "set exactly one of model"),
    (["--tiny", "gpt9", "--data", "builtin:mathchat"], "unknown tiny architecture 'gpt9'"),
    (["--tiny", "qwen3"], "no training data"),
    (["--tiny", "qwen3", "--data", "builtin:mathchat", "--schedule", "two-pass"], "unknown schedule 'two-pass'"),
    (["--tiny", "qwen3", "--data", "builtin:mathchat", "--pack"], "pack needs a row budget"),
    (["--tiny", "qwen3", "--data", "builtin:mathchat", "--optim", "lion"], "unknown optim 'lion'"),
    (["--tiny", "qwen3", "--data", "builtin:mathchat", "--output-dir", "o", "--resume"], "nothing to resume"),
    (["--config", "nope.yaml"], "config file not found: nope.yaml"),
])
def test_bad_settings_are_one_line(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert message in one_line_error(argv, capsys, tmp_path, monkeypatch)


@pytest.mark.parametrize("yaml_text,message", [
    ("tiny: qwen3\ndata: builtin:mathchat\nlerning_rate: 0.1\n", "unknown config key 'lerning_rate'"),
    ("tiny: qwen3\ndata: builtin:mathchat\nlearning_rate: fast\n", "learning_rate must be a number, got 'fast'"),
    ("tiny: qwen3\ndata: builtin:mathchat\nper_device_train_batch_size: 2.5\n",
     "per_device_train_batch_size must be an integer"),
    ("tiny: qwen3\ndata: builtin:mathchat\nlr: 0.1\nlearning_rate: 0.2\n", "sets both 'lr' and 'learning_rate'"),
    ("tiny: qwen3\ndata: builtin:mathchat\nreport_to: [tensorbord]\n", "unknown report_to tracker 'tensorbord'"),
    ("tiny: qwen3\ndata: builtin:mathchat\npack: maybe\n", "pack must be true or false"),
    ("- just\n- a list\n", "expected a mapping of config keys"),
    ("tiny: [unclosed\n", "not valid YAML"),
])
def test_bad_config_files_are_one_line(yaml_text, message, capsys, tmp_path, monkeypatch):
    (tmp_path / "c.yaml").write_text(yaml_text)
    assert message in one_line_error(["--config", "c.yaml"], capsys, tmp_path, monkeypatch)


def test_flags_override_the_file_and_yaml_numbers_are_coerced(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model: Qwen/Qwen3-8B\ndata: chats.jsonl\nlearning_rate: 1e-4\nper_device_train_batch_size: 4\n"
                    "report_to: none\nlora_target_modules: q_proj\n")
    config = load_config(path, {"tiny": "llama", "per_device_train_batch_size": 2, "learning_rate": None})
    assert config.tiny == "llama" and config.model is None  # a flag picks the model source
    assert config.learning_rate == 1e-4 and config.per_device_train_batch_size == 2 and config.report_to == ()
    from onepass.train.run.model import lora_config

    assert config.lora_target_modules == "q_proj"
    assert lora_config(config).target_modules == {"q_proj"}  # a module name, not a regex


def test_every_flag_is_a_config_key():
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    add_parser(sub)
    args = parser.parse_args(["train", "--tiny", "qwen3", "--learning-rate", "0.1", "--no-pack",
                              "--lora-target-modules", "q_proj,v_proj", "--template-kwarg", "enable_thinking=true",
                              "--backend", "eager", "--report-to", "tensorboard", "--gradient-accumulation-steps", "2"])
    overrides = overrides_from_args(args)
    assert overrides == {"tiny": "qwen3", "learning_rate": 0.1, "pack": False,
                         "lora_target_modules": ["q_proj", "v_proj"], "template_kwargs": {"enable_thinking": True},
                         "attention": "eager", "report_to": "tensorboard", "gradient_accumulation_steps": 2}
    dests = {a.dest for a in sub.choices["train"]._actions} - {"help", "config", "resume", "resume_anyway",
                                                                  argparse.SUPPRESS}
    assert dests == set(config_keys()) | set(DEPRECATED_KEYS)  # one flag per field, generated from the dataclass


def test_deprecated_short_names_give_the_same_config_with_one_warning_each(tmp_path, caplog):
    new = dict(learning_rate=1e-3, per_device_train_batch_size=2, gradient_accumulation_steps=3,
               num_train_epochs=2.0, lr_scheduler_type="cosine", optim="sgd", adam_epsilon=1e-6)
    old = {old: new[key] for old, key in DEPRECATED_KEYS.items()}
    path = tmp_path / "old.yaml"
    path.write_text("tiny: qwen3\ndata: builtin:mathchat\n" + "".join(f"{k}: {v}\n" for k, v in old.items()))
    with caplog.at_level("WARNING", logger="onepass"):
        from_file = load_config(path)
    assert from_file == load_config(None, dict(tiny="qwen3", data="builtin:mathchat", **new))
    lines = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(lines) == len(old) and "'lr' in" in lines[0] and "use 'learning_rate'" in lines[0]
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    flags = ["train", "--lr", "0.001", "--batch-size", "2", "--grad-accum", "3", "--epochs", "2"]
    assert load_config(None, {"tiny": "qwen3", "data": "x", **overrides_from_args(parser.parse_args(flags))}) == \
        load_config(None, dict(tiny="qwen3", data="x", learning_rate=1e-3, per_device_train_batch_size=2,
                               gradient_accumulation_steps=3, num_train_epochs=2))


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIGS.glob("*.yaml") if not p.name.startswith("accelerate")))
def test_shipped_configs_are_valid(name):
    config = load_config(CONFIGS / name)
    assert config.data and (config.model or config.tiny)


def test_the_paper_setup_is_reachable_from_a_config():
    c = load_config(CONFIGS / "qwen3-8b-qlora.yaml")
    assert (c.model, c.finetune, c.lora_r, c.lora_alpha, c.dtype, c.mixed_precision, c.num_train_epochs) == (
        "Qwen/Qwen3-8B", "qlora", 32, 64.0, "bfloat16", "bf16", 3.0)


def test_accelerate_configs_are_accelerate_configs():
    import yaml

    for name in ("accelerate-ddp.yaml", "accelerate-fsdp.yaml"):
        values = yaml.safe_load((CONFIGS / name).read_text())
        assert values["distributed_type"] in ("MULTI_GPU", "FSDP") and values["num_processes"] >= 2


def test_a_run_from_the_command_line(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "run"
    argv = ["--config", str(CONFIGS / "tiny-cpu.yaml"), "--limit", "4", "--max-steps", "3",
            "--per-device-train-batch-size", "2",
            "--output-dir", str(out), "--no-progress", "--logging-steps", "1", "--save-steps", "2",
            "--report-to", "tensorboard"]
    assert main(argv) == 0
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))  # accelerate's tensorboard tracker
    printed = capsys.readouterr().err  # logging, on stderr
    assert "step 3: loss" in printed and f"metrics {out / 'metrics.json'}" in printed
    metrics = json.loads((out / "metrics.json").read_text())
    assert len(metrics["history"]) == 3 and metrics["config"]["per_device_train_batch_size"] == 2
    assert (out / "final" / "model.safetensors").is_file() and (out / "loss.png").is_file()
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000002", "step-000003"]
    # asking for more steps continues the run
    assert main(argv + ["--max-steps", "4", "--resume"]) == 0
    assert f"resumed from {out / 'checkpoints' / 'step-000003'} at step 3" in capsys.readouterr().err
    history = json.loads((out / "metrics.json").read_text())["history"]
    assert [h["step"] for h in history] == [1, 2, 3, 4] and history[:3] == metrics["history"]


# ---------------------------------------------------------------------------------------------
# CUDA only


def _saved_tiny(tmp_path, vocab: int = 512) -> Path:
    from onepass.model.tiny import tiny_model

    path = tmp_path / "tiny-model"
    tiny_model("qwen3", vocab).save_pretrained(str(path))
    return path


@pytest.mark.requires_cuda
def test_flex_blockmask_training_step_equals_sdpa_on_cuda(tmp_path):
    """Batches of two padded rows: flex with onepass's BlockMask gives sdpa's loss at every step.

    With the weights held (a learning rate of 1e-12: AdamW moves a float32 weight of ~0.02 by less than its
    rounding) every step's loss agrees to float32 rounding; with a real
    rate only the first step is compared tightly: AdamW's first updates are about lr * sign(gradient),
    so a gradient component that is zero up to rounding moves by +-lr in one run and -+lr in the other
    (the first H100 run compared all 3 steps at lr 1e-3 within 1e-3 and found 6.2588 vs 6.2499)."""
    from onepass.train.run.loop import train

    base = dict(tiny="qwen3", data="builtin:mathchat", limit=8, per_device_train_batch_size=2, max_steps=3,
                device="cuda", progress=False, save_model=False, dtype="float32")
    for lr, steps_compared in ((1e-12, 3), (1e-3, 1)):
        runs = {attn: train(load_config(None, {**base, "learning_rate": lr, "attention": attn,
                                               "output_dir": str(tmp_path / f"{attn}-{lr}")}))
                for attn in ("flex_attention", "sdpa")}
        flex, sdpa = runs["flex_attention"], runs["sdpa"]
        assert len(flex.losses) == len(sdpa.losses) == 3
        for a, b in list(zip(flex.losses, sdpa.losses))[:steps_compared]:
            assert abs(a - b) <= 1e-5 * abs(b), (lr, flex.losses, sdpa.losses)
    assert json.loads(flex.metrics_path.read_text())["attention"] == "flex_attention"


@pytest.mark.requires_cuda
def test_qlora_trains_and_saves_an_adapter_on_cuda(tmp_path):
    pytest.importorskip("bitsandbytes")
    from onepass.train.run.loop import train

    model_dir = _saved_tiny(tmp_path, vocab=151_669)
    config = load_config(None, dict(model=str(model_dir), tokenizer="builtin:qwen3", data="builtin:mathchat",
                                    limit=8, finetune="qlora", lora_r=8, lora_alpha=16, dtype="bfloat16",
                                    mixed_precision="bf16", per_device_train_batch_size=2, max_steps=4,
                                    learning_rate=1e-3, progress=False,
                                    output_dir=str(tmp_path / "q")))
    result = train(config)
    assert all(torch.isfinite(torch.tensor(result.losses)))
    assert (result.final_dir / "adapter_model.safetensors").is_file()
    assert (result.final_dir / "tokenizer.json").is_file()


def test_only_user_errors_become_one_line(monkeypatch, capsys):
    """A bug inside the run keeps its traceback; Ctrl-C is one line and exit 130."""
    import onepass.train.run.loop

    def broken(config, resume=None, **_kw):
        raise ValueError("expected all tensors to be on the same device")

    monkeypatch.setattr(onepass.train.run.loop, "train", broken)
    with pytest.raises(ValueError, match="same device"):
        main(["--tiny", "qwen3", "--data", "builtin:mathchat"])

    def interrupted(config, resume=None, **_kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(onepass.train.run.loop, "train", interrupted)
    assert main(["--tiny", "qwen3", "--data", "builtin:mathchat"]) == 130
    assert capsys.readouterr().err.strip().splitlines() == ["onepass: interrupted"]


def test_a_tracker_that_is_not_installed_is_one_line(capsys, tmp_path, monkeypatch):
    import importlib.util

    missing = [t for t in ("wandb", "mlflow", "trackio", "swanlab") if importlib.util.find_spec(t) is None]
    if not missing:
        pytest.skip("every tracker is installed")
    err = one_line_error(["--tiny", "qwen3", "--data", "builtin:mathchat", "--report-to", f"tensorboard,{missing[0]}"],
                         capsys, tmp_path, monkeypatch)
    assert f"report_to: {missing[0]} needs the {missing[0]!r} package: pip install {missing[0]}" in err


def test_wandb_offline_needs_no_network(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    out = tmp_path / "run"
    assert main(["--config", str(CONFIGS / "tiny-cpu.yaml"), "--limit", "2", "--max-steps", "2", "--output-dir",
                 str(out), "--no-progress", "--no-save-model", "--report-to", "wandb"]) == 0
    assert list((out / "wandb").glob("offline-run-*"))


def test_hf_underscore_spellings_and_a_help_that_fits_a_screen(capsys):
    """`--max_steps` (HF's spelling) sets what `--max-steps` sets; `--help` shows the common flags,
    `--help-all` every one."""
    parser = argparse.ArgumentParser(add_help=False)
    from onepass.train.cli import add_arguments

    add_arguments(parser)
    dashed = overrides_from_args(parser.parse_args(["--max-steps", "7", "--learning-rate", "0.1", "--pack"]))
    underscored = overrides_from_args(parser.parse_args(["--max_steps", "7", "--learning_rate", "0.1", "--pack"]))
    assert dashed == underscored == {"max_steps": 7, "learning_rate": 0.1, "pack": True}
    for flag, most in (("--help", 70), ("--help-all", None)):
        with pytest.raises(SystemExit) as exit_:
            main([flag])
        assert exit_.value.code == 0
        text = capsys.readouterr().out
        assert "--max-steps" in text and "--max_steps" not in text.split("\n\n")[0]
        if most is not None:
            assert len(text.splitlines()) <= most and "--lora-r" not in text and "--help-all" in text
        else:
            assert "--lora-r" in text and "--save-total-limit" in text
