"""tests/tokenizer_cache.py against what it stands in for: a copy of a loaded tokenizer folder is the tokenizer a
fresh load gives (the same attributes, the same ids, the same files when saved); a copy's own changes stay its
own; a changed folder is read again; a test that changes the shared Rust tokenizer fails, naming the folder; and
the commands tests/warm.py starts find the built-in tokenizer already loaded."""

from __future__ import annotations

import filecmp
import json
import os
import sys

import pytest

import tokenizer_cache
import warm

TEXTS = ["hello <|im_start|>user\nq<|im_end|> <think>x</think>", "  spaces\tand\nlines ", "日本語 ü é"]


def _fresh(folder):
    """A load that reads the files, whatever is cached."""
    saved = dict(tokenizer_cache._loads)
    tokenizer_cache._loads.clear()
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(folder)
    finally:
        tokenizer_cache._loads.clear()
        tokenizer_cache._loads.update(saved)


@pytest.fixture
def qwen3_folder(qwen3_tokenizer, tmp_path):
    out = tmp_path / "qwen3"
    qwen3_tokenizer.save_pretrained(out)
    return str(out)


@pytest.fixture
def folder(tmp_path):
    """A small BPE tokenizer with added tokens and a chat template, saved as transformers saves one (its loads take
    milliseconds: the rules here are the same for any folder)."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.train_from_iterator(TEXTS * 20, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>"]))
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<|im_start|>", "<|im_end|>")])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", unk_token="<unk>")
    tok.chat_template = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>{% endfor %}"
    out = tmp_path / "small"
    tok.save_pretrained(out)
    return str(out)


def _public(tokenizer) -> dict:
    return {k: repr(v) for k, v in vars(tokenizer).items() if k != "_tokenizer"}


def test_a_copy_is_what_a_fresh_load_gives(qwen3_folder, tmp_path):
    """On the real Qwen3 tokenizer: every attribute, the Rust tokenizer, ids, the template's text, saved files."""
    folder = qwen3_folder
    from transformers import AutoTokenizer

    if not getattr(AutoTokenizer.from_pretrained, "_reads_once", False):
        pytest.skip("ONEPASS_TESTS_COLD=1: every load reads the files")
    first = AutoTokenizer.from_pretrained(folder)
    read = tokenizer_cache.COUNTS["read"]
    copy = AutoTokenizer.from_pretrained(folder)
    assert tokenizer_cache.COUNTS["read"] == read  # a copy, not a read
    fresh = _fresh(folder)
    assert copy is not first and type(copy) is type(fresh)
    assert _public(copy) == _public(fresh)
    assert copy.backend_tokenizer.to_str() == fresh.backend_tokenizer.to_str()
    assert copy(TEXTS)["input_ids"] == fresh(TEXTS)["input_ids"] == first(TEXTS)["input_ids"]
    messages = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    assert copy.apply_chat_template(messages, tokenize=False) == fresh.apply_chat_template(messages, tokenize=False)
    copy.save_pretrained(tmp_path / "a")
    fresh.save_pretrained(tmp_path / "b")
    names = sorted(os.listdir(tmp_path / "b"))
    assert sorted(os.listdir(tmp_path / "a")) == names
    assert filecmp.cmpfiles(tmp_path / "a", tmp_path / "b", names, shallow=False)[0] == names


def test_a_copys_own_changes_stay_its_own(folder):
    from transformers import AutoTokenizer

    one = AutoTokenizer.from_pretrained(folder)
    one.chat_template = "{{ messages }}"
    one.pad_token = one.eos_token
    one.init_kwargs["model_max_length"] = 7
    two = AutoTokenizer.from_pretrained(folder)
    assert two.chat_template != "{{ messages }}" and two.pad_token != two.eos_token
    assert two.init_kwargs.get("model_max_length") != 7
    assert _public(two) == _public(_fresh(folder))


def test_a_changed_folder_is_read_again(folder):
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(folder)
    config = os.path.join(folder, "tokenizer_config.json")
    with open(config, encoding="utf-8") as f:
        settings = json.load(f)
    settings["model_max_length"] = 1234
    with open(config + ".new", "w", encoding="utf-8") as f:
        json.dump(settings, f)
    os.replace(config + ".new", config)
    read = tokenizer_cache.COUNTS["read"]
    again = AutoTokenizer.from_pretrained(folder)
    assert again.model_max_length == 1234
    if getattr(AutoTokenizer.from_pretrained, "_reads_once", False):
        assert tokenizer_cache.COUNTS["read"] == read + 1


