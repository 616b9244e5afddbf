"""The exactness guard's call, as both front ends make it before their first step.

Why this module exists: ``onepass train`` (:func:`onepass.train.run.model.check_exactness`) and
``OnePassTrainer.check_exactness`` each picked the views, ran the tiny float64 twin
(:func:`onepass.guard.check.check_exact_once`), enforced its verdict and logged it; the three steps, and the
line a user reads (``exactness guard on 2 conversations of file chats.jsonl: ...``), are written here once.
What differs stays with each front end: when there is nothing to check (n-pass rows), which conversations
are at hand, and the hint (a flag for the command, a keyword for the trainer).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from onepass.guard.check import CLI_HINT, GuardResult, check_exact_once, enforce
from onepass.layout.view import View
from onepass.prepare.guard_sample import views_for_check


def run_guard(model_or_config: Any, *, conversations: Sequence[Any] = (), tokenizer: Any | None, render: Any | None,
              sampled: Sequence[list[View]] | None, source: str, backend: str | None, allow_inexact: bool,
              log: Callable[[str], Any], pack: bool = False, empty: str = "no conversations at hand",
              hint: str = CLI_HINT) -> tuple[GuardResult, str]:
    """One-pass against N-pass on a tiny float64 twin of ``model_or_config`` (a model or its HF config), on
    the views :func:`onepass.prepare.guard_sample.views_for_check` picks (``sampled``: as the run rendered
    them; else two of ``conversations``; else the bundled pair). Raises
    :class:`onepass.guard.InexactModelError` (one line, ending in ``hint``) when they differ, unless
    ``allow_inexact``; logs the verdict. Returns the result and what was checked."""
    views, where = views_for_check(conversations, tokenizer, render, source=source, empty=empty, sampled=sampled)
    result = check_exact_once(model_or_config, views, pack=pack, backend=backend)
    enforce(result, allow_inexact=allow_inexact, hint=hint, log=lambda line: log(f"exactness guard on {where}: {line}"))
    return result, where


__all__ = ["run_guard"]
