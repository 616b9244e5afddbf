"""``onepass export``: the merged model computes what base + adapter computes, and ships its template."""

from __future__ import annotations

import json

import torch

from onepass.cli import main
from onepass.export.merge import adapter_base
from onepass.render.tokenizer import builtin_template

def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_merged_logits_equal_the_adapter_models(tmp_path, tiny_adapter):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base_dir, adapter_dir, lora = tiny_adapter
    out = tmp_path / "merged"
    assert adapter_base(adapter_dir) == str(base_dir)  # what --base defaults to
    assert main(["export", "--base", str(base_dir), "--adapter", str(adapter_dir), "--out", str(out)]) == 0
    assert (out / "model.safetensors").is_file() and not (out / "adapter_config.json").exists()
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64)
    assert not any("lora" in name for name, _ in merged.named_parameters())
    ids = torch.randint(0, lora.config.vocab_size, (3, 19), generator=torch.Generator().manual_seed(0))
    expected = logits(lora, ids)
    with lora.disable_adapter():
        plain = logits(lora, ids)
    assert (plain - expected).abs().max() > 1e-3  # the adapter changes the model: merging it is not a no-op
    assert (logits(merged, ids) - expected).abs().max() < 1e-10
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.chat_template == builtin_template("qwen3")  # the base's tokenizer (the adapter has none here)


def test_the_adapters_tokenizer_and_template_win(tmp_path, tiny_adapter, qwen3_tokenizer):
    """``onepass train`` saves the tokenizer (with the template it trained with) beside the adapter."""
    from transformers import AutoTokenizer

    base_dir, adapter_dir, _ = tiny_adapter
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    for f in adapter_dir.iterdir():
        (adapter / f.name).write_bytes(f.read_bytes())
    tok = AutoTokenizer.from_pretrained(base_dir)
    tok.chat_template = builtin_template("chatml_reasoning")
    tok.save_pretrained(adapter)
    out = tmp_path / "merged"
    assert main(["export", "--adapter", str(adapter), "--out", str(out)]) == 0  # --base from adapter_config
    assert AutoTokenizer.from_pretrained(out).chat_template == builtin_template("chatml_reasoning")
    config = json.loads((out / "config.json").read_text())
    assert config["vocab_size"] == 300  # the tiny base's (conftest.tiny_adapter)


def test_export_refusals_are_one_line(tmp_path, tiny_adapter, capsys, monkeypatch):
    base_dir, adapter_dir, _ = tiny_adapter
    out = tmp_path / "merged"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["export", "--adapter", str(adapter_dir), "--out", str(out), "--push-to-hub", "me/model"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("onepass: error: --push-to-hub needs the hub") and "\n" not in err
    assert not out.exists()  # refused before any work
    assert main(["export", "--adapter", str(base_dir), "--out", str(out)]) == 2
    assert "not a peft adapter directory" in capsys.readouterr().err
    assert main(["export", "--adapter", str(adapter_dir), "--base", "nobody/nothing", "--out", str(out)]) == 2
    assert "not a local path and the hub is offline" in capsys.readouterr().err
