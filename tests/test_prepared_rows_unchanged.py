"""Prepared rows are byte-identical to those recorded before the rendering code was reorganised (issue 27).

The fixture ``fixtures/prepared_rows.json`` holds, per vendored template and rendering setting (every
row of ``test_real_templates.CASES``) and for the bundled data, a SHA-256 of the prepared columns
(``input_ids, position_ids, kv_end, targets, weights``, as bytes), of the skip messages and of the
statistics. It was written by the code on main before ``onepass.render`` became a package; a refactor
that changes one byte of a row, one skip message or one count fails here. Regenerate only for an
intended change of output (``python tests/test_prepared_rows_unchanged.py``), and say why in the commit.

The date the templates render (gpt-oss' ``Current date``) is pinned to :data:`RECORDED`, the day the
digests were written, so the rows are the same on any day; the statistics' ``template_date`` (recorded since
issue 33, after the fixture) is left out of the digest, the date being the config's, and so are the counts
added after it (:data:`LATER`).
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest

import onepass

sys.path.insert(0, str(Path(__file__).parent))

from test_real_templates import CASES, EOS, chat_template  # noqa: E402

from onepass.data.sources import load_conversations  # noqa: E402
from onepass.prepare.pipeline import PrepareConfig, prepare  # noqa: E402
from onepass.render import render_conversation  # noqa: E402
from onepass.prepare.template_report import tool_chain_conversations  # noqa: E402
from onepass.layout.tree import COLUMNS  # noqa: E402

FIXTURE = Path(__file__).parent / "fixtures" / "prepared_rows.json"
RECORDED = "2026-11-24"  # the day the digests were written: the date the templates render here
LATER = ("template_date", "train_turns", "turns_not_selected", "single_rendering")  # stats recorded after the
# fixture: the template's date (issue 33), the turns selected and what a single rendering trains (issue 46)
BUNDLED = {  # the bundled data, Qwen3's own template: a schedule per row layout (trees, packed, windows)
    "builtin:mathchat one-pass": PrepareConfig(template_date=RECORDED),
    "builtin:mathchat n-pass packed": PrepareConfig(schedule="n-pass", pack=True, max_tokens=4096,
                                                    template_date=RECORDED),
    "builtin:mathchat one-pass max 512": PrepareConfig(max_tokens=512, weighting="turn", template_date=RECORDED),
}


def digest(rows, stats, extra=()) -> str:
    h = hashlib.sha256()
    for row in rows:
        for column in COLUMNS:
            array = getattr(row, column)
            h.update(f"{column}:{array.dtype}:{array.shape}".encode())
            h.update(array.tobytes())
    counts = {k: v for k, v in stats.to_dict().items() if k not in LATER}  # the fixture predates them
    text = json.dumps([counts, list(extra)], sort_keys=True, default=str)
    h.update(text.replace(str(Path(onepass.__file__).parent), "<onepass>").encode())  # bundled data's path
    return h.hexdigest()


def template_digest(tokenizer, case) -> str:
    before, eos = tokenizer.chat_template, tokenizer.eos_token
    tokenizer.chat_template = chat_template(case.template)
    tokenizer.eos_token = EOS.get(case.template, eos)
    try:
        config = PrepareConfig(completion_format=case.completion_format, template_kwargs=case.template_kwargs,
                               reasoning=case.reasoning, template_date=RECORDED)
        convs = tool_chain_conversations()
        skips = [str(e) for conv in convs for e in render_conversation(conv, tokenizer, config.render).skipped]
        return digest(*prepare(convs, tokenizer, config), extra=skips)
    finally:
        tokenizer.chat_template, tokenizer.eos_token = before, eos


def bundled_digest(tokenizer, name: str) -> str:
    convs = load_conversations(name.split()[0], strict=False).conversations
    return digest(*prepare(convs, tokenizer, BUNDLED[name]))


def expected() -> dict[str, str]:
    return json.loads(FIXTURE.read_text(encoding="utf-8"))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_prepared_rows_on_every_vendored_template_are_byte_identical(qwen3_tokenizer, case):
    assert template_digest(qwen3_tokenizer, case) == expected()[case.id]


@pytest.mark.parametrize("name", BUNDLED)
def test_prepared_rows_of_the_bundled_data_are_byte_identical(qwen3_tokenizer, name):
    assert bundled_digest(qwen3_tokenizer, name) == expected()[name]


def test_the_fixture_covers_every_case():
    assert set(expected()) == {c.id for c in CASES} | set(BUNDLED)


if __name__ == "__main__":  # regenerate (only for an intended change of output)
    from onepass.render.tokenizer import load_tokenizer

    tok = load_tokenizer("builtin:qwen3")
    out = {c.id: template_digest(tok, c) for c in CASES} | {n: bundled_digest(tok, n) for n in BUNDLED}
    FIXTURE.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    print(f"wrote {len(out)} digests to {FIXTURE}")
