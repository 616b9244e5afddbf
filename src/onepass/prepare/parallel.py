"""Prepare as a stream: records in, trees out in input order, on one process or ``num_proc``.

Why this module exists: rendering every view with a Jinja chat template and
tokenising it is pure Python per conversation, so one core does ~70
conversations a second; a 145k-conversation corpus wants every core, and must
not be held in memory. :func:`iter_prepared` reads the records one at a time,
validates them in this process (``limit`` counts valid conversations, as the
serial reader), and runs :func:`onepass.prepare.pipeline.prepare_conversation` on each,
here or on a pool of ``num_proc`` forked workers fed chunks of conversations
through a bounded window (at most ``WINDOW`` chunks in flight per worker), and
yields each conversation's trees in input order while merging its counts into
one :class:`~onepass.prepare.pipeline.PrepareStats` (counters, nothing per
conversation). :func:`onepass.prepare.pipeline.write_prepared` writes them to disk as
they come. The trees and stats equal the serial in-memory pipeline's
(``tests/data/test_data_parallel.py``), including every skip and its reason.

Serial reference it matches::

    report = load_conversations(spec, strict=strict, limit=limit)
    stats = PrepareStats()
    for line in report.skipped:
        stats.skip("invalid record", line)
    rows, stats = prepare(report.conversations, tokenizer, config, stats=stats, strict=strict)

Example::

    stats = PrepareStats()
    write_prepared(iter_prepared("chats.jsonl", tok, config, stats, num_proc=8), stats, config, "out/")

Faults: every process forked while this runs gets ``PR_SET_PDEATHSIG =
SIGKILL`` on Linux, so ``kill -9`` of the parent takes its workers with it;
SIGTERM unwinds normally (the pool is terminated, temporaries removed). Nothing
is staged in the temporary folder: the only partial output is the hidden
temporary of ``--out``, removed by the next run (:func:`onepass.files.recover_dir`).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
import signal
import sys
import time
from collections import deque
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from onepass.conversation.parse import Conversation, ConversationError
from onepass.data.sources import iter_conversation_records
from onepass.prepare.guard_sample import ViewSample, usable_views
from onepass.prepare.pipeline import INVALID, PrepareConfig, PrepareStats, finalize, prepare_conversation
from onepass.render.tokenizer import load_tokenizer
from onepass.layout.tree import Layout

CHUNK = 8  # conversations per task sent to a worker
WINDOW = 4  # tasks in flight per worker: bounds memory, keeps workers busy
STOP_SECONDS = 30.0  # on an early stop, how long in-flight tasks may finish before their workers are killed
_WORKER: dict[str, Any] = {}  # in each worker: its tokenizer, config, strict
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
def _sigterm(action: Any) -> Iterator[None]:
    """SIGTERM handled by ``action`` inside the block, the previous handler back after it.

    Only the main thread may set handlers; elsewhere the block runs with the handler as it is.
    """
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, action)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _raise_exit(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)


def exit_on_sigterm() -> contextlib.AbstractContextManager[None]:
    """SIGTERM raises ``SystemExit(143)`` in the main thread instead of ending the process on the spot."""
    return _sigterm(_raise_exit)


def default_sigterm_while_forking() -> contextlib.AbstractContextManager[None]:
    """Fork workers with SIGTERM at its default action, so ``Pool.terminate`` always ends them.

    A child forked while the parent's Python handler is installed inherits it, and a SIGTERM that
    arrives before the child's interpreter has finished its after-fork bookkeeping is dropped
    (CPython clears tripped signals in the child): ``Pool.terminate`` right after the pool starts
    (a ``--strict`` error in the first chunk) then waits forever on a worker that never heard it.
    With the default action the kernel ends the worker whatever it is doing; workers hold nothing
    to clean up. The parent's handler is back as soon as the pool exists (a SIGTERM to the parent
    inside this short window ends it at once; its temporary folder is removed by the next run).
    """
    return _sigterm(signal.SIG_DFL)


def _tokenizer(tokenizer: Any, chat_template: str | None) -> Any:
    """A loaded tokenizer as is; a spec (``builtin:qwen3``, a path) loaded."""
    if not isinstance(tokenizer, str):
        return tokenizer

    return load_tokenizer(tokenizer, chat_template=chat_template)


@dataclasses.dataclass(kw_only=True)
class _PairedStats(PrepareStats):
    """Stats that also keep each skip's reason beside its message, in order (one conversation's
    turns can be skipped for different reasons): what a worker sends back."""

    pairs: list[tuple[str, str, int]] = dataclasses.field(default_factory=list, metadata={"merge": "skips"})

    def skip(self, reason: str, message: str, count: int = 1) -> None:
        super().skip(reason, message, count)
        self.pairs.append((reason, message, count))


def _init_worker(tokenizer: Any, chat_template: str | None, config: PrepareConfig, strict: bool) -> None:
    _WORKER.update(tokenizer=_tokenizer(tokenizer, chat_template), config=config, strict=strict)


_Done = tuple[list[Layout], dict[str, int], list[tuple[str, str, int]], list[Any]]


def _work(chunk: list[Conversation], sampled: bool = False) -> list[_Done]:
    """Worker: each conversation's trees, counts, skips and (``sampled``: the first conversations, whose
    views the exactness guard may check) its :func:`onepass.prepare.guard_sample.usable_views`."""
    out = []
    for conv in chunk:
        st = _PairedStats()
        views: list[Any] = []
        trees = prepare_conversation(conv, _WORKER["tokenizer"], _WORKER["config"], st, strict=_WORKER["strict"],
                                     on_rendered=(lambda r: views.append(usable_views(r))) if sampled else None)
        out.append((trees, st.counts(), st.pairs, views))
    return out


def _conversations(spec: str | Path, stats: PrepareStats, *, split: str | None, limit: int | None,
                   strict: bool) -> Iterator[Conversation]:
    """Valid conversations of ``spec``, at most ``limit``; invalid records counted in ``stats``."""
    if limit is not None and limit <= 0:
        return
    valid = 0
    for raw in iter_conversation_records(spec, split=split):
        try:
            conv = raw.parse()
        except ConversationError as e:
            if strict:
                raise
            stats.skip(INVALID, str(e))
            continue
        yield conv
        valid += 1
        if limit is not None and valid >= limit:
            return


def _chunks(items: Iterable[Conversation], size: int) -> Iterator[list[Conversation]]:
    chunk: list[Conversation] = []
    for item in items:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def iter_prepared(spec: str | Path, tokenizer: Any, config: PrepareConfig, stats: PrepareStats, *,
                  num_proc: int = 1, chat_template: str | None = None, split: str | None = None,
                  limit: int | None = None, strict: bool = False, progress: bool = False,
                  units: bool = False) -> Iterator[Any]:
    """The trees (unpacked) of ``spec``'s conversations in input order, counted into ``stats``; with
    ``units``, each conversation's list of trees (what sharing prefixes across conversations needs:
    :func:`onepass.prepare.pipeline.write_prepared`).

    ``tokenizer`` is a loaded tokenizer (inherited by forked workers) or a spec (loaded once per
    process). Memory holds at most ``num_proc * WINDOW * CHUNK`` conversations and their trees.
    """
    stats.configure(config)
    convs: Iterable[Conversation] = _conversations(spec, stats, split=split, limit=limit, strict=strict)
    for trees in iter_units(convs, tokenizer, config, stats, num_proc=num_proc, chat_template=chat_template,
                            strict=strict, progress=progress, total=limit):
        if units:
            if trees:
                yield trees
        else:
            yield from trees


def iter_units(convs: Iterable[Conversation], tokenizer: Any, config: PrepareConfig, stats: PrepareStats, *,
               num_proc: int = 1, chat_template: str | None = None, strict: bool = False, progress: bool = False,
               total: int | None = None, sample: ViewSample | None = None) -> Iterator[list[Layout]]:
    """Each conversation's trees (unpacked; an empty list when all its views are skipped), in input order,
    counted into ``stats``; on ``num_proc`` forked workers when > 1, as :func:`iter_prepared`. ``sample``
    is offered each conversation's rendering, in order (the exactness guard's views)."""
    if num_proc < 1:
        raise ValueError(f"num_proc must be >= 1, got {num_proc}")
    stats.configure(config)
    config = config.replace(pack=False)
    if progress:
        from tqdm.auto import tqdm

        convs = tqdm(convs, total=total, desc="prepare", unit="conv", delay=1.0)  # none for a short run
    if num_proc == 1:
        tok = _tokenizer(tokenizer, chat_template)
        for conv in convs:
            yield prepare_conversation(conv, tok, config, stats, strict=strict,
                                       on_rendered=sample.offer if sample is not None else None)
        return
    import multiprocessing

    with workers_die_with_parent():
        with default_sigterm_while_forking():
            pool = multiprocessing.get_context("fork").Pool(
                num_proc, initializer=_init_worker, initargs=(tokenizer, chat_template, config, strict))
        pending: deque[Any] = deque()
        try:
            chunks = _chunks(convs, CHUNK)
            sent = 0  # conversations sent: the first sample.limit of them come back with their views
            while True:
                while len(pending) < WINDOW * num_proc and (chunk := next(chunks, None)) is not None:
                    pending.append(pool.apply_async(_work, (chunk, sample is not None and sent < sample.limit)))
                    sent += len(chunk)
                if not pending:
                    break
                for trees, counts, skips, views in pending.popleft().get():
                    stats.add(counts, skips)
                    if sample is not None and views:
                        sample.add(views[0])
                    yield trees
        finally:
            _stop(pool, pending)


def _stop(pool: Any, pending: Iterable[Any], timeout: float = STOP_SECONDS) -> None:
    """Close ``pool`` once its ``pending`` tasks are done (at most ``timeout`` seconds), then terminate it.

    ``Pool.terminate`` kills workers where they stand; one killed while it writes a result holds the
    result queue's lock forever, and the pool's own task thread then blocks on that lock, so terminate
    never returns (seen as a hung test when the consumer stopped early). Letting the <= ``WINDOW`` tasks
    per worker finish first (a second or so) leaves every worker idle, and ``close`` + ``join`` ends
    them cleanly; ``terminate`` is then only the fallback for a worker that does not finish.
    """
    try:
        pool.close()
        deadline = time.monotonic() + timeout
        for result in pending:
            result.wait(max(0.0, deadline - time.monotonic()))
        if all(result.ready() for result in pending):
            pool.join()
    finally:  # also when a second signal interrupts the wait
        pool.terminate()


def prepare_parallel(spec: str | Path, tokenizer: Any, config: PrepareConfig | None = None, *,
                     num_proc: int = 2, chat_template: str | None = None, split: str | None = None,
                     limit: int | None = None, strict: bool = False,
                     progress: bool = False) -> tuple[list[Layout], PrepareStats]:
    """Rows and stats of ``spec`` (any :mod:`onepass.data.sources` spec) prepared on ``num_proc``
    processes, in memory (for a dataset that fits; ``onepass prepare`` streams to disk instead)."""
    config = config if config is not None else PrepareConfig()  # today's date resolved here, once for every worker
    stats = PrepareStats()
    units = list(iter_prepared(spec, tokenizer, config, stats, num_proc=num_proc, chat_template=chat_template,
                               split=split, limit=limit, strict=strict, progress=progress, units=True))
    return finalize(units, stats, config)
