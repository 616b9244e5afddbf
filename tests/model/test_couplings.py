"""The couplings to other libraries' internals hold on the installed releases, and fail loudly when they do not.

Each registered hybrid's mixer is found from its installed code with the cache argument its forward
really takes (5.23: ``cache_params`` / ``past_key_values``; 5.24: ``cache``) and calls only cache methods
onepass's chain state provides. Stub mixers play a future release: a renamed argument is followed, a
new cache method or a state read from elsewhere is one :class:`CouplingError` line at model load, and
float64 kernels that stop applying are caught by the probe instead of a 1e-7 "DIFFERENT".
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import onepass.model.float64 as f64
import onepass.mixers.tree as tree
from onepass.model.couplings import COUPLINGS, CouplingError, mixer_classes, recurrent_mixer, upcast_kept_parameters
from onepass.model.private_names import PRIVATE_NAMES, find_private, installed, missing_private_names, private
from onepass.layout.geometry import Chain
from onepass.model.tiny import HYBRID_ARCHS, tiny_model
from onepass.parallel.forward import ForwardPlan


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
    out = stub(hidden, **ForwardPlan(mask=None, chains=plan).model_kwargs())
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
    recurrent_mixer(mod.Qwen3_5GatedDeltaNet)  # a release before the cache API refuses first (conftest)
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


# ---------------------------------------------------------------------------------------------
# private names of other libraries (issue 33): each found in the installed code, or one line


@pytest.mark.parametrize("label", sorted(PRIVATE_NAMES))
def test_every_private_name_onepass_uses_is_in_the_installed_releases(label):
    if not installed(PRIVATE_NAMES[label].package):  # an optional integration (skyrl: make test-skyrl)
        assert label not in missing_private_names()
        pytest.skip(f"{PRIVATE_NAMES[label].package} is not installed here")
    assert find_private(label) is not None, f"{label}: missing in the installed release (see couplings.py)"
    assert PRIVATE_NAMES[label].coupling in {c.name for c in COUPLINGS}


@pytest.mark.parametrize("label", sorted(PRIVATE_NAMES))
def test_a_private_name_a_release_lacks_is_one_line_naming_release_and_remedy(label, monkeypatch):
    def gone():
        raise AttributeError(label)

    monkeypatch.setitem(PRIVATE_NAMES, label, dataclasses.replace(PRIVATE_NAMES[label], find=gone))
    with pytest.raises(CouplingError) as err:
        private(label)
    p = PRIVATE_NAMES[label]
    line = str(err.value)
    assert "\n" not in line and label in line and line.startswith(f"{p.package} ") and p.instead in line
    assert (label in missing_private_names()) == installed(p.package)  # an integration not installed lacks nothing


_NO_CPU_FLASH = """
import torch
real = torch.ops.aten
class Aten:  # a torch release without the private CPU flash ops
    def __getattr__(self, name):
        if "flash_attention_for_cpu" in name:
            raise AttributeError(name)
        return getattr(real, name)
torch.ops.aten = Aten()
import onepass.attention.backends, onepass.attention.cpu_tiles, onepass.train.run.loop  # no error at import
import onepass.verify.check
from onepass.attention.cpu import register
try:
    register()
except Exception as e:
    print(type(e).__name__, "|", e)
