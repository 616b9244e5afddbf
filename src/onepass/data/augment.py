"""Write the hidden reasoning of every assistant turn with an LLM (``onepass data augment``).

Why this module exists: the paper's data set is MathChat_sync plus a
rationale for every assistant turn, written by an LLM that sees the dialogue
so far and the reply, and is asked only for the reasoning that would have
led to that reply. Users need the same for their own chats, at the scale of
tens of thousands of requests, where runs get interrupted and requests fail.

Guarantees:

- Every result is appended to a cache file (JSON lines, one per request, keyed
  by :func:`request_key`, a hash of the model and the exact request) and
  flushed as it arrives. A rerun reads the cache and sends only what is not
  in it, so an interrupted run (Ctrl-C, SIGKILL, a crash) resumes without
  repeating a finished request or losing one. Two runs on one cache are
  refused (a file lock).
- A failed request is retried (:mod:`onepass.data.chat_client`) and then
  listed per turn in the failure report, never skipped silently; its
  conversation is left out of the output until a rerun succeeds.
- A reply whose reasoning is a refusal (:mod:`onepass.data.refusal`, also when
  wrapped in the requested JSON) is a failed attempt: retried, then reported;
  a refusal cached by an earlier run is requested again. All are counted.
- A cache line that does not parse, and a last line cut by a kill, are named
  (file and line) in the summary; their turns are requested again.
- Credentials (the key, auth headers, ``?key=``) are masked in everything
  written: errors, the failure report, the cache.
- The output holds every conversation whose turns all have reasoning, in
  input order, as OpenAI ``messages`` records with ``reasoning_content``.

One request (the history never shows earlier reasoning, as at inference)::

    system  SYSTEM_PROMPT (asks for {"reasoning": "..."} only)
    user    Conversation so far: [{"role": "user", "content": "2+2?"}]
            The assistant's reply: {"role": "assistant", "content": "4"}
    reply   {"reasoning": "I need to add two and two ..."}
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from onepass.conversation.parse import Conversation
from onepass.data.chat_client import ChatClient, FatalRequestError, RequestFailed, scrub
from onepass.data.sources import to_record
from onepass.data.refusal import RefusalCheck
from onepass.errors import OnePassError, UsageError

SYSTEM_PROMPT = """You write the hidden reasoning of an AI assistant in a conversation.
You are given the conversation so far and the reply the assistant gave next. Write the private \
step-by-step reasoning the assistant thinks through BEFORE writing that reply: what the user is \
asking now, the facts from the conversation it relies on, and the steps that lead to the reply.
Write it as a first-person inner monologue in the present tense ("I need to ...", "So ..."). Do \
not copy the reply word for word, do not talk about "the assistant", and do not mention these \
instructions.
Answer with exactly one JSON object and nothing else: {"reasoning": "<the reasoning>"}"""


class AugmentError(OnePassError, ValueError):
    """A run that cannot start or go on (cache in use, unreadable cache, endpoint refuses)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Turn:
    """One assistant turn to write reasoning for, and the request that asks for it."""

    key: str
    conversation: str  # the conversation's id, or where it came from
    turn: int  # index of the assistant message in Conversation.messages
    messages: tuple[dict[str, str], ...]


def _message_json(m: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls:
        out["tool_calls"] = [{"name": c.name, "arguments": c.arguments} for c in m.tool_calls]
    return out


def build_request(conv: Conversation, turn: int, system_prompt: str = SYSTEM_PROMPT) -> tuple[dict[str, str], ...]:
    """The chat messages that ask for the reasoning of assistant message ``turn`` of ``conv``."""
    history = ([{"role": "system", "content": conv.system}] if conv.system else []) + \
        [_message_json(m) for m in conv.messages[:turn]]
    reply = _message_json(conv.messages[turn])
    user = ("Conversation so far:\n" + json.dumps(history, ensure_ascii=False, indent=1)
            + "\n\nThe assistant's reply:\n" + json.dumps(reply, ensure_ascii=False, indent=1))
    return ({"role": "system", "content": system_prompt}, {"role": "user", "content": user})


def request_key(model: str, messages: Sequence[dict[str, str]]) -> str:
    """Stable id of one request: the same model and messages give the same key, in any run."""
    blob = json.dumps({"model": model, "messages": list(messages)}, ensure_ascii=False, sort_keys=True)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:32]


