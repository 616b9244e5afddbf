"""Every place onepass relies on another library's internals, detected from the code in front of us.

Why this module exists: transformers ships a release every few weeks and
renames what it does not promise to keep (5.24 renamed every recurrent mixer's
cache argument from ``past_key_values`` / ``cache_params`` to ``cache``; a
table of names true for 5.23 silently dropped the chain states and every
hybrid ran left to right over the whole row). So onepass does not *name* what
it couples to: it reads it off the installed code (a forward's signature, the
cache methods its source calls, the float32 casts a kernel makes) and, where a
coupling no longer holds, stops at model load with one line naming the class,
what changed and the installed version (:class:`CouplingError`). The guard
(:mod:`onepass.guard`) stays the last line of defence: it compares one-pass
with N-pass on a tiny twin whatever this module concluded.

:data:`COUPLINGS` lists each coupling, what it relies on and where it lives;
``tests/model/test_couplings.py`` checks each against the installed releases (and
``make test-latest`` against the newest ones). Every private name of torch,
transformers, trl and accelerate that onepass reads, calls or overrides is a row of
:data:`onepass.model.private_names.PRIVATE_NAMES`, found in the installed code before use. Besides
the recurrent mixers (below): whether a causal LM takes one ``logits_to_keep`` mask per row
(:func:`logits_to_keep_for`: before 5.23 the rows' positions are joined instead), and which name a release gives
activation checkpointing (:func:`checkpointing_field`). Add a coupling: a row of
:data:`COUPLINGS` (what, detected how, fails how, where, checked on which releases), the
detection here (or a row of ``PRIVATE_NAMES``), its call at model load, and a test that plays
the release that breaks it.

Add a coupling (a new reliance on a library's internals): one :class:`Coupling` row of
:data:`COUPLINGS` (what it relies on in the library's words, how it is detected in the installed code,
how it fails, where it lives, the releases checked); the detection reads the installed code rather than
a table of names, a coupling that no longer holds stops at model load in one :class:`CouplingError`
line, and ``tests/model/test_couplings.py`` checks it against the installed releases (``make test-latest``
against the newest).

Example: a recurrent mixer is a module whose forward reads conv or recurrent
states from one of its arguments; that argument is its cache argument
(``past_key_values`` for LFM2's short convolution up to transformers 5.23,
``cache`` since 5.24), and it calls only what onepass's chain state provides.

>>> from transformers.models.lfm2.modeling_lfm2 import Lfm2ShortConv, Lfm2MLP
>>> coupling = recurrent_mixer(Lfm2ShortConv)
>>> coupling.cache_arg in ("cache", "past_key_values"), sorted(coupling.cache_methods)
(True, ['get_conv_state', 'is_recording_past', 'update_conv_state'])
>>> recurrent_mixer(Lfm2MLP) is None
True
"""

from __future__ import annotations

import functools
import inspect
import re
import sys
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from onepass.errors import OnePassError


