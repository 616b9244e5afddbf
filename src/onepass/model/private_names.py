"""Every private name of another library onepass uses, found in the installed code before it is used, or one line.

Why this module exists: a private name (``torch.ops.aten._scaled_dot_product_flash_attention_for_cpu``,
``AutoModelForCausalLM._model_mapping``, TRL's ``GRPOTrainer._get_per_token_logps_and_entropies`` that
onepass overrides...) can be renamed or dropped by any release. Each one is a row of :data:`PRIVATE_NAMES`:
what it serves (its :data:`onepass.model.couplings.COUPLINGS` entry), how it is found in the installed code (an
override must still be called by the class it overrides, else it would silently stop applying), and the
one :class:`~onepass.model.couplings.CouplingError` line a release without it gives, naming the release, what
onepass cannot do without it and what to do instead (:func:`private`). Nothing is looked up at import.
``tests/model/test_couplings.py`` checks every row against the installed releases, and that each miss is one line;
``make test-latest`` lists the misses of the newest releases (:func:`missing_private_names`).

    >>> private("transformers.AutoModelForCausalLM._model_mapping") is not None
    True
    >>> find_private("torch.ops.aten._no_such_op") is None  # not a row: a KeyError, a typo in onepass
    Traceback (most recent call last):
    ...
    KeyError: 'torch.ops.aten._no_such_op'

Add a row: the label (the name as it is written), the distribution, the COUPLINGS entry it serves, what
needs it and what to do without it, and a ``find`` reading it off the installed code; then call
:func:`private` (or :func:`find_private` where there is a fallback) where onepass uses it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from onepass.model.couplings import CouplingError, source_of


@dataclass(frozen=True, kw_only=True, slots=True)
class PrivateName:
    """A private name of another library that onepass reads, calls or overrides, and how it is found.

    ``find`` returns the object (raising ``AttributeError`` / ``ImportError`` / ``LookupError`` where the
    release lacks it); :func:`private` turns a miss into one :class:`CouplingError` line naming the release,
    what onepass cannot do without it (``needs``) and what to do (``instead``).
    """

    label: str  # what the line names: "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu"
    package: str  # the distribution whose version the line names
    coupling: str  # the COUPLINGS entry it serves
    needs: str
    instead: str
    find: Callable[[], Any]


def _attr(path: str) -> Any:
    """The object at dotted ``path``: the longest importable module, then attributes."""
    import importlib

    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            if cut == 1:
                raise
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(path)  # pragma: no cover - the loop returns or raises


def _called_override(owner: str, name: str, *, returns: int | None = None) -> Callable[[], Any]:
    """A ``find`` for a private method onepass overrides: ``owner`` defines ``name`` and calls it on itself
    (else the override would silently stop applying); ``returns``: every call site unpacks that many values."""
    def find() -> Any:
        cls = _attr(owner)
        method = getattr(cls, name)
        source = "".join(source_of(c) for c in cls.__mro__ if c.__module__.split(".")[0] == cls.__module__.split(".")[0])
        if f"self.{name}(" not in source:
            raise LookupError(f"{owner} no longer calls self.{name}()")
        if returns is not None:
            sites = re.findall(rf"^[ \t]*([\w ,]+?)[ \t]*=[ \t]*self\.{name}\(", source, re.M)
            arities = {len(t.split(",")) for t in sites}
            if arities and arities != {returns}:  # no one-line unpacking found: nothing to compare
                raise LookupError(f"{owner}.{name} now returns {sorted(arities)} values, not {returns}")
        return method
    return find


def _launch_arguments() -> Any:
    from accelerate.commands.launch import launch_command_parser

    actions = launch_command_parser()._actions  # argparse's list of the parser's arguments
    if not any(a.dest == "num_processes" for a in actions):
        raise LookupError("accelerate launch's parser has no num_processes argument")
    return actions


def _module_stores() -> Any:
    module = _attr("torch.nn.Module")()
    return (module._parameters, module._buffers)


def _mapping() -> Any:
    from transformers import AutoModelForCausalLM

    mapping = AutoModelForCausalLM._model_mapping
    if not hasattr(mapping, "__getitem__"):
        raise LookupError("AutoModelForCausalLM._model_mapping is not a mapping")
    return mapping


def _insource_of(owner: str, name: str) -> Callable[[], Any]:
    """A ``find`` for an instance attribute: ``owner``'s source sets or reads ``name``."""
    def find() -> Any:
        cls = _attr(owner)
        if f".{name}" not in source_of(cls):
            raise LookupError(f"{owner} no longer uses {name}")
        return cls
    return find


def _fused_step_skip() -> Any:
    """torch's fused optimizers still take GradScaler's ``found_inf`` flag (and skip their update when it is set)."""
    import torch

    for cls in (torch.optim.Adam, torch.optim.SGD):
        if '"found_inf"' not in source_of(cls) or not hasattr(cls, "step"):
            raise LookupError(f"{cls.__name__}.step no longer reads found_inf")
    return torch.optim.Adam


