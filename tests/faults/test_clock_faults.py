"""A chat template's clock and dice (issue 44, items 3 and 5): what onepass renders is what inference renders.

Before the fix (b757769): the random-text check ran only for a template that also read the clock, and read the
text with a pattern that ``{% filter random %}`` and ``map("random")`` pass. Every other template was rendered:
a view was kept when the prompt's and the conversation's random draws happened to agree, skipped when not
(``{% filter random %}``: 4 of 4 views trained in one run, each starting with a random letter; ``| random``: 2
of 4), where docs/templates.md promises a one-line refusal. The pinned ``strftime_now`` macro rendered an empty date when called without a
format, where transformers' own ``strftime_now(format)`` raises, so inference would fail on text onepass
trained.
"""

from __future__ import annotations

import json

import pytest

from onepass.cli import main
from onepass.render.clock import TEMPLATE_DATE
from onepass.render.template import apply_template, is_template_error

CHATML = ("{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
Q = [{"role": "user", "content": "q"}]
RANDOM = {  # each draws random text on its own: none reads the clock
    "filter block": "{% filter random %}ab{% endfilter %}" + CHATML,
    "random filter": "{{ ['a', 'b'] | random }}" + CHATML,
    "lipsum": "{{ lipsum(1) }}" + CHATML,
    "map random": "{{ [['a', 'b']] | map('random') | join }}" + CHATML,
}


def _chats(tmp_path, n=4):
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"question {i}"},
                                                     {"role": "assistant", "content": f"answer {i}"}]}) + "\n"
                            for i in range(n)))
    return path


def _prepare(tmp_path, capsys, template: str, *extra: str):
    (tmp_path / "t.jinja").write_text(template)
    code = main(["prepare", "--data", str(_chats(tmp_path)), "--tokenizer", "builtin:qwen3", "--chat-template",
                 str(tmp_path / "t.jinja"), "--out", str(tmp_path / "out"), "--no-progress", *extra])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("name", ["filter block", "random filter"])  # each form at every render: the test below
def test_a_template_that_draws_random_text_is_refused_in_one_line_before_the_data(tmp_path, capsys, name):
    code, out, err = _prepare(tmp_path, capsys, RANDOM[name])
    assert code == 2, (code, out, err)
    assert err.strip().splitlines()[-1].startswith("onepass: error: the chat template draws random text ("), err
    assert not (tmp_path / "out").exists()  # nothing written, no row of a random draw


@pytest.mark.parametrize("name", list(RANDOM))
def test_every_render_refuses_it_dated_or_not(with_template, name):
    from onepass.errors import ConfigError

    tok = with_template(RANDOM[name])
    for kwargs in ({}, {TEMPLATE_DATE: "2027-03-05"}):  # a library render without a date too
        with pytest.raises(ConfigError, match="draws random text"):
            apply_template(tok, Q, tools=None, kwargs=kwargs)


def test_the_word_random_in_a_string_comment_or_attribute_is_not_random_text(tmp_path, capsys):
    # reference (passes on the old tree too): the check reads jinja tokens, so these are rendered as before
    template = "{# pick one at random #}{{ '| random lipsum(' }}{% set x = namespace(random=1) %}{{ x.random }}" + CHATML
    code, out, err = _prepare(tmp_path, capsys, template)
    assert code == 0, (out, err)


def test_strftime_now_without_a_format_raises_as_transformers_does(with_template):
    tok = with_template("{{ strftime_now() }}" + CHATML)
    raised = {}
    for kwargs in ({}, {TEMPLATE_DATE: "2027-03-05"}):  # transformers' own strftime_now, then the pinned macro
        with pytest.raises(Exception) as info:
            apply_template(tok, Q, tools=None, kwargs=kwargs)
        assert is_template_error(info.value)  # a template error: the view is a counted skip, as at inference
        raised["pinned" if kwargs else "transformers"] = str(info.value)
    assert "missing 1 required positional argument: 'format'" in raised["transformers"]
    assert raised["transformers"].endswith(raised["pinned"]), raised  # transformers' names its function's qualname
    pinned = apply_template(with_template("[{{ strftime_now(format='%Y') }}]" + CHATML), Q, tools=None,
                            kwargs={TEMPLATE_DATE: "2027-03-05"})
    assert pinned.startswith("[2027]")  # the format by keyword, as transformers' function takes it


def test_prepare_trains_no_empty_date(tmp_path, capsys):
    code, out, err = _prepare(tmp_path, capsys, "Date: {{ strftime_now() }}\n" + CHATML)
    assert code == 1 and "template error: 4" in out, (out, err)  # every view the template's skip, none trained
    assert "nothing to write" in err