"""


def test_a_torch_without_the_cpu_flash_ops_imports_and_refuses_onepass_cpu_in_one_line():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    result = subprocess.run([sys.executable, "-c", _NO_CPU_FLASH], env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    name, line = result.stdout.strip().splitlines()[-1].split(" | ")
    assert name == "CouplingError" and "_scaled_dot_product_flash_attention_for_cpu" in line
    assert "use --attn sdpa" in line


class _CallsNothing:
    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        return None


class _ReturnsTwo:
    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        return None, None

    def compute_loss(self, model, inputs):
        logps, entropies = self._get_per_token_logps_and_entropies(model, inputs)
        return logps


@pytest.mark.parametrize("fake, why", [(_CallsNothing, "no longer calls"), (_ReturnsTwo, "returns")])
def test_a_grpo_override_that_would_stop_applying_is_one_line(fake, why, monkeypatch):
    """TRL renaming the log-prob method, or changing what it returns, must not leave our override unused."""
    import trl

    from onepass.rl.trl_grpo import GRPO_LOGPS, onepass_grpo_trainer

    monkeypatch.setattr(trl, "GRPOTrainer", fake)
    assert find_private(GRPO_LOGPS) is None
    with pytest.raises(CouplingError, match="trl .* has no trl.GRPOTrainer._get_per_token_logps_and_entropies"):
        onepass_grpo_trainer(16)
    with pytest.raises(LookupError, match=why):
        PRIVATE_NAMES[GRPO_LOGPS].find()


def test_onepass_trainer_checks_the_trainer_privates_before_anything_else(monkeypatch):
    from onepass.train.trainer.trainer import TRAINER_PRIVATES, OnePassTrainer

    label = TRAINER_PRIVATES[0]

    def gone():
        raise AttributeError(label)

    monkeypatch.setitem(PRIVATE_NAMES, label, dataclasses.replace(PRIVATE_NAMES[label], find=gone))
    with pytest.raises(CouplingError, match=label):
        OnePassTrainer(model=None)


def test_a_mixer_reading_states_through_the_old_cache_api_is_one_line_at_load():
    """transformers 5.17's mixers read ``cache_params.layers[i].conv_states`` and ``has_previous_state``: before,
    detection found no mixer there and the recurrent layers would have run over the whole row (the guard then
    refused); now it is one line at model load naming what the class reads."""
    class OldApi(torch.nn.Module):
        layer_idx = 0

        def forward(self, hidden_states, cache_params=None):
            if cache_params is not None and cache_params.has_previous_state(self.layer_idx):
                return hidden_states + cache_params.layers[self.layer_idx].conv_states[0]
            return hidden_states

    with pytest.raises(CouplingError, match=r"OldApi .* reads its recurrent states as cache_params\.conv_states, "
                                            r"cache_params\.has_previous_state .*transformers>=5\.21") as err:
        tree.install(OldApi())
    assert "\n" not in str(err.value)


def test_lfm2s_conv_cache_of_transformers_5_2_is_one_line_at_load():
    """transformers 5.2's LFM2 reads ``past_key_values.conv_cache[i]``: before, no mixer was found and its short
    convolutions ran over the whole row, 1e-4 off N-pass (make test-compat found it); now it is refused at load."""
    class ConvCache(torch.nn.Module):
        layer_idx = 0

        def forward(self, hidden_states, past_key_values=None, cache_position=None):
            if past_key_values is not None and cache_position[0] > 0:
                return hidden_states + past_key_values.conv_cache[self.layer_idx]
            return hidden_states

    with pytest.raises(CouplingError, match=r"ConvCache .* as past_key_values\.conv_cache .*transformers>=5\.21"):
        tree.install(ConvCache())


def _old_slicing_qwen3():
    """Qwen3ForCausalLM as transformers 5.17 wrote its head: ``hidden_states[:, logits_to_keep, :]`` (one set of
    positions for every row; a [B, L] mask raises inside the forward)."""
    from transformers import Qwen3ForCausalLM
    from transformers.modeling_outputs import CausalLMOutputWithPast

    class OldSlicing(Qwen3ForCausalLM):
        def forward(self, input_ids=None, attention_mask=None, position_ids=None, logits_to_keep=0, **kwargs):
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs)
            slice_indices = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
            return CausalLMOutputWithPast(logits=self.lm_head(out.last_hidden_state[:, slice_indices, :]))

    model = tiny_model("qwen3", 32, dtype=torch.float64)
    old = OldSlicing(model.config).to(torch.float64)
    old.load_state_dict(model.state_dict())
    return model, old


def test_a_causal_lm_without_row_masks_runs_a_batch_of_rows_exactly():
    """The 5.2-5.22 spelling: a causal LM that slices ``hidden_states[:, logits_to_keep, :]`` gets the union of the
    rows' kept positions and each row's own are picked after (before: a batch of two rows was refused, on 5.17 in
    one line, and crashed inside the model before that). Both LM head paths: the chunked head (hidden states
    picked) and the plain one (logits picked)."""
    from onepass.model.couplings import causal_lm_class, logits_to_keep_for, takes_row_mask
    from onepass.loss import batch_loss, batch_dft_loss, layouts_to_batch
    from onepass.layout.tree import Layout

    model, old = _old_slicing_qwen3()
    assert not takes_row_mask(causal_lm_class(old))  # the installed model: a mask per row from 5.23 on
    a = Layout(input_ids=np.array([1, 2, 3, 4, 5]), position_ids=np.arange(5), kv_end=np.full(5, 5),
               targets=np.array([2, 3, 4, 5, -100]), weights=np.array([1.0, 1, 1, 1, 0]))
    b = Layout(input_ids=np.array([7, 8, 9]), position_ids=np.arange(3), kv_end=np.full(3, 3),
               targets=np.array([-100, 9, 10]), weights=np.array([0.0, 1, 1]))  # other kept positions than a's
    two = layouts_to_batch([a, b])
    keep, pick = logits_to_keep_for(old, two["targets"].numpy() != -100)
    assert keep.tolist() == [0, 1, 2, 3] and pick.tolist() == [0, 1, 2, 3, 5, 6]  # [B * K] flat, row-major
    for loss in (batch_loss, batch_dft_loss):
        want = loss(model, layouts_to_batch([a])) + loss(model, layouts_to_batch([b]))
        torch.testing.assert_close(loss(old, two), want, rtol=1e-12, atol=0)
        torch.testing.assert_close(loss(model, two), want, rtol=1e-12, atol=0)
    want = batch_loss(model, layouts_to_batch([a]), lm_head="plain") + batch_loss(model, layouts_to_batch([b]),
                                                                                    lm_head="plain")
    torch.testing.assert_close(batch_loss(old, two, lm_head="plain"), want, rtol=1e-12, atol=0)  # logits picked


def test_onepass_train_runs_batches_of_rows_on_a_model_without_row_masks(tmp_path, monkeypatch):
    """As on transformers 5.2-5.22: a batch of 2 rows per forward trains (before: refused at load, in one line)."""
    import onepass.model.couplings as couplings
    from onepass.train.config import load_config
    from onepass.train.run.loop import train

    monkeypatch.setattr(couplings, "takes_row_mask", lambda cls: False)
    config = load_config(None, dict(tiny="qwen3", data="builtin:mathchat", limit=2, max_steps=1, progress=False,
                                    save_model=False, output_dir=str(tmp_path / "two"), per_device_train_batch_size=2))
    assert train(config, log=lambda _m: None).steps == 1


def _no_wraps(forward):
    def hooked(*args, **kwargs):  # as transformers 5.15's force_accelerate_hooks: no functools.wraps
        return forward(*args, **kwargs)

    return hooked


class _OldApiMixerBehindADecorator(torch.nn.Module):
    layer_idx = 0

    @_no_wraps
    def forward(self, hidden_states, cache_params=None, attention_mask=None):
        if cache_params is not None and cache_params.has_previous_state(self.layer_idx):
            return hidden_states + cache_params.layers[self.layer_idx].conv_states[0]
        return hidden_states


def test_a_mixer_whose_forward_a_decorator_hides_is_still_found_and_refused():
    """transformers 5.15: the hybrids' forward behind a decorator shows ``(*args, **kwargs)``; before, the cache
    argument was in no parameter, the mixer passed as no mixer and the hybrid ran silently inexact (0.02 in a
    log-prob). Now its parameters come from its ``def`` line and the old cache API is refused in one line."""
    from onepass.model.couplings import forward_parameters

    assert forward_parameters(_OldApiMixerBehindADecorator) == ["self", "hidden_states", "cache_params",
                                                                "attention_mask"]
    with pytest.raises(CouplingError, match=r"cache_params\.conv_states, cache_params\.has_previous_state"):
        recurrent_mixer(_OldApiMixerBehindADecorator)


def test_sources_are_parsed_one_thread_at_a_time(monkeypatch):
    """CPython 3.11's AST constructor keeps its recursion depth per interpreter, not per thread: two threads
    parsing at once raise ``SystemError: AST constructor recursion depth mismatch`` (the sequence-parallel
    guard's simulated ranks, threads, did on both ranks of a launch). Each parse here holds the GIL released a
    moment, so two threads reading sources would overlap unless the couplings take turns."""
    import ast
    import threading
    import time

    import onepass.model.couplings as couplings

    inside, most, errors = 0, 0, []
    count = threading.Lock()
    real_parse = ast.parse

    def parse(*args, **kwargs):
        nonlocal inside, most
        with count:
            inside += 1
            most = max(most, inside)
        time.sleep(0.02)
        try:
            return real_parse(*args, **kwargs)
        finally:
            with count:
                inside -= 1

    class MixerA(torch.nn.Module):  # a forward behind a decorator without functools.wraps: read off the source
        def forward(self, *args, **kwargs):
            return args

    class MixerB(torch.nn.Module):
        def forward(self, *args, **kwargs):
            return kwargs

    def read(cls):
        try:
            couplings.forward_parameters(cls)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    monkeypatch.setattr(ast, "parse", parse)
    threads = [threading.Thread(target=read, args=(cls,)) for cls in (MixerA, MixerB)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and most == 1, (errors, most)
    assert couplings.forward_parameters(MixerA) == ["self"]  # *args, **kwargs: no named parameter
