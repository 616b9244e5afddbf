"""The date a chat template renders is a setting, never the machine's clock (issue 33).

gpt-oss' template renders ``Current date: {{ strftime_now("%Y-%m-%d") }}`` into every system message: before
``template_date`` the same data prepared on two days gave two datasets (and the suite's recorded digests
failed the day after they were written). Here: two dates give rows that differ only in the date's tokens;
one pinned date gives the same bytes whatever the clock says (faked in process, and with ``faketime``
where it is installed); the date is recorded in stats.json, the run's config and the resume fingerprint.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import transformers.utils.chat_template_utils as hf_templates

from onepass.prepare.config import DataConfig
from onepass.errors import ConfigError
from onepass.prepare.pipeline import PrepareConfig, prepare
from onepass.render import RenderConfig, render_conversation
from onepass.render.clock import TEMPLATE_DATE, pinned_template, resolve_template_date
from onepass.render.template import apply_template, render_or_none, template_line
from onepass.prepare.template_report import TOOL_CHAIN_RECORDS, tool_chain_conversations
from onepass.layout.tree import COLUMNS

TEMPLATES = Path(__file__).parents[1] / "fixtures" / "chat_templates"
GPTOSS = (TEMPLATES / "gptoss.jinja").read_text(encoding="utf-8")
SHARED = Path(__file__).parents[3] / "shared" / "fixtures" / "chat_templates" / "reasoning"
Q = [{"role": "user", "content": "q"}]


@pytest.fixture
def gptoss(with_template):
    return with_template(GPTOSS)


def _prepare(tokenizer, date):
    rows, stats = prepare(tool_chain_conversations(), tokenizer, PrepareConfig(template_date=date))
    return rows, stats


def _digest(rows) -> str:
    h = hashlib.sha256()
    for row in rows:
        for column in COLUMNS:
            h.update(getattr(row, column).tobytes())
    return h.hexdigest()


class _FakeNow(datetime.datetime):
    """transformers' ``strftime_now`` reads ``datetime.now()``: this one says 2031-02-03 14:15."""

    @classmethod
    def now(cls, tz=None):
        return cls(2031, 2, 3, 14, 15)


def test_two_dates_give_rows_that_differ_only_in_the_dates_tokens(gptoss):
    (a, stats_a), (b, stats_b) = _prepare(gptoss, "2026-11-24"), _prepare(gptoss, "2027-03-05")
    assert (stats_a.template_date, stats_b.template_date) == ("2026-11-24", "2027-03-05")
    assert len(a) == len(b) > 0 and stats_a.views_trained == stats_b.views_trained > 0
    changed = 0
    for x, y in zip(a, b, strict=True):
        for column in ("position_ids", "kv_end", "targets", "weights"):  # the tree and what is trained: the same
            np.testing.assert_array_equal(getattr(x, column), getattr(y, column))
        differ = np.flatnonzero(x.input_ids != y.input_ids)
        changed += len(differ)
        text_a, text_b = gptoss.decode(x.input_ids), gptoss.decode(y.input_ids)
        assert text_a.count("Current date: 2026-11-24") > 0
        assert text_a.replace("2026-11-24", "2027-03-05") == text_b  # the date, and nothing else
        assert all(gptoss.decode(x.input_ids[i:i + 1]).strip() in "2026-11-24" for i in differ)
    assert changed > 0


def test_a_pinned_date_gives_the_same_rows_whatever_the_clock_says(gptoss, monkeypatch):
    before = _digest(_prepare(gptoss, "2026-11-24")[0])
    unpinned = render_or_none(gptoss, [{"role": "user", "content": "q"}], tools=None,
                              kwargs={"add_generation_prompt": True})
    monkeypatch.setattr(hf_templates, "datetime", _FakeNow)  # the clock transformers' strftime_now reads
    faked = render_or_none(gptoss, [{"role": "user", "content": "q"}], tools=None,
                           kwargs={"add_generation_prompt": True})
    assert "Current date: 2031-02-03" in faked and faked != unpinned  # the fake clock is the template's clock
    rows, stats = _prepare(gptoss, "2026-11-24")
    assert _digest(rows) == before and stats.template_date == "2026-11-24"
    assert "2031" not in gptoss.decode(rows[0].input_ids)


