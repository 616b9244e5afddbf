"""``onepass``: one command-line entry point, ``main(argv) -> int``, and the registry of its commands.

Subcommands, each with its parser beside its code (``onepass COMMAND --help``)::

    onepass prepare ...      conversations -> one-pass rows            (onepass.prepare.cli)
    onepass verify ...       one-pass vs N-pass loss and gradients     (onepass.verify.cli; --rollouts: onepass.rl.cli)
    onepass show ...         one conversation's mask as a PNG          (onepass.prepare.show)
    onepass train ...        fine-tune (YAML config + flags)           (onepass.train.cli)
    onepass data ...         convert-mathchat, sample, augment, stats  (onepass.prepare.data_cli)
    onepass bench ...        every schedule timed side by side         (onepass.bench.cli)
    onepass export ...       a LoRA adapter merged into its base       (onepass.export.cli)
    onepass eval ...         accuracy per turn, generated turn by turn (onepass.evaluate.cli)
    onepass templates check  how a chat template splits the data       (onepass.prepare.template_report)

Why this module is only a registry: a command's flags live beside the code they drive. Each
module in :data:`COMMANDS` is a parser that imports no torch; its ``add_parser(subparsers)``
adds the command and names the function that runs it as ``"module:function"``
(``set_defaults(func=...)``), imported when the command runs (:func:`onepass.lazy.resolve`), so
``onepass --help`` and every ``onepass COMMAND --help`` answer without loading torch.

Add a command: write its parser module (torch-free: ``add_parser(subparsers)`` that sets ``func``
to its runner's name) beside its code, add the module to :data:`COMMANDS` and a line above;
``tests/test_cli.py`` checks that its ``--help`` imports no torch.

``--data`` is the same everywhere (:func:`onepass.data.sources.resolve_data`). Errors a user can
cause (:class:`onepass.errors.OnePassError`) print one line (``onepass: error: ...``) and exit 2;
set ``ONEPASS_DEBUG=1`` to see the traceback instead. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as installed_version

import onepass
from onepass.bench import cli as bench_cli
from onepass.prepare import data_cli
from onepass.errors import run_main
from onepass.evaluate import cli as eval_cli
from onepass.export import cli as export_cli
from onepass.prepare import show
from onepass.lazy import resolve
from onepass.prepare import cli as prepare_cli
from onepass.prepare import template_report
from onepass.train import cli as train_cli
from onepass.verify import cli as verify_cli

COMMANDS = (prepare_cli, verify_cli, show, train_cli, data_cli, bench_cli, export_cli, eval_cli, template_report)
"""The parser modules, in ``onepass --help`` order: each has ``add_parser(subparsers)``."""

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


def version() -> str:
    """The installed distribution's version, else (a source tree on the path) ``onepass.__version__``."""
    try:
        return installed_version("onepass")
    except PackageNotFoundError:
        return onepass.__version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="onepass", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"onepass {version()}")
    sub = parser.add_subparsers(dest="command", required=True, title="commands", metavar="COMMAND")
    for module in COMMANDS:
        module.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """``onepass ...``: the exit status. User errors are one line and exit 2 (:func:`onepass.errors.run_main`)."""
    args = build_parser().parse_args(argv)
    return run_main(resolve(args.func) if isinstance(args.func, str) else args.func, args)


if __name__ == "__main__":
    sys.exit(main())
