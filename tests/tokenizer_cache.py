"""Each tokenizer folder the suite loads is read once per process: ``AutoTokenizer.from_pretrained`` of a folder
it has loaded before hands out a copy of that load instead of reading the files again.

Why: transformers 5 reads a tokenizer by parsing its ``tokenizer.json`` twice in Python and building the Rust
tokenizer from it again: 1.2 s of CPU for Qwen3's (151,669 entries), and the suite loaded one 215 times (in its
own processes: every ``onepass`` command a test runs in-process, every ``OnePassTrainer``; and in the commands it
starts): 270 s of CPU, a fifth of ``make test`` on 2 cores. The issue asks for tokenizers built once per test
run. tests/conftest.py installs this in each pytest process and tests/warm.py in its server, which loads the
built-in Qwen3 tokenizer before it forks, so the commands it starts find it loaded too.

A copy: a new tokenizer object whose attributes are deep copies of the first load's (chat template, special
tokens, ``init_kwargs``, ``name_or_path``...), over the first load's Rust tokenizer, which all copies share
(copying it is a re-parse: 0.7 s). Sharing is safe while nothing changes that Rust object, and nothing in
onepass does (transformers sets truncation, padding and the special-token split on it per call, from the
call's arguments); tests that change a tokenizer's vocabulary or pipeline change a copy
(``Tokenizer.from_str(backend.to_str())``). That is checked rather than hoped: :func:`check` (after every test,
tests/conftest.py) fails the test that changed a shared Rust tokenizer's vocabulary, added tokens or pipeline
(and drops the entry), and puts back per-call settings a call left on it; a load whose entry is found changed
reads the files again.

What counts as the same load: the same argument (the folder as given, and where it resolves to), the same
keyword arguments, and every file in the folder the same (name, size, inode, modification time in ns): a test
that writes another ``tokenizer_config.json`` or chat template into a folder gets a new load. Anything else (a
hub id, a file, extra positional arguments) is loaded as before. ``ONEPASS_TESTS_COLD=1`` turns this off with
the warm start (tests/warm.py): every load reads the files, as before. tests/test_tokenizer_cache.py compares a
copy with a fresh load.
"""

from __future__ import annotations

import copy
import json
import os
from collections import OrderedDict
from typing import Any

from warm import COLD_ENV

# key -> (the first load, never handed out; its Rust tokenizer's state), the most recently used last; at most KEEP
# (a Qwen3 tokenizer holds ~100 MB, and tests load many folders they saved once into a temporary folder)
_loads: OrderedDict[tuple, tuple[Any, tuple]] = OrderedDict()
KEEP = 4
COUNTS = {"read": 0, "copied": 0}
_PER_CALL = ("truncation", "padding", "encode_special_tokens")  # set by transformers on every call
_DEFAULTS = {"revision": None, "trust_remote_code": False}


def _key(path: Any, args: tuple, kwargs: dict) -> tuple | None:
    if args or not isinstance(path, (str, os.PathLike)):
        return None
    given = os.fspath(path)
    folder = os.path.realpath(given)
    if not os.path.isfile(os.path.join(folder, "tokenizer.json")):
        return None
    files = []
    for entry in os.scandir(folder):
        if entry.is_file():
            st = entry.stat()
            files.append((entry.name, st.st_size, st.st_ino, st.st_mtime_ns))
    given_kwargs = {k: v for k, v in kwargs.items() if _DEFAULTS.get(k, ...) != v}  # revision=None: not given
    return given, folder, tuple(sorted(files)), json.dumps(given_kwargs, sort_keys=True, default=repr)


def _component(obj: Any) -> Any:
    return None if obj is None else obj.__getstate__()


