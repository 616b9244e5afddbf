"""onepass's SkyRL switch against SkyRL's own code (skyrl 0.3.0, ``make test-skyrl``; skipped where skyrl is absent).

SkyRL's step-wise trajectories, as its generator emits them with a reasoning template: every turn its own
sample, the turn's prompt re-rendered by the real Qwen3 template (earlier reasoning dropped), the group's
trajectories sharing their first prompt, tool-output spans masked, the sampler's log-probs carried (seed 2814,
used nowhere else). SkyRL's own batch converter pads them; SkyRL's own ``HFModelWrapper.forward`` scores every
row as its own sequence, onepass's wrapper scores the batch from prefix trees; float64: every log-prob and
entropy, and every registered policy loss's value and gradients (with the KL to a reference and the entropy
term the policy worker adds), agree to 1e-9 relative.

Two shims let SkyRL import on this CPU venv (Python 3.11, the local CPU torch wheel), nothing of SkyRL's code
replaced: flash-attn's package is registered without running its ``__init__`` (its CUDA kernels cannot build
on CPU; SkyRL's model wrapper imports only its pure-torch ``bert_padding``), and ``typing.TypedDict`` is
typing_extensions' (SkyRL's ``skyrl.tinker.types`` uses the stdlib's in a pydantic model, which pydantic refuses
before Python 3.12: SkyRL 0.3.0 needs Python >= 3.12 in practice). SkyRL's Ray/FSDP worker path needs CUDA:
``make gpu-check`` runs it (onepass.bench.skyrl_step).
"""

from __future__ import annotations

import copy
import importlib.util
import sys
import types
import typing

import numpy as np
import pytest
import torch

pytest.importorskip("skyrl")  # CI's main venv has no skyrl: make test-skyrl

import typing_extensions  # noqa: E402

typing.TypedDict = typing_extensions.TypedDict  # before skyrl is imported (the module docstring)
if "flash_attn" not in sys.modules and importlib.util.find_spec("flash_attn") is not None:
    sys.modules["flash_attn"] = importlib.util.module_from_spec(importlib.util.find_spec("flash_attn"))

from skyrl.backends.skyrl_train.utils.ppo_utils import (  # noqa: E402
    PolicyLossRegistry,
    apply_loss_reduction_to_advantages_minibatch,
    compute_approx_kl,
)
from skyrl.backends.skyrl_train.utils.torch_utils import masked_mean  # noqa: E402
from skyrl.backends.skyrl_train.workers.fsdp import fsdp_worker  # noqa: E402
from skyrl.backends.skyrl_train.workers.model_wrapper import HFModelWrapper  # noqa: E402
from skyrl.train.config import AlgorithmConfig  # noqa: E402
from skyrl.train.dataset.preprocess import convert_prompts_responses_to_batch_tensors  # noqa: E402
from skyrl.train.generators.base import TrajectoryID  # noqa: E402
from skyrl.train.generators.utils import merge_stepwise_output  # noqa: E402
from skyrl.train.trainer import RayPPOTrainer  # noqa: E402

import onepass.rl.skyrl as onepass_skyrl  # noqa: E402
from onepass.model.couplings import CouplingError  # noqa: E402
from onepass.model.precision import float64_norms  # noqa: E402
from onepass.model.tiny import tiny_model  # noqa: E402
from onepass.rl.rollouts import trajectories_from_records  # noqa: E402
from onepass.rl.synthetic import template_rollouts  # noqa: E402
from onepass.rl.verify import compact_rollouts  # noqa: E402
from onepass.verify.check import max_rel_grad_diff  # noqa: E402

TOL = 1e-9
SEED = 2814


