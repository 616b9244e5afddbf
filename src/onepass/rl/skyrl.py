"""SkyRL's policy and reference models scoring each micro-batch from onepass's prefix trees: one switch.

Why this module exists: SkyRL's step-wise trajectories (``generator.step_wise_trajectories=true``)
re-render every turn with the model's chat template, so earlier reasoning is dropped and each turn is
its own sample (``prompt_ids``, ``response_ids`` with the tool output masked, ``rollout_logprobs``).
SkyRL pads the samples into one [B, S] batch and scores every row as its own sequence;
``merge_stepwise_output`` joins two turns only when one's prompt + response is a prefix of the next
prompt, which never holds once the template drops the reasoning. Here the model wrapper SkyRL's FSDP
workers call (``HFModelWrapper.forward``: [B, num_actions] log-probs, and [B, S] entropies) lays the
micro-batch into prefix trees instead (:func:`onepass.rl.padded.window_token_logprobs`): a group's
shared prompt, and each trajectory's history shared by its turns, run once. The log-probs are SkyRL's
own to rounding (``tests/rl/test_skyrl.py``: float64, <= 1e-9, against SkyRL's batch converter and its
own wrapper), so every registered policy loss, the KL to the reference and the entropy term train on
them unchanged.

The switch, on SkyRL's own command line (``python -m onepass.rl.skyrl ...`` is the same)::

    python -m skyrl.train.entrypoints.main_base trainer.override_entrypoint=onepass.rl.skyrl \\
        generator.step_wise_trajectories=true trainer.onepass.max_tokens=16384 ...

``trainer.onepass.max_tokens``: the longest row one forward runs (a micro-batch's trees are split and
packed under it; unset: one row per micro-batch). The micro-batch is what shares a tree, so a
``trainer.micro_train_batch_size_per_gpu`` that holds a whole group (n_samples_per_prompt x turns)
shares the most. FSDP only (``trainer.strategy=fsdp``); the critic, the generator and everything else
are SkyRL's.

skyrl is imported by :func:`skyrl_classes`, which builds the SkyRL-side classes once per process (as
:func:`onepass.rl.trl_grpo.onepass_grpo_trainer` builds TRL's), so this module imports without skyrl.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from onepass.attention.backends import supported_backend
from onepass.errors import ConfigError, run_main
from onepass.model.couplings import CouplingError
from onepass.model.private_names import private
from onepass.rl.padded import window_token_logprobs

WRAPPER_GLOBAL = "skyrl.backends.skyrl_train.workers.fsdp.fsdp_worker.HFModelWrapper"
# the arguments of HFModelWrapper.forward (SkyRL 0.3.0) this wrapper handles; a new one is a CouplingError
FORWARD_ARGS = ("self", "sequences", "num_actions", "attention_mask", "temperature", "return_output",
                "compute_entropy", "entropy_requires_grad", "pixel_values", "image_grid_thw", "mm_token_type_ids")


class SkyRLSettingError(ConfigError):
    """A SkyRL setting the onepass workers cannot serve (the message names it and what to do)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class OnePassConfig:
    """``trainer.onepass.*`` on SkyRL's command line: the longest row one forward runs (None: one row per
    micro-batch)."""

    max_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.max_tokens is not None and (isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int)
                                            or self.max_tokens < 1):
            raise SkyRLSettingError(f"trainer.onepass.max_tokens must be a positive integer, got {self.max_tokens!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class WindowCall:
    """What one ``HFModelWrapper.forward`` call asks for, checked once: the window, the temperature, what to return."""

    num_actions: int
    temperature: float
    entropy: bool
    entropy_requires_grad: bool

    @classmethod
    def of(cls, num_actions: Any, temperature: Any, compute_entropy: bool, entropy_requires_grad: bool,
           multimodal: dict[str, Any]) -> WindowCall:
        given = sorted(k for k, v in multimodal.items() if v is not None)
        if given:
            raise SkyRLSettingError(f"onepass's SkyRL model wrapper scores text only, got {', '.join(given)}; "
                                    "drop trainer.override_entrypoint=onepass.rl.skyrl for multimodal runs")
        if isinstance(num_actions, (list, tuple)):
            if len(set(num_actions)) != 1:
                raise SkyRLSettingError(f"num_actions must be one window for the batch, got {list(num_actions)}")
            num_actions = num_actions[0]
        return cls(num_actions=int(num_actions), temperature=float(temperature), entropy=bool(compute_entropy),
                   entropy_requires_grad=bool(entropy_requires_grad))


def check_forward_signature(forward: Any) -> None:
    """One :class:`CouplingError` line if SkyRL's ``HFModelWrapper.forward`` takes arguments this wrapper does not
    know (it would silently ignore them) or lost one it relies on."""
    names = tuple(inspect.signature(forward).parameters)
    if names != FORWARD_ARGS:
        new, gone = sorted(set(names) - set(FORWARD_ARGS)), sorted(set(FORWARD_ARGS) - set(names))
        raise CouplingError(f"SkyRL's HFModelWrapper.forward changed its arguments (new: {', '.join(new) or '-'}; "
                            f"gone: {', '.join(gone) or '-'}): onepass's SkyRL wrapper supports skyrl 0.3.0's; "
                            "drop trainer.override_entrypoint=onepass.rl.skyrl or use skyrl 0.3.0")


@contextlib.contextmanager
def _wrapper_in_workers(wrapper: Any) -> Iterator[None]:
    """SkyRL's FSDP workers build ``HFModelWrapper(...)`` from their module's global name: ``wrapper`` there while
    one worker's ``init_model`` runs (a Ray actor is its own process), SkyRL's class again after."""
    module = private(WRAPPER_GLOBAL)  # the workers' module
    before = module.HFModelWrapper
    module.HFModelWrapper = wrapper
    try:
        yield
    finally:
        module.HFModelWrapper = before


@dataclass(frozen=True, kw_only=True, slots=True)
class SkyRLClasses:
    """The SkyRL-side classes (:func:`skyrl_classes`): the config with ``trainer.onepass``, the model wrapper, the
    policy and reference workers (their bases and their Ray actors), the trainer and the experiment."""

    config: type
    trainer_config: type
    model_wrapper: type
    policy_worker_base: type
    ref_worker_base: type
    policy_worker: Any  # ray.remote(num_gpus=1)(policy_worker_base), as SkyRL declares its FSDP actors
    ref_worker: Any
    trainer: type
    experiment: type


@functools.cache
def skyrl_classes() -> SkyRLClasses:
    """Every SkyRL-side class, built once per process (skyrl imported here)."""
    import ray
    from skyrl.backends.skyrl_train.workers.fsdp.fsdp_worker import FSDPPolicyWorkerBase, FSDPRefWorkerBase
    from skyrl.backends.skyrl_train.workers.model_wrapper import HFModelWrapper
    from skyrl.train.config import TrainerConfig, make_config
    from skyrl.train.entrypoints.main_base import BasePPOExp
    from skyrl.train.trainer import RayPPOTrainer

    check_forward_signature(HFModelWrapper.forward)

    # SkyRL builds nested configs from their fields' classes: real classes here, not postponed annotations
    OnePassTrainerConfig = dataclasses.make_dataclass(
        "OnePassTrainerConfig", [("onepass", OnePassConfig, field(default_factory=OnePassConfig))],
        bases=(TrainerConfig,))
    OnePassSkyRLConfig = make_config(trainer_cls=OnePassTrainerConfig)

    class OnePassModelWrapper(HFModelWrapper):
        """SkyRL's model wrapper, its forward's log-probs and entropies from prefix trees (the module docstring)."""

        def __init__(self, *args: Any, onepass_max_tokens: int | None = None, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            if self.is_vlm:
                raise SkyRLSettingError("onepass's SkyRL model wrapper scores text only and this model has a vision "
                                        "config; set trainer.policy.language_model_only=true, or drop the switch")
            if self.sequence_parallel_size > 1:
                raise SkyRLSettingError("onepass's SkyRL workers run no sequence parallelism (SkyRL's Ulysses patch "
                                        "replaces the attention the tree mask needs): set "
                                        "trainer.policy.sequence_parallel_size=1 and trainer.ref.sequence_parallel_size=1")
            self.onepass_max_tokens = onepass_max_tokens
            self._onepass_backend_on: str | None = None

        def _prepare_model(self) -> None:
            """Once the parameters sit where they run (after SkyRL's FSDPStrategy placed them): the attention
            backend that serves a tree mask there (flex_attention on CUDA, onepass_cpu on CPU); and, under FSDP2
            (``fully_shard`` per decoder layer, then the model), the model's own parameters (the LM head's) kept
            gathered after its forward until backward, since onepass applies the head in chunks after the
            forward returns (torch 2.13 reshards the root after forward too: the head would be a DTensor)."""
            parameter = next(self.model.parameters())
            device = parameter.device.type
            if self._onepass_backend_on != device:
                self.model.set_attn_implementation(supported_backend(self.model, device, parameter.dtype))
                if hasattr(self.model, "set_reshard_after_forward"):  # an FSDP2 module (FSDPModule)
                    self.model.set_reshard_after_forward(False, recurse=False)
                self._onepass_backend_on = device

        def forward(self, sequences: Any, num_actions: Any, attention_mask: Any = None, temperature: float = 1.0,
                    return_output: bool = False, compute_entropy: bool = False, entropy_requires_grad: bool = True,
                    pixel_values: Any = None, image_grid_thw: Any = None, mm_token_type_ids: Any = None) -> Any:
            call = WindowCall.of(num_actions, temperature, compute_entropy, entropy_requires_grad,
                                 {"pixel_values": pixel_values, "image_grid_thw": image_grid_thw,
                                  "mm_token_type_ids": mm_token_type_ids})
            if attention_mask is None:
                attention_mask = torch.ones_like(sequences)
            self._prepare_model()
            logprobs_BW, entropy_BW = window_token_logprobs(
                self.model, sequences, attention_mask, call.num_actions, entropy=call.entropy,
                max_tokens=self.onepass_max_tokens, temperature=call.temperature)
            if not return_output:
                return logprobs_BW
            output: dict[str, Any] = {}
            if entropy_BW is not None:  # SkyRL reads output["entropy"][:, -num_actions - 1:-1]
                B, S = sequences.shape
                entropy_BS = entropy_BW.new_zeros(B, S)
                entropy_BS[:, S - call.num_actions - 1:S - 1] = (
                    entropy_BW if call.entropy_requires_grad else entropy_BW.detach())
                output["entropy"] = entropy_BS
            return logprobs_BW, output

    def built_wrapper(cfg: Any) -> Any:
        return functools.partial(OnePassModelWrapper, onepass_max_tokens=_onepass_settings(cfg).max_tokens)

    class OnePassPolicyWorkerBase(FSDPPolicyWorkerBase):
        """SkyRL's FSDP policy worker whose model is :class:`OnePassModelWrapper`."""

        def init_model(self, *args: Any, **kwargs: Any) -> Any:
            with _wrapper_in_workers(built_wrapper(self.cfg)):
                return super().init_model(*args, **kwargs)

    class OnePassRefWorkerBase(FSDPRefWorkerBase):
        """SkyRL's FSDP reference worker whose model is :class:`OnePassModelWrapper`."""

        def init_model(self, *args: Any, **kwargs: Any) -> Any:
            with _wrapper_in_workers(built_wrapper(self.cfg)):
                return super().init_model(*args, **kwargs)

    class OnePassRayPPOTrainer(RayPPOTrainer):
        """SkyRL's trainer, building the onepass policy and reference workers (the critic stays SkyRL's)."""

        def build_models(self, PolicyWorker: Any, CriticWorker: Any, RefWorker: Any) -> Any:  # noqa: N803
            return super().build_models(PolicyActor, CriticWorker, RefActor)

    class OnePassPPOExp(BasePPOExp):
        """SkyRL's experiment with :class:`OnePassRayPPOTrainer`."""

        def get_trainer(self, cfg: Any, tracker: Any, tokenizer: Any, train_dataset: Any, eval_dataset: Any,
                        inference_engine_client: Any, generator: Any, colocate_pg: Any) -> Any:
            return OnePassRayPPOTrainer(cfg=cfg, tracker=tracker, tokenizer=tokenizer, train_dataset=train_dataset,
                                        eval_dataset=eval_dataset, inference_engine_client=inference_engine_client,
                                        generator=generator, colocate_pg=colocate_pg)

    PolicyActor = ray.remote(num_gpus=1)(OnePassPolicyWorkerBase)
    RefActor = ray.remote(num_gpus=1)(OnePassRefWorkerBase)
    return SkyRLClasses(config=OnePassSkyRLConfig, trainer_config=OnePassTrainerConfig,
                        model_wrapper=OnePassModelWrapper, policy_worker_base=OnePassPolicyWorkerBase,
                        ref_worker_base=OnePassRefWorkerBase, policy_worker=PolicyActor, ref_worker=RefActor,
                        trainer=OnePassRayPPOTrainer, experiment=OnePassPPOExp)


def _onepass_settings(cfg: Any) -> Any:
    """``trainer.onepass`` of a worker's TrainerConfig (defaults where a plain SkyRL config reached the worker)."""
    return getattr(cfg, "onepass", None) or OnePassConfig()


def parse_config(argv: list[str]) -> Any:
    """SkyRL's command line (``key.path=value`` overrides) as :class:`OnePassSkyRLConfig`, checked as SkyRL checks
    it; ``trainer.override_entrypoint`` (how SkyRL's own entry point got here) is left out."""
    from skyrl.train.utils import validate_cfg

    overrides = [a for a in argv if not a.startswith("trainer.override_entrypoint=")]
    cfg = skyrl_classes().config.from_cli_overrides(overrides)
    if cfg.trainer.strategy != "fsdp":
        raise SkyRLSettingError(f"onepass's SkyRL workers are FSDP workers; trainer.strategy={cfg.trainer.strategy!r} "
                                "is not supported: use trainer.strategy=fsdp, or drop the switch")
    validate_cfg(cfg)
    return cfg


def _run(cfg: Any) -> None:
    """One training run in a Ray task, as SkyRL's ``skyrl_entrypoint`` runs its own."""
    skyrl_classes().experiment(cfg).run()


def main(argv: list[str] | None = None) -> int:
    """SkyRL's training entry point with the onepass workers (``trainer.override_entrypoint=onepass.rl.skyrl``)."""
    import ray
    from skyrl.train.utils.utils import initialize_ray

    def start(args: list[str]) -> int:
        cfg = parse_config(args)
        initialize_ray(cfg)
        ray.get(ray.remote(num_cpus=1)(_run).remote(cfg))
        return 0

    return run_main(start, list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    raise SystemExit(main())
