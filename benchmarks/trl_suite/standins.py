"""Offline stand-ins for the hub models and datasets TRL's SFT and GRPO tests load.

Why this module exists: TRL's ``tests/test_sft_trainer.py`` and ``tests/test_grpo_trainer.py`` load
``trl-internal-testing/tiny-*`` models (causal LMs, and sequence classifiers as reward models) and the ``zen`` /
``toolcall`` / ``harmony`` datasets from the hub; here there is no hub. The stand-ins are built the way TRL's
own scripts build them, offline:

- models: the architecture's config scaled down as in TRL's ``scripts/generate_tiny_models`` (hidden size 8,
  two layers, ...; a sequence classifier with ``num_labels=1``), random weights in bfloat16, on a real Qwen
  vocabulary (``builtin:qwen3``: Qwen's BPE ranks and added tokens; every stand-in shares it, where the hub
  models have their own vocabularies) with the architecture's own chat template from the *installed* trl's
  ``trl/chat_templates`` (what users get; none for GPT-NeoX, as the hub model; Olmo 3 and Mistral, whose
  templates TRL does not ship, get Qwen 2.5's ChatML). They are written as a Hugging Face hub cache
  (``models--ORG--NAME/snapshots/...``), so ``from_pretrained(NAME)`` finds them with ``HF_HUB_OFFLINE=1``;
- datasets: the TRL checkout's own ``scripts/generate_{zen,toolcall,harmony}_dataset.py`` run with their
  ``push_to_hub`` saving to disk instead (no TRL code is copied: it runs from the checkout).

Not built (their tests fail in the control run too, and are left out of the pass rate): vision-language
models and the image datasets, ``tiny-RemoteForCausalLM`` (custom code), models of the slow GPU-only tests.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
import sys
from pathlib import Path
from typing import Any

ORG = "trl-internal-testing"
SNAPSHOT = "0" * 40

# hub name -> (transformers config class, config overrides, chat template file in trl/chat_templates or None);
# a name ending in ForSequenceClassification[-...] is a reward model (one label)
TINY = {"hidden_size": 8, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
        "intermediate_size": 32}
MODELS: dict[str, tuple[str, dict[str, Any], str | None]] = {
    f"{ORG}/tiny-Qwen2ForCausalLM-2.5": ("Qwen2Config", {}, "qwen2_5.jinja"),
    f"{ORG}/tiny-Qwen3ForCausalLM": ("Qwen3Config", {}, "qwen3_training.jinja"),  # the hub's: generation markers
    f"{ORG}/tiny-Qwen3MoeForCausalLM": ("Qwen3MoeConfig", {"num_experts": 4, "num_experts_per_tok": 2,
                                                           "norm_topk_prob": True}, "qwen3.jinja"),
    f"{ORG}/tiny-GptOssForCausalLM": ("GptOssConfig", {"num_local_experts": 4, "num_experts_per_tok": 2},
                                      "gptoss.jinja"),
    f"{ORG}/tiny-Cohere2ForCausalLM": ("Cohere2Config", {"logit_scale": 1.0, "use_qk_norm": False},
                                       "cohere2.jinja"),
    f"{ORG}/tiny-Glm4MoeForCausalLM": ("Glm4MoeConfig", {"moe_intermediate_size": 32, "head_dim": 2,
                                                         "n_routed_experts": 4, "num_experts_per_tok": 2,
                                                         "attention_bias": True, "use_qk_norm": True},
                                       "glm4moe.jinja"),
    f"{ORG}/tiny-NemotronHForCausalLM-nano": (
        "NemotronHConfig", {"hidden_size": 16, "num_hidden_layers": None,
                            "layers_block_type": ["mamba", "attention", "moe"], "mamba_num_heads": 8,
                            "mamba_head_dim": 4, "mamba_n_groups": 1, "ssm_state_size": 16, "mamba_d_conv": 4,
                            "mamba_expand": 2, "n_routed_experts": 4, "num_experts_per_tok": 2,
                            "moe_intermediate_size": 32, "moe_shared_expert_intermediate_size": 32,
                            "use_mamba_kernels": False}, "nemotron_3_nano.jinja"),
    f"{ORG}/tiny-Olmo3ForCausalLM": ("Olmo3Config", {}, "qwen2_5.jinja"),
    f"{ORG}/tiny-Lfm2ForCausalLM": ("Lfm2Config", {"layer_types": ["conv", "full_attention"]}, "lfm2.jinja"),
    f"{ORG}/tiny-Lfm2ForCausalLM-2.5": ("Lfm2Config", {"layer_types": ["conv", "full_attention"]},
                                        "lfm2_2_5.jinja"),
    f"{ORG}/tiny-GPTNeoXForCausalLM": ("GPTNeoXConfig", {}, None),
    "Qwen/Qwen3-4B": ("Qwen3Config", {}, "qwen3.jinja"),
    f"{ORG}/tiny-LlamaForCausalLM-3.2": ("LlamaConfig", {}, "llama3_2.jinja"),
    f"{ORG}/tiny-MistralForCausalLM-0.2": ("MistralConfig", {}, "qwen2_5.jinja"),
    f"{ORG}/tiny-Gemma2ForCausalLM": ("Gemma2Config", {"head_dim": 2}, "gemma.jinja"),
    f"{ORG}/tiny-Qwen2ForSequenceClassification-2.5": ("Qwen2Config", {}, "qwen2_5.jinja"),
    f"{ORG}/tiny-Qwen3ForSequenceClassification": ("Qwen3Config", {}, "qwen3.jinja"),
    f"{ORG}/tiny-LlamaForSequenceClassification-3.2": ("LlamaConfig", {}, "llama3_2.jinja"),
}
DATASETS = {f"{ORG}/zen": "generate_zen_dataset.py", f"{ORG}/toolcall": "generate_toolcall_dataset.py",
            f"{ORG}/harmony": "generate_harmony_dataset.py"}


def _hub_dir(cache: Path, name: str) -> Path:
    org, repo = name.split("/")
    return cache / f"models--{org}--{repo}"


def templates_dir() -> Path:
    """The chat templates of the installed trl (the ones its users get)."""
    import trl

    return Path(trl.__file__).parent / "chat_templates"


def build_model(name: str, cache: Path, templates: Path, tokenizer: Any) -> Path:
    """The stand-in of hub model ``name`` in the hub cache ``cache`` (built once)."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, GenerationConfig

    root = _hub_dir(cache, name)
    snap = root / "snapshots" / SNAPSHOT
    if (snap / "config.json").is_file():
        return snap
    config_cls, overrides, template = MODELS[name]
    values = {**TINY, **overrides}
    values = {k: v for k, v in values.items() if v is not None}
    tok = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    tok.chat_template = (templates / template).read_text() if template else None
    reward = "ForSequenceClassification" in name
    config = getattr(transformers, config_cls)(vocab_size=len(tok), eos_token_id=tok.eos_token_id,
                                                pad_token_id=tok.pad_token_id, **values,
                                                **({"num_labels": 1} if reward else {}))
    torch.manual_seed(int(hashlib.sha256(name.encode()).hexdigest()[:8], 16))
    auto = AutoModelForSequenceClassification if reward else AutoModelForCausalLM
    model = auto.from_config(config).to(torch.bfloat16)
    tmp = snap.with_name(snap.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id).save_pretrained(tmp)
    tmp.rename(snap)
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / "main").write_text(SNAPSHOT)
    return snap


