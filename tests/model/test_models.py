"""The one loader of a causal LM (onepass.model.load), the one dtype table (onepass.model.dtypes), the one is_peft."""

from __future__ import annotations

import pytest
import torch

from onepass.model.dtypes import DTYPES, default_tolerance, dtype_names, torch_dtype
from onepass.errors import UsageError
from onepass.model.couplings import base_model, is_peft, loaded_from
from onepass.model.load import ModelLoadError, ModelSpec, load_causal_lm, load_model_config
from onepass.model.tiny import tiny_model


def test_every_dtype_name_is_torchs_and_each_command_takes_its_rows():
    assert all(torch_dtype(d.name) is getattr(torch, d.name) for d in DTYPES)
    assert torch_dtype("auto") == "auto" and torch_dtype(torch.float64) is torch.float64
    assert dtype_names(trains=True) == ("float32", "bfloat16", "float64")  # float16 without loss scaling: no
    assert dtype_names(verified=True) == ("float32", "bfloat16", "float64")
    assert dtype_names(auto=True)[0] == "auto" and "float16" in dtype_names(auto=True)
    assert [default_tolerance(n) for n in ("float64", "float32", "bfloat16")] == [1e-9, 1e-4, 2e-2]


def test_an_unknown_dtype_is_one_line_naming_the_known_ones():
    with pytest.raises(UsageError, match="unknown dtype 'float8'; use one of auto, float32, bfloat16, float16"):
        torch_dtype("float8")


def test_a_tiny_spec_loads_what_tiny_model_builds():
    model = load_causal_lm(ModelSpec(tiny="qwen3", vocab_size=50, dtype="float64", seed=3))
    reference = tiny_model("qwen3", 50, dtype=torch.float64, seed=3)
    assert not model.training and next(model.parameters()).dtype == torch.float64
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        assert torch.equal(p, q), name


def test_a_saved_model_loads_in_the_dtype_asked_and_names_where_it_came_from(tmp_path):
    tiny_model("llama", 40).save_pretrained(tmp_path / "m")
    model = load_causal_lm(ModelSpec(model=str(tmp_path / "m"), dtype="float64", attention="eager"))
    assert next(model.parameters()).dtype == torch.float64 and model.config._attn_implementation == "eager"
    assert loaded_from(model) == str(tmp_path / "m")


@pytest.mark.parametrize("spec, message", [
    ("./no/such/model", "--model path not found: ./no/such/model"),
    ("no-such-org/no-such-model", "it is not a local path and the hub is offline"),
])
def test_a_model_that_is_not_there_is_one_line_and_an_oserror(spec, message, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError, match=message) as e:
        load_model_config(spec, label="--model")
    assert isinstance(e.value, OSError)  # as transformers' own loading errors are


def test_a_folder_that_is_not_a_model_is_one_line(tmp_path):
    with pytest.raises(ModelLoadError, match="has no config.json"):
        load_causal_lm(ModelSpec(model=str(tmp_path)))


def test_is_peft_is_a_peft_wrapper_not_an_attribute():
    """The rule: a peft wrapper (what get_peft_model returns), decided by class as transformers' Trainer does.
    The two rules before it disagreed: train's (``hasattr(model, "peft_config")``) called a model with
    transformers-integrated adapters a peft model (it has no base model to unwrap to), and the
    trainer's (a ``get_base_model`` method and a ``peft_config``) called any look-alike one."""
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"], task_type="CAUSAL_LM")
    plain = tiny_model("qwen3", 30)
    assert not is_peft(plain) and base_model(plain) is plain
    wrapped = get_peft_model(tiny_model("qwen3", 30), lora)
    assert is_peft(wrapped) and base_model(wrapped) is wrapped.get_base_model()
    integrated = tiny_model("qwen3", 30)  # what transformers' own adapter support (model.add_adapter) leaves: a
    integrated.peft_config = {"default": lora}  # peft_config on the model itself, no wrapper (set here by hand:
    integrated._hf_peft_config_loaded = True  # add_adapter needs a newer peft than this environment's)
    assert hasattr(integrated, "peft_config") and not is_peft(integrated) and base_model(integrated) is integrated

    class LookAlike:
        peft_config: dict = {}

        def get_base_model(self):
            return plain

    assert not is_peft(LookAlike())
