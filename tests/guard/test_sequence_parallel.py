"""The sequence-parallel guard: a tiny float64 twin split over simulated ranks, or one line naming the module."""

from __future__ import annotations

import pytest

import onepass.mixers.tree as tree
from onepass.model.tiny import tiny_config
from onepass.guard.sequence_parallel import check_row, check_sequence_parallel
from onepass.parallel.model import check_degree
from onepass.parallel.plan import SequenceParallelError
from onepass.layout.geometry import branches, row_chains

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_check_row_branches_and_its_chains_cross_every_shard_boundary():
    row = check_row(64)
    assert branches(row.kv_end) and len(row) % 4 == 0
    for degree in (2, 4):
        bounds = {len(row) // degree * r for r in range(1, degree)}
        assert any(c.start < b < c.end for c in row_chains(row.kv_end) for b in bounds), degree


@pytest.mark.parametrize("arch", ["qwen3", "gpt-oss", "qwen3.5", "nemotron-h", "lfm2"])
def test_models_onepass_claims_are_exact_split_over_ranks(arch):
    result = check_sequence_parallel(tiny_config(arch, 100), 2, backend="onepass_cpu")
    assert result["checked"] and result["rel_loss_diff"] <= 1e-12 and result["max_rel_grad_diff"] <= 1e-9


def test_a_layer_that_mixes_positions_outside_attention_is_refused_naming_it(monkeypatch):
    import transformers.models.llama.modeling_llama as llama

    forward = llama.LlamaMLP.forward
    monkeypatch.setattr(llama.LlamaMLP, "forward", lambda self, x: forward(self, x).cumsum(1) / 10)
    with pytest.raises(SequenceParallelError) as e:
        check_sequence_parallel(tiny_config("llama", 100), 4, backend="onepass_cpu")
    message = str(e.value)
    assert message.startswith("sequence parallelism (sp_size 4) is not exact for LlamaForCausalLM: "
                              "model.layers.0.mlp (LlamaMLP) is the first module whose output differs")
    assert "\n" not in message and "train with sp_size 1" in message


def test_a_recurrent_mixer_onepass_does_not_find_is_refused_naming_it(monkeypatch):
    """A mixer that scans only its shard (not found, so never gathered) loses the chain state at the boundary."""
    monkeypatch.setattr(tree, "recurrent_mixer", lambda cls: None)
    with pytest.raises(SequenceParallelError, match=r"model\.layers\.0\.linear_attn \(Qwen3_5GatedDeltaNet\) is the "
                                                     "first module whose output differs"):
        check_sequence_parallel(tiny_config("qwen3.5", 100), 2, backend="onepass_cpu")


def test_a_degree_that_does_not_divide_the_real_models_heads_is_refused_in_one_line():
    config = tiny_config("qwen3", 100, num_attention_heads=6, num_key_value_heads=2)
    assert check_degree(config, 2).local_heads == 3
    assert check_degree(config, 6).kv_repeat == 3
    with pytest.raises(SequenceParallelError, match="^sp_size 4 does not divide the 6 attention heads of Qwen3: "):
        check_degree(config, 4)
    latent = tiny_config("deepseek-v3", 100)  # keys and values expand to one per query head
    assert check_degree(latent, 4).kv_repeat == 1