def _dynamo_config() -> Any:
    config = _attr("torch._dynamo.config")
    for name in ("automatic_dynamic_shapes", "recompile_limit", "patch"):
        getattr(config, name)
    return config


def _dynamo_counters() -> Any:
    counters = _attr("torch._dynamo.utils.counters")
    if not hasattr(counters, "__getitem__"):
        raise LookupError("torch._dynamo.utils.counters is not a mapping")
    return counters


def _skyrl_fsdp_workers() -> Any:
    """SkyRL's FSDP worker module, whose policy and reference workers build their model as
    ``HFModelWrapper(...)`` by that module's global name (onepass's SkyRL workers put theirs there)."""
    import importlib

    module = importlib.import_module("skyrl.backends.skyrl_train.workers.fsdp.fsdp_worker")
    for worker in (module.FSDPPolicyWorkerBase, module.FSDPRefWorkerBase):
        if "HFModelWrapper(" not in source_of(worker.init_model):
            raise LookupError(f"{worker.__name__}.init_model no longer builds HFModelWrapper(...)")
    module.HFModelWrapper  # noqa: B018 - the global it reads
    return module


_TILES = "the onepass_cpu attention backend (tree attention on CPU runs on this fused kernel)"
_SDPA = "use --attn sdpa (exact, computes every pair)"
PRIVATE_NAMES: dict[str, PrivateName] = {p.label: p for p in (
    PrivateName(label="torch.ops.aten._scaled_dot_product_flash_attention_for_cpu", package="torch",
                coupling="torch CPU flash kernels", needs=_TILES, instead=_SDPA,
                find=lambda: _attr("torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default")),
    PrivateName(label="torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward", package="torch",
                coupling="torch CPU flash kernels", needs=_TILES, instead=_SDPA,
                find=lambda: _attr("torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default")),
    PrivateName(label="torch.utils._python_dispatch.TorchDispatchMode", package="torch",
                coupling="float64 recurrent kernels",
                needs="the float64 probe that finds float32 ops inside recurrent mixers",
                instead="verify hybrid models on a torch release that has it",
                find=lambda: _attr("torch.utils._python_dispatch.TorchDispatchMode")),
    PrivateName(label="torch.optim fused step skip (found_inf)", package="torch",
                coupling="torch fused optimizer step skip",
                needs="skipping a non-finite step's update on the device (a training step that never waits)",
                instead="nothing: the guard then reads each step's loss and gradient norm before its update",
                find=_fused_step_skip),
    PrivateName(label="torch._dynamo.config.automatic_dynamic_shapes", package="torch",
                coupling="torch dynamo static shapes",
                needs="compiling flex_attention once per length bucket, never for dynamic lengths",
                instead="nothing: flex then compiles as torch decides (a second length: one more, dynamic, compile)",
                find=_dynamo_config),
    PrivateName(label="torch._dynamo.utils.counters", package="torch", coupling="torch dynamo static shapes",
                needs="counting flex_attention's compiles per length bucket (metrics.json)",
                instead="nothing: the compiles are then not counted", find=_dynamo_counters),
    PrivateName(label="torch.nn.Module._parameters/_buffers", package="torch", coupling="parameters kept in float32",
                needs="casting parameters kept in float32 up to float64 for verification",
                instead="verify in float64 on a torch release that has them",
                find=lambda: _module_stores()),
    PrivateName(label="transformers.AutoModelForCausalLM._model_mapping", package="transformers",
                coupling="causal-LM class of a config",
                needs="finding a config's causal-LM class (the attention backends it supports, the guard's twin)",
                instead="use a transformers release onepass supports (make test-min / test-latest)", find=_mapping),
    PrivateName(label="transformers.PreTrainedModel._from_config", package="transformers",
                coupling="guard twin construction", needs="building the guard's float64 twin with its own class",
                instead="the twin is built by the public AutoModelForCausalLM.from_config instead",
                find=lambda: _attr("transformers.PreTrainedModel._from_config")),
    PrivateName(label="transformers.PreTrainedConfig._attn_implementation", package="transformers",
                coupling="guard twin construction", needs="choosing a tiny model's or twin's attention backend",
                instead="use a transformers release onepass supports (make test-min / test-latest)",
                find=lambda: _attr("transformers.PreTrainedConfig._attn_implementation")),
    PrivateName(label="transformers.PreTrainedConfig._experts_implementation", package="transformers",
                coupling="guard twin construction",
                needs="running a float64 twin's MoE experts eagerly (grouped_mm has no float64 kernel)",
                instead="a release without the switch runs experts eagerly: nothing is set",
                find=lambda: _attr("transformers.PreTrainedConfig._experts_implementation")),
    PrivateName(label="transformers.PreTrainedConfig._attn_implementation_internal", package="transformers",
                coupling="guard twin construction", needs="copying a config's chosen backends onto its twin",
                instead="the twin keeps its own defaults",
                find=_insource_of("transformers.PreTrainedConfig", "_attn_implementation_internal")),
    PrivateName(label="transformers.utils.chat_template_utils._compile_jinja_template", package="transformers",
                coupling="chat template compiler",
                needs="compiling a chat template as transformers does before any data is read",
                instead="use a transformers release onepass supports (make test-min / test-latest)",
                find=lambda: _attr("transformers.utils.chat_template_utils._compile_jinja_template")),
    PrivateName(label="transformers.Trainer._set_signature_columns_if_needed", package="transformers",
                coupling="Trainer overrides", needs="OnePassTrainer keeping the one-pass row columns",
                instead="use a transformers release onepass supports (make test-min / test-latest)",
                find=_called_override("transformers.Trainer", "_set_signature_columns_if_needed")),
    PrivateName(label="transformers.Trainer._get_num_items_in_batch", package="transformers",
                coupling="Trainer overrides", needs="OnePassTrainer counting a step's trained tokens",
                instead="use a transformers release onepass supports (make test-min / test-latest)",
                find=_called_override("transformers.Trainer", "_get_num_items_in_batch")),
    PrivateName(label="transformers.Trainer._prepare_inputs", package="transformers",
                coupling="Trainer overrides", needs="OnePassTrainer moving a batch to the device as Trainer does",
                instead="use a transformers release onepass supports (make test-min / test-latest)",
                find=lambda: _attr("transformers.Trainer._prepare_inputs")),
    PrivateName(label="trl.GRPOTrainer._get_per_token_logps_and_entropies", package="trl",
                coupling="TRL GRPO log-probs", needs="OnePassGRPOTrainer scoring a group's samples in one tree",
                instead="use TRL's own GRPOTrainer, or a trl release onepass supports",
                find=_called_override("trl.GRPOTrainer", "_get_per_token_logps_and_entropies", returns=3)),
    PrivateName(label="skyrl.backends.skyrl_train.workers.fsdp.fsdp_worker.HFModelWrapper", package="skyrl",
                coupling="SkyRL model wrapper", needs="onepass's SkyRL policy and reference workers building "
                "their model as onepass's wrapper", instead="drop trainer.override_entrypoint=onepass.rl.skyrl, or "
                "use skyrl 0.3.0", find=_skyrl_fsdp_workers),
    PrivateName(label="accelerate launch_command_parser()._actions", package="accelerate",
                coupling="accelerate config check", needs="checking an accelerate config's keys against accelerate "
                "launch's arguments", instead="use an accelerate release onepass supports", find=_launch_arguments),
    PrivateName(label="accelerate.state.AcceleratorState._shared_state", package="accelerate",
                coupling="accelerate FSDP on CPU ranks", needs="running FSDP on CPU ranks",
                instead="train without FSDP on CPU", find=lambda: _attr("accelerate.state.AcceleratorState._shared_state")),
    PrivateName(label="accelerate.state.PartialState._shared_state", package="accelerate",
                coupling="accelerate FSDP on CPU ranks", needs="running FSDP on CPU ranks",
                instead="train without FSDP on CPU", find=lambda: _attr("accelerate.state.PartialState._shared_state")),
    PrivateName(label="accelerate.state.AcceleratorState._reset_state", package="accelerate",
                coupling="accelerate state reset", needs="a second train() in one process with other settings",
                instead="run each training in its own process",
                find=lambda: _attr("accelerate.state.AcceleratorState._reset_state")),
)}
"""Every private name of another library onepass uses, by label (add a row: the name, what it serves, a
``find`` that reads it off the installed code, and a call of :func:`private` where onepass uses it)."""


