"""Rendering: a conversation's views, one per assistant turn, by the model's own chat template.

The one entry is :func:`render_conversation` (:func:`render_views` raises the first skipped turn
instead); its rule is in :mod:`onepass.render.views`. The package's rooms, one concept each:

- ``template``  the one call of ``apply_chat_template``, and how a template error names its line
- ``clock``     the date a template renders: a setting (``template_date``), never the machine's clock
- ``fields``    what the template expects of a message's fields (probed once per template)
- ``sources``   where a completion comes from (template split, derived format, given format) and the checks
- ``derived``   the derived generation format, read off a probe turn
- ``formats``   ``--completion-format``: named formats, filled with the template's own tool calls
- ``reasoning`` reasoning left out, counted: ``--reasoning drop``, or an earlier turn's the template drops
- ``encode``    encoding each distinct piece of text once
- ``errors``    why a turn gives no view
- ``quirks``    which real templates take which of these paths, each with its probe and proving test (data)
- ``single``    what one rendering of the whole conversation would train instead of the views (counted)

No torch here: this is pure data.
"""

from onepass.render.errors import ReasoningNotRendered, RenderError, TemplateRaised, UnopenedReasoning
from onepass.render.formats import COMPLETION_FORMATS
from onepass.render.views import (
    RenderConfig,
    Rendered,
    merges_across,
    render_conversation,
    render_prompt,
    render_texts,
    render_views,
)

__all__ = ["COMPLETION_FORMATS", "ReasoningNotRendered", "RenderConfig", "RenderError", "Rendered", "TemplateRaised",
           "UnopenedReasoning", "merges_across", "render_conversation", "render_prompt", "render_texts", "render_views"]