def test_a_change_to_the_shared_rust_tokenizer_is_named_and_read_again(folder):
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    if not getattr(AutoTokenizer.from_pretrained, "_reads_once", False):
        pytest.skip("ONEPASS_TESTS_COLD=1: nothing is shared")
    one = AutoTokenizer.from_pretrained(folder)
    one.backend_tokenizer.enable_truncation(3)  # a per-call setting left behind: put back, not an error
    assert tokenizer_cache.check() is None
    assert one.backend_tokenizer.truncation is None
    one.backend_tokenizer.add_special_tokens([AddedToken("<shared?>", special=True)])
    line = tokenizer_cache.check()
    assert line is not None and folder in line and "change a copy" in line
    read = tokenizer_cache.COUNTS["read"]
    two = AutoTokenizer.from_pretrained(folder)
    assert tokenizer_cache.COUNTS["read"] == read + 1 and len(two) == len(one) - 1
    two.backend_tokenizer.add_special_tokens([AddedToken("<again>", special=True)])  # found at the next load
    three = AutoTokenizer.from_pretrained(folder)
    assert tokenizer_cache.COUNTS["read"] == read + 2 and len(three) == len(two) - 1
    assert tokenizer_cache.check() is None


def test_the_folders_used_least_lately_are_let_go(folder, tmp_path):
    """At most KEEP first loads are kept (the suite loads many folders it saved once), the latest used."""
    import shutil

    from transformers import AutoTokenizer

    if not getattr(AutoTokenizer.from_pretrained, "_reads_once", False):
        pytest.skip("ONEPASS_TESTS_COLD=1: nothing is kept")
    others = [shutil.copytree(folder, tmp_path / f"copy{i}") for i in range(tokenizer_cache.KEEP)]
    AutoTokenizer.from_pretrained(folder)
    for other in others[:-1]:
        AutoTokenizer.from_pretrained(other)
    read = tokenizer_cache.COUNTS["read"]
    AutoTokenizer.from_pretrained(folder)  # used again: now the latest
    AutoTokenizer.from_pretrained(others[-1])  # one more folder: the one used least lately goes
    assert tokenizer_cache.COUNTS["read"] == read + 1 and len(tokenizer_cache._loads) <= tokenizer_cache.KEEP
    AutoTokenizer.from_pretrained(folder)
    assert tokenizer_cache.COUNTS["read"] == read + 1  # still kept
    AutoTokenizer.from_pretrained(others[0])
    assert tokenizer_cache.COUNTS["read"] == read + 2  # let go, read again


_CHILD = """
import json, sys
sys.path.insert(0, sys.argv[1])
import tokenizer_cache
from onepass.render.tokenizer import load_tokenizer
tok = load_tokenizer("builtin:qwen3")
print(json.dumps({"counts": tokenizer_cache.COUNTS, "ids": tok(sys.argv[2])["input_ids"],
                  "template": tok.chat_template}))
"""


def test_a_command_started_warm_finds_the_builtin_tokenizer_loaded(qwen3_tokenizer):
    """tests/warm.py's server loaded it before it forked: the command's load is a copy, the same ids and template."""
    proc = warm.run([sys.executable, "-c", _CHILD, os.path.dirname(__file__), TEXTS[0]],
                    capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["ids"] == qwen3_tokenizer(TEXTS[0])["input_ids"] and out["template"] == qwen3_tokenizer.chat_template
    cold = os.environ.get(warm.COLD_ENV)  # a fresh interpreter: tokenizer_cache imported, nothing installed
    assert out["counts"] == ({"read": 0, "copied": 0} if cold else {"read": 0, "copied": 1}), out["counts"]


def test_nothing_is_wrapped_with_onepass_tests_cold(monkeypatch):
    import transformers

    class Auto:
        @classmethod
        def from_pretrained(cls, path):
            return path

    monkeypatch.setattr(transformers, "AutoTokenizer", Auto)
    monkeypatch.setenv(warm.COLD_ENV, "1")
    tokenizer_cache.install()
    tokenizer_cache.preload("/nonexistent")
    assert not hasattr(Auto.from_pretrained, "_reads_once") and Auto.from_pretrained("x") == "x"
    monkeypatch.delenv(warm.COLD_ENV)
    tokenizer_cache.install()
    assert Auto.from_pretrained._reads_once and Auto.from_pretrained("x") == "x"  # not a folder: loaded as before
