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
global and ``random`` filter (random text, unseeded: ``| random``, ``{% filter random %}``,
``map("random")``). No chat template we know uses them; one that does renders other text on every call
(two renderings of one view may agree by chance and train a random letter), so rendering it is refused
in one line, dated or not (:func:`check_pinnable`, read off the template's jinja tokens by
:func:`draws_random`, so the words in a string or a comment do not count). The rest of the environment
(``raise_exception``, ``namespace``, ``dict``, ``range``, ``cycler``, ``joiner``) is deterministic.
The pinned ``strftime_now`` takes its one argument as transformers' does: called without a format it
raises (transformers' raises ``TypeError``), so a view onepass trains never holds a date inference
cannot render.

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


@functools.lru_cache(maxsize=64)
def draws_random(template: str) -> str | None:
    """What in ``template`` draws random text, as the template writes it, or None: jinja's ``lipsum``
    global, its ``random`` filter (``x | random``, ``{% filter random %}``) or that filter named to ``map``
    (``map("random")``). Read off the template's jinja tokens, so "random" in a string, a comment or an
    attribute (``x.random``) is not a use. A template that does not lex is left to the compile check
    (:func:`onepass.render.tokenizer.check_template`).

    >>> draws_random("{% filter random %}ab{% endfilter %}"), draws_random("{{ '| random' }}{# lipsum #}")
    ('{% filter random %}', None)
    """
    from jinja2 import Environment
    from jinja2.exceptions import TemplateSyntaxError

    try:
        tokens = [(kind, value) for _, kind, value in Environment().lex(template)
                  if kind not in ("whitespace", "comment", "linecomment")]
    except TemplateSyntaxError:
        return None
    for i, (kind, value) in enumerate(tokens):
        before = tokens[max(0, i - 2):i]
        if kind == "name" and value == "lipsum":
            return "lipsum"
        if kind == "name" and value == "random" and before[-1:] == [("operator", "|")]:
            return "| random"
        if kind == "name" and value == "random" and before[-1:] == [("name", "filter")]:
            return "{% filter random %}"
        if kind == "string" and value[1:-1] == "random" and before == [("name", "map"), ("operator", "(")]:
            return f"map({value})"
    return None


def check_pinnable(template: str) -> None:
    """Refuse, in one line, a template that draws random text (:func:`draws_random`): no date makes its
    rendering reproducible, and a view whose prompt and completion renderings happen to agree would train
    a random draw."""
    found = draws_random(template)
    if found is not None:
        raise ConfigError(f"the chat template draws random text ({found!r}), so the same conversation renders "
                          "differently on every call; onepass trains only reproducible renderings: use a "
                          "template without it")


PINNED_LINES = 1
"""Lines :func:`pinned_template` puts before the template's first line (error lines are reported without them)."""


@functools.lru_cache(maxsize=64)
def pinned_template(template: str, date: str) -> str:
    """``template`` with ``strftime_now`` shadowed by a macro formatting ``date`` at midnight, as
    ``datetime.strftime`` formats it (every directive, glibc's ``%-d`` forms too); the rendering is
    otherwise identical: the macro line's newline is the one ``trim_blocks`` removes, so the template's
    first line still starts a line. Called without a format it raises as transformers' does (``TypeError:
    strftime_now() missing 1 required positional argument``), where a macro would render an empty date.
    Cached: the same text object for the same inputs (transformers caches compiled templates by text)."""
    day = datetime.datetime.combine(datetime.date.fromisoformat(date), datetime.time())
    table = {}
    for directive in _DIRECTIVES:
        try:
            value = day.strftime(directive)
        except ValueError:  # a directive this platform's strftime refuses
            continue
        if value != directive:
            table[directive] = value
    macro = ("{% macro strftime_now(format) %}{% if format is not defined %}"
             "{{ raise_exception(\"strftime_now() missing 1 required positional argument: 'format'\") }}"
             "{% endif %}{% set table = " + json.dumps(table, sort_keys=True)
             + ' %}{% set ns = namespace(out="", pending="") %}{% for c in format %}'
             '{% if ns.pending == "" and c == "%" %}{% set ns.pending = "%" %}'
             '{% elif ns.pending == "%" and c == "-" %}{% set ns.pending = "%-" %}'
             '{% elif ns.pending %}{% set ns.out = ns.out ~ table.get(ns.pending ~ c, ns.pending ~ c) %}'
             '{% set ns.pending = "" %}'
             "{% else %}{% set ns.out = ns.out ~ c %}{% endif %}{% endfor %}"
             "{{ ns.out ~ ns.pending }}{% endmacro %}\n")
    assert macro.count("\n") == PINNED_LINES
    return macro + template


__all__ = ["CLOCK_GLOBALS", "PINNED_LINES", "TEMPLATE_DATE", "check_pinnable", "draws_random", "pinned_template",
           "reads_clock", "resolve_template_date"]
