"""Synthetic agent conversations: a few harnesses, each a long system prompt and tool schemas shared by
every conversation it runs, then turns of tool calls and results. Seeded, offline.

Why this module exists: agent and tool-calling data repeat the same system prompt and tools in every
conversation (the real tau-bench airline and BFCL sets in ``../shared/data/agent/`` begin with 3-7k
tokens of them), which is where sharing a prefix across conversations (:mod:`onepass.share`) pays;
the benchmark needs that shape at any size, with no download. A *harness* is a system prompt of
``prompt`` tokens and ``tools`` tool schemas (names, descriptions and parameters), 2-6k tokens
rendered with Qwen3's template; a conversation picks a harness and runs 4-20 turns, each a
user request, then up to one tool call answered by a tool result, then an answer; every
assistant message (each a view) has a short reasoning (which Qwen3 drops from later turns, so each turn is a view).
Text is the one-token words of :mod:`onepass.data.synthetic`.

    >>> recs = [agent_record(i, 0, AGENT_WORKLOADS["agent"]) for i in range(4)]
    >>> [r["harness"] for r in recs], recs[0]["messages"][0]["role"]
    ([0, 1, 2, 0], 'system')
    >>> recs[0]["tools"] == recs[3]["tools"] and recs[0]["messages"][0] == recs[3]["messages"][0]
    True

Conversation ``i`` depends only on ``(seed, i)`` and belongs to harness ``i % harnesses`` (whose
prompt and tools depend only on ``(seed, harness)``), so any prefix of the stream mixes the harnesses.

No torch here: numpy only.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from onepass.data.synthetic import WORDS, _text


@dataclass(frozen=True, kw_only=True, slots=True)
class AgentConfig:
    """An agent workload: ``harnesses`` harnesses whose system prompts hold ``prompt`` tokens (one per
    harness, cycled) and ``tools`` tools each; conversations of ``min_turns``-``max_turns`` turns (a
    user message, ``calls`` tool calls and results, an answer); segment lengths in tokens (each drawn
    uniformly between the pair's bounds)."""

    harnesses: int = 3
    prompt: tuple[int, ...] = (1500, 2500, 3500)  # system prompt tokens of harness h: prompt[h % len(prompt)]
    tools: int = 10
    min_turns: int = 4
    max_turns: int = 20
    user: tuple[int, int] = (10, 40)
    reasoning: tuple[int, int] = (10, 40)
    tool_result: tuple[int, int] = (10, 60)
    answer: tuple[int, int] = (5, 30)
    calls: tuple[int, int] = (0, 1)  # tool calls before the answer of a turn
    num_conversations: int = 30  # how many a ``synthetic:NAME`` data spec yields


AGENT_WORKLOADS: dict[str, AgentConfig] = {
    # three harnesses of 1.5k / 2.5k / 3.5k prompt tokens and ten tools (2.4-4.4k tokens with Qwen3's
    # template), 4-20 turns of 0-1 tool calls each, short reasoning on every assistant message
    "agent": AgentConfig(),
}


def _words(rng: np.random.Generator, n: int) -> str:
    picked = iter([WORDS[j] for j in rng.integers(0, len(WORDS), size=n).tolist()])
    return _text(n, picked, iter(rng.integers(5, 15, size=n // 6 + 2).tolist()))


def _between(rng: np.random.Generator, bounds: tuple[int, int]) -> int:
    return int(rng.integers(bounds[0], bounds[1] + 1))


def harness(h: int, seed: int, config: AgentConfig) -> tuple[str, list[dict[str, Any]]]:
    """Harness ``h``'s system prompt and tool schemas (OpenAI ``tools``)."""
    rng = np.random.default_rng([seed, 1_000_003, h])
    system = f"# Harness {h} policy\n\n" + _words(rng, config.prompt[h % len(config.prompt)])
    tools = []
    for t in range(config.tools):
        params = {f"arg_{a}": {"type": "string", "description": _words(rng, _between(rng, (6, 20)))}
                  for a in range(_between(rng, (1, 4)))}
        tools.append({"type": "function", "function": {
            "name": f"h{h}_tool_{t}", "description": _words(rng, _between(rng, (15, 60))),
            "parameters": {"type": "object", "properties": params, "required": sorted(params)[:1]}}})
    return system, tools


def agent_record(i: int, seed: int, config: AgentConfig) -> dict[str, Any]:
    """Agent conversation ``i`` of stream ``seed``: OpenAI ``messages`` (system first) with ``tool_calls``
    and ``tool`` results, its harness's ``tools``, and ``harness``."""
    h = i % config.harnesses
    system, tools = harness(h, seed, config)
    rng = np.random.default_rng([seed, i])
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
    call = 0
    for _ in range(_between(rng, (config.min_turns, config.max_turns))):
        messages.append({"role": "user", "content": _words(rng, _between(rng, config.user))})
        for _ in range(_between(rng, config.calls)):
            tool = tools[int(rng.integers(len(tools)))]["function"]
            args = {name: _words(rng, _between(rng, (1, 6))) for name in tool["parameters"]["properties"]}
            call_id = f"call_{i}_{call}"
            call += 1
            messages.append({"role": "assistant", "content": "",
                             "reasoning_content": _words(rng, _between(rng, config.reasoning)),
                             "tool_calls": [{"id": call_id, "type": "function",
                                             "function": {"name": tool["name"], "arguments": json.dumps(args)}}]})
            messages.append({"role": "tool", "tool_call_id": call_id, "name": tool["name"],
                             "content": _words(rng, _between(rng, config.tool_result))})
        messages.append({"role": "assistant", "content": _words(rng, _between(rng, config.answer)),
                         "reasoning_content": _words(rng, _between(rng, config.reasoning))})
    return {"id": f"agent-{seed}-{i}", "harness": h, "messages": messages, "tools": tools}


def iter_agent(seed: int = 0, config: AgentConfig = AgentConfig()) -> Iterator[dict[str, Any]]:
    """An endless stream of agent records (cut it with ``itertools.islice``)."""
    for i in itertools.count():
        yield agent_record(i, seed, config)
