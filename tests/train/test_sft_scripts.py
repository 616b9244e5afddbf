"""A TRL ``SFTTrainer`` script becomes a onepass script by changing the import and the class names.

``scripts/trl_sft.py`` is what a TRL user writes (a ``datasets.Dataset`` with a
``messages`` column, LoRA through ``peft_config``, ``processing_class=tokenizer``,
the model as a directory name); ``scripts/onepass_sft.py`` is the same file with
``SFTConfig``/``SFTTrainer`` renamed. The onepass one runs here (in process) on a
tiny random Qwen3 (the real Qwen3 tokenizer and chat template) for 2 steps; its
checkpoint holds the adapter, the tokenizer and the chat template. The TRL one
runs the same way with ``ONEPASS_TEST_TRL=1`` (a subprocess, about a minute).
"""

from __future__ import annotations

import difflib
import json
import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
from strategies import synthetic_conversations
from transformers import AutoTokenizer
import warm

SCRIPTS = Path(__file__).parent / "scripts"
RENAMES = {"from trl import SFTConfig, SFTTrainer": "from onepass.train import OnePassConfig, OnePassTrainer",
           "SFTConfig(": "OnePassConfig(", "SFTTrainer(": "OnePassTrainer("}


def test_the_scripts_differ_only_in_the_import_and_the_class_names():
    trl, onepass = (SCRIPTS / "trl_sft.py").read_text(), (SCRIPTS / "onepass_sft.py").read_text()
    changed = [line for line in difflib.ndiff(trl.splitlines(), onepass.splitlines()) if line[:2] in ("- ", "+ ")]
    assert len(changed) == 2 * 3, "\n".join(changed)  # the import, the config line, the trainer line
    for old, new in RENAMES.items():
        trl = trl.replace(old, new)
    assert trl == onepass


@pytest.fixture(scope="module")
def model_and_data(tmp_path_factory, qwen3_tokenizer):
    """A tiny random Qwen3 saved with the Qwen3 tokenizer, and 4 short reasoning conversations (a
    ``messages`` column) as jsonl."""
    from onepass.model.tiny import tiny_model

    root = tmp_path_factory.mktemp("sft")
    model_dir = root / "model"
    tiny_model("qwen3", len(qwen3_tokenizer), hidden_size=32, intermediate_size=64).save_pretrained(model_dir)
    qwen3_tokenizer.save_pretrained(model_dir)
    data = root / "chats.jsonl"
    data.write_text("".join(json.dumps(record) + "\n" for record in synthetic_conversations(4)))
    return model_dir, data


def check_outputs(out):
    for saved in (out / "checkpoint-2", out):  # save_steps=2, then save_model()
        names = sorted(p.name for p in saved.iterdir())
        assert "adapter_model.safetensors" in names and "adapter_config.json" in names, names
        assert "tokenizer.json" in names and "chat_template.jinja" in names, names
    state = json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())
    losses = [h["loss"] for h in state["log_history"] if "loss" in h]
    assert len(losses) == 2 and all(loss > 0 for loss in losses)


@pytest.mark.e2e
def test_the_onepass_script_trains_and_saves_the_tokenizer_with_every_checkpoint(model_and_data, tmp_path,
                                                                                  monkeypatch, one_thread):
    model_dir, data = model_and_data
    out = tmp_path / "out"
    monkeypatch.setattr(sys, "argv", ["onepass_sft.py", str(model_dir), str(data), str(out)])
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    namespace = runpy.run_path(str(SCRIPTS / "onepass_sft.py"), run_name="__main__")  # in process: no re-import
    check_outputs(out)
    trainer = namespace["trainer"]
    assert trainer.exactness.ok and len(trainer.train_dataset) == 4  # one item per conversation, guard ran
    saved = AutoTokenizer.from_pretrained(out / "checkpoint-2")
    assert saved.chat_template == trainer.processing_class.chat_template


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("ONEPASS_TEST_TRL") != "1",
                    reason="the TRL original takes about a minute: set ONEPASS_TEST_TRL=1")
def test_the_trl_original_runs_too(model_and_data, tmp_path):
    pytest.importorskip("trl")
    model_dir, data = model_and_data
    out = tmp_path / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = warm.run([sys.executable, str(SCRIPTS / "trl_sft.py"), str(model_dir), str(data), str(out)],
                    env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    check_outputs(out)


def test_docs_show_the_same_diff():
    docs = (Path(__file__).parents[2] / "docs" / "train.md").read_text()
    trl, onepass = (SCRIPTS / "trl_sft.py").read_text(), (SCRIPTS / "onepass_sft.py").read_text()
    for line in difflib.ndiff(trl.splitlines(), onepass.splitlines()):
        if line[:2] in ("- ", "+ "):
            assert f"\n{line[0]}{line[2:]}\n" in docs, line


# ---------------------------------------------------------------------------------------------
# Scripts nobody here wrote: TRL's own trl/scripts/sft.py (from the installed trl) and TRL's docs
# snippets, with only the import and the class names changed.

TRL_NAMES = {"SFTTrainer": "OnePassTrainer", "SFTConfig": "OnePassConfig"}


def to_onepass(source: str) -> str:
    """``source`` with ``SFTTrainer``/``SFTConfig`` imported from ``onepass.train`` instead of ``trl`` and
    renamed; nothing else changes (the other trl imports stay)."""
    out = []
    for line in source.splitlines():
        match = re.match(r"^(\s*)from trl import (.+)$", line)
        if match and any(name in match.group(2) for name in TRL_NAMES):
            names = [n.strip() for n in match.group(2).split(",")]
            ours = [TRL_NAMES[n] for n in names if n in TRL_NAMES]
            rest = [n for n in names if n not in TRL_NAMES]
            out.append(f"{match.group(1)}from onepass.train import {', '.join(ours)}")
            if rest:
                out.append(f"{match.group(1)}from trl import {', '.join(rest)}")
            continue
        for old, new in TRL_NAMES.items():
            line = re.sub(rf"\b{old}\b", new, line)
        out.append(line)
    return "\n".join(out) + "\n"


def changed_lines(a: str, b: str) -> list[str]:
    return [line for line in difflib.ndiff(a.splitlines(), b.splitlines()) if line[:2] in ("- ", "+ ")]


def run_script(path: Path, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return warm.run([sys.executable, str(path), *args], env=env, capture_output=True, text=True, timeout=timeout,
                    check=False)


@pytest.fixture(scope="module")
def data_dir(model_and_data, tmp_path_factory):
    """train.jsonl and test.jsonl of messages: what ``--dataset_name DIR`` loads as two splits."""
    root = tmp_path_factory.mktemp("data")
    records = synthetic_conversations(6)
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records[:4]))
    (root / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records[4:]))
    return root


