"""Why a turn gives no view: the errors that skip one turn, each counted under its ``reason``.

Why this module exists: every step of rendering (the template call, the completion sources, the
shared checks, the retries) decides on these; a retry is chosen by the kind of error
(:data:`onepass.render.views.RETRIES`), so they are one small vocabulary of their own.

No torch here: this is pure data.
"""

from __future__ import annotations

from onepass.errors import DataError


class RenderError(DataError):
    """A turn the template cannot split into prompt and completion (counted as ``reason``)."""

    reason = "template"


class ReasoningNotRendered(RenderError):
    """The template does not render the turn's reasoning (``--reasoning drop`` trains the turn without it)."""


class UnopenedReasoning(RenderError):
    """A completion format closes a reasoning block (``</think>``) that neither it nor the turn's generation
    prompt opens (DeepSeek-V3.1 thinking after a tool result): the target would close a tag never opened."""

    reason = "format not opened by the prompt"


class TemplateRaised(RenderError):
    """The chat template itself raised (``raise_exception``, a jinja error) for one turn."""

    reason = "template error"