_UNDER_FAKETIME = """
import hashlib, json
from onepass.prepare.pipeline import PrepareConfig, prepare
from onepass.prepare.template_report import tool_chain_conversations
from onepass.render.tokenizer import load_tokenizer
tok = load_tokenizer("builtin:qwen3", chat_template=TEMPLATE)
out = {}
for name, config in (("pinned", PrepareConfig(template_date="2026-11-24")), ("default", PrepareConfig())):
    rows, stats = prepare(tool_chain_conversations(), tok, config)
    h = hashlib.sha256(b"".join(getattr(r, c).tobytes() for r in rows for c in ("input_ids", "position_ids",
                                                                                 "kv_end", "targets", "weights")))
    out[name] = [h.hexdigest(), stats.template_date]
print(json.dumps(out))
"""


def _without_faketime(environ):
    """``environ`` with an outer libfaketime taken out (the suite run under ``faketime`` to try another date):
    faketime inside faketime adds the two offsets (2031 inside 2026 gave 2022), so the days faked below would
    not be the days asked for."""
    env = {k: v for k, v in environ.items() if not k.startswith("FAKETIME")}
    preload = [p for p in env.get("LD_PRELOAD", "").split() if "faketime" not in p]
    if preload:
        env["LD_PRELOAD"] = " ".join(preload)
    else:
        env.pop("LD_PRELOAD", None)
    return env


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.skipif(shutil.which("faketime") is None, reason="needs faketime (apt-get install faketime)")
def test_prepare_on_another_day_of_the_machine_clock_gives_the_same_rows():
    """The whole process under a faked clock (libfaketime: every time, gettimeofday and clock_gettime call):
    a pinned date gives byte-identical rows on any day; the default is the faked day, resolved once."""
    env = {**_without_faketime(os.environ), "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}
    script = _UNDER_FAKETIME.replace("TEMPLATE", repr(str(TEMPLATES / "gptoss.jinja")))
    seen = {}
    for day in ("2026-11-24", "2031-02-03"):
        result = subprocess.run(["faketime", f"{day} 23:59:30", sys.executable, "-c", script], env=env,
                                capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr[-2000:]
        seen[day] = json.loads(result.stdout.strip().splitlines()[-1])
    assert seen["2026-11-24"]["pinned"] == seen["2031-02-03"]["pinned"] == seen["2026-11-24"]["default"][:1] + [
        "2026-11-24"]
    assert seen["2031-02-03"]["default"][1] == "2031-02-03"  # the default: the faked today
    assert seen["2031-02-03"]["default"][0] != seen["2031-02-03"]["pinned"][0]  # the date is in the rows


def test_the_pinned_macro_formats_as_strftime_does(with_template):
    tok = with_template("{% for f in formats %}[{{ strftime_now(f) }}]{% endfor %}")
    formats = ["%Y-%m-%d", "%d %b %Y", "%A %-d %B, %H:%M:%S %% %j %y %a %p", "no directive", "%", "100%"]
    text = apply_template(tok, Q, tools=None, kwargs={"formats": formats, TEMPLATE_DATE: "2027-03-05"})
    day = datetime.datetime(2027, 3, 5)
    assert text == "".join(f"[{day.strftime(f)}]" for f in formats)


def test_pinning_changes_nothing_but_the_date(with_template):
    """The macro is a line the template never sees: leading whitespace, lstrip_blocks, macros calling the
    clock, ``strftime_now is defined`` and the template's own error lines are as they were."""
    body = ("\n  {% if true %}x{% endif %}\n{%- macro d() %}{{ strftime_now('%Y') }}{% endmacro %}"
            "{{ d() }}|{% if strftime_now is defined %}defined{% endif %}\n")
    literal = body.replace("{{ strftime_now('%Y') }}", "2027")
    assert pinned_template(body, "2027-03-05").endswith(body)
    assert (apply_template(with_template(body), Q, tools=None, kwargs={TEMPLATE_DATE: "2027-03-05"})
            == apply_template(with_template(literal), Q, tools=None, kwargs={}))
    raising = "{{ strftime_now('%Y') }}\n\n{{ raise_exception('stop') }}"
    for kwargs in ({}, {TEMPLATE_DATE: "2027-03-05"}):
        with pytest.raises(Exception) as info:
            apply_template(with_template(raising), Q, tools=None, kwargs=kwargs)
        assert template_line(info.value) == 3


def test_a_template_that_draws_random_text_is_refused_in_one_line(with_template):
    tok = with_template("{{ strftime_now('%Y') }} {{ ['a', 'b'] | random }}")
    with pytest.raises(ConfigError, match="draws random text"):
        apply_template(tok, Q, tools=None, kwargs={TEMPLATE_DATE: "2027-03-05"})


@pytest.mark.parametrize("name", ["gptoss", "apertus", "solar_open"])
def test_every_vendored_template_that_reads_the_clock_renders_the_pinned_date(with_template, name):
    path = TEMPLATES / f"{name}.jinja" if (TEMPLATES / f"{name}.jinja").exists() else SHARED / f"{name}.jinja"
    if not path.exists():
        pytest.skip(f"{path} not here (the shared fixtures sit beside the repository)")
    tok = with_template(path.read_text(encoding="utf-8"))
    messages = [{"role": "user", "content": "q"}]
    text = apply_template(tok, messages, tools=None, kwargs={"add_generation_prompt": True,
                                                             TEMPLATE_DATE: "2027-03-05"})
    assert "2027-03-05" in text


def test_every_vendored_template_reading_the_clock_or_randomness_is_known():
    """The templates we ship or test against: the ones that call a clock global are the three above, and
    none draws random text (a new one must be added to the test above or refused)."""
    from onepass.render.clock import draws_random, reads_clock

    paths = sorted(TEMPLATES.glob("*.jinja")) + sorted(SHARED.glob("*.jinja"))
    assert {p.stem for p in paths if reads_clock(p.read_text(encoding="utf-8"))} <= {"gptoss", "apertus",
                                                                                     "solar_open"}
    assert not [p for p in paths if draws_random(p.read_text(encoding="utf-8"))]


def test_transformers_template_globals_that_read_the_clock_are_the_ones_pinned():
    """transformers' template environment: the globals it adds, beside jinja's own. A new global (one that
    could read the clock or draw at random) fails here until it is pinned or known deterministic."""
    env = hf_templates._compile_jinja_template("x").environment
    known = {"raise_exception", "strftime_now", "dict", "namespace",  # transformers' (strftime_now: pinned)
             "range", "lipsum", "cycler", "joiner"}  # jinja's (lipsum: refused)
    assert set(env.globals) <= known, set(env.globals) - known
    assert "random" in env.filters  # jinja's random filter: refused (test above)


def test_the_date_is_resolved_once_and_carried():
    assert resolve_template_date(None, today=datetime.date(2031, 2, 3)) == "2031-02-03"
    config = DataConfig()
    datetime.date.fromisoformat(config.template_date)  # a concrete date, from the day the config was built
    assert config.replace(schedule="n-pass").template_date == config.template_date
    assert config.render.template_date == config.template_date
    assert config.render.kwargs()[TEMPLATE_DATE] == config.template_date
    assert DataConfig(template_date=datetime.date(2026, 11, 24)).template_date == "2026-11-24"  # YAML's date
    assert DataConfig(template_date="2026-11-24").to_dict()["template_date"] == "2026-11-24"
    for bad in ("24/11/2026", "2026-13-01", "20261124", 20261124):
        with pytest.raises(ConfigError, match="template_date must be a date YYYY-MM-DD"):
            DataConfig(template_date=bad)


def test_a_library_render_without_a_date_reads_the_clock_as_transformers_does(gptoss, monkeypatch):
    monkeypatch.setattr(hf_templates, "datetime", _FakeNow)
    conv = tool_chain_conversations()[0]
    unpinned = render_conversation(conv, gptoss, RenderConfig()).views[0]
    pinned = render_conversation(conv, gptoss, RenderConfig(template_date="2026-11-24")).views[0]
    assert "2031-02-03" in gptoss.decode(unpinned.tokens) and "2026-11-24" in gptoss.decode(pinned.tokens)


def test_prepare_records_the_date_in_stats_json(tmp_path):
    from onepass.cli import main

    out = tmp_path / "prepared"
    assert main(["prepare", "--data", "builtin:mathchat", "--limit", "2", "--out", str(out), "--no-progress",
                 "--template-date", "2026-11-24"]) == 0
    assert json.loads((out / "stats.json").read_text())["template_date"] == "2026-11-24"


def test_a_bad_date_flag_is_one_line(tmp_path, capsys):
    from onepass.cli import main

    assert main(["prepare", "--data", "builtin:mathchat", "--limit", "2", "--out", str(tmp_path / "p"),
                 "--template-date", "tomorrow"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "template_date must be a date YYYY-MM-DD" in err[0]


def test_train_config_and_onepass_config_carry_the_date(tmp_path):
    import yaml

    from onepass.train.config import config_from_dict, write_yaml
    from onepass.train.hf_config import OnePassConfig

    config = config_from_dict({"tiny": "qwen3", "data": "builtin:mathchat", "template_date": "2026-11-24",
                               "output_dir": str(tmp_path)}, where="test")
    assert config.data_config.template_date == "2026-11-24"
    write_yaml(config, tmp_path / "c.yaml")
    assert yaml.safe_load((tmp_path / "c.yaml").read_text())["template_date"] in ("2026-11-24",
                                                                                   datetime.date(2026, 11, 24))
    args = OnePassConfig(str(tmp_path), report_to="none", use_cpu=True, template_date="2026-11-24")
    assert args.data_config.template_date == "2026-11-24" and args.to_dict()["template_date"] == "2026-11-24"
    default = OnePassConfig(str(tmp_path), report_to="none", use_cpu=True)
    datetime.date.fromisoformat(default.template_date)  # resolved when built, shown in to_dict()
    assert default.data_config.template_date == default.template_date


def test_the_resume_fingerprint_holds_the_date_where_the_template_reads_it(gptoss, tmp_path):
    from onepass.train.config import config_from_dict
    from onepass.train.fingerprint import check_fingerprint, rendered_date

    def config(date):
        return config_from_dict({"tiny": "qwen3", "data": "builtin:mathchat", "template_date": date,
                                 "output_dir": str(tmp_path)}, where="test")

    assert rendered_date(config("2026-11-24"), gptoss, renders=True) == "2026-11-24"
    assert rendered_date(config("2026-11-24"), gptoss, renders=False) is None  # prepared rows: no rendering
    saved = {"data": "d", "tokenizer": "t", "template_date": "2026-11-24"}
    now = {"data": "d", "tokenizer": "t", "template_date": "2026-11-25"}
    with pytest.raises(ConfigError, match="template_date .*pass --template-date 2026-11-24"):
        check_fingerprint(saved, now, tmp_path, anyway=False, say=print)
    check_fingerprint(saved, dict(saved), tmp_path, anyway=False, say=print)


def test_the_fingerprint_ignores_the_date_of_a_template_that_never_reads_it(qwen3_tokenizer, tmp_path):
    from onepass.train.config import config_from_dict
    from onepass.train.fingerprint import rendered_date

    config = config_from_dict({"tiny": "qwen3", "data": "builtin:mathchat", "output_dir": str(tmp_path)},
                              where="test")
    assert rendered_date(config, qwen3_tokenizer, renders=True) is None  # Qwen3 resumes on any day
