"""The date a chat template sees: a setting, never the machine's clock.

Why this module exists: transformers gives every chat template a ``strftime_now(format)`` that reads
the clock (gpt-oss, Apertus and Solar Open render ``Current date: 2026-11-24`` into every system
message; Llama 3.x its ``date_string``). Rendered that way, the same data and template give other
rows every day, and nothing records why. onepass renders with a date that is a setting
(``DataConfig.template_date``, ``--template-date``; default: the day the run starts, resolved once
by :func:`resolve_template_date` and recorded in ``stats.json``, the run's config and its resume
fingerprint): the template's ``strftime_now`` is shadowed by a macro of the same name prepended to
its text (:func:`pinned_template`), which formats that date at midnight. That is jinja's own
scoping (a template's top-level macro hides a global of the same name, in its macros too), through
``apply_chat_template``'s public ``chat_template`` argument: no library internals are touched.

The other sources of change in transformers' template environment are jinja's own ``lipsum()``
global and ``random`` filter (random text, unseeded). No chat template we know uses them; one that
does cannot be pinned, so rendering it with a pinned date is refused in one line
(:func:`check_pinnable`). The rest of the environment (``raise_exception``, ``namespace``, ``dict``,
``range``, ``cycler``, ``joiner``) is deterministic.

    >>> text = pinned_template('Current date: {{ strftime_now("%Y-%m-%d") }}', "2026-11-24")
    >>> text.endswith('Current date: {{ strftime_now("%Y-%m-%d") }}'), text.count("\\n") == PINNED_LINES
    (True, True)

No torch here: this is pure data.
"""

from __future__ import annotations

import datetime
import functools
import json
import re
import string
from typing import Any

from onepass.errors import ConfigError

TEMPLATE_DATE = "onepass_template_date"
"""In a render's template kwargs: the pinned date (``YYYY-MM-DD``), taken out before the template sees them
(:func:`onepass.render.template.apply_template`); absent: the template reads the clock as transformers gives it."""
CLOCK_GLOBALS = ("strftime_now",)
"""Template globals that read the clock, each pinned by :func:`pinned_template`."""
_CLOCK = re.compile(r"\bstrftime_now\b")
_RANDOM = re.compile(r"\blipsum\s*\(|\|\s*random\b")  # jinja's random text: lipsum() and the random filter
_ISO_DATE = re.compile(r"\d{4}-\d{2}-\d{2}")
_DIRECTIVES = [f"%{c}" for c in string.ascii_letters + "%"] + [f"%-{c}" for c in string.ascii_letters]


def resolve_template_date(value: Any, *, today: datetime.date | None = None) -> str:
    """The date a template renders, as ``YYYY-MM-DD``: ``value`` checked (a ``date`` from YAML, or text),
    or ``today`` (the machine's date) when ``value`` is None. Called once, where a config is built.

    >>> resolve_template_date("2026-11-24"), resolve_template_date(datetime.date(2026, 1, 2))
    ('2026-11-24', '2026-01-02')
    >>> resolve_template_date(None, today=datetime.date(2027, 3, 1))
    '2027-03-01'
    >>> resolve_template_date("24/11/2026")
    Traceback (most recent call last):
    ...
    onepass.errors.ConfigError: template_date must be a date YYYY-MM-DD (--template-date), got '24/11/2026'
    """
    if value is None:
        return (today or datetime.date.today()).isoformat()
    if isinstance(value, datetime.datetime):  # a YAML timestamp: its day
        value = value.date()
    if isinstance(value, datetime.date):
        return value.isoformat()
    if isinstance(value, str) and _ISO_DATE.fullmatch(value.strip()):
        try:
            return datetime.date.fromisoformat(value.strip()).isoformat()
        except ValueError:
            pass
    raise ConfigError(f"template_date must be a date YYYY-MM-DD (--template-date), got {value!r}")


def reads_clock(template: str) -> bool:
    """True when ``template`` calls a clock global (:data:`CLOCK_GLOBALS`): its text depends on the date."""
    return _CLOCK.search(template) is not None


def check_pinnable(template: str) -> None:
    """Refuse, in one line, a template that draws random text (jinja's ``lipsum()`` or ``random`` filter):
    no date makes its rendering reproducible."""
    found = _RANDOM.search(template)
    if found is not None:
        raise ConfigError(f"the chat template draws random text ({found.group().strip(' (|')!r}), so the same "
                          "conversation renders differently on every call; onepass trains only reproducible "
                          "renderings: use a template without it")


PINNED_LINES = 1
"""Lines :func:`pinned_template` puts before the template's first line (error lines are reported without them)."""


@functools.lru_cache(maxsize=64)
def pinned_template(template: str, date: str) -> str:
    """``template`` with ``strftime_now`` shadowed by a macro formatting ``date`` at midnight, as
    ``datetime.strftime`` formats it (every directive, glibc's ``%-d`` forms too); the rendering is
    otherwise identical: the macro line's newline is the one ``trim_blocks`` removes, so the template's
    first line still starts a line. Cached: the same text object for the same inputs (transformers
    caches compiled templates by text)."""
    day = datetime.datetime.combine(datetime.date.fromisoformat(date), datetime.time())
    table = {}
    for directive in _DIRECTIVES:
        try:
            value = day.strftime(directive)
        except ValueError:  # a directive this platform's strftime refuses
            continue
        if value != directive:
            table[directive] = value
    macro = ("{% macro strftime_now(format) %}{% set table = " + json.dumps(table, sort_keys=True)
             + ' %}{% set ns = namespace(out="", pending="") %}{% for c in format %}'
             '{% if ns.pending == "" and c == "%" %}{% set ns.pending = "%" %}'
             '{% elif ns.pending == "%" and c == "-" %}{% set ns.pending = "%-" %}'
             '{% elif ns.pending %}{% set ns.out = ns.out ~ table.get(ns.pending ~ c, ns.pending ~ c) %}'
             '{% set ns.pending = "" %}'
             "{% else %}{% set ns.out = ns.out ~ c %}{% endif %}{% endfor %}"
             "{{ ns.out ~ ns.pending }}{% endmacro %}\n")
    assert macro.count("\n") == PINNED_LINES
    return macro + template


__all__ = ["CLOCK_GLOBALS", "PINNED_LINES", "TEMPLATE_DATE", "check_pinnable", "pinned_template", "reads_clock",
           "resolve_template_date"]
