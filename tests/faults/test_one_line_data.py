"""Reserved names in ``--template-kwarg`` are one line (issue 37, round 3, data side).

Before: ``--template-kwarg messages=x`` or ``tokenize=true`` was a raw ``TypeError`` from jinja / transformers
(``got multiple values for keyword argument``), ``continue_final_message=true`` a raw ``ValueError``, and
``add_generation_prompt=true`` was overridden for every view without a word.
"""

from __future__ import annotations

import inspect

import pytest

from onepass.cli import main


@pytest.mark.parametrize("pair", ["messages=x", "tokenize=true", "continue_final_message=true",
                                  "add_generation_prompt=true", "tools=[]", "chat_template=x"])
def test_a_reserved_template_kwarg_is_one_line_before_the_work(tmp_path, capsys, pair):
    name = pair.split("=")[0]
    code = main(["prepare", "--data", "builtin:mathchat", "--limit", "1", "--template-kwarg", pair, "--no-progress",
                 "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1].startswith(f"onepass: error: --template-kwarg {name} is reserved (")
    assert not (tmp_path / "o").exists()


def test_the_reserved_names_cover_apply_chat_template_s_own_arguments():
    from transformers import PreTrainedTokenizerBase

    from onepass.render.template import RESERVED_KWARGS

    params = inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters
    own = {n for n, p in params.items() if n != "self" and p.kind is not inspect.Parameter.VAR_KEYWORD}
    assert own <= set(RESERVED_KWARGS), own - set(RESERVED_KWARGS)


def test_the_api_refuses_them_too():
    from onepass.prepare.config import DataConfig
    from onepass.errors import OnePassError

    with pytest.raises(OnePassError, match="--template-kwarg messages is reserved"):
        DataConfig(template_kwargs={"messages": []})
    assert DataConfig(template_kwargs={"enable_thinking": False}).render.template_kwargs == {"enable_thinking": False}


@pytest.mark.parametrize("command", ["prepare", "show", "data stats"])
def test_a_limit_below_1_is_one_line_not_every_conversation_skipped(tmp_path, capsys, command):
    # before: prepare --limit -1 read nothing and said "every conversation was skipped; first: the data has no
    # conversations", blaming the data for the flag
    out = {"prepare": ["--out", str(tmp_path / "o")], "show": ["--out", str(tmp_path / "m.png")], "data stats": []}
    with pytest.raises(SystemExit) as e:
        main([*command.split(), "--data", "builtin:mathchat", *out[command], "--limit", "-1"])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
        "error: argument --limit: must be at least 1 (a number of conversations), got -1")