def find_private(label: str) -> Any | None:
    """The object :data:`PRIVATE_NAMES` ``label`` names in the installed code, or None where the release lacks it."""
    entry = PRIVATE_NAMES[label]  # an unknown label is a KeyError: a typo in onepass, not a release's change
    try:
        return entry.find()
    except (AttributeError, ImportError, LookupError, RuntimeError):  # RuntimeError: torch.ops' missing op
        return None


def private(label: str) -> Any:
    """:func:`find_private`, or one :class:`CouplingError` line: which release lacks what, what onepass cannot
    do without it, and what to do instead."""
    found = find_private(label)
    if found is None:
        p = PRIVATE_NAMES[label]
        raise CouplingError(f"{p.package} {_package_version(p.package)} has no {p.label} (a private name, renamed or "
                            f"removed in this release), which {p.needs} relies on: {p.instead}")
    return found


def missing_private_names() -> list[str]:
    """The labels the installed releases lack (``make test-latest`` prints them); a package that is not installed
    at all (skyrl, an optional integration) lacks nothing."""
    return [label for label, p in PRIVATE_NAMES.items() if installed(p.package) and find_private(label) is None]


def installed(package: str) -> bool:
    """Whether the distribution ``package`` is installed here."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        version(package)
    except PackageNotFoundError:
        return False
    return True


def _package_version(package: str) -> str:
    try:
        from importlib.metadata import version

        return version(package)
    except Exception:  # noqa: BLE001 - not installed as a distribution
        return "(version unknown)"


__all__ = ["PRIVATE_NAMES", "PrivateName", "find_private", "installed", "missing_private_names", "private"]