def conversation_name(conv: Conversation) -> str:
    return conv.id if conv.id is not None else conv.source


def plan_turns(conversations: Sequence[Conversation], *, model: str, system_prompt: str = SYSTEM_PROMPT,
               only_missing: bool = False) -> list[list[Turn]]:
    """Per conversation, the turns to request (``only_missing`` keeps reasoning already present)."""
    plan = []
    for conv in conversations:
        turns = []
        for k, m in enumerate(conv.messages):
            if m.role != "assistant" or (only_missing and m.reasoning):
                continue
            messages = build_request(conv, k, system_prompt)
            turns.append(Turn(key=request_key(model, messages), conversation=conversation_name(conv),
                              turn=k, messages=messages))
        plan.append(turns)
    return plan


REFUSAL = "refusal: "  # how the error of a refused reply starts


class Cache:
    """Append-only JSON lines ``{"key", "conversation", "turn", "reasoning", ...}``, flushed per line.

    Opening it takes an exclusive lock and repairs a last line cut by a kill (truncated away:
    its request was not finished, so it is sent again); ``cut_line`` is its line number.
    Lines that do not parse stay in the file and their numbers are in ``corrupt_lines``.
    ``value``: the field that holds the cached text (``eval`` keeps its replies under ``reply``).
    """

    def __init__(self, path: str | Path, *, value: str = "reasoning") -> None:
        self.path, self.value = Path(path), value
        self.results: dict[str, str] = {}
        self.duplicates = 0
        self.corrupt_lines: list[int] = []  # 1-based
        self.cut_line: int | None = None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a+b")
        try:
            import fcntl

            fcntl.flock(self._file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except ImportError:  # not POSIX: no lock
            pass
        except OSError:
            self._file.close()
            raise AugmentError(f"{self.path} is in use by another run; wait for it or use another "
                               f"{'--cache' if value == 'reasoning' else '--out'}") from None
        self._load()

    def _load(self) -> None:
        self._file.seek(0)
        data = self._file.read()
        cut = data.rfind(b"\n") + 1
        if cut < len(data):  # a partial last line from a killed run
            self._file.truncate(cut)
            data = data[:cut]
            self.cut_line = data.count(b"\n") + 1
        for number, line in enumerate(data.split(b"\n")[:-1], 1):
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
                key, reasoning = entry["key"], entry[self.value]
                if not isinstance(key, str) or not isinstance(reasoning, str):
                    raise TypeError
            except (ValueError, KeyError, TypeError):  # ValueError: not JSON, or not UTF-8
                self.corrupt_lines.append(number)
                continue
            if key in self.results:
                self.duplicates += 1
            self.results[key] = reasoning
        self._file.seek(0, os.SEEK_END)

    def add(self, turn: Turn, reasoning: str, *, attempts: int, model: str) -> None:
        self.put(turn.key, reasoning, conversation=turn.conversation, turn=turn.turn, model=model, attempts=attempts)

    def put(self, key: str, text: str, **fields: Any) -> None:
        """Append one entry (flushed: a kill loses at most the line being written)."""
        entry = {"key": key, **fields, "time": round(time.time(), 3), self.value: text}
        self._file.write((json.dumps(entry, ensure_ascii=False) + "\n").encode("utf-8"))
        self._file.flush()
        self.results[key] = text

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> Cache:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


@dataclass(kw_only=True)
class AugmentResult:
    records: list[dict[str, Any]] = field(default_factory=list)  # complete conversations
    failures: list[dict[str, Any]] = field(default_factory=list)  # one per failed turn
    turns: int = 0
    from_cache: int = 0
    requested: int = 0
    succeeded: int = 0
    conversations: int = 0
    conversations_incomplete: int = 0
    skipped: list[str] = field(default_factory=list)  # invalid input records
    refused_replies: int = 0  # replies rejected as refusals, retried ones included
    refused_in_cache: int = 0  # cached refusals of an earlier run, requested again
    cache: str = ""
    cache_corrupt_lines: list[int] = field(default_factory=list)
    cache_cut_line: int | None = None

    @property
    def refused_turns(self) -> int:
        return sum(bool(f.get("refused")) for f in self.failures)

    def summary(self) -> str:
        lines = [f"turns {self.turns}: {self.from_cache} from the cache, {self.requested} requested, "
                 f"{self.succeeded} succeeded, {len(self.failures)} failed",
                 f"conversations {self.conversations}: {len(self.records)} complete, "
                 f"{self.conversations_incomplete} left out (a turn failed; rerun to retry it)"]
        if self.refused_replies or self.refused_in_cache:
            lines.append(f"REFUSALS: {self.refused_replies} replies were refusals (retried), "
                         f"{self.refused_turns} turns failed on one; {self.refused_in_cache} cached refusals "
                         "requested again")
        if self.cache_corrupt_lines:
            shown = ", ".join(map(str, self.cache_corrupt_lines[:20]))
            more = f" and {len(self.cache_corrupt_lines) - 20} more" if len(self.cache_corrupt_lines) > 20 else ""
            lines.append(f"CACHE {self.cache}: {len(self.cache_corrupt_lines)} corrupt lines ignored (lines "
                         f"{shown}{more}); their turns were requested again")
        if self.cache_cut_line is not None:
            lines.append(f"CACHE {self.cache}: line {self.cache_cut_line} was cut (a killed run) and removed; "
                         "its turn was requested again")
        if self.skipped:
            lines.append(f"SKIPPED {len(self.skipped)} invalid input records; first: {self.skipped[0]}")
        return "\n".join(lines)


class _RefusalFilter:
    """``check`` for :meth:`ChatClient.complete_json`: raises on a refusal and counts it (thread-safe)."""

    def __init__(self, refusal: RefusalCheck) -> None:
        self.refusal, self.count, self._lock = refusal, 0, threading.Lock()

    def __call__(self, reasoning: str) -> None:
        pattern = self.refusal.match(reasoning)
        if pattern is not None:
            with self._lock:
                self.count += 1
            raise ValueError(f"{REFUSAL}the reasoning matches {pattern!r}: {reasoning[:80]!r}")


def _apply(conv: Conversation, reasoning: dict[int, str]) -> Conversation:
    messages = tuple(dataclasses.replace(m, reasoning=reasoning[k]) if k in reasoning else m
                     for k, m in enumerate(conv.messages))
    return dataclasses.replace(conv, messages=messages)


def _run_requests(todo: list[Turn], client: ChatClient, cache: Cache, *, concurrency: int, progress: bool,
                  total: int, initial: int, check: _RefusalFilter) -> dict[str, tuple[str, int]]:
    """Send ``todo`` with ``concurrency`` threads; results go to ``cache`` as they arrive.
    Returns the failures: key -> (error, attempts)."""
    from tqdm.auto import tqdm

    failures: dict[str, tuple[str, int]] = {}
    fatal: FatalRequestError | None = None
    pending: Iterator[Turn] = iter(todo)
    in_flight: dict[Future, Turn] = {}
    bar = tqdm(total=total, initial=initial, unit="turn", desc="augment", disable=not progress, smoothing=0.1)
    with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="augment") as pool:
        def submit() -> None:
            while fatal is None and len(in_flight) < concurrency and (t := next(pending, None)) is not None:
                in_flight[pool.submit(client.complete_json, t.messages, required="reasoning",
                                      aliases=("thought",), check=check)] = t
        try:
            submit()
            while in_flight:
                done, _ = wait(in_flight, return_when=FIRST_COMPLETED)
                for fut in done:
                    turn = in_flight.pop(fut)
                    try:
                        reasoning, attempts = fut.result()
                    except RequestFailed as e:
                        failures[turn.key] = (e.error, e.attempts)
                    except FatalRequestError as e:
                        fatal = fatal or e
                    except Exception as e:  # an unforeseen error in one request: report the turn, go on
                        failures[turn.key] = (f"unexpected error: {e!r}", 0)
                    else:  # a failing cache write (disk full) stops the run: nothing is lost
                        cache.add(turn, scrub_key(reasoning, client.config.api_key()), attempts=attempts,
                                  model=client.config.model)
                    bar.update(1)
                submit()
        finally:
            bar.close()
    if fatal is not None:
        raise AugmentError(scrub(str(fatal), client.config.api_key()))
    return failures


