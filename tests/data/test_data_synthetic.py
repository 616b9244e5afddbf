"""Synthetic MathChat-shaped data: seeded, the paper's depths, exact token lengths for Qwen3."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from onepass.conversation.parse import parse_record
from onepass.data.synthetic import (
    PAPER_SAMPLED_DEPTHS,
    WORDS,
    WORKLOADS,
    LengthDist,
    generate,
    generate_conversations,
    single_token_words,
    text_of_length,
)
from onepass.render import render_views


def test_every_word_is_one_qwen3_token_in_every_form(qwen3_tokenizer):
    assert single_token_words(qwen3_tokenizer) == WORDS
    assert len(WORDS) == len(set(WORDS)) >= 300


def test_segments_tokenize_to_their_intended_lengths(qwen3_tokenizer):
    records = generate(40, seed=7)
    texts, wanted = [], []
    for r in records:
        for k, (h, t, resp) in enumerate(r["lengths"]):
            user, assistant = r["messages"][2 * k], r["messages"][2 * k + 1]
            texts += [user["content"], assistant["content"]]
            wanted += [h, resp]
            if t:
                texts.append(assistant["reasoning_content"])
                wanted.append(t)
    got = [len(x) for x in qwen3_tokenizer(texts, add_special_tokens=False)["input_ids"]]
    assert got == wanted


def test_rendered_views_hold_the_segments_exactly(qwen3_tokenizer):
    # in the Qwen3 template a segment is followed by a newline or <|im_end|>: no merge across it,
    # so the last view has exactly the segment tokens plus the template's fixed tokens
    (conv,) = generate_conversations(1, seed=3, depth_table={3: 1})
    record = generate(1, seed=3, depth_table={3: 1})[0]
    views = render_views(conv, qwen3_tokenizer)
    assert len(views) == 3 and not any(v.boundary_merge for v in views)
    h, t, r = np.array(record["lengths"]).T
    # last view: every human and response, only the last reasoning; Qwen3 adds 5 tokens per message
    # (<|im_start|> role \n ... <|im_end|> \n) and <think>\n ... \n</think>\n\n (5) on the last turn
    expected = h.sum() + r.sum() + t[-1] + 5 * 6 + 5
    assert len(views[-1]) == expected


def test_same_seed_same_data_and_prefix_stable():
    a = generate(30, seed=5)
    assert a == generate(30, seed=5)
    assert a[:10] == generate(10, seed=5)
    assert a != generate(30, seed=6)
    for i, r in enumerate(a):
        parse_record(r, index=i)


def test_depths_follow_the_papers_sampled_table():
    records = generate(2000, seed=0)
    counts = collections.Counter(len(r["lengths"]) for r in records)
    total = sum(PAPER_SAMPLED_DEPTHS.values())
    for depth in (2, 5, 6, 7):
        expected = 2000 * PAPER_SAMPLED_DEPTHS[depth] / total
        assert abs(counts[depth] - expected) < 5 * np.sqrt(expected), (depth, counts[depth], expected)
    assert set(counts) <= set(PAPER_SAMPLED_DEPTHS)


def test_length_distribution_has_the_given_median_and_p95():
    dist = LengthDist(median=100, p95=400)
    x = dist.sample(np.random.default_rng(0), 40_000)
    assert abs(np.median(x) - 100) < 3 and abs(np.percentile(x, 95) - 400) < 15
    assert (LengthDist(median=8, p95=8).sample(np.random.default_rng(0), 5) == 8).all()
    with pytest.raises(ValueError, match="median <= p95"):
        LengthDist(median=10, p95=5)


def test_text_of_length_small_cases(qwen3_tokenizer):
    rng = np.random.default_rng(0)
    for n in (1, 2, 6, 15, 16, 17, 100):
        text = text_of_length(n, rng)
        assert not text.endswith(".")
        assert len(qwen3_tokenizer(text, add_special_tokens=False)["input_ids"]) == n


def test_overrides_and_empty_reasoning():
    recs = generate(50, seed=1, depth_table={2: 1, 4: 1},
                    lengths={"reasoning": LengthDist(median=5, p95=5)})
    assert {len(r["lengths"]) for r in recs} == {2, 4}
    assert {t for r in recs for _, t, _ in r["lengths"]} == {5}
    cfg = WORKLOADS["mathchat-sync"]
    import dataclasses

    empty = generate(20, seed=1, config=dataclasses.replace(cfg, empty_reasoning=1.0))
    assert all(m.get("reasoning_content") == "" for r in empty for m in r["messages"] if m["role"] == "assistant")
    with pytest.raises(ValueError, match="unknown segment"):
        generate(1, lengths={"answer": LengthDist(median=1, p95=1)})


def test_another_tokenizer_filters_the_word_list():
    class CharTokenizer:  # one token per character: only one-letter words survive
        def __call__(self, texts, add_special_tokens=False):
            return {"input_ids": [list(t) for t in texts]}

    with pytest.raises(ValueError, match="single tokens"):
        single_token_words(CharTokenizer())
