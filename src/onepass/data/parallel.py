"""Prepare at scale: render and tokenise with ``datasets.map(num_proc=...)``, same result as serial.

Why this module exists: rendering every view with a Jinja chat template and
tokenising it is pure Python per conversation, so one core does ~70
conversations a second; a 145k-conversation corpus wants every core. This
shards the conversations over ``num_proc`` processes with HF ``datasets``
(records stream into an Arrow file in a temporary folder, never all in
memory), runs :func:`onepass.prepare.prepare` on each conversation in the
workers (unpacked), and merges in input order: layouts, then packing and the
final counts exactly as ``prepare`` does them. The rows and
:class:`~onepass.prepare.PrepareStats` equal the serial pipeline's
(``tests/test_data_parallel.py``), including every skip and its reason.

Serial reference it matches::

    report = load_conversations(spec, strict=strict, limit=limit)
    stats = PrepareStats()
    for line in report.skipped:
        stats.skip("invalid record", line)
    rows, stats = prepare(report.conversations, tokenizer, config, stats=stats, strict=strict)

Example::

    rows, stats = prepare_parallel("chats.jsonl", "builtin:qwen3", PrepareConfig(), num_proc=8)

Faults: every process forked while this runs (the pool's workers and its
manager) gets ``PR_SET_PDEATHSIG = SIGKILL`` on Linux, so ``kill -9`` of the
parent takes them with it; SIGTERM unwinds normally (temporaries removed), and
the temporary folder of a process killed outright (``onepass-prepare-PID-*``)
is removed by the next run.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import shutil
import signal
import sys
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from onepass.conversation import ConversationError, parse_record

from onepass.prepare import PrepareConfig, PrepareStats, finalize, prepare
from onepass.tree import COLUMNS, ROW_SCHEMA, Layout, row_from_columns

ADDITIVE = ("conversations", "conversations_used", "views", "views_trained", "views_skipped",
            "boundary_merge_views", "n_pass_tokens", "one_pass_tokens", "scheduled_tokens", "target_tokens")
_TOKENIZERS: dict[tuple[str, str | None], Any] = {}  # per worker process
TEMP_PREFIX = "onepass-prepare-"
PR_SET_PDEATHSIG = 1
_FORKING: dict[str, Any] = {"active": False, "parent": 0, "hooked": False, "prctl": None}  # read in the child


def _before_fork() -> None:
    _FORKING["parent"] = os.getpid()


def _after_fork_in_child() -> None:
    """A child forked during :func:`workers_die_with_parent`: SIGKILL when its parent dies (Linux)."""
    if not _FORKING["active"] or _FORKING["prctl"] is None:
        return
    _FORKING["prctl"](PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # resolved before the fork: no dlopen here
    if os.getppid() != _FORKING["parent"]:  # the parent died before prctl took effect
        os._exit(1)


@contextmanager
def workers_die_with_parent() -> Iterator[None]:
    """Children forked inside this block die with this process, even on ``kill -9``; SIGTERM
    raises SystemExit here (so ``finally`` blocks and temporary folders are cleaned up)."""
    if not _FORKING["hooked"]:
        if sys.platform.startswith("linux"):  # looked up in the parent: dlopen in a forked child of a
            _FORKING["prctl"] = ctypes.CDLL(None, use_errno=True).prctl  # threaded process can hang
        os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
        _FORKING["hooked"] = True
    with exit_on_sigterm():
        _FORKING["active"] = True
        try:
            yield
        finally:
            _FORKING["active"] = False


@contextmanager
def exit_on_sigterm() -> Iterator[None]:
    """SIGTERM raises ``SystemExit(143)`` in the main thread instead of ending the process on the spot."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def _exit(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, _exit)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def remove_stale_temporaries(root: str | Path | None = None) -> list[Path]:
    """Remove ``onepass-prepare-PID-*`` folders of processes that no longer run (a ``kill -9``)."""
    root = Path(root or tempfile.gettempdir())
    removed = []
    for p in root.glob(f"{TEMP_PREFIX}*"):
        pid = p.name[len(TEMP_PREFIX):].split("-")[0]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
        except PermissionError:
            pass
    return removed


def _records(spec: str, split: str | None, limit: int | None, strict: bool) -> Iterator[dict[str, Any]]:
    """Raw records as JSON text with their origin; invalid ones carry their error instead."""
    from onepass.data.load import iter_conversation_records

    valid = 0
    for raw in iter_conversation_records(spec, split=split):
        if limit is not None and valid >= limit:
            return
        error = None
        try:
            raw.parse()
            valid += 1
        except ConversationError as e:
            if strict:
                raise
            error = str(e)
        yield {"source": raw.source, "index": raw.index, "unit": raw.unit, "error": error,
               "record": None if error else json.dumps(raw.record, ensure_ascii=False, default=str)}


@dataclasses.dataclass(kw_only=True)
class _PairedStats(PrepareStats):
    """Stats that also keep each skip's reason beside its message, in order (one conversation's
    turns can be skipped for different reasons)."""

    pairs: list[tuple[str, str]] = dataclasses.field(default_factory=list)

    def skip(self, reason: str, message: str) -> None:
        super().skip(reason, message)
        self.pairs.append((reason, message))