def _state(backend: Any) -> tuple:
    """What a change to the shared Rust tokenizer would show in (cheap: not the vocabulary itself, which only
    changes through the added tokens), the per-call settings last."""
    added = tuple((i, t.content, t.special, t.single_word, t.lstrip, t.rstrip, t.normalized)
                  for i, t in sorted(backend.get_added_tokens_decoder().items()))
    model = backend.model
    model_settings = tuple(getattr(model, name, None) for name in (
        "dropout", "unk_token", "continuing_subword_prefix", "end_of_word_suffix", "fuse_unk", "byte_fallback",
        "ignore_merges"))
    structure = (type(model).__name__, backend.get_vocab_size(with_added_tokens=False), added, model_settings,
                 *(_component(getattr(backend, c)) for c in ("normalizer", "pre_tokenizer", "post_processor",
                                                             "decoder")))
    return structure, tuple(json.dumps(getattr(backend, name, None), sort_keys=True) for name in _PER_CALL)


def _copy(tokenizer: Any) -> Any:
    new = object.__new__(type(tokenizer))
    new.__dict__.update({k: v if k == "_tokenizer" else copy.deepcopy(v) for k, v in tokenizer.__dict__.items()})
    COUNTS["copied"] += 1
    return new


def _put_back(backend: Any, state: tuple) -> None:
    """The per-call settings as they were after the first load."""
    truncation, padding, split = (json.loads(s) for s in state[1])
    if truncation is None:
        backend.no_truncation()
    else:
        backend.enable_truncation(**truncation)
    if padding is None:
        backend.no_padding()
    else:
        backend.enable_padding(**{k: v for k, v in padding.items() if k != "pad_to_multiple_of" or v is not None})
    if split is not None:
        backend.encode_special_tokens = split


def _as_loaded(key: tuple) -> bool:
    """Whether the Rust tokenizer of ``key``'s first load is as it was loaded: the per-call settings a call left
    on it put back; an entry changed otherwise (vocabulary, added tokens, pipeline) dropped, and False."""
    tokenizer, state = _loads[key]
    now = _state(tokenizer._tokenizer)
    if now[0] != state[0]:
        del _loads[key]
        return False
    if now[1] != state[1]:
        _put_back(tokenizer._tokenizer, state)
    return True


def install() -> None:
    """Wrap ``AutoTokenizer.from_pretrained`` (once per process; not with ``ONEPASS_TESTS_COLD=1``)."""
    if os.environ.get(COLD_ENV):
        return
    from transformers import AutoTokenizer

    real = AutoTokenizer.from_pretrained
    if getattr(real, "_reads_once", False):
        return

    def from_pretrained(path, *args, **kwargs):
        key = _key(path, args, kwargs)
        if key is None:
            return real(path, *args, **kwargs)
        if key in _loads and _as_loaded(key):  # else never loaded, or changed: read the files again
            _loads.move_to_end(key)
            return _copy(_loads[key][0])
        tokenizer = real(path, *args, **kwargs)
        COUNTS["read"] += 1
        if getattr(tokenizer, "_tokenizer", None) is None:
            return tokenizer  # not a Rust-backed tokenizer: as loaded
        _loads[key] = (_copy(tokenizer), _state(tokenizer._tokenizer))
        COUNTS["copied"] -= 1  # the kept first load is not a hand-out
        while len(_loads) > KEEP:
            _loads.popitem(last=False)
        return tokenizer

    from_pretrained._reads_once = True  # type: ignore[attr-defined]
    AutoTokenizer.from_pretrained = staticmethod(from_pretrained)


def preload(folders: str) -> None:
    """Load each folder of ``folders`` (``os.pathsep``-separated): tests/warm.py's server, before it forks."""
    if os.environ.get(COLD_ENV):
        return
    from transformers import AutoTokenizer

    for folder in filter(None, folders.split(os.pathsep)):
        AutoTokenizer.from_pretrained(folder)
    COUNTS.update(read=0, copied=0)  # the commands forked from here count their own


def check() -> str | None:
    """After a test: the per-call settings put back; the folders whose shared Rust tokenizer the test changed
    otherwise dropped and named (the test is failed with that line)."""
    changed = [key[0] for key in list(_loads) if not _as_loaded(key)]
    if not changed:
        return None
    return (f"the test changed the Rust tokenizer shared by every load of {', '.join(changed)} in this process "
            "(tests/tokenizer_cache.py): change a copy, Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())")
