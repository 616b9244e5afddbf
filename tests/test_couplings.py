"""The couplings to transformers internals hold on the installed releases, and fail loudly when they do not.

Each registered hybrid's mixer is found from its installed code with the cache argument its forward
really takes (5.23: ``cache_params`` / ``past_key_values``; 5.24: ``cache``) and calls only cache methods
onepass's chain state provides. Stub mixers play a future release: a renamed argument is followed, a
new cache method or a state read from elsewhere is one :class:`CouplingError` line at model load, and
float64 kernels that stop applying are caught by the probe instead of a 1e-7 "DIFFERENT".
"""

from __future__ import annotations

import inspect

import pytest
import torch

import onepass.mixers.float64 as f64
import onepass.mixers.tree as tree
from onepass.couplings import COUPLINGS, CouplingError, mixer_classes, recurrent_mixer, upcast_kept_parameters
from onepass.geometry import Chain
from onepass.tiny import HYBRID_ARCHS, tiny_model


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
def test_every_tested_hybrid_mixer_is_found_with_the_argument_its_forward_takes(arch):
    model = tiny_model(arch, 32)
    found = mixer_classes(model.modules())
    assert [c.__name__ for c in found] and all(c.__name__ in tree.TESTED_MIXERS for c in found)
    for cls, coupling in found.items():
        params = inspect.signature(inspect.unwrap(cls.forward)).parameters
        assert coupling.cache_arg in params, (cls.__name__, coupling.cache_arg, list(params))
        assert coupling.cache_methods <= tree.CHAIN_STATE_METHODS, coupling.cache_methods - tree.CHAIN_STATE_METHODS
    assert tree.install(model) == sum(type(m) in found for m in model.modules())


def test_no_attention_or_mlp_is_taken_for_a_mixer():
    model = tiny_model("qwen3", 32)
    assert mixer_classes(model.modules()) == {} and tree.install(model) == 0


class _Stub(torch.nn.Module):
    """A one-channel 'recurrent' mixer: adds the running sum of its inputs (carried in a cache state)."""

    layer_idx = 0

    def forward(self, hidden_states, state_of_the_art=None, attention_mask=None):
        prev = state_of_the_art.get_recurrent_state(self.layer_idx) if state_of_the_art is not None else None
        run = hidden_states.cumsum(1) + (0 if prev is None else prev)
        if state_of_the_art is not None:
            state_of_the_art.update_recurrent_state(run[:, -1:], self.layer_idx)
        return run


def test_a_renamed_cache_argument_is_followed():
    """The 5.24 failure mode: the argument got a new name. Detection reads it off the signature."""
    stub = _Stub()
    assert recurrent_mixer(_Stub).cache_arg == "state_of_the_art"
    assert tree.install(stub) == 1
    hidden = torch.arange(1.0, 7.0)[None, :, None]
    # two chains: [0, 3) and a child [3, 6) that continues from it
    plan = ((Chain(start=0, end=3, parent=-1, depth=0), Chain(start=3, end=6, parent=0, depth=1)),)
    out = stub(hidden, **{tree.PLAN_KWARG: plan})
    assert torch.equal(out, hidden.cumsum(1)), "the child chain must start from its parent's end state"
    tree.uninstall(stub)


def test_a_cache_method_the_chain_state_lacks_is_one_line_at_load():
    class NewApi(torch.nn.Module):
        def forward(self, hidden_states, cache=None):
            if cache is not None:
                cache.get_conv_state(0)
                cache.get_ssm_state_v2(0)
            return hidden_states

    with pytest.raises(CouplingError, match=r"cache\.get_ssm_state_v2\(\).*chain state does not provide") as err:
        tree.install(NewApi())
    assert "\n" not in str(err.value)


def test_states_read_from_outside_the_forward_arguments_are_refused():
    class Hidden(torch.nn.Module):
        def forward(self, hidden_states):
            return self.cache.get_recurrent_state(0)

    with pytest.raises(CouplingError, match="from none of its forward's arguments"):
        tree.install(Hidden())


def test_float64_kernels_that_stop_applying_fail_loudly(monkeypatch):
    """Mutation: the kernel rewrite reaches nothing (as when a release moves a kernel); the probe says so."""
    import transformers.models.qwen3_5.modeling_qwen3_5 as mod

    monkeypatch.setattr(f64, "float64_kernels", lambda classes: 0)
    for name, fn in list(vars(mod).items()):  # undo what earlier tests in this process patched
        if getattr(fn, f64._PATCHED, False):
            monkeypatch.setattr(mod, name, fn.__wrapped__)
    model = tiny_model("qwen3.5", 32, dtype=torch.float64)
    with pytest.raises(CouplingError, match="still compute in float32.*Qwen3_5GatedDeltaNet"):
        f64.float64_mixers(model)


@pytest.mark.parametrize("arch", ["qwen3.5", "nemotron-h", "falcon-h1"])
def test_float64_mixers_leave_nothing_in_float32(arch):
    model = tiny_model(arch, 32, dtype=torch.float64)
    f64.float64_mixers(model)  # raises if anything inside a mixer is still float32
    assert f64.float32_inside_mixers(model) == {}


def test_parameters_kept_in_float32_are_cast_up_only_in_a_float64_model():
    model = tiny_model("deepseek-v3", 32, dtype=torch.float64)
    router = next(m for m in model.modules() if type(m).__name__.endswith("TopkRouter"))
    router.weight.data = router.weight.data.float()  # as transformers >= 5.24 keeps it; 5.23 did not
    kept = [n for n, p in model.named_parameters() if p.dtype != torch.float64]
    assert upcast_kept_parameters(model) >= len(kept) >= 1
    assert all(p.dtype == torch.float64 for p in model.parameters())
    assert all(b.dtype == torch.float64 for b in model.buffers() if b.is_floating_point())
    lower = tiny_model("deepseek-v3", 32, dtype=torch.bfloat16)
    before = {n: p.dtype for n, p in lower.named_parameters()}
    assert upcast_kept_parameters(lower) == 0 and before == {n: p.dtype for n, p in lower.named_parameters()}


def test_every_coupling_says_what_it_relies_on_where_and_when_checked():
    assert len({c.name for c in COUPLINGS}) == len(COUPLINGS)
    for c in COUPLINGS:
        assert c.relies_on and c.detected_by and c.fails_as and c.where.startswith("onepass.") and c.checked
