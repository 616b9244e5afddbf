"""Measured equivalence: the one-pass loss and gradients against plain N-pass forwards.

Why this module exists: the method's promise is that the loss is *identical*
to training every view on its own. ``verify`` checks it on the user's own
data, tokenizer and model: it runs every view as a plain HF forward (the
N-pass reference, :func:`onepass.loss.view_loss_reference`), then the
scheduled trees (:func:`onepass.loss.layout_loss`), and compares the summed
losses and every parameter's gradient.

With a tiny random model the vocabulary is compacted first (the ids that
occur are renumbered 0..V-1, the same map for both sides), so a 151k-token
vocabulary costs nothing; the layout under test is unchanged.

``onepass verify --data`` runs here (:func:`run`); its flags are :mod:`onepass.verify.cli`'s, and
``--rollouts`` is :func:`onepass.rl.cli.verify_rollouts`. Both load the model with :func:`verify_model`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from onepass.attention.backends import check_backend, cpu_backend, supported_backend
from onepass.conversation.parse import ReadReport
from onepass.data.sources import load_conversations, print_skipped
from onepass.prepare.config import DataConfig, data_config_from_args
from onepass.model.dtypes import default_tolerance, torch_dtype
from onepass.errors import DataError, UsageError
from onepass.verify.divergence import judge, locate, max_rel_grad_diff, rel_diff, trains_nothing
from onepass.loss import layout_loss, view_loss_reference
from onepass.model.couplings import CouplingError
from onepass.model.load import ModelSpec, load_causal_lm, load_model_config
from onepass.layout.pack import pack_layouts
from onepass.model.precision import float64_norms
from onepass.render import render_conversation
from onepass.layout.schedule import Schedule, parse_schedule, schedule_views
from onepass.layout.share import share_rows
from onepass.model.tiny import tiny_config
from onepass.render.tokenizer import load_tokenizer
from onepass.verify.cli import VERIFY_KEYS, verify_limit
from onepass.layout.view import View
from onepass.layout.vocab import remap, used_ids


@dataclass(frozen=True, kw_only=True, slots=True)
class VerifyReport:
    loss_n_pass: float
    loss_one_pass: float
    max_abs_loss_diff: float
    rel_loss_diff: float
    max_rel_grad_diff: float
    num_conversations: int
    num_views: int
    num_trees: int
    n_pass_tokens: int
    one_pass_tokens: int
    schedule: str
    weighting: str
    dtype: str
    worst_parameter: str = ""  # the parameter with the largest relative gradient difference
    packed: bool = False  # the trees of all conversations were packed into shared rows
    shared: bool = False  # ... and trees of conversations that share a prefix merged into one (onepass.layout.share)
    num_rows: int = 0
    row_tokens: int = 0  # tokens of the rows run (the trees', less the prefixes shared)
    views_left_out: int = 0  # views prepare leaves out under max_tokens (over it alone, or in a tree over it)
    first_left_out: str = ""  # the first of their skip lines

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def compact_vocab(conversations: Sequence[Sequence[View]]) -> tuple[list[list[View]], int]:
    """Renumber the token ids that occur to 0..V-1 (one map for all views, :mod:`onepass.layout.vocab`)."""
    used = used_ids(v.tokens for views in conversations for v in views)
    out = [[replace(v, tokens=remap(v.tokens, used)) for v in views] for views in conversations]
    return out, len(used)


def parameter_grads(model: Any) -> dict[str, torch.Tensor]:
    """A copy of every trainable parameter's gradient (zeros where there is none)."""
    return {n: torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
            for n, p in model.named_parameters() if p.requires_grad}


