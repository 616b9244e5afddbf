"""``KEY=VALUE`` command-line flags (``--template-kwarg``, the train CLI's overrides), parsed one way.

Why this module exists: every subcommand takes ``KEY=VALUE`` pairs whose values are typed the same
way (JSON when they parse: ``true``, ``3``, ``"x"``; else text), so one definition reads them all.

No torch here: this is pure data.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from onepass.errors import UsageError


def parse_key_value(text: str, *, flag: str = "--template-kwarg") -> tuple[str, Any]:
    """``KEY=VALUE`` -> ``(KEY, VALUE)``; VALUE is parsed as JSON when it can be (true, 3, "x"),
    else kept as text. Every ``KEY=VALUE`` flag of every subcommand (``--template-kwarg``) reads through this.

    >>> parse_key_value("enable_thinking=false"), parse_key_value("name=qwen 3")
    (('enable_thinking', False), ('name', 'qwen 3'))
    """
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise UsageError(f"{flag} expects KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def key_value_arg(text: str) -> tuple[str, Any]:
    """:func:`parse_key_value` as an argparse ``type``: a malformed pair is argparse's own usage error."""
    import argparse

    try:
        return parse_key_value(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def template_kwargs(pairs: Sequence[str]) -> dict[str, Any]:
    """``--template-kwarg KEY=VALUE`` pairs (:func:`parse_key_value`) as a dict."""
    return dict(parse_key_value(pair) for pair in pairs)
