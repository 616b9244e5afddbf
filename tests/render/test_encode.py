"""Encoding by pieces between added tokens (onepass.render.encode) against the tokenizer's own encode of
each whole text (the reference), on every vendored template and on the bundled and synthetic data;
and the probe that turns the fast path off where the tokenizer does not cut text at its added tokens."""

from __future__ import annotations

from pathlib import Path

import pytest

from onepass.render import encode
from onepass.conversation.parse import parse_record
from onepass.data.sources import load_conversations
from onepass.render.encode import encode_plain, encode_texts, piece_splitter, split_between
from onepass.render import RenderConfig, RenderError, merges_across, render_conversation
from onepass.render.views import _iter_texts
from onepass.prepare.template_report import TOOL_CHAIN_RECORDS

FIXTURES = Path(__file__).parents[1] / "fixtures" / "chat_templates"
TEMPLATES = sorted(p.stem for p in FIXTURES.glob("*.jinja"))
CONFIGS = (RenderConfig(), RenderConfig(completion_format="deepseek-r1"), RenderConfig(completion_format="think-tags"))


def _texts(convs, tok, config):
    return [(text.prompt, text.completion) for conv in convs for _, text in _iter_texts(conv, tok, config)
            if not isinstance(text, RenderError)]


def _views(convs, tok, config):
    out = []
    for conv in convs:
        r = render_conversation(conv, tok, config)
        out.append(([(v.tokens.tolist(), v.num_prompt, v.turn, v.boundary_merge, v.provenance.derived)
                     for v in r.views],
                    [str(e) for e in r.skipped]))
    return out


def _assert_fast_is_plain(convs, tok, config, monkeypatch):
    pairs = _texts(convs, tok, config)
    texts = [t for pair in pairs for t in pair]
    assert encode_texts(tok, texts) == encode_plain(tok, texts)
    whole = [a != b + c for a, b, c in zip(encode_plain(tok, [p + c for p, c in pairs]),
                                           encode_plain(tok, [p for p, _ in pairs]),
                                           encode_plain(tok, [c for _, c in pairs]))]
    assert merges_across(tok, pairs) == whole
    fast = _views(convs, tok, config)
    with monkeypatch.context() as m:
        m.setattr(encode, "piece_splitter", lambda tokenizer: None)
        assert _views(convs, tok, config) == fast


@pytest.fixture
def chains():
    return [parse_record(r, source="chains.jsonl", index=i) for i, r in enumerate(TOOL_CHAIN_RECORDS)]


@pytest.mark.parametrize("template", TEMPLATES)
def test_pieces_give_the_tokenizers_own_ids_on_every_vendored_template(qwen3_tokenizer, chains, template,
                                                                       monkeypatch):
    assert piece_splitter(qwen3_tokenizer) is not None  # the fast path is what is tested
    monkeypatch.setattr(qwen3_tokenizer, "chat_template", (FIXTURES / f"{template}.jinja").read_text("utf-8"))
    for config in CONFIGS:
        _assert_fast_is_plain(chains, qwen3_tokenizer, config, monkeypatch)


@pytest.mark.parametrize("data", ["builtin:mathchat", "synthetic:mathchat-sync"])
def test_pieces_give_the_tokenizers_own_ids_on_bundled_and_synthetic_data(qwen3_tokenizer, data, monkeypatch):
    convs = load_conversations(data, strict=False, limit=40).conversations
    assert convs
    _assert_fast_is_plain(convs, qwen3_tokenizer, RenderConfig(), monkeypatch)


def test_an_added_token_inside_a_message_is_cut_as_the_tokenizer_cuts_it(qwen3_tokenizer):
    texts = ["x<think>y</think>z", "<|im_start|><|im_start|>", "a<|im_end|>\n\n<think>\n\n", "<tool_call", "<", ""]
    assert encode_texts(qwen3_tokenizer, texts) == encode_plain(qwen3_tokenizer, texts)


def test_split_between_only_where_an_added_token_is_at_the_join(qwen3_tokenizer):
    tok = qwen3_tokenizer
    assert split_between(tok, "a<|im_end|>", "\n")
    assert split_between(tok, "assistant\n", "<think>\nr")
    assert not split_between(tok, "<think>\n", "\n</think>")  # "\n\n" is one Qwen token: unknown, not "no merge"
    assert not split_between(tok, "<thi", "nk>")  # the token straddles the join