def loss_and_grads(model: Any, loss_of: Callable[[Any], torch.Tensor]) -> tuple[float, dict[str, torch.Tensor]]:
    """``loss_of(model)`` and every trainable parameter's gradient of it (zeros where there is none), taken
    without touching ``.grad``: what each side of a comparison (one process, or one simulated rank's copy)
    hands :func:`onepass.verify.divergence.max_rel_grad_diff`."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    loss = loss_of(model)
    grads = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
    return float(loss.detach()), {n: torch.zeros_like(p) if g is None else g for (n, p), g in zip(named, grads)}


def run_verify(conversations: Sequence[Sequence[View]], model: Any, *,
               schedule: Schedule | str = "one-pass", weighting: str = "token",
               max_tokens: int | None = None, pack: bool = False, share: bool = False) -> VerifyReport:
    """Loss and gradients of N-pass vs ``schedule`` on the same views and model: the views ``prepare``
    trains, each with the weight it has there.

    ``max_tokens``: a view over it, or a tree over it under a schedule that does not split, is left out of
    both sides as ``prepare`` leaves it out (counted in the report, with the first skip line); nothing left
    is an error. ``pack``: the trees of all conversations are packed into rows of at most ``max_tokens``
    (one row when it is None), so documents share rows as in packed training; ``share`` (with ``pack``,
    under any schedule but n-pass): trees of conversations that share a token prefix are merged into one
    tree per row (:mod:`onepass.layout.share`), as ``prepare --pack`` does by default. A reference that
    trains nothing (every gradient zero) is an error, never EQUAL.
    """
    if isinstance(schedule, str):
        schedule = parse_schedule(schedule)
    if not any(len(views) for views in conversations):
        raise DataError("verify checked nothing: no view to compare (a verdict on nothing is no verdict)")
    trees, units, trained, left_out = [], [], [], []
    for c, views in enumerate(conversations):  # what prepare trains: the scheduled trees and the views they hold
        scheduled = schedule_views(views, schedule, weighting=weighting, max_tokens=max_tokens)
        left_out.extend(zip(scheduled.skipped, scheduled.skipped_views))
        trees.extend(scheduled.layouts)
        units.extend([c] * len(scheduled.layouts))
        trained.extend((views[i], scheduled.weights[i]) for group in scheduled.groups for i in group)
    num_left_out = sum(n for _, n in left_out)
    if not trained:
        raise DataError(f"verify checked nothing: prepare would train none of the {num_left_out} views under "
                        f"max_tokens={max_tokens}; first: {left_out[0][0]}")

    model.zero_grad(set_to_none=True)
    loss_n = 0.0
    n_tokens = 0
    for view, w in trained:
        loss = view_loss_reference(model, view, w)
        loss.backward()
        loss_n += loss.item()
        n_tokens += len(view)
    grads_n = parameter_grads(model)
    if trains_nothing(grads_n):
        raise DataError("verify checked nothing: the N-pass loss has no gradient (nothing is trained), so both "
                        "sides' zero gradients agree on nothing (a verdict on nothing is no verdict)")

    model.zero_grad(set_to_none=True)
    loss_1 = 0.0
    budget = max_tokens or sum(len(x) for x in trees)
    shared = pack and share and schedule.kind != "n-pass"
    if shared:
        rows = share_rows(trees, units, budget)
    else:
        rows = pack_layouts(trees, budget) if pack else trees
    for layout in rows:
        loss = layout_loss(model, layout)
        loss.backward()
        loss_1 += loss.item()
    grads_1 = parameter_grads(model)
    model.zero_grad(set_to_none=True)

    rel_grad, worst = max_rel_grad_diff(grads_n, grads_1)
    abs_diff = abs(loss_1 - loss_n)
    return VerifyReport(
        loss_n_pass=loss_n, loss_one_pass=loss_1, max_abs_loss_diff=abs_diff,
        rel_loss_diff=rel_diff(loss_1, loss_n),
        max_rel_grad_diff=rel_grad, num_conversations=len(set(units)), num_views=len(trained),
        num_trees=len(trees), n_pass_tokens=n_tokens, one_pass_tokens=sum(len(x) for x in trees),
        schedule=str(schedule), weighting=weighting, dtype=str(next(model.parameters()).dtype),
        worst_parameter=worst, packed=pack, shared=shared, num_rows=len(rows),
        row_tokens=sum(len(x) for x in rows), views_left_out=num_left_out,
        first_left_out=left_out[0][0] if left_out else "")


# ---------------------------------------------------------------------------------------------
# onepass verify


def verify_model(args: argparse.Namespace, vocab: int | None) -> tuple[Any, str, str]:
    """``verify``'s model, its label and attention backend: ``--model`` in ``--dtype``, else a tiny random
    ``--tiny`` model of ``vocab`` ids, on ``--device``; the backend is ``--attn`` when given, else one that
    runs the model exactly there (on CPU the guard's choice, on CUDA the default, flex); float64 runs norms
    in float64."""
    dtype = torch_dtype(args.dtype)
    requested = None if args.attn == "auto" else args.attn
    device = torch.device(getattr(args, "device", "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: torch sees no CUDA device here")
    if requested is not None:
        check_backend(requested, device, dtype)  # flex on CPU or in float64, onepass_cpu on CUDA: one line

    def backend_for(config: Any) -> str:
        return cpu_backend(config, requested) if device.type == "cpu" else requested or supported_backend(
            config, device, dtype)

    # the mixers are wrapped at the first one-pass forward (onepass.loss.forward_plan), after the float64 patches
    if args.model:
        backend = backend_for(load_model_config(args.model, label="--model"))
        spec = ModelSpec(model=args.model, dtype=args.dtype, attention=backend, device=device, label="--model")
        label = args.model
    else:
        backend = backend_for(tiny_config(args.tiny, vocab))
        spec = ModelSpec(tiny=args.tiny, vocab_size=vocab, dtype=args.dtype, seed=args.seed, attention=backend,
                         device=device)
        label = f"tiny {args.tiny} (random, vocabulary compacted to {vocab} ids)"
    model = load_causal_lm(spec)
    if args.dtype == "float64":
        patched, left = float64_norms(model)
        print(f"float64: {patched} RMSNorm modules run in float64 (transformers upcasts them to float32)"
              + (f"; left alone: {', '.join(left[:3])}" if left else ""))
    return model, label, backend


@contextlib.contextmanager
def refusal_as_json(args: argparse.Namespace) -> Any:
    """``verify``'s last line is JSON, a refusal's too: where the installed release cannot run the model one-pass
    (:class:`onepass.model.couplings.CouplingError`, e.g. a hybrid's mixers on transformers before 5.21), the
    line says so (``"equal": null``: nothing was compared) with the refusal, which then goes on to the CLI (one
    line on stderr, exit 2)."""
    try:
        yield
    except CouplingError as e:
        print(json.dumps({"equal": None, "refused": str(e), "model": args.model or f"tiny {args.tiny}",
                          "dtype": args.dtype}))
        raise


def tolerance(args: argparse.Namespace) -> float:
    """``--tolerance``, else the default of ``--dtype`` (:func:`onepass.model.dtypes.default_tolerance`)."""
    return args.tolerance if args.tolerance is not None else default_tolerance(args.dtype)


def verify_views(report: ReadReport, tokenizer: Any, config: DataConfig, args: argparse.Namespace, given: bool
                 ) -> tuple[list[list[View]], dict[str, Any]]:
    """The views of the conversations ``verify`` checks, and what was read and skipped (for its JSON line).

    A turn ``prepare`` skips (the template raises for it, cannot split it) is skipped here too, counted and
    reported, so the data that will be trained is the data verified; ``--strict`` stops at the first. What
    was checked is printed, with the limit when it cut the data; nothing to check is an error, never a
    verdict on zero views."""
    checked, skipped = [], []
    for conv in report.conversations:
        rendered = render_conversation(conv, tokenizer, config.render)
        if rendered.skipped and args.strict:
            raise rendered.skipped[0]
        skipped.extend(rendered.skipped)
        views = [v for v in rendered.views if isinstance(v, View)]
        if views:
            checked.append(views)
    reasons: dict[str, int] = {}
    for error in skipped:
        reasons[error.reason] = reasons.get(error.reason, 0) + 1
    limit = (f"the first {len(report.conversations)} valid (--limit {args.limit}"
             + ("" if given else ", verify's default") + "; there are more)") if report.more else "every valid one"
    print(f"verifying {len(checked)} conversations: {len(report.conversations)} read, {limit}"
          + (f"; {len(report.skipped)} records skipped" if report.skipped else "")
          + (f"; {len(skipped)} views skipped as prepare skips them "
             f"({', '.join(f'{k}: {v}' for k, v in sorted(reasons.items()))}); first: {skipped[0]}" if skipped else ""))
    if not checked:
        first = skipped[0] if skipped else report.skipped[0] if report.skipped else "the data has no conversations"
        raise DataError(f"verify checked nothing: no view of {args.data} could be rendered "
                        f"({len(report.conversations)} conversations read); first: {first}")
    read = {"conversations_read": len(report.conversations), "limit": args.limit, "limited": report.more,
            "records_skipped": len(report.skipped), "views_skipped": len(skipped), "views_skipped_by_reason": reasons}
    return checked, read


def run(args: argparse.Namespace) -> int:
    """``onepass verify --data``: one-pass vs N-pass on the conversations; exit 1 when they differ."""
    config: DataConfig = data_config_from_args(args, names=VERIFY_KEYS)
    pack, share = bool(args.pack), args.share_prefix is not False
    if args.max_tokens is not None and args.max_tokens < 2:
        raise UsageError(f"--max-tokens must be >= 2, got {args.max_tokens}")
    given = verify_limit(args)
    report = load_conversations(args.data, strict=args.strict, limit=args.limit)  # refuses prepared rows
    print_skipped(report.skipped)
    tokenizer = load_tokenizer(args.tokenizer, chat_template=args.chat_template)
    views, read = verify_views(report, tokenizer, config, args, given)
    vocab = None
    if not args.model:
        views, vocab = compact_vocab(views)
    with refusal_as_json(args):
        model, label, backend = verify_model(args, vocab)
        result = run_verify(views, model, schedule=config.schedule_spec, weighting=config.weighting,
                            max_tokens=args.max_tokens, pack=pack, share=share)
    tol = tolerance(args)
    verdict = judge(result.rel_loss_diff, result.max_rel_grad_diff, tolerance=tol,
                    where=lambda: locate(model, views, worst_parameter=result.worst_parameter, tolerance=tol))
    device = next(model.parameters()).device
    print(f"model: {label}, {args.dtype}, attention {backend}, device {device}")
    if result.views_left_out:
        print(f"{result.views_left_out} views left out, as prepare leaves them out under --max-tokens "
              f"{args.max_tokens}; first: {result.first_left_out}")
    print(f"{result.num_conversations} conversations, {result.num_views} views: "
          f"N-pass {result.n_pass_tokens} tokens vs {result.schedule} {result.one_pass_tokens} tokens "
          f"in {result.num_trees} trees"
          + (f", packed in {result.num_rows} rows of {result.row_tokens} tokens"
             + (" (prefixes shared across conversations)" if result.shared else "") if result.packed else ""))
    print(f"loss N-pass {result.loss_n_pass:.12g}  {result.schedule} {result.loss_one_pass:.12g}  "
          f"rel diff {result.rel_loss_diff:.3g}  max rel grad diff {result.max_rel_grad_diff:.3g}  "
          f"-> {verdict.word} within {tol:g}")
    if verdict.where is not None:
        print(verdict.located(result.worst_parameter))
    print(json.dumps({**result.to_dict(), "attention": backend, "device": str(device), "tolerance": tol, **read,
                      **verdict.to_dict()}))
    return 0 if verdict.equal else 1