@pytest.fixture(scope="module")
def stepwise(qwen3_tokenizer):
    """SkyRL's step-wise GeneratorOutput for 2 groups of 3 multi-turn trajectories, and the vocabulary size."""
    records = template_rollouts(qwen3_tokenizer, num_groups=2, group_size=3, seed=SEED, max_turns=3,
                                system="You are a careful agent.")
    trajs, vocab = compact_rollouts(trajectories_from_records(records, source=f"seed {SEED}"))
    out = {k: [] for k in ("prompt_token_ids", "response_ids", "rewards", "loss_masks", "stop_reasons",
                           "rollout_logprobs", "trajectory_ids", "is_last_step")}
    for i, traj in enumerate(trajs):
        for k, turn in enumerate(traj.turns):
            out["prompt_token_ids"].append(turn.prompt_ids.tolist())
            out["response_ids"].append(turn.completion_ids.tolist())
            out["rewards"].append([0.0] * (len(turn.completion_ids) - 1) + [float(turn.advantages[0])])
            out["loss_masks"].append(turn.mask.astype(int).tolist())
            out["stop_reasons"].append("stop")
            out["rollout_logprobs"].append(turn.logprobs.tolist())
            out["trajectory_ids"].append(TrajectoryID(instance_id=traj.group, repetition_id=i))
            out["is_last_step"].append(k == len(traj.turns) - 1)
    out["rollout_metrics"], out["rollout_expert_indices"] = None, None
    return out, vocab


@pytest.fixture(scope="module")
def batch(stepwise):
    """SkyRL's own batch converter on the step-wise samples (its left-padded [B, S] layout)."""
    out, _ = stepwise
    pad = types.SimpleNamespace(pad_token_id=0)
    sequences, attention_mask, action_mask, rewards, loss_mask, rollout_logprobs, _ = \
        convert_prompts_responses_to_batch_tensors(pad, out["prompt_token_ids"], out["response_ids"], out["rewards"],
                                                   out["loss_masks"], out["rollout_logprobs"])
    return dict(sequences=sequences, attention_mask=attention_mask, action_mask=action_mask, rewards=rewards,
                loss_mask=loss_mask.double(), rollout_logprobs=rollout_logprobs.double(),
                num_actions=action_mask.shape[1])


def test_the_trajectories_are_what_skyrl_cannot_merge(stepwise, batch):
    """Reasoning dropped (no turn's prompt extends the last's prompt + response: merge_stepwise_output merges
    nothing), a prompt shared within each group, tool outputs masked, sampler log-probs carried."""
    out, _ = stepwise
    merged = merge_stepwise_output(copy.deepcopy(out))
    assert len(merged["response_ids"]) == len(out["response_ids"])
    assert sum(not last for last in out["is_last_step"]) >= 4  # multi-turn trajectories
    firsts = [p for p, t, k in zip(out["prompt_token_ids"], out["trajectory_ids"], range(len(out["trajectory_ids"])))
              if k == 0 or out["is_last_step"][k - 1]]
    assert len({tuple(p) for p in firsts}) < len(firsts)  # a group's trajectories share their first prompt
    assert (batch["loss_mask"][batch["action_mask"] == 1] == 0).any()  # masked tool-output spans
    assert (batch["rollout_logprobs"][batch["action_mask"] == 1] < 0).all()


@pytest.fixture(scope="module")
def wrappers(stepwise):
    """SkyRL's wrapper (sdpa, each row its own sequence) and onepass's, on float64 twins of one tiny Qwen3; and a
    reference model likewise."""
    _, vocab = stepwise

    def model(seed):
        m = tiny_model("qwen3", vocab, dtype=torch.float64, seed=seed)
        float64_norms(m)
        return m

    ours = onepass_skyrl.skyrl_classes().model_wrapper
    return {"skyrl": (HFModelWrapper(model(0)), HFModelWrapper(model(1))), "onepass": (ours(model(0)), ours(model(1)))}


def scored(batch):
    """Window positions whose token has a real token before it (where both wrappers score a log-prob)."""
    w = batch["num_actions"]
    real = batch["attention_mask"].bool()
    return real[:, -w:] & real[:, -w - 1:-1]


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_log_probs_and_entropies_equal_skyrls_forward(wrappers, batch, one_thread, temperature):
    got = {}
    for name, (policy, _) in wrappers.items():
        with torch.no_grad():
            lp, out = policy(batch["sequences"], batch["num_actions"], attention_mask=batch["attention_mask"],
                             temperature=temperature, return_output=True, compute_entropy=True)
        w = batch["num_actions"]
        got[name] = lp, out["entropy"][:, -w - 1:-1]
    keep = scored(batch)
    assert keep.sum() > (batch["action_mask"] == 1).sum()  # short responses: the window reaches into prompts
    (lp_s, ent_s), (lp_o, ent_o) = got["skyrl"], got["onepass"]
    assert lp_o.shape == lp_s.shape == batch["action_mask"].shape
    assert rel(lp_o[keep], lp_s[keep]) <= TOL and rel(ent_o[keep], ent_s[keep]) <= TOL
    assert (lp_o[~keep] == 0).all()