def build_datasets(out: Path, trl_dir: Path) -> dict[str, str]:
    """Run the checkout's dataset scripts with ``push_to_hub`` saving each config to ``out/REPO/CONFIG``."""
    import datasets

    made: dict[str, str] = {}
    saved = (datasets.DatasetDict.push_to_hub, datasets.Dataset.push_to_hub)

    def save(self: Any, repo_id: str, config_name: str = "default", **_: Any) -> None:
        path = out / repo_id / config_name
        if not path.exists():
            self.save_to_disk(str(path))

    datasets.DatasetDict.push_to_hub = save
    datasets.Dataset.push_to_hub = save
    try:
        for repo, script in DATASETS.items():
            if (out / repo).is_dir():
                made[repo] = str(out / repo)
                continue
            spec = importlib.util.spec_from_file_location(f"trl_suite_{script[:-3]}", trl_dir / "scripts" / script)
            module = importlib.util.module_from_spec(spec)
            assert spec.loader is not None
            spec.loader.exec_module(module)
            module.main(test_size=0.1, push_to_hub=True, repo_id=repo)
            made[repo] = str(out / repo)
    finally:
        datasets.DatasetDict.push_to_hub, datasets.Dataset.push_to_hub = saved
    return made


def build(root: Path, trl_dir: Path) -> dict[str, Any]:
    """Every stand-in under ``root`` (``hub/`` a hub cache, ``datasets/``); returns what was built and what
    could not be (with the first line of why)."""
    from onepass.render.tokenizer import load_tokenizer

    root.mkdir(parents=True, exist_ok=True)
    base = load_tokenizer("builtin:qwen3")
    report: dict[str, Any] = {"models": {}, "failed": {}, "datasets": {}, "chat_templates": str(templates_dir())}
    for name in MODELS:
        try:
            report["models"][name] = str(build_model(name, root / "hub", templates_dir(), base))
        except Exception as e:  # noqa: BLE001  (a config this transformers lacks: its tests fail in both runs)
            report["failed"][name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    report["datasets"] = build_datasets(root / "datasets", trl_dir)
    (root / "standins.json").write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    print(json.dumps(build(Path(sys.argv[1]), Path(sys.argv[2])), indent=1))