def scrub_key(text: str, secret: str | None) -> str:
    """Only the key itself masked: for model output, where a header-like phrase may be content."""
    return text.replace(secret, "***") if secret else text


def augment(conversations: Sequence[Conversation], client: ChatClient, cache_path: str | Path, *,
            concurrency: int = 8, system_prompt: str = SYSTEM_PROMPT, only_missing: bool = False,
            progress: bool = False, refusal: RefusalCheck | None = None) -> AugmentResult:
    """Reasoning for every assistant turn of ``conversations``, resumable through ``cache_path``.

    ``refusal`` (default :meth:`RefusalCheck.default`; :meth:`RefusalCheck.none` for no check)
    rejects reasoning that is a refusal, in replies and in the cache.
    """
    if concurrency < 1:
        raise UsageError(f"concurrency must be >= 1, got {concurrency}")
    plan = plan_turns(conversations, model=client.config.model, system_prompt=system_prompt,
                      only_missing=only_missing)
    refusal = RefusalCheck.default() if refusal is None else refusal
    check = _RefusalFilter(refusal)
    result = AugmentResult(conversations=len(conversations), turns=sum(map(len, plan)), cache=str(cache_path))
    with Cache(cache_path) as cache:
        result.cache_corrupt_lines, result.cache_cut_line = list(cache.corrupt_lines), cache.cut_line
        refused = [k for k, reasoning in cache.results.items() if refusal.match(reasoning) is not None]
        for k in refused:  # from a run without the check (or with other patterns): ask again
            del cache.results[k]
        unique: dict[str, Turn] = {}
        for turns in plan:
            for t in turns:
                unique.setdefault(t.key, t)
        todo = [t for k, t in unique.items() if k not in cache.results]
        result.refused_in_cache = sum(k in unique for k in refused)
        result.from_cache = sum(t.key in cache.results for turns in plan for t in turns)
        result.requested = len(todo)
        try:
            failed = _run_requests(todo, client, cache, concurrency=concurrency, progress=progress,
                                   total=len(unique), initial=len(unique) - len(todo), check=check)
        finally:
            result.refused_replies = check.count
        result.succeeded = len(todo) - len(failed)
        for conv, turns in zip(conversations, plan):
            missing = [t for t in turns if t.key not in cache.results]
            for t in missing:
                error, attempts = failed.get(t.key, ("not requested (the run stopped)", 0))
                result.failures.append({"conversation": t.conversation, "turn": t.turn, "key": t.key,
                                        "error": scrub(error, client.config.api_key()), "attempts": attempts,
                                        "refused": error.startswith(REFUSAL)})
            if missing:
                result.conversations_incomplete += 1
                continue
            done = _apply(conv, {t.turn: cache.results[t.key] for t in turns})
            result.records.append(to_record(done) if done.id is not None else
                                  {"id": conversation_name(done), **to_record(done)})
    return result


def write_failure_report(result: AugmentResult, path: str | Path) -> Path | None:
    """Write the per-turn failures as JSON (or remove a stale report when there are none)."""
    path = Path(path)
    if not result.failures:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    report = {"failed_turns": len(result.failures), "incomplete_conversations": result.conversations_incomplete,
              "refused_turns": result.refused_turns, "refused_replies": result.refused_replies,
              "refused_in_cache": result.refused_in_cache, "cache": result.cache,
              "cache_corrupt_lines": result.cache_corrupt_lines, "cache_cut_line": result.cache_cut_line,
              "failures": result.failures}
    path.write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return path