class CouplingError(OnePassError):
    """An internal of transformers / peft / torch that onepass relies on no longer holds."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Coupling:
    """One place onepass relies on something a library does not promise to keep."""

    name: str
    relies_on: str  # what exactly, in the library's words
    detected_by: str  # how onepass finds it in the installed code (never a table of names)
    fails_as: str  # what a user sees when it no longer holds
    where: str  # the onepass module that holds it
    checked: str  # releases it was checked on


COUPLINGS: tuple[Coupling, ...] = (
    Coupling(name="recurrent mixer cache argument",
             relies_on="a recurrent mixer's forward takes a cache object as a keyword argument",
             detected_by="the forward parameter whose uses in the class source read conv / recurrent states",
             fails_as="CouplingError at model load (mixer found, no cache argument)",
             where="onepass.model.couplings.recurrent_mixer, onepass.mixers.tree",
             checked="transformers 5.23 (cache_params / past_key_values), 5.24 (cache)"),
    Coupling(name="recurrent mixer cache API",
             relies_on="the mixer calls only get/update_conv_state, get/update_recurrent_state, is_recording_past",
             detected_by="every `<cache arg>.<method>(` call in the class source, against ChainState's methods",
             fails_as="CouplingError at model load naming the method onepass's chain state lacks",
             where="onepass.model.couplings.check_cache_api, onepass.mixers.tree.ChainState",
             checked="transformers 5.23, 5.24"),
    Coupling(name="float64 recurrent kernels",
             relies_on="the mixer's scan kernels are module-level functions that cast to float32 inside",
             detected_by="functions the mixer's forward calls by name in its module whose source casts to float32",
             fails_as="CouplingError when a float64 model still computes float32 inside a mixer (probed)",
             where="onepass.model.float64",
             checked="transformers 5.23, 5.24"),
    Coupling(name="float64 norms and MoE routers",
             relies_on="RMSNorm `weight * x` / `(1 + weight) * x`; TopkRouter's grouped top-k in float32",
             detected_by="each candidate checked against the original on a random input before it is patched",
             fails_as="the module is left alone and reported (verify: the norms left are listed)",
             where="onepass.model.precision",
             checked="transformers 5.23, 5.24"),
    Coupling(name="parameters kept in float32",
             relies_on="`_keep_in_fp32_modules_strict` keeps e.g. MoE router weights float32 in a float64 model",
             detected_by="any floating parameter or buffer below the model's dtype",
             fails_as="cast up for float64 verification (exact: float32 values are float64 values)",
             where="onepass.model.couplings.upcast_kept_parameters",
             checked="transformers 5.24 (DeepSeek-V3, GLM-4-MoE routers)"),
    Coupling(name="attention backend registration",
             relies_on="public AttentionInterface / AttentionMaskInterface .register",
             detected_by="public API", fails_as="ImportError naming transformers",
             where="onepass.attention.cpu.register", checked="transformers 5.0-5.24"),
    Coupling(name="chat template compiler",
             relies_on="transformers.utils.chat_template_utils._compile_jinja_template (private)",
             detected_by="attribute lookup (PRIVATE_NAMES)", fails_as="CouplingError at template load",
             where="onepass.render.tokenizer", checked="transformers 5.17-5.24"),
    Coupling(name="torch CPU flash kernels",
             relies_on="torch.ops.aten._scaled_dot_product_flash_attention_for_cpu and its _backward (private ops)",
             detected_by="op lookup when onepass_cpu is registered, never at import (PRIVATE_NAMES)",
             fails_as="CouplingError when onepass_cpu is chosen, saying to use sdpa",
             where="onepass.attention.cpu_tiles, onepass.attention.cpu.register", checked="torch 2.11-2.15"),
    Coupling(name="torch fused optimizer step skip",
             relies_on="torch.optim's fused Adam/AdamW/SGD read optimizer.found_inf (the flag torch's GradScaler "
                       "hands them) and then leave weights, moments and step counts unchanged",
             detected_by="the installed optimizers' step source reads found_inf (PRIVATE_NAMES)",
             fails_as="none: the non-finite guard reads the step's numbers before the update (one wait per step)",
             where="onepass.train.run.step.Stepper", checked="torch 2.13"),
    Coupling(name="torch dynamo static shapes",
             relies_on="torch._dynamo.config (automatic_dynamic_shapes, recompile_limit, patch) and "
                       "torch._dynamo.utils.counters['frames']['ok'] (private)",
             detected_by="attribute lookup when a flex_attention run starts (PRIVATE_NAMES)",
             fails_as="none: without them flex compiles as torch decides and no compile is counted",
             where="onepass.train.run.compiles", checked="torch 2.13"),
    Coupling(name="causal-LM class of a config",
             relies_on="AutoModelForCausalLM._model_mapping[type(config)] (private)",
             detected_by="attribute lookup (PRIVATE_NAMES)", fails_as="CouplingError where a class is looked up",
             where="onepass.attention.backends, onepass.guard.check", checked="transformers 5.17-5.24"),
    Coupling(name="guard twin construction",
             relies_on="PreTrainedModel._from_config, PreTrainedConfig._attn_implementation / "
                       "_experts_implementation (private)",
             detected_by="attribute lookup (PRIVATE_NAMES)",
             fails_as="_from_config missing: the public AutoModelForCausalLM.from_config; _experts_implementation "
                      "missing: nothing set (eager experts); _attn_implementation missing: CouplingError",
             where="onepass.guard.check, onepass.guard.twin, onepass.model.tiny, onepass.parallel.model",
             checked="transformers 5.17-5.24"),
    Coupling(name="Trainer overrides",
             relies_on="Trainer._set_signature_columns_if_needed / _get_num_items_in_batch (overridden), "
                       "_prepare_inputs (called): private methods",
             detected_by="each defined on Trainer and called by Trainer's own source (an override of a method "
                         "no longer called would silently stop applying)",
             fails_as="CouplingError when OnePassTrainer is built", where="onepass.train.trainer.trainer",
             checked="transformers 5.17-5.24"),
    Coupling(name="TRL GRPO log-probs",
             relies_on="GRPOTrainer._get_per_token_logps_and_entropies (private, overridden)",
             detected_by="defined on GRPOTrainer, called by its source, every call site unpacking 3 values",
             fails_as="CouplingError when the OnePassGRPOTrainer class is made",
             where="onepass.rl.trl_grpo", checked="trl 1.16"),
    Coupling(name="logits_to_keep row mask",
             relies_on="the causal LM's forward takes logits_to_keep as a [B, L] boolean mask (slice_logits_to_keep, "
                       "5.23 on); 5.2-5.22 slice hidden_states[:, logits_to_keep, :] (one set of positions for all rows)",
             detected_by="the function the forward hands logits_to_keep to, probed on a 2 x 3 mask",
             fails_as="nothing: older releases get the union of the rows' kept positions and each row's own is "
                      "picked after (onepass.model.couplings.logits_to_keep_for)",
             where="onepass.model.couplings.logits_to_keep_for, onepass.loss",
             checked="transformers 5.2.0, 5.6.2, 5.8.0, 5.10.4, 5.15.0, 5.17.0 (union), 5.23, 5.24 (mask)"),
    Coupling(name="activation checkpointing name",
             relies_on="TrainingArguments.activation_checkpointing (5.24 on; gradient_checkpointing, its deprecated "
                       "alias, warns a FutureWarning and goes in v6); PreTrainedModel.activation_checkpointing_enable",
             detected_by="the TrainingArguments dataclass fields / the model's methods",
             fails_as="the old name on a release without the new one, never a FutureWarning from onepass's own calls",
             where="onepass.model.couplings.checkpointing_field, onepass.bench.trl, onepass.train.trainer.trainer, "
                   "onepass.train.run.model", checked="transformers 5.17-5.24"),
    Coupling(name="accelerate config check",
             relies_on="accelerate.commands.launch.launch_command_parser()._actions (argparse's private list)",
             detected_by="the parser's actions, one of them num_processes",
             fails_as="CouplingError when an accelerate config file is checked",
             where="onepass.train.distributed", checked="accelerate 1.4-1.15"),
    Coupling(name="accelerate FSDP on CPU ranks",
             relies_on="AcceleratorState / PartialState._shared_state['distributed_type', 'fsdp_plugin'] (private)",
             detected_by="the launcher's FSDP request read from accelerate's environment variables",
             fails_as="a launch that asked for FSDP and would run another mode stops in one line; so does an "
                      "accelerate older than 1.14 (its FSDP2 path fails in a step on CPU ranks: mixed Tensor and "
                      "DTensor, measured on 1.4-1.13)",
             where="onepass.train.distributed", checked="accelerate 1.14-1.15"),
    Coupling(name="sequence-parallel attention and mixers",
             relies_on="attention layers call ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, "
                       "their eager_attention_forward) with [B, H, L, D] and return [B, L, H, D]; decoder layers "
                       "hand the model call's **kwargs to their attention and recurrent mixers; gpt-oss's eager "
                       "reads module.sinks",
             detected_by="a tiny float64 twin split over simulated ranks against one process before training "
                         "(onepass.guard.sequence_parallel), whatever the architecture",
             fails_as="SequenceParallelError at the start of training naming the first module whose output differs",
             where="onepass.parallel.attention, onepass.guard.sequence_parallel, onepass.mixers.tree",
             checked="transformers 5.24"),
    Coupling(name="accelerate parallelism_config for sequence parallelism",
             relies_on="accelerate launch exports ACCELERATE_USE_PARALLELISM_CONFIG and PARALLELISM_CONFIG_*_SIZE; "
                       "an Accelerator built without the first builds no ParallelismConfig",
             detected_by="the variables read as the launcher writes them (accelerate.utils.launch)",
             fails_as="a sequence-parallel request that cannot run here stops in one line (tests/train/"
                      "test_sequence_parallel.py launches the shipped config)",
             where="onepass.train.sequence_parallel, onepass.train.distributed", checked="accelerate 1.15"),
    Coupling(name="SkyRL model wrapper",
             relies_on="SkyRL's FSDP policy and reference workers build HFModelWrapper(...) by their module's global "
                       "name in init_model; HFModelWrapper.forward(sequences, num_actions, attention_mask, temperature, "
                       "return_output, compute_entropy, entropy_requires_grad, pixel_values, image_grid_thw, "
                       "mm_token_type_ids) returns [B, num_actions] log-probs and output['entropy'] [B, S]",
             detected_by="the workers' init_model source (PRIVATE_NAMES); the forward's parameters, compared with "
                         "those onepass's wrapper handles",
             fails_as="CouplingError when the onepass SkyRL classes are built (python -m onepass.rl.skyrl)",
             where="onepass.rl.skyrl", checked="skyrl 0.3.0"),
    Coupling(name="accelerate state reset",
             relies_on="AcceleratorState._reset_state (private) between two train() calls in one process",
             detected_by="attribute lookup", fails_as="AttributeError", where="onepass.train.run.loop",
             checked="accelerate 1.0-1.15"),
)



# ---------------------------------------------------------------------------------------------
# peft's wrapper and what a model was loaded from: the one answer, used by every caller


def is_peft(model: Any) -> bool:
    """A peft wrapper (``PeftModel``, ``PeftMixedModel``): what ``get_peft_model`` returns. A model with
    adapters loaded by transformers' own integration (``model.load_adapter``) has a ``peft_config``
    too but is not one: it is its own base model. Decided as transformers' Trainer decides, by class;
    peft never imported means no peft model exists."""
    peft = sys.modules.get("peft")
    classes = tuple(c for c in (getattr(peft, "PeftModel", None), getattr(peft, "PeftMixedModel", None)) if c)
    return bool(classes) and isinstance(model, classes)


def is_prompt_learning(model: Any) -> bool:
    """A PEFT prompt-learning model (prompt tuning, prefix tuning, p-tuning): virtual tokens every position sees."""
    if not is_peft(model):
        return False
    config = model.peft_config.get(getattr(model, "active_adapter", "default"))
    return bool(getattr(config, "is_prompt_learning", False))


def base_model(model: Any) -> Any:
    """The model under a peft wrapper (:func:`is_peft`), else the model itself."""
    return model.get_base_model() if is_peft(model) else model


def loaded_from(model: Any) -> str:
    """The hub id or folder a model (a peft model's base model) was loaded from, as TRL finds it."""
    config = getattr(base_model(model), "config", None)
    return str(getattr(config, "_name_or_path", "") or "")


# ---------------------------------------------------------------------------------------------
# a batch of rows: one logits_to_keep mask per row


def causal_lm_class(model: Any) -> type:
    """The class of the causal LM inside ``model``'s wrappers (peft, DDP/DeepSpeed, torch.compile, the loss's
    ``ForwardView``): the first whose forward takes ``logits_to_keep``."""
    seen: set[int] = set()
    while id(model) not in seen:
        seen.add(id(model))
        forward = getattr(type(model), "forward", None)
        try:
            if forward is not None and "logits_to_keep" in inspect.signature(forward).parameters:
                return type(model)
        except (TypeError, ValueError):
            pass
        inner = base_model(model) if is_peft(model) else next(
            (getattr(model, a) for a in ("_wrapped", "module", "_orig_mod") if getattr(model, a, None) is not None),
            model)
        model = inner
    return type(model)


@functools.lru_cache(maxsize=None)
def takes_row_mask(cls: type) -> bool:
    """Whether ``cls.forward`` takes ``logits_to_keep`` as a [B, L] boolean mask (one per row, the kept positions
    flattened), as a batch of one-pass rows needs. Read off the installed code: the forward hands
    ``logits_to_keep`` to a function of its module (``slice_logits_to_keep``, 5.23 on), which is probed on a
    2 x 3 mask. transformers 5.17 indexes ``hidden_states[:, logits_to_keep, :]`` itself: one set of positions
    for every row."""
    import torch

    forward = inspect.unwrap(getattr(cls, "forward", None) or (lambda: None))
    names = set(re.findall(r"(?<![.\w])(\w+)\(", source_of(forward)))
    scope = getattr(forward, "__globals__", {})
    mask_BL = torch.tensor([[True, False, True], [False, True, False]])
    for name in sorted(n for n in names if "logits_to_keep" in n):
        fn = scope.get(name)
        try:
            if callable(fn) and tuple(fn(torch.zeros(2, 3, 1), mask_BL).shape) == (3, 1):
                return True
        except Exception:  # noqa: BLE001 - a slicer that cannot take a mask
            continue
    return False


def logits_to_keep_for(model: Any, keep_BL: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """What ``model``'s forward takes as ``logits_to_keep`` for rows whose kept positions are ``keep_BL`` [B, L]
    (host-side, numpy: nothing here reads the device), and the flat indices [T] that pick each row's own outputs,
    row-major, from the ``[B * K, .]`` it returns (None: the outputs come back as the kept positions, row-major).

    One row: its positions, 1-D (every transformers 5.x). Several rows, on a causal LM that takes one mask per row
    (:func:`takes_row_mask`, 5.23 on): the mask. On older releases, which slice ``hidden_states[:, logits_to_keep,
    :]`` (one set of positions for every row): the union of the rows' kept positions, then each row's own among
    them (exact: a position's output does not depend on which are kept; more head work on the plain head path).

    >>> keep_BL = np.array([[True, False, True, False], [False, True, True, False]])
    >>> union = np.flatnonzero(keep_BL.any(0)); union.tolist(), np.flatnonzero(keep_BL[:, union]).tolist()
    ([0, 1, 2], [0, 2, 4, 5])
    """
    keep_BL = np.asarray(keep_BL, dtype=bool)
    if keep_BL.shape[0] == 1:
        return np.flatnonzero(keep_BL[0]), None
    if takes_row_mask(causal_lm_class(model)):
        return keep_BL, None
    union = np.flatnonzero(keep_BL.any(0))
    return union, np.flatnonzero(keep_BL[:, union])


# ---------------------------------------------------------------------------------------------
# names a release renames: the one the installed code takes


def checkpointing_field() -> str:
    """The ``TrainingArguments`` field that turns activation checkpointing on, as the installed transformers
    names it: ``activation_checkpointing`` (5.24 on; ``gradient_checkpointing`` is its deprecated alias, a
    ``FutureWarning`` on every use, removed in v6), else ``gradient_checkpointing``."""
    from transformers import TrainingArguments

    fields = getattr(TrainingArguments, "__dataclass_fields__", {})
    return "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"


def checkpointing_on(args: Any) -> bool:
    """Whether training arguments ``args`` (any spelling given) turn activation checkpointing on, read without
    the deprecated name where the release has the new one."""
    value = getattr(args, checkpointing_field(), None)
    return bool(value if value is not None else getattr(args, "gradient_checkpointing", False))


# the cache methods a mixer reads states with: their presence makes a module a recurrent mixer
STATE_READS = frozenset({"get_conv_state", "get_recurrent_state"})
# how mixers of older releases read states instead: cache.layers[i].conv_states, cache.has_previous_state(...)
# (5.6-5.20), cache.conv_states[i] / ssm_states (5.2), cache.conv_cache[i] (LFM2 on 5.2)
_OLD_STATE_READS = re.compile(r"\b(\w+)\.(?:layers\[[^\]]*\]\.)?(conv_states|recurrent_states|ssm_states|"
                              r"has_previous_state|conv_cache)\b")
# the first release whose mixers read their states through get_conv_state / get_recurrent_state (make test-compat)
CACHE_API_SINCE = "5.21"


@dataclass(frozen=True, kw_only=True, slots=True)
class MixerCoupling:
    """How a recurrent mixer class takes its states, read off its installed source."""

    cls_name: str
    cache_arg: str  # the forward keyword the cache object goes in
    cache_methods: frozenset[str]  # every method the class calls on it


_PARSING = threading.RLock()
"""Held while this module parses Python source (``inspect.getsource`` of a class parses its whole module file;
:func:`forward_parameters` a class body). CPython 3.11 keeps the AST constructor's recursion depth per
interpreter, not per thread: two threads parsing at once raise ``SystemError: AST constructor recursion depth
mismatch``. The sequence-parallel guard's simulated ranks are threads that install the mixers on every forward
(measured: both ranks of a 2-rank launch died so, before sources were read once; make test-min, Python 3.11.7)."""


def source_of(obj: Any) -> str:
    """``obj``'s source text ("" where there is none: a builtin, a C extension). Read once per object: for a
    class, ``inspect.getsource`` parses the whole module file it is defined in, and the mixer search asks for
    every module class of a model each time a model is installed, made float64 or checked (measured: 297 reads,
    14 CPU s, in one tiny Nemotron-H training run). One thread at a time (:data:`_PARSING`)."""
    with _PARSING:
        try:
            return _source_once(obj)
        except TypeError:  # unhashable: read it again
            return _read_source(obj)


@functools.lru_cache(maxsize=None)
def _source_once(obj: Any) -> str:
    return _read_source(obj)


def _read_source(obj: Any) -> str:
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        return ""


def _version(cls: type) -> str:
    package = cls.__module__.split(".")[0]
    try:
        from importlib.metadata import version

        return f"{package} {version(package)}"
    except Exception:  # noqa: BLE001 - a module outside an installed distribution
        return package


@functools.lru_cache(maxsize=None)
def forward_parameters(cls: type) -> list[str]:
    """The parameter names of ``cls.forward`` as its ``def`` line spells them. A decorator without
    ``functools.wraps`` (transformers 5.15's ``force_accelerate_hooks``) shows its signature as ``(*args,
    **kwargs)``: the cache argument would then be found in no parameter, and a mixer pass as no mixer."""
    import ast
    import textwrap

    try:
        names = list(inspect.signature(inspect.unwrap(cls.forward)).parameters)
    except (TypeError, ValueError):
        names = []
    if set(names) - {"self", "args", "kwargs"}:
        return names
    try:
        with _PARSING:
            tree = ast.parse(textwrap.dedent(source_of(cls)))
    except SyntaxError:
        return names
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == "forward":
            a = node.args
            return [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
    return names


def recurrent_mixer(cls: type) -> MixerCoupling | None:
    """``cls``'s cache argument and cache calls if it is a recurrent mixer, else None.

    A recurrent mixer is a class whose source reads conv or recurrent states
    (:data:`STATE_READS`) from one of its forward's parameters. Raises
    :class:`CouplingError` if the class reads states from something that is
    not a forward parameter (onepass could not hand it a chain's states).
    """
    forward = getattr(cls, "forward", None)
    if forward is None:
        return None
    source = source_of(cls)
    params = forward_parameters(cls)
    if not any(f".{read}(" in source for read in STATE_READS):
        old = sorted({f"{arg}.{what}" for arg, what in _OLD_STATE_READS.findall(source) if arg in params})
        if old:  # a mixer, but one reading its states where a chain state cannot hand them over
            raise CouplingError(
                f"{cls.__name__} ({_version(cls)}) reads its recurrent states as {', '.join(old)} (the cache API "
                f"of transformers before {CACHE_API_SINCE}), not through {' / '.join(sorted(STATE_READS))}: onepass "
                f"cannot run its recurrent layers chain by chain on a tree; use transformers>={CACHE_API_SINCE}")
        return None
    for name in params:
        methods = frozenset(re.findall(rf"\b{re.escape(name)}\.(\w+)\(", source))
        if methods & STATE_READS:
            return MixerCoupling(cls_name=cls.__name__, cache_arg=name, cache_methods=methods)
    raise CouplingError(
        f"{cls.__name__} ({_version(cls)}) reads recurrent states, but from none of its forward's arguments "
        f"({', '.join(params) or 'none found'}): onepass cannot run it on a tree; please report it")


def check_cache_api(coupling: MixerCoupling, provided: Iterable[str], cls: type | None = None) -> None:
    """Raise :class:`CouplingError` if the mixer calls a cache method outside ``provided``."""
    missing = sorted(coupling.cache_methods - set(provided))
    if missing:
        where = f" ({_version(cls)})" if cls is not None else ""
        raise CouplingError(
            f"{coupling.cls_name}{where} calls {', '.join(f'{coupling.cache_arg}.{m}()' for m in missing)}, "
            f"which onepass's chain state does not provide: this release changed the recurrent cache API; "
            f"one-pass cannot lay this model's recurrent layers on a tree until onepass supports it")


def mixer_classes(modules: Iterable[Any]) -> dict[type, MixerCoupling]:
    """The recurrent mixer classes among ``modules`` (e.g. ``model.modules()``), each with its coupling."""
    found: dict[type, MixerCoupling] = {}
    for mod in modules:
        cls = type(mod)
        if cls not in found:
            coupling = recurrent_mixer(cls)
            if coupling is not None:
                found[cls] = coupling
    return found


def called_kernels(cls: type, *, wanted: Callable[[Any], bool]) -> dict[str, Any]:
    """Module-level functions of ``cls``'s module that its forward calls by name and ``wanted`` accepts."""
    import sys

    module = sys.modules.get(cls.__module__)
    forward = getattr(cls, "forward", None)
    if module is None or forward is None:
        return {}
    names = set(re.findall(r"(?<![.\w])(\w+)\(", source_of(inspect.unwrap(forward))))
    found = {n: getattr(module, n, None) for n in sorted(names)}
    return {n: f for n, f in found.items() if inspect.isfunction(inspect.unwrap(f)) and wanted(f)}


def upcast_kept_parameters(model: Any) -> int:
    """In a float64 ``model``, cast floating parameters and buffers below float64 (kept in float32 by
    ``_keep_in_fp32_modules_strict``) up to float64, for verification. Returns how many.

    Exact: every float32 value is a float64 value. Without it a float32 router weight of a float64
    model accumulates its gradient in float32 and one-pass and N-pass differ by ~1e-8 for rounding.
    """
    import torch

    dtype = torch.float64
    if not any(p.dtype == dtype for p in model.parameters()):
        return 0  # a model in training precision keeps what its release keeps in float32
    count = 0
    for mod in model.modules():
        for store in (mod._parameters, mod._buffers):
            for name, t in store.items():
                if (t is not None and t.is_floating_point()
                        and torch.finfo(t.dtype).bits < torch.finfo(dtype).bits):
                    if isinstance(t, torch.nn.Parameter):
                        store[name] = torch.nn.Parameter(t.detach().to(dtype), requires_grad=t.requires_grad)
                    else:
                        store[name] = t.to(dtype)
                    count += 1
    return count
