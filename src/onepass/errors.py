"""Errors a user can cause, and the one ``main()`` wrapper that prints them.

Why this module exists: a command must tell a user what *they* got wrong in
one line (``onepass: error: chats.jsonl line 3, message 1: unknown role
'bot'; ...``, exit 2), and must *not* do that for a bug: a ``ValueError``
from torch or numpy deep inside a run is ours to fix and keeps its traceback.
So everything a user can cause (a missing file, a bad record, a bad flag or
config value, a model or backend that cannot work here) raises a subclass of
:class:`OnePassError`, and :func:`run_main`, which every ``main()`` uses
(``onepass``, ``python -m onepass.train.cli``, ``python -m onepass.prepare.data_cli``,
the demo), turns only those into one line.

    OnePassError
      UsageError        a bad command-line value or combination
      ConfigError       a setting that cannot work (config file, model, tokenizer, backend, device)
      DataError         data that is missing, unreadable or not what the command needs
        DataNotFound    ... missing (also a FileNotFoundError)

The concrete classes subclass ``ValueError`` too (and ``DataNotFound``
``FileNotFoundError``), so callers of the library that catch those still do.
Modules keep their own names (``ConversationError(DataError)``,
``TrainConfigError(ConfigError)``, ...) so a message can say where it came from.

Example::

    >>> def handler(args):
    ...     raise DataNotFound("data file not found: chats.jsonl")
    >>> run_main(handler, None)   # prints "onepass: error: data file not found: chats.jsonl" to stderr
    2

No torch here (and no other import): every module may import this one.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import TypeVar

A = TypeVar("A")

EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130


class OnePassError(Exception):
    """Something a user can cause and fix; the message is one line saying what, where and what to do."""


class UsageError(OnePassError, ValueError):
    """A bad command-line value, or a combination of flags that cannot work."""


class ConfigError(OnePassError, ValueError):
    """A setting that cannot work: a config key, a model, a tokenizer, a backend on this device."""


class DataError(OnePassError, ValueError):
    """Data that is missing, unreadable, or not what the command needs (names the file or record)."""


class DataNotFound(DataError, FileNotFoundError):
    """A data spec that names nothing: no such file, an unknown ``builtin:``, a hub id while offline."""


def debug() -> bool:
    """``ONEPASS_DEBUG=1``: user errors raise with their traceback instead of printing one line."""
    return os.environ.get("ONEPASS_DEBUG", "").strip().lower() not in ("", "0", "false", "no", "off")


class ConversationError(DataError):
    """A record that cannot be used; the message names file, record and message."""


def message_at(source: str, number: int) -> str:
    """``SOURCE, message N``: the one wording of every error and skip naming a record's message N (a record's
    errors and a view's skips alike, so it lives here, below both the conversation and the layout)."""
    return f"{source}, message {number}"


def run_main(handler: Callable[[A], int], args: A) -> int:
    """``handler(args)``'s exit status; a :class:`OnePassError` is one line on stderr and exit 2.

    Anything else (a bug, ours or a library's) propagates with its traceback. Ctrl-C is one
    line and exit 130. With ``ONEPASS_DEBUG=1`` both raise instead.
    """
    try:
        return handler(args)
    except OnePassError as e:
        if debug():
            raise
        message = " ".join(str(e).split("\n")).strip() or type(e).__name__
        print(f"onepass: error: {message}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        if debug():
            raise
        print("onepass: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
