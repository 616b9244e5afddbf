"""``onepass``: one command-line entry point, ``main(argv) -> int``.

Subcommands::

    onepass prepare --data FILE --tokenizer SPEC --out DIR [--schedule ...] [--max-tokens N] [--pack]
    onepass verify  --data FILE --tokenizer SPEC [--model PATH | --tiny ARCH] [--dtype float64]
    onepass verify  --rollouts FILE [--model PATH | --tiny ARCH] [--dtype float64]   (RL, see docs/rl.md)
    onepass show    --data FILE --tokenizer SPEC --index I --out mask.png
    onepass train   --config FILE.yaml [--model ID|PATH | --tiny ARCH] [--data ...] [--resume] [flags]
    onepass data convert-mathchat|sample|augment|stats ...   (see onepass.data.cli)
    onepass bench --quick --out DIR [--data SPEC]                    (see onepass.bench.cli)
    onepass export --adapter DIR --out DIR [--base MODEL] [--push-to-hub ID]   (see onepass.export)
    onepass eval --data SPEC --model PATH|--tiny ARCH --out DIR [--history reference|model]
                 [--backend hf|vllm|openai]                             (see onepass.evaluate.cli)

``--data`` is the same everywhere (:func:`onepass.data.load.resolve_data`): a
.jsonl/.json/.parquet file, a folder of them, a saved dataset, a hub id
(online), ``builtin:mathchat`` (the bundled MathChat sample) or
``synthetic:NAME``; ``train`` also takes the rows ``prepare`` wrote.
``--tokenizer builtin:qwen3`` is the real Qwen3 vocabulary and template,
offline. Errors a user can cause (:class:`onepass.errors.OnePassError`) print
one line (``onepass: error: ...``) and exit 2; set ``ONEPASS_DEBUG=1`` to see
the traceback instead. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path

from onepass import export as export_cli
from onepass import template_report as templates_cli
from onepass.bench import cli as bench_cli
from onepass.data import cli as data_cli
from onepass.data.load import limit_arg
from onepass.data_config import RENDER_KEYS, DataConfig, add_data_arguments, data_config_from_args
from onepass.evaluate import cli as eval_cli
from onepass.errors import ConfigError, DataError, OnePassError, UsageError, run_main
from onepass.hub import hub_offline, offline_reason
from onepass.train import cli as train_cli

DTYPES = ("float64", "float32", "bfloat16")
SUBCOMMAND_MODULES = (train_cli, data_cli, bench_cli, export_cli, eval_cli, templates_cli)  # subcommands that live beside their code

DESCRIPTION = """\
Fine-tune reasoning models on multi-turn conversations with one forward pass per
conversation instead of one per assistant turn, with exactly the per-turn loss."""
EPILOG = """\
a typical session:
  onepass prepare --data chats.jsonl --tokenizer Qwen/Qwen3-8B --out prepared/
  onepass verify  --data chats.jsonl --tokenizer Qwen/Qwen3-8B       # one-pass loss == per-turn loss
  onepass train   --config configs/qwen3-8b-qlora.yaml --data chats.jsonl
  onepass export  --adapter runs/qwen3-8b/final --out merged/        # LoRA -> one model directory
  onepass eval    --model merged/ --data held-out.jsonl --out eval/  # accuracy per turn

--data takes a .jsonl/.json/.parquet file, a folder, a saved dataset, builtin:mathchat
(a bundled sample) or a hub id. 'onepass COMMAND --help' shows a command's options."""


VERIFY_KEYS = ("schedule", "weighting", *RENDER_KEYS)
VERIFY_ROW_KEYS = ("pack", "share_prefix")  # verify --data: packed rows of --max-tokens (one row when unset)
SHOW_KEYS = ("schedule", *RENDER_KEYS)


def _add_common(p: argparse.ArgumentParser, *, data_required: bool = True,
                limit_help: str = "use only the first N valid conversations") -> None:
    p.add_argument("--data", required=data_required,
                   help="conversations: .jsonl/.json/.parquet, a folder of them, a saved dataset, "
                        "builtin:mathchat, synthetic:NAME or a hub id (online only)")
    p.add_argument("--tokenizer", default="builtin:qwen3",
                   help="builtin:qwen3 (offline), a local tokenizer directory or a hub id")
    p.add_argument("--chat-template", help="a .jinja file or builtin:NAME replacing the tokenizer's template")
    p.add_argument("--limit", type=limit_arg, help=limit_help)
    p.add_argument("--strict", action="store_true", help="stop at the first bad record instead of skipping it")