def _skip_unless_trl_and_peft_agree(trl):
    """TRL >= 1.7's ``--use_peft`` builds ``LoraConfig(target_parameters=...)``, which peft < 0.17 lacks: TRL's own
    script fails there before any onepass code runs (seen with make test-min's peft 0.13)."""
    import inspect

    import peft
    from trl.trainer import utils

    if ("target_parameters" in inspect.getsource(utils.get_peft_config)
            and "target_parameters" not in inspect.signature(peft.LoraConfig).parameters):
        pytest.skip(f"trl {trl.__version__} passes LoraConfig(target_parameters=...), which peft {peft.__version__} "
                    "lacks: TRL's own sft.py --use_peft fails the same way")


@pytest.mark.e2e
@pytest.mark.slow
def test_trls_own_sft_script_runs_with_only_the_names_changed(model_and_data, data_dir, tmp_path):
    """The installed trl's trl/scripts/sft.py with its docstring's flags (LoRA, --packing, eval,
    --eos_token '<|im_end|>'), on a tiny local Qwen3 and a local dataset, for 2 steps."""
    trl = pytest.importorskip("trl")
    _skip_unless_trl_and_peft_agree(trl)
    original = (Path(trl.__file__).parent / "scripts" / "sft.py").read_text()
    ported = to_onepass(original)
    changed = changed_lines(original, ported)
    assert len(changed) == 2 * 3 + 2 * 2, "\n".join(changed)  # 2 imports (-1 +2 each), 2 renamed lines (-1 +1)
    assert all(re.search(r"SFT|OnePass|^[-+] *from trl import", c) for c in changed), changed
    script = tmp_path / "sft.py"
    script.write_text(ported)
    model_dir, _ = model_and_data
    out = tmp_path / "out"
    proc = run_script(script, "--model_name_or_path", str(model_dir), "--dataset_name", str(data_dir),
                      "--learning_rate", "2.0e-4", "--max_steps", "2", "--packing", "--per_device_train_batch_size",
                      "2", "--gradient_accumulation_steps", "1", "--eos_token", "<|im_end|>", "--eval_strategy",
                      "steps", "--eval_steps", "2", "--output_dir", str(out), "--use_peft", "--lora_r", "4",
                      "--lora_alpha", "8", "--max_length", "512", "--use_cpu", "true", "--report_to", "none",
                      "--logging_steps", "1", "--dataset_num_proc", "2")
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert "Training completed" in proc.stdout, proc.stdout[-2000:]
    names = {p.name for p in out.iterdir()}
    assert {"adapter_model.safetensors", "loss.png", "chat_template.jinja"} <= names, names
    state = json.loads(next(out.glob("checkpoint-*/trainer_state.json")).read_text())
    logs = [h for h in state["log_history"] if "loss" in h]
    assert len(logs) == 2 and all(k in logs[0] for k in ("num_tokens", "mean_token_accuracy", "entropy")), logs
    assert any("eval_loss" in h and "eval_mean_token_accuracy" in h for h in state["log_history"])
    assert AutoTokenizer.from_pretrained(out).eos_token == "<|im_end|>"


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("name", ["trl_docs_peft.py", "trl_docs_config.py"])
def test_trl_docs_snippets_run_with_only_the_names_changed(name, model_and_data, tmp_path, monkeypatch, one_thread):
    original = (SCRIPTS / name).read_text()
    ported = to_onepass(original)
    changed = changed_lines(original, ported)
    assert all(re.search(r"SFT|OnePass|^[-+] *from trl import", c) for c in changed), changed
    script = tmp_path / name
    script.write_text(ported)
    model_dir, data = model_and_data
    out = tmp_path / "out"
    monkeypatch.setattr(sys, "argv", [str(script), str(model_dir), str(data), str(out)])
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    runpy.run_path(str(script), run_name="__main__")  # the ported script as its user runs it, in process: no re-import
    if name == "trl_docs_peft.py":
        for saved in ("adapter", "continued"):
            assert (out / saved / "adapter_model.safetensors").is_file()
            assert (out / saved / "tokenizer.json").is_file()  # found from the model, then the PeftModel
    else:
        state = json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())
        assert [h["step"] for h in state["log_history"] if "loss" in h] == [1, 2]
        assert AutoTokenizer.from_pretrained(out / "checkpoint-2").eos_token == "<|im_end|>"
