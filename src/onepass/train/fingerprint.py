"""The fingerprint of what a training run learns from, compared when it resumes.

Why this module exists: ``--resume`` continues a run only if the steps after the checkpoint are the
steps the run would have taken. The settings are compared by name (``RESUME_KEYS``), but the same
name can hold other content: a data file rewritten in place (20 one-pass rows became 234 n-pass
rows), a chat template edited behind the same path, a tokenizer updated on disk. So a checkpoint's
``state.json`` keeps a digest of each, and resuming with a different one is refused naming the key
(``--resume-anyway`` is the deliberate case):

    {"data": "sha256:9f2c...", "eval_data": null, "tokenizer": "sha256:41d0...", "template_date": null,
     "rows": "blake2b:77e1...", "eval_rows": null}

``rows`` (and ``eval_rows``) is the digest of the rows as the run loaded them
(:func:`onepass.train.run.data.units_digest`, added by the loop): it also changes when the same data and
tokenizer render otherwise (another onepass or transformers version), and the processes of a run compare
it before their first step.

Digests are of content, never of a path, so the same data given by a relative or an absolute path
is the same run. ``template_date`` is the date the chat template renders (``--template-date``, default: the
day the run started) where it changes the rows: the run renders conversations and its template reads the
clock (gpt-oss' ``Current date``); else None, so a Qwen3 run or one on prepared rows resumes on any day. No
torch here.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from onepass.data.sources import DataSource
from onepass.render.clock import reads_clock
from onepass.train.config import TrainConfig, TrainConfigError

# what a run writes into a folder (training into the data folder must not change the data's digest)
_RUN_OUTPUTS = frozenset({"checkpoints", "final", "metrics.json", "metrics.jsonl", "train_config.yaml", "loss.png"})
_CHUNK = 1 << 20


def _digest_files(files: list[Path], root: Path) -> str:
    h = hashlib.sha256()
    for f in files:
        h.update(str(f.relative_to(root)).encode() + b"\0")
        with open(f, "rb") as stream:
            while chunk := stream.read(_CHUNK):
                h.update(chunk)
        h.update(b"\0")
    return "sha256:" + h.hexdigest()


def data_digest(source: DataSource) -> str:
    """The digest of the content a data source names (a file, or the data files of a folder); a spec
    that names no local content (``builtin:``, ``synthetic:``, a hub id) is its own digest."""
    path = source.path
    if path is None or not path.exists():
        return f"spec:{source.spec}"
    if path.is_file():
        return _digest_files([path], path.parent)
    files = [f for f in sorted(path.rglob("*")) if f.is_file()
             and not any(part.startswith(".") or part in _RUN_OUTPUTS for part in f.relative_to(path).parts)]
    return _digest_files(files, path)


def tokenizer_digest(tokenizer: Any | None) -> str | None:
    """The digest of a tokenizer's vocabulary, merges and special tokens, and of its chat template."""
    if tokenizer is None:
        return None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    body = backend.to_str() if backend is not None else repr(sorted(tokenizer.get_vocab().items()))
    template = getattr(tokenizer, "chat_template", None)
    return "sha256:" + hashlib.sha256(f"{body}\0{template!r}".encode()).hexdigest()


def rendered_date(config: TrainConfig, tokenizer: Any | None, *, renders: bool) -> str | None:
    """The date the run's chat template renders, where it matters (``renders``: the run renders conversations,
    and the template reads the clock); else None."""
    template = getattr(tokenizer, "chat_template", None)
    templates = template.values() if isinstance(template, dict) else [template]
    if renders and any(isinstance(t, str) and reads_clock(t) for t in templates):
        return config.data_config.template_date
    return None


def run_fingerprint(config: TrainConfig, data: DataSource, eval_data: DataSource | None, tokenizer: Any | None, *,
                    renders: bool = True) -> dict[str, str | None]:
    """The digests of the run's inputs: its data and held-out data as the run resolved them, its tokenizer, the
    date its template renders (``renders``: the run renders conversations, not prepared rows)."""
    return {"data": data_digest(data), "eval_data": data_digest(eval_data) if eval_data is not None else None,
            "tokenizer": tokenizer_digest(tokenizer),
            "template_date": rendered_date(config, tokenizer, renders=renders)}


_CHANGED = {"tokenizer": "vocabulary or chat template", "rows": "the rows made of it: rendering or tokenization",
            "eval_rows": "the rows made of it: rendering or tokenization"}


def check_fingerprint(saved: dict[str, Any] | None, now: dict[str, str | None], path: Path, *, anyway: bool,
                      say: Callable[[str], None]) -> None:
    """Refuse to resume from ``path`` when a digest differs (naming the key); ``anyway``: say so and go on.
    A checkpoint from before fingerprints (``saved`` None) is not checked."""
    if not saved:
        return
    diffs = [key for key, value in now.items() if key in saved and saved[key] != value]
    if not diffs:
        return
    what = ", ".join(_changed(k, saved[k], now[k]) for k in diffs)
    if anyway:
        say(f"warning: --resume-anyway: resuming {path} although {what}")
        return
    raise TrainConfigError(f"cannot resume from {path}: {what} since the checkpoint was written; the steps "
                           "after it would not be the run's. Start a new run, or pass --resume-anyway if you "
                           "mean to continue on the changed input")


def _changed(key: str, saved: Any, now: Any) -> str:
    if key == "template_date":
        hint = f"; pass --template-date {saved} to render as before" if saved is not None else ""
        return f"template_date (the chat template renders {now}, the checkpoint's run {saved}{hint})"
    return f"{key} ({_CHANGED.get(key, 'content')} changed)"


__all__ = ["check_fingerprint", "data_digest", "rendered_date", "run_fingerprint", "tokenizer_digest"]
