"""Is one-pass exact for this model? Proved on a tiny float64 twin before training.

Why this module exists: the promise is "the loss and every gradient equal
N-pass, for your model", and it holds only if every layer type sees, at each
tree node, exactly the node's ancestors (docs/design.md). Attention with the tree
mask does; a sliding window needs its own mask, attention sinks a backend that
carries them, and a recurrent layer (Gated DeltaNet, Mamba2, a short
convolution) mixes in every earlier token of the row. Rather than trust a
list of known architectures, the guard checks the user's one, also one we have
never seen: a tiny random twin (:mod:`onepass.guard.twin`: same config class and
layer types, small sizes, float64, eager MoE experts) runs
:func:`onepass.verify.check.run_verify` on two of the user's conversations. When they
differ it names the first layer whose output differs: every layer's output at
every tree node is compared with a plain forward of the node's path (the
layer before it agreed, so that layer itself is not exact).

    >>> result = check_exact(Qwen3NextConfig(), views)            # doctest: +SKIP
    >>> result.ok, result.message()                               # doctest: +SKIP
    (False, 'one-pass is not exact for Qwen3NextForCausalLM: layer type linear_attention
     (Qwen3NextGatedDeltaNet) differs: loss by 8.7e-06, gradients by 1.2e-01 relative ...')

``onepass train`` and ``OnePassTrainer`` run it before the first step and stop
with that one line (:class:`InexactModelError`) unless ``allow_inexact``. A model the installed release cannot
run one-pass at all (:class:`onepass.model.couplings.CouplingError`: e.g. a hybrid's mixers on transformers before
5.21) is refused with the coupling's own line, naming the release that works, ``allow_inexact`` or not.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from onepass.attention.backends import cpu_backend
from onepass.attention.cpu import register
from onepass.model.private_names import find_private, private
from onepass.verify import divergence
from onepass.verify.divergence import LayerDiff, judge, layer_of_parameter, locate, named_layer
from onepass.errors import ConfigError, debug
from onepass.layout.view import View
from onepass.model.layers import layer_types as twin_layer_types
from onepass.guard.twin import tiny_twin
from onepass.model.config import text_config
from onepass.model.couplings import CouplingError, base_model
from onepass.model.precision import float64_norms
from onepass.verify.check import compact_vocab, run_verify

TOLERANCE = divergence.TOLERANCE  # relative, float64; exact is ~1e-16 (a gradient may round further: judge)
CLI_HINT = "train with --schedule n-pass, or pass --allow-inexact to train anyway"


class InexactModelError(ConfigError):
    """One-pass is not exact for this model (or could not be checked); the message is one line."""


@dataclass(frozen=True, kw_only=True, slots=True)
class GuardResult:
    architecture: str  # the model class, e.g. Qwen3NextForCausalLM
    model_type: str
    layer_types: tuple[str, ...]  # of the twin
    backend: str
    num_conversations: int
    num_views: int
    packed: bool
    rel_loss_diff: float
    max_rel_grad_diff: float
    worst_parameter: str  # of the twin, e.g. model.layers.0.linear_attn.in_proj_qkvz.weight
    differing_layer: int | None  # the twin's first layer whose output differs
    differing_layer_type: str | None  # e.g. linear_attention
    mixer: str | None  # that layer's token mixer, e.g. Qwen3NextGatedDeltaNet
    error: str | None  # the twin could not be built or run
    refused: bool = False  # error is a coupling's refusal (CouplingError): the installed release cannot run it
    max_layer_diff: float | None  # every layer's output, one-pass node vs plain forward (when compared)
    tolerance: float
    ok: bool
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "layer_types": list(self.layer_types)}

    def where(self) -> str:
        if self.differing_layer_type is None:
            return f"the largest gradient difference is in {self.worst_parameter or '?'}"
        return f"layer type {self.differing_layer_type}" + (f" ({self.mixer})" if self.mixer else "")

    def message(self, hint: str = CLI_HINT) -> str:
        """One line: what differs, by how much, how it was checked, and what to do."""
        how = f"tiny float64 twin, {self.num_conversations} conversations, {self.backend} attention"
        if self.refused:  # neither n-pass nor allow_inexact runs it here: the coupling's line says what does
            return f"one-pass is refused for {self.architecture}: {str(self.error).removeprefix('CouplingError: ')}"
        if self.error is not None:
            return f"one-pass could not be checked for {self.architecture} ({how}): {self.error}; {hint}"
        if self.ok:
            rounded = (f"; a gradient rounds differently (cancellation or float32 steps inside the model), every "
                       f"layer's output within {self.max_layer_diff:.1e}"
                       if max(self.rel_loss_diff, self.max_rel_grad_diff) > self.tolerance else "")
            return (f"one-pass is exact for {self.architecture} ({how}{', packed' if self.packed else ''}): "
                    f"loss {self.rel_loss_diff:.1e}, gradients {self.max_rel_grad_diff:.1e} relative{rounded}")
        return (f"one-pass is not exact for {self.architecture}: {self.where()} differs: loss by "
                f"{self.rel_loss_diff:.1e}, gradients by {self.max_rel_grad_diff:.1e} relative ({how}); {hint}")


# ---------------------------------------------------------------------------------------------
# the twin model


def _auto_class(config: Any) -> Any | None:
    try:
        return private("transformers.AutoModelForCausalLM._model_mapping")[type(config)]
    except (KeyError, ValueError):
        return None


def describe(model_or_config: Any) -> tuple[Any, Any | None, str]:
    """(the decoder's config, the model class to build the twin with, the architecture's name)."""
    obj = base_model(model_or_config)  # a peft model's base model
    is_model = isinstance(obj, torch.nn.Module)
    config = obj.config if is_model else obj
    decoder = text_config(config)
    cls = type(obj) if is_model and decoder is config else _auto_class(decoder)
    named = type(obj).__name__ if is_model else (getattr(config, "architectures", None) or [None])[0]
    return decoder, cls, named or (cls.__name__ if cls is not None else type(config).__name__)


def build_twin(model_or_config: Any, vocab_size: int, *, backend: str | None = None, seed: int = 0) -> Any:
    """The tiny float64 twin of ``model_or_config`` with ``backend`` attention, in eval mode."""
    from transformers import AutoModelForCausalLM

    config, cls, _ = describe(model_or_config)
    twin = tiny_twin(config, vocab_size)
    backend = cpu_backend(twin, backend)
    if backend == "onepass_cpu":
        register()
    private("transformers.PreTrainedConfig._attn_implementation")
    twin._attn_implementation = backend
    if find_private("transformers.PreTrainedConfig._experts_implementation") is not None:
        twin._experts_implementation = "eager"  # grouped_mm has no float64 kernel (a release without it: eager)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if cls is not None and find_private("transformers.PreTrainedModel._from_config") is not None:
            model = cls._from_config(twin, dtype=torch.float64, attn_implementation=backend)
        else:
            model = AutoModelForCausalLM.from_config(twin, dtype=torch.float64, attn_implementation=backend)
    float64_norms(model)
    return model.eval()


# ---------------------------------------------------------------------------------------------
# the check


def check_exact(model_or_config: Any, conversations: Sequence[Sequence[View]], *, pack: bool = False,
                backend: str | None = None, seed: int = 0, tolerance: float = TOLERANCE) -> GuardResult:
    """One-pass vs N-pass on a tiny float64 twin of ``model_or_config`` (a model or its config),
    on ``conversations`` (their views; the vocabulary is compacted here). ``pack``: the trees
    share one row, as in packed training (trees of conversations that share a prefix merged into one,
    as packing does by default: :mod:`onepass.layout.share`). Never raises for the model: a twin that cannot be
    built or run is a failed result with ``error`` set (``ONEPASS_DEBUG=1`` raises instead)."""
    t0 = time.perf_counter()
    config, _, architecture = describe(model_or_config)
    views, vocab = compact_vocab(conversations)
    common: dict[str, Any] = {"architecture": architecture, "model_type": str(getattr(config, "model_type", "")),
                              "num_conversations": len(views), "num_views": sum(len(v) for v in views),
                              "packed": pack, "tolerance": tolerance}
    model, chosen, threads = None, backend or "?", torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: more threads only wait on each other
    try:
        with torch.random.fork_rng(devices=[]):
            model = build_twin(model_or_config, vocab, backend=backend, seed=seed)
            chosen = str(model.config._attn_implementation)
            report = run_verify(views, model, schedule="one-pass", pack=pack, share=pack)
            verdict = judge(report.rel_loss_diff, report.max_rel_grad_diff, tolerance=tolerance,  # NaN: not equal
                            where=lambda: locate(model, views, worst_parameter=report.worst_parameter,
                                                 tolerance=tolerance))
            where = verdict.where or LayerDiff(index=None, layer_type=None, mixer=None, max_diff=None)
            ok = verdict.equal
    except Exception as e:  # the twin of an architecture we do not know may fail in any way
        if debug():
            raise
        refused = isinstance(e, CouplingError)  # onepass's own one line, whole: it names the release that works
        first = (str(e).strip().splitlines() or [""])[0][:None if refused else 300]
        return GuardResult(**common, layer_types=tuple(twin_layer_types(model.config)) if model is not None else (),
                           backend=chosen, rel_loss_diff=float("nan"), max_rel_grad_diff=float("nan"),
                           worst_parameter="", differing_layer=None, differing_layer_type=None, mixer=None,
                           max_layer_diff=None,
                           error=f"{type(e).__name__}: {first}", refused=refused, ok=False,
                           seconds=time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    if not ok and where.index is None:  # the outputs agree: name the layer of the worst gradient
        where = named_layer(model, layer_of_parameter(report.worst_parameter), where.max_diff)
    return GuardResult(
        **common, layer_types=tuple(twin_layer_types(model.config)), backend=chosen,
        rel_loss_diff=report.rel_loss_diff, max_rel_grad_diff=report.max_rel_grad_diff,
        worst_parameter=report.worst_parameter, differing_layer=where.index, max_layer_diff=where.max_diff,
        differing_layer_type=where.layer_type, mixer=where.mixer, error=None, ok=ok,
        seconds=time.perf_counter() - t0)


_RESULTS: dict[str, GuardResult] = {}


def check_exact_once(model_or_config: Any, conversations: Sequence[Sequence[View]], *, pack: bool = False,
                     backend: str | None = None) -> GuardResult:
    """:func:`check_exact`, remembered for this process: runs that train the same architecture on
    the same conversations (tests, the demo, a resumed run) check it once."""
    import hashlib
    import json

    config, cls, _ = describe(model_or_config)
    key = hashlib.sha256(json.dumps([config.to_dict(), getattr(cls, "__name__", None), backend, pack],
                                    sort_keys=True, default=str).encode())
    for views in conversations:
        for view in views:
            key.update(view.tokens.tobytes() + b"|")
        key.update(b"#")
    digest = key.hexdigest()
    if digest not in _RESULTS:
        _RESULTS[digest] = check_exact(model_or_config, conversations, pack=pack, backend=backend)
    return _RESULTS[digest]


def enforce(result: GuardResult, *, allow_inexact: bool, hint: str = CLI_HINT,
            log: Callable[[str], None] = print) -> None:
    """Raise :class:`InexactModelError` (one line) when ``result`` failed, unless ``allow_inexact``; a refusal
    (``result.refused``: the installed release cannot run the model one-pass) whatever ``allow_inexact``."""
    if result.ok:
        log(result.message())
    elif allow_inexact and not result.refused:
        log("warning: " + result.message(hint="training anyway (allow_inexact); the loss is not the N-pass loss"))
    else:
        raise InexactModelError(result.message(hint))
