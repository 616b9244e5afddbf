"""The table of template quirks (onepass.render.quirks.QUIRKS) holds for the vendored templates.

Each quirk's probe runs on every vendored template (tests/fixtures/chat_templates, with the named
templates of test_real_templates.NAMED) and must fire on exactly the templates the table lists: a
template update that gains or loses a quirk fails here, naming it. Each quirk names the test that
proves its handling and the function that holds it; both must exist. docs/templates.md's
"Template quirks" section is the table's own Markdown.
"""

from __future__ import annotations

import dataclasses
import importlib
import subprocess
import sys
from pathlib import Path

import pytest
from test_real_templates import EOS, TEMPLATES, chat_template

from onepass.render.fields import TemplateFields
from onepass.render.quirks import DOCS_BEGIN, DOCS_END, QUIRKS, Quirk, with_quirks_section
from onepass.render.views import RETRIES

ROOT = Path(__file__).parents[2]
DOCS = ROOT / "docs" / "templates.md"


@pytest.fixture(scope="module")
def showing(qwen3_tokenizer):
    """{quirk name: the vendored templates its probe fires on}, every probe run on every template."""
    before, eos = qwen3_tokenizer.chat_template, qwen3_tokenizer.eos_token
    found: dict[str, list[str]] = {q.name: [] for q in QUIRKS}
    try:
        for name in TEMPLATES:
            qwen3_tokenizer.chat_template, qwen3_tokenizer.eos_token = chat_template(name), EOS.get(name, eos)
            for quirk in QUIRKS:
                if quirk.probe(qwen3_tokenizer):
                    found[quirk.name].append(name)
    finally:
        qwen3_tokenizer.chat_template, qwen3_tokenizer.eos_token = before, eos
    return found


def test_quirk_names_are_unique_and_templates_are_vendored():
    assert len({q.name for q in QUIRKS}) == len(QUIRKS)
    for quirk in QUIRKS:
        assert set(quirk.templates) <= set(TEMPLATES), quirk.name
        assert list(quirk.templates) == sorted(quirk.templates), quirk.name


@pytest.mark.parametrize("quirk", QUIRKS, ids=[q.name for q in QUIRKS])
def test_each_probe_fires_on_exactly_the_templates_listed(showing, quirk: Quirk):
    assert showing[quirk.name] == list(quirk.templates), (
        f"quirk {quirk.name!r}: the probe fires on {showing[quirk.name]}, the table lists {list(quirk.templates)}")


@pytest.mark.parametrize("quirk", QUIRKS, ids=[q.name for q in QUIRKS])
def test_each_quirk_names_the_function_that_handles_it(quirk: Quirk):
    parts = quirk.where.split(".")
    for cut in range(len(parts) - 1, 0, -1):  # the longest importable module, then attributes
        try:
            target = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            target = getattr(target, attr)  # AttributeError names what moved
        return
    pytest.fail(f"{quirk.where}: no such module")


def test_every_retry_and_every_probed_field_is_a_quirk_of_the_table():
    """Model knowledge lives in the table: a new retry of a skipped turn, or a new field probed on the
    template, is a quirk some template shows, so it gets a row (and a proving test) here."""
    wheres = {q.where for q in QUIRKS}
    assert {f"{r.drop.__module__}.{r.drop.__qualname__}" for r in RETRIES} <= wheres
    described = " ".join(q.detected_by for q in QUIRKS)
    assert [f.name for f in dataclasses.fields(TemplateFields) if f"TemplateFields.{f.name}" not in described] == []


def test_each_proving_test_exists():
    files = sorted({q.proved_by.split("::")[0] for q in QUIRKS})
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:randomly",
                          "-p", "no:cacheprovider", *files], cwd=ROOT, capture_output=True, text=True)
    collected = set(out.stdout.split())
    missing = [q.proved_by for q in QUIRKS if q.proved_by not in collected]
    assert not missing, f"proving tests not collected: {missing}\n{out.stdout[-2000:]}{out.stderr[-2000:]}"


def test_the_docs_list_the_table():
    text = DOCS.read_text(encoding="utf-8")
    assert DOCS_BEGIN in text and DOCS_END in text
    assert text == with_quirks_section(text), (
        "docs/templates.md's quirks section is not the table: regenerate it with "
        "`python -m onepass.render.quirks docs/templates.md`")
