"""The pre-skip (onepass.render.preskip): a view proven over ``max_tokens`` from the messages it must hold is
skipped without calling the template, never a view that fits, and only where the conversation proves that its
template renders those messages verbatim (issue 37: a long conversation's budgeted render is linear).

The reference everywhere is the same render with the pre-skip off (``views._preskip`` returning None): every
view rendered, then skipped for its length. With the pre-skip on, the prepared rows are byte-identical and
every count of ``stats.json`` is equal; only the skip line of a view skipped unrendered differs (it names a
floor, not the length it never learnt). tests/faults/test_render_calls.py shows the cost is linear.
"""

from __future__ import annotations

import itertools
import json
import random
import re
import sys
from pathlib import Path

import numpy as np
import pytest

import onepass.render.views as views_module
from onepass.conversation.parse import parse_record
from onepass.prepare.pipeline import PrepareConfig, prepare
from onepass.render import RenderConfig, render_conversation, render_texts
from onepass.render.preskip import History, Preskip, holds
from onepass.render.encode import encode_plain, encode_texts
from onepass.render.token_floor import parts_floor
from onepass.prepare.template_report import TOOL_CHAIN_RECORDS
from onepass.layout.tree import COLUMNS
from onepass.layout.view import Unmeasured, over_budget

sys.path.insert(0, str(Path(__file__).parents[1]))

from test_real_templates import CASES, EOS, chat_template  # noqa: E402