def version() -> str:
    """The installed distribution's version, else (a source tree on the path) ``onepass.__version__``."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed_version

    try:
        return installed_version("onepass")
    except PackageNotFoundError:
        from onepass import __version__

        return __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="onepass", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"onepass {version()}")
    sub = parser.add_subparsers(dest="command", required=True, title="commands", metavar="COMMAND")

    p = sub.add_parser("prepare", help="conversations -> one-pass rows (Arrow) + stats.json")
    _add_common(p)
    add_data_arguments(p)  # every DataConfig field: --schedule, --max-tokens, --pack, --weighting, ...
    p.add_argument("--out", required=True, help="output directory (new, empty, or an earlier prepare output)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace --out even when it holds files that are not an earlier onepass output")
    p.add_argument("--num-proc", type=int, default=1,
                   help="render and tokenise on N processes (forked workers); same rows and stats")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_prepare)

    p = sub.add_parser("verify", help="one-pass vs N-pass loss and gradients on the same conversations")
    _add_common(p, data_required=False, limit_help="check the first N valid conversations (or trajectories); "
                                                   "default 8 (each view is a forward of its own)")
    p.add_argument("--rollouts", help="RL rollouts (.jsonl, token ids; see docs/rl.md) instead of --data: "
                                      "per-token log-probs and policy-loss gradients vs per-turn forwards")
    p.add_argument("--max-tokens", type=int, help="row token budget: --rollouts (groups split and packed), "
                                                  "--pack (the conversations' trees packed; one row when unset)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="a local model directory or hub id")
    src.add_argument("--tiny", default="qwen3",
                     help="random tiny model of this architecture (default qwen3; see onepass.tiny.TINY_ARCHS)")
    p.add_argument("--dtype", choices=DTYPES, default="float64")
    add_data_arguments(p, names=VERIFY_KEYS + VERIFY_ROW_KEYS)
    p.add_argument("--attn", default="auto", choices=("auto", "onepass_cpu", "sdpa", "eager", "flex_attention"),
                   help="attention backend (auto: one the model supports exactly on --device; flex_attention: "
                        "CUDA only)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda: where both sides run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tolerance", type=float, default=None,
                   help="exit 1 when the relative loss or gradient difference exceeds this "
                        "(default 1e-9 for float64, 1e-4 for float32, 2e-2 for bfloat16)")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("show", help="draw one conversation's tree mask as a PNG")
    _add_common(p)
    p.add_argument("--index", type=int, default=0, help="which valid conversation (0-based)")
    add_data_arguments(p, names=SHOW_KEYS)
    p.add_argument("--out", required=True, help="output .png")
    p.set_defaults(func=cmd_show)

    for module in SUBCOMMAND_MODULES:  # add_parser(sub) adds the subcommand and sets its func
        module.add_parser(sub)
    return parser


def _read(args: argparse.Namespace):
    from onepass.data.load import load_conversations

    report = load_conversations(args.data, strict=args.strict, limit=args.limit)  # refuses prepared rows
    for line in report.skipped[:5]:
        print(f"skipped: {line}", file=sys.stderr)
    if len(report.skipped) > 5:
        print(f"... and {len(report.skipped) - 5} more skipped records", file=sys.stderr)
    return report


def _tokenizer(args: argparse.Namespace):
    from onepass.tokenizer import load_tokenizer

    return load_tokenizer(args.tokenizer, chat_template=args.chat_template)


def cmd_prepare(args: argparse.Namespace) -> int:
    from onepass.data.parallel import exit_on_sigterm

    from onepass.files import output_lock

    # SIGTERM unwinds: temporaries removed, an earlier output kept whole; one prepare per --out at a time
    with exit_on_sigterm(), output_lock(args.out, command="prepare"):
        return _prepare(args)


def _prepare(args: argparse.Namespace) -> int:
    from onepass.data.load import conversation_source
    from onepass.data.parallel import iter_prepared
    from onepass.files import check_output_dir
    from onepass.prepare import INVALID, PrepareStats, write_prepared

    config = data_config_from_args(args)  # the schedule was parsed with the flags, not again
    if args.num_proc < 1:
        raise UsageError(f"--num-proc must be >= 1, got {args.num_proc}")
    conversation_source(args.data)  # fails in one line before any work: missing, unrecognised, or prepared rows
    check_output_dir(args.out, overwrite=args.overwrite)  # a file, unrelated files, or not writable: before the work
    tokenizer = _tokenizer(args)  # a template that does not compile: one line before data is read
    stats = PrepareStats()
    trees = iter_prepared(args.data, tokenizer, config, stats, num_proc=args.num_proc, limit=args.limit,
                          strict=args.strict, progress=not args.no_progress, units=True)
    out = write_prepared(trees, stats, config, args.out)  # streams: rows are written as they are made
    invalid = stats.skipped[:stats.skipped_by_reason.get(INVALID, 0)]  # listed first
    for line in invalid[:5]:
        print(f"skipped: {line}", file=sys.stderr)
    if len(invalid) > 5:
        print(f"... and {len(invalid) - 5} more skipped records", file=sys.stderr)
    print(stats.summary())
    if out is None:
        first = stats.skipped[0] if stats.skipped else "the data has no conversations"
        print(f"onepass: error: nothing to write, every conversation was skipped; first: {first}",
              file=sys.stderr)
        return 1
    print(f"wrote {stats.rows} rows to {out} (stats in {out / 'stats.json'})")
    return 0


def _default_tolerance(dtype: str) -> float:
    return {"float64": 1e-9, "float32": 1e-4, "bfloat16": 2e-2}[dtype]


def verify_model(args: argparse.Namespace, vocab: int | None) -> tuple[object, str, str]:
    """``verify``'s model, its label and attention backend: ``--model`` in ``--dtype``, else a tiny random
    ``--tiny`` model of ``vocab`` ids; the guard picks the backend; float64 runs norms in float64."""
    import torch

    from onepass.attention.backends import check_backend, supported_backend
    from onepass.guard import guard_backend

    dtype = getattr(torch, args.dtype)
    requested = None if args.attn == "auto" else args.attn
    device = torch.device(getattr(args, "device", "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: torch sees no CUDA device here")
    if requested is not None:
        check_backend(requested, device, dtype)  # flex on CPU or in float64, onepass_cpu on CUDA: one line

    def backend_for(config: object) -> str:  # the guard's choice on CPU, the CUDA default (flex) there
        return guard_backend(config, requested) if device.type == "cpu" else requested or supported_backend(
            config, device, dtype)
    if args.model:
        from transformers import AutoConfig, AutoModelForCausalLM

        if not Path(args.model).exists() and hub_offline():
            raise UsageError(f"model {args.model!r} is not a local path and the hub is offline ({offline_reason()})")
        experts = {"experts_implementation": "eager"} if dtype == torch.float64 else {}  # no float64 grouped_mm
        try:
            backend = backend_for(AutoConfig.from_pretrained(args.model))
            model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, attn_implementation=backend,
                                                         **experts).to(device)
        except (OSError, ValueError, KeyError) as e:  # not a model folder, a config transformers cannot read
            if isinstance(e, OnePassError):
                raise
            raise ConfigError(f"--model {args.model} cannot be loaded as a causal LM: "
                              f"{(str(e).splitlines() or [type(e).__name__])[0]}") from None
        model.eval()
        label = args.model
    else:
        from onepass.tiny import tiny_config, tiny_model

        backend = backend_for(tiny_config(args.tiny, vocab))
        model = tiny_model(args.tiny, vocab, dtype=dtype, seed=args.seed, attn_implementation=backend, device=device)
        label = f"tiny {args.tiny} (random, vocabulary compacted to {vocab} ids)"
    if dtype == torch.float64:
        from onepass.precision import float64_norms

        patched, left = float64_norms(model)
        print(f"float64: {patched} RMSNorm modules run in float64 (transformers upcasts them to float32)"
              + (f"; left alone: {', '.join(left[:3])}" if left else ""))
    return model, label, backend


def cmd_verify(args: argparse.Namespace) -> int:
    if args.tolerance is not None and not (math.isfinite(args.tolerance) and 0 < args.tolerance < 1):
        raise UsageError(f"--tolerance must be a relative difference above 0 and below 1, got {args.tolerance:g}: "
                         "a tolerance of 1 or more (or inf) calls any difference EQUAL")
    if args.rollouts:
        if args.data:
            raise UsageError("give --data (conversations) or --rollouts (RL token ids), not both")
        from onepass.rl.cli import verify_rollouts

        given = verify_limit(args)
        return verify_rollouts(args, verify_model, args.tolerance if args.tolerance is not None
                               else _default_tolerance(args.dtype), limit_given=given)
    if not args.data:
        raise UsageError("verify needs --data FILE (conversations) or --rollouts FILE (RL rollouts)")
    from onepass.guard.divergence import judge, locate
    from onepass.verify import compact_vocab, run_verify

    config: DataConfig = data_config_from_args(args, names=VERIFY_KEYS)
    pack, share = bool(args.pack), args.share_prefix is not False
    if args.max_tokens is not None and args.max_tokens < 2:
        raise UsageError(f"--max-tokens must be >= 2, got {args.max_tokens}")
    given = verify_limit(args)
    report = _read(args)
    tokenizer = _tokenizer(args)
    views, read = _verify_views(report, tokenizer, config, args, given)
    vocab = None
    if not args.model:
        views, vocab = compact_vocab(views)
    model, label, backend = verify_model(args, vocab)
    result = run_verify(views, model, schedule=config.schedule_spec, weighting=config.weighting,
                        max_tokens=args.max_tokens, pack=pack, share=share)
    tol = args.tolerance if args.tolerance is not None else _default_tolerance(args.dtype)
    verdict = judge(result.rel_loss_diff, result.max_rel_grad_diff, tolerance=tol,
                    where=lambda: locate(model, views, worst_parameter=result.worst_parameter, tolerance=tol))
    ok = verdict.equal
    print(f"model: {label}, {args.dtype}, attention {backend}, device {next(model.parameters()).device}")
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
    print(json.dumps({**result.to_dict(), "attention": backend, "device": str(next(model.parameters()).device),
                      "tolerance": tol, **read, **verdict.to_dict()}))
    return 0 if ok else 1


VERIFY_LIMIT = 8
"""``verify`` checks the first 8 valid conversations unless ``--limit`` says otherwise: every view is a forward
of its own (float64 by default), so a whole corpus would take hours; it says so when the limit cut the data."""


def verify_limit(args: argparse.Namespace) -> bool:
    """Set ``args.limit`` (:data:`VERIFY_LIMIT` when not given) and say whether it was given; below 1 is an error
    (a check of nothing is no check)."""
    given = args.limit is not None
    if given and args.limit < 1:
        raise UsageError(f"--limit must be at least 1, got {args.limit}: verify checks the first N valid "
                         f"conversations ({VERIFY_LIMIT} unless --limit says otherwise)")
    args.limit = args.limit if given else VERIFY_LIMIT
    return given


def _verify_views(report, tokenizer, config: DataConfig, args: argparse.Namespace, given: bool
                  ) -> tuple[list, dict]:
    """The views of the conversations ``verify`` checks, and what was read and skipped (for its JSON line).

    A turn ``prepare`` skips (the template raises for it, cannot split it) is skipped here too, counted and
    reported, so the data that will be trained is the data verified; ``--strict`` stops at the first. What
    was checked is printed, with the limit when it cut the data; nothing to check is an error, never a
    verdict on zero views."""
    from onepass.render import render_conversation
    from onepass.view import View

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
             + ("" if given else f", verify's default") + "; there are more)") if report.more else "every valid one"
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


def cmd_show(args: argparse.Namespace) -> int:
    from onepass.show import show

    config = data_config_from_args(args, names=SHOW_KEYS)
    args.limit = None if args.limit is None else max(args.limit, args.index + 1)
    report = _read(args)
    if not 0 <= args.index < len(report.conversations):
        raise UsageError(f"--index {args.index} is out of range: {len(report.conversations)} valid conversations")
    out = show(report.conversations[args.index], _tokenizer(args), args.out,
               config=config.render, schedule=config.schedule_spec)
    print(f"wrote {out}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``onepass ...``: the exit status. User errors are one line and exit 2 (:func:`onepass.errors.run_main`)."""
    args = build_parser().parse_args(argv)
    return run_main(args.func, args)


if __name__ == "__main__":
    sys.exit(main())