def _tokenizer(tokenizer: Any, chat_template: str | None) -> Any:
    if not isinstance(tokenizer, str):
        return tokenizer
    key = (tokenizer, chat_template)
    if key not in _TOKENIZERS:
        from onepass.tokenizer import load_tokenizer

        _TOKENIZERS[key] = load_tokenizer(tokenizer, chat_template=chat_template)
    return _TOKENIZERS[key]


def _prepare_batch(batch: dict[str, list], *, tokenizer: Any, chat_template: str | None,
                   config: PrepareConfig, strict: bool) -> dict[str, list]:
    """Worker: one output row per input record (its layouts as nested lists, its counts as JSON)."""
    tok = _tokenizer(tokenizer, chat_template)
    out: dict[str, list] = {c: [] for c in (*COLUMNS, "stats")}
    for source, index, unit, record, error in zip(batch["source"], batch["index"], batch["unit"],
                                                   batch["record"], batch["error"]):
        layouts: list[Layout] = []
        if error is not None:
            info: dict[str, Any] = {"invalid": error}
        else:
            conv = parse_record(json.loads(record), source=source, index=index, unit=unit)
            st = _PairedStats()
            layouts, _ = prepare([conv], tok, config, stats=st, strict=strict)
            info = {k: getattr(st, k) for k in ADDITIVE} | {"skips": st.pairs}
        for c in COLUMNS:
            out[c].append([getattr(x, c).tolist() for x in layouts])
        out["stats"].append(json.dumps(info))
    return out


def _features() -> Any:
    import datasets

    rows = {c: datasets.List(datasets.List(datasets.Value(dtype.name))) for c, dtype in ROW_SCHEMA.items()}
    return datasets.Features({**rows, "stats": datasets.Value("string")})


def _record_features() -> Any:
    import datasets

    s = datasets.Value("string")
    return datasets.Features({"source": s, "index": datasets.Value("int64"), "unit": s, "error": s, "record": s})


def prepare_parallel(spec: str | Path, tokenizer: Any, config: PrepareConfig = PrepareConfig(), *,
                     num_proc: int = 2, chat_template: str | None = None, split: str | None = None,
                     limit: int | None = None, strict: bool = False, batch_size: int = 8,
                     progress: bool = False) -> tuple[list[Layout], PrepareStats]:
    """Rows and stats of ``spec`` (any :mod:`onepass.data.load` spec) prepared on ``num_proc`` processes.

    ``tokenizer`` is a spec (``builtin:qwen3``, a path; each worker loads it once) or a loaded
    tokenizer (pickled to each worker). ``limit`` counts valid conversations, as the serial reader.
    """
    import datasets
    from datasets.exceptions import DatasetGenerationError

    from onepass.schedule import parse_schedule

    if num_proc < 1:
        raise ValueError(f"num_proc must be >= 1, got {num_proc}")
    stats = PrepareStats(schedule=str(parse_schedule(config.schedule)), weighting=config.weighting,
                         max_tokens=config.max_tokens, packed=config.pack)
    if limit is not None and limit <= 0:
        return finalize([], stats, config)
    bars = datasets.utils.logging.is_progress_bar_enabled()
    if not progress:
        datasets.disable_progress_bars()
    remove_stale_temporaries()
    prefix = f"{TEMP_PREFIX}{os.getpid()}-"
    try:
        with workers_die_with_parent(), tempfile.TemporaryDirectory(prefix=prefix) as tmp:
            try:
                records = datasets.Dataset.from_generator(
                    _records, features=_record_features(), cache_dir=tmp, fingerprint=uuid.uuid4().hex,
                    gen_kwargs={"spec": str(spec), "split": split, "limit": limit, "strict": strict})
            except DatasetGenerationError as e:
                cause = e.__cause__
                raise cause if isinstance(cause, (ConversationError, FileNotFoundError)) else e from None
            if len(records) == 0:
                return finalize([], stats, config)
            fn_kwargs = {"tokenizer": tokenizer, "chat_template": chat_template, "strict": strict,
                         "config": dataclasses.replace(config, pack=False)}
            done = records.map(_prepare_batch, batched=True, batch_size=batch_size, fn_kwargs=fn_kwargs,
                               num_proc=min(num_proc, len(records)) if num_proc > 1 else None,
                               remove_columns=records.column_names, features=_features(),
                               load_from_cache_file=False, new_fingerprint=uuid.uuid4().hex, desc="prepare")
            layouts, skips = _merge(done, stats)
    finally:
        if bars:
            datasets.enable_progress_bars()
    for reason, message in skips:
        stats.skip(reason, message)
    return finalize(layouts, stats, config)


def _merge(done: Any, stats: PrepareStats) -> tuple[list[Layout], list[tuple[str, str]]]:
    """Layouts in input order; invalid-record skips go straight into ``stats`` (the serial reader
    reports them first), the others are returned in order."""
    layouts: list[Layout] = []
    skips: list[tuple[str, str]] = []
    for batch in done.iter(batch_size=256):
        for i, text in enumerate(batch["stats"]):
            info = json.loads(text)
            if "invalid" in info:
                stats.skip("invalid record", info["invalid"])
                continue
            for k in ADDITIVE:
                setattr(stats, k, getattr(stats, k) + info[k])
            skips.extend((reason, m) for reason, m in info["skips"])
            for arrays in zip(*(batch[c][i] for c in COLUMNS)):
                layouts.append(row_from_columns(dict(zip(COLUMNS, arrays))))
    return layouts, skips