SHARED = Path(__file__).parents[3] / "shared" / "fixtures" / "chat_templates" / "reasoning"
AGENT = Path(__file__).parents[3] / "shared" / "data" / "agent"
DATE = "2026-11-24"
# A template that renders every message as given, and one that does not render a user message verbatim
# (upper-cased), one that renders only the last 6 messages, and one that writes a tool result as JSON.
PLAIN = ("{% for m in messages %}<|im_start|>{{ m.role }}\n"
         "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}{{ m.content }}"
         "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }}</tool_call>{% endfor %}<|im_end|>\n"
         "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
NOT_VERBATIM = {
    "upper-cased user": PLAIN.replace("{{ m.content }}", "{{ m.content | upper if m.role == 'user' else m.content }}"),
    "last 6 messages": PLAIN.replace("{% for m in messages %}", "{% for m in messages[-6:] %}"),
    "tool result as JSON": PLAIN.replace("{{ m.content }}",
                                         "{{ m.content | tojson if m.role == 'tool' else m.content }}"),
}


def _off(*args, **kwargs):
    return None


@pytest.fixture(autouse=True)
def renders_once(qwen3_tokenizer):
    """Each distinct text render of the shared tokenizer's template is made once per test: the reference (the
    pre-skip off) renders every view of the same conversations for every budget, and the prepare with the
    pre-skip on renders the same views again. A render is a pure function of the template, the special tokens
    and the call's arguments (the date is pinned), all of which are the key, so every comparison here holds the
    same texts it would hold rendered anew; only the repeats are left out (the real-template sweep's CPU: 60 ->
    26 s). A call that raises is not kept: it raises again."""
    render = qwen3_tokenizer.apply_chat_template
    texts: dict[str, str] = {}

    def apply_chat_template(*args, **kwargs):
        if kwargs.get("tokenize", True):
            return render(*args, **kwargs)
        key = json.dumps([qwen3_tokenizer.chat_template, qwen3_tokenizer.special_tokens_map, args, kwargs],
                         sort_keys=True, default=repr)
        if key not in texts:
            texts[key] = render(*args, **kwargs)
        return texts[key]

    qwen3_tokenizer.apply_chat_template = apply_chat_template
    yield texts
    del qwen3_tokenizer.apply_chat_template  # the class's method again


def long_tool_chain(rounds: int, words: int = 3) -> dict:
    """Tool-chain record 2 (two calls in a turn, a chain of calls, a user's thanks) played ``rounds`` times,
    each user and tool content lengthened by a line of ``words`` words: 4 assistant turns a round."""
    record = TOOL_CHAIN_RECORDS[2]
    messages = []
    for i in range(rounds):
        for m in record["messages"]:
            m = dict(m)
            if m["role"] in ("user", "tool"):
                m["content"] += f" (round {i}:\n" + "the weather data is ready " * words + ")"
            messages.append(m)
    return {"tools": record["tools"], "system": "You are a weather bot.", "messages": messages}


def chat(turns: int, seed: int = 0) -> dict:
    """Questions and answers with reasoning, of random lengths."""
    rng = random.Random(seed)
    messages = []
    for i in range(turns):
        messages += [{"role": "user", "content": f"Question {i}: " + "what is it " * rng.randint(1, 30)},
                     {"role": "assistant", "content": f"It is {i}. " * rng.randint(1, 20),
                      "reasoning_content": "think " * rng.randint(0, 10)}]
    return {"messages": messages}


_SKIP = re.compile(r"view of (?:at least )?\d+ tokens(?: \([^)]*\))?")


def prepare_both(records, tokenizer, config, monkeypatch):
    """(rows, stats) with the pre-skip, (rows, stats) without it, and how many views were skipped unrendered."""
    convs = [parse_record(r, index=i) for i, r in enumerate(records)]
    with_preskip = prepare(convs, tokenizer, config)
    monkeypatch.setattr(views_module, "_preskip", _off)
    without = prepare(convs, tokenizer, config)
    monkeypatch.undo()
    return with_preskip, without, sum("(not rendered:" in line for line in with_preskip[1].skipped)


def assert_same_prepare(got, want) -> None:
    """Rows byte-identical; every count equal; the skip lines equal but for the length a view skipped
    unrendered never learnt."""
    (rows, stats), (ref_rows, ref_stats) = got, want
    assert len(rows) == len(ref_rows)
    for row, ref in zip(rows, ref_rows):
        for c in COLUMNS:
            assert np.array_equal(getattr(row, c), getattr(ref, c)), c
    counts, ref_counts = stats.to_dict(), ref_stats.to_dict()
    skipped, ref_skipped = counts.pop("skipped"), ref_counts.pop("skipped")
    assert counts == ref_counts  # views, trained, skipped by reason, derived, tokens, ...
    def unlearnt(lines):
        return [_SKIP.sub("view of N tokens", s) for s in lines]

    assert unlearnt(skipped) == unlearnt(ref_skipped)


def test_holds_finds_parts_in_order_without_overlap():
    assert holds("abcabc", ["abc", "abc"]) and holds("xaybz", ["a", "b"]) and holds("anything", [])
    assert not holds("abc", ["abc", "abc"]) and not holds("ba", ["a", "b"]) and not holds("aXa", ["aXa", "a"])


@pytest.mark.parametrize("schedule", ["one-pass", "n-pass", "budget", "k-pass:2"])
@pytest.mark.parametrize("max_tokens", [40, 200, 800])
def test_a_prepare_with_the_preskip_equals_one_that_renders_every_view(qwen3_tokenizer, monkeypatch, schedule,
                                                                       max_tokens):
    records = [chat(turns, seed) for seed, turns in enumerate([1, 3, 12, 40, 40])]
    config = PrepareConfig(schedule=schedule, max_tokens=max_tokens, template_date=DATE)
    got, want, unrendered = prepare_both(records, qwen3_tokenizer, config, monkeypatch)
    assert_same_prepare(got, want)
    assert unrendered > 0  # the pre-skip skipped something here


def plain_chat(turns: int) -> dict:
    """Questions and answers without reasoning or tools (what the templates that render neither keep)."""
    return {"messages": [m for i in range(turns) for m in (
        {"role": "user", "content": f"Question {i}: " + "what is the weather like " * (1 + i % 4)},
        {"role": "assistant", "content": f"It is sunny, {i} degrees."})]}


SETTINGS = [(f"vendored:{c.id}", chat_template(c.template), EOS.get(c.template),
             {"completion_format": c.completion_format, "reasoning": c.reasoning, "template_kwargs": c.template_kwargs})
            for c in CASES] + \
           [(f"shared:{p.stem}", p.read_text(encoding="utf-8"), None, {}) for p in sorted(SHARED.glob("*.jinja"))]
# make test-quick's share of the template sweeps (the rest are marked slow: make test runs every one): the
# built-in Qwen3, harmony, a template that drops reasoning and renders tools its own way, and a shared one.
QUICK = {"vendored:qwen3", "vendored:gptoss", "vendored:cohere2_tool_use+reasoning=drop", "shared:kimi_k3"}
SETTING_PARAMS = [pytest.param(*s, id=s[0], marks=() if s[0] in QUICK else pytest.mark.slow) for s in SETTINGS]


def _provable(conv, tokenizer, config: RenderConfig, rendered) -> int:
    """The floor of the conversation's last view when every check of the pre-skip passes on its views rendered
    one by one (every turn the template's own split, each holding its messages' contents), else 0: the floor of
    its messages, or its history floor where every view's prompt also begins with its history (check 3)."""
    if rendered.skipped or any(v.provenance.flags() for v in rendered.views):
        return 0
    texts = render_texts(conv, tokenizer, config)
    if not texts:
        return 0
    last = texts[-1][0]
    pre = Preskip(conv, tokenizer, 1, last_turn=last, render_prompt=lambda k: texts[-1][1])
    if not all(holds(p, pre.prompt_parts(k)) and holds(c, [pre.completion_part(k)]) for k, p, c in texts):
        return 0
    floor = parts_floor(tokenizer, pre.prompt_parts(last))
    pre._measure()
    pre.history = History.read(tokenizer, conv, texts[-1][1], last)
    if all(pre._holds_history(k, u, p) for k, p, _ in texts if (u := pre.history_user(k)) is not None):
        floor = max(floor, pre.floors(last)[0])
    return floor


def agent_records(n: int = 2) -> list[dict]:
    """Real tau-bench airline and BFCL conversations (tools, tool results, reasoning), every 40th line."""
    out = []
    for name in ("taubench_airline", "bfcl_base_reasoning", "taubench_airline_reasoning"):
        path = AGENT / f"{name}.jsonl"
        if path.exists():
            lines = path.read_text(encoding="utf-8").splitlines()[::40]
            out += [json.loads(line) for line in itertools.islice(lines, n)]
    return out


def token_counts(tokenizer, texts) -> dict[int, tuple[int, int]]:
    """Each turn's (prompt, completion) token counts: the ids prepare trains (encode_texts: each piece between
    added tokens encoded once, so the tools and history every prompt repeats are not encoded again per view),
    checked on the conversation's longest prompt against the tokenizer's own call of the whole text (the
    fast path's equality everywhere else: tests/render/test_encode.py)."""
    if not texts:
        return {}
    ids = encode_texts(tokenizer, [t for _, text in texts for t in (text.prompt, text.completion)])
    longest = max(range(len(texts)), key=lambda i: len(texts[i][1].prompt))
    assert ids[2 * longest] == encode_plain(tokenizer, [texts[longest][1].prompt])[0]
    return {k: (len(ids[2 * i]), len(ids[2 * i + 1])) for i, (k, _) in enumerate(texts)}


@pytest.mark.parametrize(("name", "template", "eos", "settings"), SETTING_PARAMS)
def test_the_floor_is_below_every_real_view_that_holds_its_messages(qwen3_tokenizer, name, template, eos, settings):
    """The pre-skip's floor is a true lower bound: on every vendored and shared template, on the real agent data
    and the tool-chain and chat conversations, every rendered view whose prompt and completion hold the messages'
    contents (what the pre-skip checks before it trusts a floor) has at least as many prompt and completion
    tokens as :meth:`Preskip.floors` says; and those floors, summed per message, are :func:`parts_floor` of the
    parts themselves. The history floor (read off the last turn's prompt) is never below them and never above the
    real count of a prompt that begins with its history (what check 3 verifies before it trusts one). (A template here that renders no view of these conversations, only its own skips, checks
    nothing: qwq_32b, gemma4_31b_interleaved, ... with their default settings.)"""
    before = qwen3_tokenizer.chat_template, qwen3_tokenizer.eos_token
    qwen3_tokenizer.chat_template, qwen3_tokenizer.eos_token = template, eos or qwen3_tokenizer.eos_token
    try:
        config = PrepareConfig(template_date=DATE, **settings).render
        rendered = checked = floored = histories = 0
        for i, record in enumerate([*agent_records(), long_tool_chain(3), plain_chat(8)]):
            conv = parse_record(record, index=i)
            pre = Preskip(conv, qwen3_tokenizer, 1, last_turn=0, render_prompt=_off)
            pre._measure()
            texts = [(k, t) for k, t in views_module._iter_texts(conv, qwen3_tokenizer, config)  # every turn, rendered
                     if hasattr(t, "prompt")]  # not the template's own skip (a RenderError)
            counts = token_counts(qwen3_tokenizer, texts)
            for k, text in texts:
                prompt, completion, floors = text.prompt, text.completion, pre.floors(k)
                rendered += 1
                assert floors == (parts_floor(qwen3_tokenizer, pre.prompt_parts(k)),
                                  parts_floor(qwen3_tokenizer, [pre.completion_part(k)]))
                if not (holds(prompt, pre.prompt_parts(k)) and holds(completion, [pre.completion_part(k)])):
                    continue
                real = counts[k]
                assert floors[0] <= real[0] and floors[1] <= real[1], (conv.at(k), floors, real)
                checked += 1
                floored += floors[0] > 1
            if not texts:
                continue
            # The history floor, read off the last turn's prompt: at most the real count of every prompt that begins
            # with its history and holds the contents after it (check 3), and close to it.
            last, text = texts[-1]
            hist = Preskip(conv, qwen3_tokenizer, 1, last_turn=last, render_prompt=_off)
            hist._measure()
            hist.history = History.read(qwen3_tokenizer, conv, text.prompt, last)
            for k, text in texts:
                if (u := hist.history_user(k)) is None or not hist._holds_history(k, u, text.prompt):
                    continue
                real = counts[k][0]
                assert pre.floors(k)[0] <= hist.floors(k)[0] <= real, (conv.at(k), hist.floors(k), real)
                histories += 1
        assert floored or not rendered  # views were checked, with floors that say something, where any rendered
    finally:
        qwen3_tokenizer.chat_template, qwen3_tokenizer.eos_token = before


@pytest.mark.parametrize("max_tokens", [256, 1024])
def test_a_prepare_of_real_agent_data_with_the_preskip_equals_one_that_renders_every_view(qwen3_tokenizer, monkeypatch,
                                                                                        max_tokens):
    """tau-bench and BFCL conversations (Qwen3 template): the same rows and counts, views skipped unrendered."""
    config = PrepareConfig(max_tokens=max_tokens, template_date=DATE)
    got, want, unrendered = prepare_both(agent_records(5), qwen3_tokenizer, config, monkeypatch)
    assert_same_prepare(got, want)
    assert unrendered > 0


@pytest.mark.parametrize(("name", "template", "eos", "settings"), SETTING_PARAMS)
def test_the_preskip_never_skips_a_view_that_fits_on_real_templates(qwen3_tokenizer, monkeypatch, name, template,
                                                                    eos, settings):
    """Every vendored template with each setting it is tested with (test_real_templates.CASES), and the shared
    ones: budgets on both sides of a middle view length and under the shortest, on a long tool-chain conversation
    and a plain chat. The same rows and counts as rendering every view; and where a conversation passes every
    check of the pre-skip, with a later view's floor over the smallest budget, views are skipped unrendered."""
    before = qwen3_tokenizer.chat_template, qwen3_tokenizer.eos_token
    qwen3_tokenizer.chat_template, qwen3_tokenizer.eos_token = template, eos or qwen3_tokenizer.eos_token
    try:
        records = [long_tool_chain(5), plain_chat(16)]
        config = PrepareConfig(template_date=DATE, **settings)
        monkeypatch.setattr(views_module, "_preskip", _off)
        convs = [parse_record(r) for r in records]
        references = [render_conversation(c, qwen3_tokenizer, config.render) for c in convs]
        provable = max(_provable(c, qwen3_tokenizer, config.render, r) for c, r in zip(convs, references))
        monkeypatch.undo()
        lengths = sorted(len(v) for r in references for v in r.views)
        middle = lengths[len(lengths) // 2] if lengths else 65
        budgets = sorted({lengths[0] - 1 if lengths else 64, middle - 1, middle})
        unrendered = 0
        for budget in budgets:
            got, want, skipped_unrendered = prepare_both(records, qwen3_tokenizer,
                                                         PrepareConfig(max_tokens=budget, template_date=DATE,
                                                                       **settings), monkeypatch)
            assert_same_prepare(got, want)
            unrendered += skipped_unrendered
        assert (unrendered > 0) == (provable > min(budgets)), (provable, budgets, unrendered)
    finally:
        qwen3_tokenizer.chat_template, qwen3_tokenizer.eos_token = before


@pytest.mark.parametrize("why", NOT_VERBATIM)
def test_nothing_is_skipped_unrendered_where_the_template_does_not_render_a_message_verbatim(
        with_template, monkeypatch, why):
    record = long_tool_chain(8)
    config = PrepareConfig(max_tokens=60, template_date=DATE)
    got, want, unrendered = prepare_both([record], with_template(PLAIN), config, monkeypatch)
    assert unrendered > 0  # the same conversation, rendered verbatim: the pre-skip applies
    got, want, unrendered = prepare_both([record], with_template(NOT_VERBATIM[why]), config, monkeypatch)
    assert unrendered == 0
    assert_same_prepare(got, want)
    assert got[1].skipped_by_reason == {"over max_tokens": got[1].views_skipped}


def _raising_at(question: int) -> str:
    """:data:`PLAIN`, raising for the prompt whose last message is question ``question`` (that turn only)."""
    return (f"{{% if messages[-1].content.startswith('Question {question}:') %}}{{{{ raise_exception('no') }}}}"
            "{% endif %}" + PLAIN)


def test_a_turn_the_template_cannot_render_stops_the_preskip(with_template, monkeypatch):
    """Check 4: once a turn is skipped for the template, every later turn is rendered, so a turn it would raise
    for is counted under the template's reason, not over max_tokens."""
    config = PrepareConfig(max_tokens=60, template_date=DATE)
    got, want, unrendered = prepare_both([chat(40)], with_template(_raising_at(0)), config, monkeypatch)
    assert unrendered == 0
    assert_same_prepare(got, want)
    assert got[1].skipped_by_reason["template error"] == 1


def test_the_one_count_a_skip_unrendered_can_move(with_template, monkeypatch):
    """What the checks leave assumed (docs/faults.md, Round 3): a turn skipped unrendered would have rendered as
    the turns rendered before it. Here the template raises for turn 61's prompt alone, after the pre-skip is
    proven: that turn is counted over max_tokens (its messages alone are over it) instead of "template error".
    The same views are skipped and trained, the same rows written; one view's reason moves."""
    config = PrepareConfig(max_tokens=60, template_date=DATE)
    (rows, stats), (ref_rows, ref_stats), unrendered = prepare_both([chat(40)], with_template(_raising_at(30)),
                                                                    config, monkeypatch)
    assert unrendered > 0 and len(rows) == len(ref_rows) and stats.views_skipped == ref_stats.views_skipped
    assert ref_stats.skipped_by_reason == {"over max_tokens": stats.views_skipped - 1, "template error": 1}
    assert stats.skipped_by_reason == {"over max_tokens": stats.views_skipped}


def test_a_view_skipped_unrendered_names_its_floor(qwen3_tokenizer):
    conv = parse_record(chat(40), source="chat.jsonl", index=3)
    rendered = render_conversation(conv, qwen3_tokenizer, RenderConfig(template_date=DATE), max_tokens=100)
    skipped = [v for v in rendered.views if isinstance(v, Unmeasured) and not v.rendered]
    assert skipped
    assert re.fullmatch(r"chat\.jsonl record 3, message \d+: view of at least \d+ tokens \(not rendered: the \d+ "
                        r"characters of its messages it must hold\) is longer than max_tokens=100",
                        over_budget(skipped[0], 100))


def test_views_with_other_tools_than_the_last_turn_keep_the_rows_of_a_full_render(qwen3_tokenizer, monkeypatch):
    """A tool added mid-way (a message's own ``tools``: BFCL's miss_func) changes the prompt's system block: the
    history floor, read off the last turn's prompt (rendered with the longer list), bounds only the views rendered
    with that list; the others keep the messages' floor. The same rows and counts as rendering every view, on both
    sides of the change, and views are skipped unrendered."""
    record = long_tool_chain(6)
    big = {"type": "function", "function": {"name": "forecast_week", "description": "A week of forecasts. " * 40,
                                            "parameters": {"type": "object", "properties": {}}}}
    change = next(i for i, m in enumerate(record["messages"]) if m["role"] == "user" and i > len(record["messages"]) // 2)
    record["messages"][change]["tools"] = [*record["tools"], big]
    unrendered = 0
    for max_tokens in (400, 900, 1500):
        got, want, skipped = prepare_both([record], qwen3_tokenizer, PrepareConfig(max_tokens=max_tokens,
                                                                                  template_date=DATE), monkeypatch)
        assert_same_prepare(got, want)
        unrendered += skipped
    assert unrendered > 0
