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
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
from strategies import synthetic_conversations
from transformers import AutoTokenizer

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
    from onepass.tiny import tiny_model

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


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("ONEPASS_TEST_TRL") != "1",
                    reason="the TRL original takes about a minute: set ONEPASS_TEST_TRL=1")
def test_the_trl_original_runs_too(model_and_data, tmp_path):
    pytest.importorskip("trl")
    model_dir, data = model_and_data
    out = tmp_path / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, str(SCRIPTS / "trl_sft.py"), str(model_dir), str(data), str(out)],
                          env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    check_outputs(out)


def test_docs_show_the_same_diff():
    docs = (Path(__file__).parents[2] / "docs" / "train.md").read_text()
    trl, onepass = (SCRIPTS / "trl_sft.py").read_text(), (SCRIPTS / "onepass_sft.py").read_text()
    for line in difflib.ndiff(trl.splitlines(), onepass.splitlines()):
        if line[:2] in ("- ", "+ "):
            assert f"\n{line[0]}{line[2:]}\n" in docs, line
