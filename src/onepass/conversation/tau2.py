"""tau2-bench trajectories as recorded: a simulation's ``messages``, read as the agent saw them.

Why this module exists: tau2-bench (sierra-research/tau2-bench) saves each simulation's ``messages`` as its
pydantic models dump them, not as the OpenAI messages its agent was sent. Its ``to_litellm_messages`` turns
them into those messages at every step, and this module reads a record the same way, so the views are the
text the agent saw:

- a tool call is ``{"id", "name", "arguments", "requestor"}`` (arguments an object): read as an OpenAI call
  (``{"id", "type": "function", "function": {"name", "arguments"}}``);
- a tool result carries its call's id as ``id``: read as ``tool_call_id``;
- the bookkeeping every message carries (``turn_idx``, ``timestamp``, ``cost``, ``usage``, ``raw_data``, ...:
  :data:`BOOKKEEPING`) is what the simulator logged, never sent to the model, so no template renders it: left
  out, the record counted (:data:`TAU2`);
- the user simulator's own tool calls (telecom: the user toggles their phone) and their results, a user message
  with ``tool_calls`` and tool messages with ``requestor: "user"``, went to the user's environment, never to the
  agent: left out of the agent's conversation, counted (:data:`TAU2_USER_TOOLS`);
- what would make the record another text than the agent saw is refused naming the message: a voice or
  streaming message (``is_audio``, ``chunk_id``, audio fields: :data:`TEXT_DEFAULTS`), a history the agent
  saw truncated (``context_truncation``), a field tau2-bench does not write.

The first message of every text simulation is the agent's fixed greeting (tau2-bench's orchestrator
writes ``"Hi! How can I help you today?"`` before the user speaks): a conversation that opens with an
assistant message is read as one (:attr:`onepass.conversation.parse.Conversation.greeting`; whether it is
trained is a setting, ``--train-greeting``). The system prompt and the tools are not in a simulation's
messages (the agent holds them): a record gives them as ``system`` and ``tools``, as any record does.

A record is read so when one of its messages has tau2-bench's ``turn_idx`` or ``requestor`` (fields no other
schema writes); other records are OpenAI messages. No torch here: this is pure data.

    >>> where = Where(source="sim.jsonl", index=0)
    >>> tau2_messages([{"role": "assistant", "content": "Hi! How can I help you today?", "turn_idx": 0,
    ...                 "timestamp": "2025-06-01T10:00:00", "cost": 0.0},
    ...                {"role": "user", "content": "Cancel my order.", "turn_idx": 1, "cost": 0.0012}], where)
    [{'role': 'assistant', 'content': 'Hi! How can I help you today?'}, {'role': 'user', 'content': 'Cancel my order.'}]
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from onepass.conversation.schemas import MESSAGE_KEYS, TAU2, TAU2_USER_TOOLS, Where, unknown_fields

MARKERS = ("turn_idx", "requestor")
"""Fields only tau2-bench writes on a message: a record holding one is read by :func:`tau2_messages`."""
BOOKKEEPING = frozenset({"turn_idx", "timestamp", "cost", "usage", "raw_data", "generation_time_seconds", "error",
                         "requestor"})
"""What tau2-bench logs beside a message and never sends to the model (``error``: the result's text says it)."""
TEXT_DEFAULTS = {"is_audio": False, "is_final_chunk": True, "contains_speech": True, "source": None,
                 "chunk_id": None, "utterance_ids": None, "turn_taking_action": None, "audio_format": None,
                 "audio_content": None, "audio_path": None, "audio_script_gold": None, "speech_effects": None,
                 "source_effects": None, "channel_effects": None, "context_truncation": None}
"""tau2-bench's voice and streaming fields, at the value a text (half-duplex) simulation writes; any other value
means the message is audio, a streaming chunk or a history the agent saw cut: not the text it saw."""
CALL_KEYS = frozenset({"id", "name", "arguments", "requestor", "type", "function"})


def is_tau2(raw: Any) -> bool:
    """Is ``raw`` (a record's messages) a tau2-bench simulation's, by the fields only tau2-bench writes?"""
    for m in raw if isinstance(raw, list) else ():
        if not isinstance(m, Mapping):
            continue
        calls = m.get("tool_calls")
        if any(k in m for k in MARKERS) or (isinstance(calls, list) and any(
                isinstance(c, Mapping) and "requestor" in c for c in calls)):
            return True
    return False


def _text_only(m: Mapping[str, Any], where: Where, i: int) -> None:
    for key, default in TEXT_DEFAULTS.items():
        value = m.get(key, default)
        if value != default and not (default is None and value in ("", [], {})) and not (
                key == "source" and value == "text"):
            why = ("the agent saw a truncated history, not these messages" if key == "context_truncation" else
                   "a voice or streaming message; onepass reads the text (half-duplex) simulations")
            raise where(f"tau2-bench field {key!r} is {value!r:.60}: {why}", i)


def _call(call: Any, where: Where, i: int, j: int) -> dict[str, Any]:
    if not isinstance(call, Mapping):
        raise where(f"tool_calls[{j}] must be an object", i)
    unknown_fields(call, CALL_KEYS, where, i, what=f"field of tool_calls[{j}]")
    if call.get("requestor", "assistant") != "assistant":
        raise where(f"tool_calls[{j}] of an assistant message has requestor {call.get('requestor')!r}", i)
    if "function" in call:  # already OpenAI's shape
        return {k: v for k, v in call.items() if k != "requestor"}
    out: dict[str, Any] = {"type": "function", "function": {"name": call.get("name"),
                                                            "arguments": call.get("arguments", {})}}
    if call.get("id"):  # tau2-bench's default id is "": no id
        out["id"] = call["id"]
    return out


def tau2_messages(raw: list[Any], where: Where) -> list[Any]:
    """A tau2-bench simulation's messages -> the OpenAI messages its agent was sent (module docstring); message
    numbers in errors are the record's. A message that is not an object is passed on (the reader refuses it)."""
    out: list[Any] = []
    known = MESSAGE_KEYS | BOOKKEEPING | set(TEXT_DEFAULTS) | {"id"}
    for i, m in enumerate(raw):
        if not isinstance(m, Mapping):
            out.append(m)
            continue
        unknown_fields(m, known, where, i)
        _text_only(m, where, i)
        role = m.get("role")
        if (role == "user" and m.get("tool_calls")) or (role == "tool" and m.get("requestor") == "user"):
            where.converted(TAU2_USER_TOOLS)
            continue
        message = {k: v for k, v in m.items() if k in MESSAGE_KEYS}
        if role == "tool" and m.get("id") is not None:
            if m.get("tool_call_id") not in (None, m["id"]):
                raise where(f"a tool message with id {m['id']!r} and tool_call_id {m['tool_call_id']!r}", i)
            message["tool_call_id"] = m["id"]
        elif m.get("id") is not None:
            raise where(f"'id' on a {role} message (tau2-bench writes it on tool results only)", i)
        if role == "assistant" and isinstance(m.get("tool_calls"), list):
            message["tool_calls"] = [_call(c, where, i, j) for j, c in enumerate(m["tool_calls"])]
        out.append(message)
    where.converted(TAU2)
    return out