def losses_and_grads(policy, reference, batch, name):
    """One micro-batch of SkyRL's policy worker (PolicyWorkerBase._forward_backward_micro, its CUDA moves aside):
    the registered loss on the wrapper's log-probs, + KL to the reference - entropy; its value and gradients."""
    w = batch["num_actions"]
    config = AlgorithmConfig(policy_loss_type=name, use_entropy_loss=True, kl_loss_coef=0.05, temperature=1.0)
    if name in ("regular", "gspo", "cispo", "sapo"):  # truncated importance sampling against the sampler
        config.off_policy_correction.tis_ratio_type = "token"
    noise = torch.randn(batch["loss_mask"].shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        old = policy(batch["sequences"], w, attention_mask=batch["attention_mask"]) + 0.1 * noise * batch["loss_mask"]
        base = reference(batch["sequences"], w, attention_mask=batch["attention_mask"])
    advantages = batch["rewards"].sum(-1, keepdim=True).double() * batch["action_mask"]
    advantages = apply_loss_reduction_to_advantages_minibatch(advantages, batch["loss_mask"], "token_mean",
                                                              micro_batch_size=len(advantages), max_seq_len=w)
    policy.zero_grad()
    lp, out = policy(batch["sequences"], w, attention_mask=batch["attention_mask"], temperature=1.0,
                     return_output=True, compute_entropy=True, entropy_requires_grad=True)
    torch.manual_seed(SEED)  # clip_cov draws the tokens it clips
    loss, _ = PolicyLossRegistry.get(name)(lp, old, advantages, config=config, loss_mask=batch["loss_mask"],
                                           rollout_logprobs=batch["rollout_logprobs"])
    kl = masked_mean(compute_approx_kl(lp, base, loss_mask=batch["loss_mask"], kl_estimator_type="k3"),
                     batch["loss_mask"], dim=-1).mean()
    entropy = masked_mean(out["entropy"][:, -w - 1:-1], batch["loss_mask"])
    total = loss + config.kl_loss_coef * kl - config.entropy_loss_coef * entropy
    total.backward()
    return total.detach(), {n: p.grad.clone() for n, p in policy.model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", sorted(PolicyLossRegistry.list_available()))
def test_every_registered_policy_loss_and_its_gradients_equal_skyrls(wrappers, batch, one_thread, name):
    want, want_grads = losses_and_grads(*wrappers["skyrl"], batch, name)
    got, got_grads = losses_and_grads(*wrappers["onepass"], batch, name)
    assert want.abs() > 0 and abs((got - want) / want).item() <= TOL, name
    assert set(got_grads) == set(want_grads) and len(want_grads) > 10
    assert max_rel_grad_diff(want_grads, got_grads)[0] <= TOL, name


# --------------------------------------------------------------------------------------------
# under SkyRL's FSDP2 layout (its apply_fsdp2: fully_shard per decoder layer and embedding, then the model), on one
# gloo rank; SkyRL's FSDPStrategy.prepare itself moves buffers with .cuda(), and FSDP has no float64 mixed precision:
# float32, both wrappers sharded alike


@pytest.fixture(scope="module")
def gloo():
    import socket

    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def fsdp2_wrapped(wrapper_cls, vocab):
    from skyrl.backends.skyrl_train.distributed.fsdp_utils import apply_fsdp2
    from skyrl.train.config.config import FSDPConfig
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    wrapper = wrapper_cls(tiny_model("qwen3", vocab, dtype=torch.float32, seed=0))
    mp = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32, cast_forward_inputs=True)
    apply_fsdp2(wrapper.model, {"mesh": init_device_mesh("cpu", (1,), mesh_dim_names=["fsdp"]), "mp_policy": mp,
                                "offload_policy": None, "reshard_after_forward": True}, FSDPConfig())
    return wrapper


def test_under_skyrls_fsdp2_layout_the_log_probs_and_gradients_are_skyrls(stepwise, batch, gloo, one_thread):
    """The LM head is applied after the model's forward returns; FSDP2 reshards the root after forward (torch
    2.13), so onepass's wrapper keeps the root gathered until backward (before: a mixed Tensor/DTensor error)."""
    _, vocab = stepwise
    w, keep = batch["num_actions"], scored(batch)
    got = {}
    for name, cls in (("skyrl", HFModelWrapper), ("onepass", onepass_skyrl.skyrl_classes().model_wrapper)):
        wrapper = fsdp2_wrapped(cls, vocab)
        assert type(next(wrapper.model.parameters())).__name__ == "DTensor"
        lp, out = wrapper(batch["sequences"], w, attention_mask=batch["attention_mask"], return_output=True,
                          compute_entropy=True)
        entropy = out["entropy"][:, -w - 1:-1]
        (lp[keep].sum() + (entropy * batch["loss_mask"]).sum()).backward()
        got[name] = lp.detach(), {n: p.grad.full_tensor() for n, p in wrapper.model.named_parameters()}
    (lp_s, grads_s), (lp_o, grads_o) = got["skyrl"], got["onepass"]
    assert rel(lp_o[keep], lp_s[keep]) <= 1e-5
    assert max_rel_grad_diff(grads_s, grads_o)[0] <= 1e-4


# --------------------------------------------------------------------------------------------
# the switch: workers, trainer, config (their Ray/FSDP run needs CUDA: make gpu-check)


def test_the_workers_build_onepass_wrapper_while_they_init_and_skyrls_after():
    seen = []
    with onepass_skyrl._wrapper_in_workers(lambda *a, **k: seen.append(k)):
        fsdp_worker.HFModelWrapper("model", bf16=False)
    assert seen == [{"bf16": False}] and fsdp_worker.HFModelWrapper is HFModelWrapper
    classes = onepass_skyrl.skyrl_classes()
    assert issubclass(classes.policy_worker_base, fsdp_worker.FSDPPolicyWorkerBase)
    assert issubclass(classes.ref_worker_base, fsdp_worker.FSDPRefWorkerBase)


def test_the_trainer_builds_the_onepass_policy_and_reference_workers(monkeypatch):
    built = []
    monkeypatch.setattr(RayPPOTrainer, "build_models", lambda self, *workers: built.append(workers))
    classes = onepass_skyrl.skyrl_classes()
    trainer = object.__new__(classes.trainer)
    trainer.build_models(fsdp_worker.PolicyWorker, fsdp_worker.CriticWorker, fsdp_worker.RefWorker)
    assert built == [(classes.policy_worker, fsdp_worker.CriticWorker, classes.ref_worker)]


def test_the_config_key_and_the_entry_point(tmp_path):
    cfg = onepass_skyrl.skyrl_classes().config.from_cli_overrides(
        ["trainer.onepass.max_tokens=4096", "generator.step_wise_trajectories=true"])
    assert cfg.trainer.onepass.max_tokens == 4096 and cfg.generator.step_wise_trajectories
    assert onepass_skyrl._onepass_settings(cfg.trainer).max_tokens == 4096
    with pytest.raises(onepass_skyrl.SkyRLSettingError, match="trainer.strategy='megatron' is not supported"):
        onepass_skyrl.parse_config(["trainer.override_entrypoint=onepass.rl.skyrl", "trainer.strategy=megatron"])


def test_a_skyrl_whose_forward_takes_new_arguments_is_one_line():
    def forward(self, sequences, num_actions, attention_mask=None, temperature=1.0, return_output=False,
                compute_entropy=False, entropy_requires_grad=True, pixel_values=None, image_grid_thw=None,
                mm_token_type_ids=None, new_flag=False):
        pass

    onepass_skyrl.check_forward_signature(HFModelWrapper.forward)
    with pytest.raises(CouplingError, match=r"HFModelWrapper\.forward changed its arguments \(new: new_flag"):
        onepass_skyrl.check_forward_signature(forward)