def _qwen_copy(qwen3_tokenizer, change):
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer.from_str(qwen3_tokenizer.backend_tokenizer.to_str())
    change(backend)
    return PreTrainedTokenizerFast(tokenizer_object=backend)


TEXTS = ["hello <x> world", " <x> ", "a<|im_end|>\nb", "<|im_start|>user\n q<|im_end|>"]


def test_an_added_token_that_strips_whitespace_turns_the_fast_path_off(qwen3_tokenizer):
    from tokenizers import AddedToken

    tok = _qwen_copy(qwen3_tokenizer, lambda b: b.add_special_tokens([AddedToken("<x>", lstrip=True)]))
    assert piece_splitter(tok) is None
    assert encode_texts(tok, TEXTS) == encode_plain(tok, TEXTS)


def test_special_tokens_encoded_as_text_turn_the_fast_path_off(qwen3_tokenizer):
    tok = _qwen_copy(qwen3_tokenizer, lambda b: None)
    tok.split_special_tokens = True  # transformers hands it to the backend on every call
    assert encode_plain(tok, ["<think>"]) != [[151667]]
    assert piece_splitter(tok) is None
    assert encode_texts(tok, TEXTS) == encode_plain(tok, TEXTS)


def test_a_tokenizer_that_treats_the_first_piece_differently_turns_the_fast_path_off():
    """SentencePiece style: ``Metaspace(prepend_scheme="first")`` adds "▁" to the text's first piece
    only, so a piece after ``<s>`` encodes differently alone; the probe sees it."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    backend.train_from_iterator(["hello world", "a b c", "x y z"] * 20,
                                trainers.BpeTrainer(vocab_size=60, special_tokens=["<unk>"]))
    backend.add_special_tokens([AddedToken("<s>", normalized=False, special=True)])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend)
    assert piece_splitter(tok) is None
    texts = ["hello<s>world", "a <s> b"]
    assert encode_texts(tok, texts) == encode_plain(tok, texts)


def test_the_probe_is_redone_when_the_added_tokens_change(qwen3_tokenizer):
    from tokenizers import AddedToken

    tok = _qwen_copy(qwen3_tokenizer, lambda b: None)
    assert piece_splitter(tok) is not None
    tok.backend_tokenizer.add_special_tokens([AddedToken("<y>", rstrip=True)])
    assert piece_splitter(tok) is None


def test_vocab_size_is_len_and_the_render_never_builds_the_whole_vocabulary(qwen3_tokenizer):
    """:func:`onepass.render.tokenizer.vocab_size` is ``len(tokenizer)`` (added tokens past the base vocabulary,
    and one already inside it), and rendering and encoding conversations never asks the backend for its size with
    the added tokens: tokenizers before 0.23 build the whole vocabulary to answer (66 ms for Qwen3's on 0.22.2,
    transformers 5.2's), and the render asked once per view: `onepass prepare` of the bundled sample took 107 s
    at make test-min's floor, 6 s on the lock."""
    from tokenizers import AddedToken

    from onepass.render.tokenizer import vocab_size

    tok = _qwen_copy(qwen3_tokenizer, lambda b: None)
    tok.chat_template = qwen3_tokenizer.chat_template
    assert vocab_size(tok) == len(tok) == 151669
    tok.add_tokens(["<a_new_token>"])
    tok.backend_tokenizer.add_special_tokens([AddedToken("hello", special=True)])  # a token the vocabulary has
    assert vocab_size(tok) == len(tok) == 151670

    class Counting:  # the Rust backend, with its answers to get_vocab_size counted
        def __init__(self, real):
            self.real, self.whole = real, 0

        def __getattr__(self, name):
            return getattr(self.real, name)

        def get_vocab_size(self, with_added_tokens=True):
            self.whole += bool(with_added_tokens)
            return self.real.get_vocab_size(with_added_tokens=with_added_tokens)

    tok._tokenizer = counting = Counting(tok._tokenizer)
    convs = load_conversations("builtin:mathchat", limit=3).conversations
    views = [v for c in convs for v in render_conversation(c, tok).views]
    assert views and counting.whole == 0
    assert encode_texts(tok, ["a<|im_end|>\nb"]) == encode_plain(tok, ["a<|im_end|>\nb"]) and counting.whole == 0
