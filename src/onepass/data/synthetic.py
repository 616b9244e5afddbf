"""Synthetic conversations, seeded and offline: MathChat-shaped with exact token lengths, and agent-shaped.

Why this module exists: benchmarks need thousands of conversations with the
depth distribution of the paper's training set and realistic segment
lengths, on a machine with no hub. The paper's data (MathChatSync-reasoning)
is not reachable, but its depth distribution is known (its appendix table,
after the depth-6 cap and stratified sampling: :data:`PAPER_SAMPLED_DEPTHS`),
and segment lengths are easy to model. So: depth ~ that table, each segment
length ~ a lognormal given by its median and P95 (in tokens), and text built
from :data:`WORDS`, words that are each ONE token in the Qwen vocabulary with
and without a leading space, capitalised or not. A segment of ``n`` tokens is
sentences of such words, a period (one token) ending each sentence but the
last, so a Qwen tokenizer turns it into exactly ``n`` tokens (tests check it
with ``builtin:qwen3``). Pass another ``tokenizer`` and the word list is
filtered to the words that are single tokens for it.

Example::

    >>> recs = generate(2, seed=0)
    >>> recs[0]["id"], len(recs[0]["lengths"]) == len(recs[0]["messages"]) // 2
    ('synthetic-0-0', True)

Conversation ``i`` depends only on ``(seed, i)``, so ``generate(n)`` is a
prefix of ``generate(m)`` for ``n < m``, and a stream can be cut anywhere.

No torch here: numpy only.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from onepass.conversation.parse import parse_record
from onepass.errors import UsageError

# The paper's MathChat_sync depth table after capping depth 6 at 30,000 and drawing 8,000
# stratified with at least min(200, available) per depth, by the authors' own rule
# (onepass.data.sample.allocate(..., rule="paper")): 8,797 conversations, the size of the
# published MathChatSync-reasoning. tests/data/test_data_sample.py recomputes it.
PAPER_SAMPLED_DEPTHS: dict[int, int] = {
    1: 199, 2: 573, 3: 200, 4: 298, 5: 1879, 6: 3219, 7: 1498, 8: 237, 9: 200, 10: 200, 11: 149,
    12: 63, 13: 41, 14: 15, 15: 9, 16: 7, 17: 1, 18: 4, 19: 2, 21: 2, 23: 1,
}

# Each is one Qwen token as "w", " w", "W" and " W" (checked in tests/data/test_data_synthetic.py).
WORDS: tuple[str, ...] = tuple("""
the a an and or but so if then when while because since after before until of to in on at by for
with from into over under about between through during without within per than as is are was were be
been being has have had do does did can could will would should may must need i you he she it we they
me her us them my your his its our their this that these those each every some any all both few many
much more most less least other another same such one two three four five six seven eight nine ten
twenty half third quarter double number numbers sum total difference product ratio rate price cost
money cent percent fraction part parts piece pieces value values answer answers result step steps
problem question questions unit units area length width height distance speed time hour hours minute
minutes second seconds day days week month months year years age add adds added multiply times plus
equal equals left remaining average apple orange book books pen box boxes bag car cars train bus
ticket tickets cookie cookies cake pie pizza water toy ball game games card cards hat dog cat bird fish
tree trees farm house room school class teacher student students friend friends family mother father
son boy girl man woman people child children team player players store shop market job work pay salary
bill coin coins page pages story stories song songs movie buy sell sold give take make makes made get
gets got put keep find found needs want use uses used eat read run runs walk drive save earn share
shares split count counts pack fill first next last new old big small large long short high low full
empty whole different extra free cheap check think know see look note start begin compute try let
remember consider write show how what which who where why yes no not now also just only still very
well again here there
""".split())

SEGMENTS = ("human", "reasoning", "response")
_Z95 = 1.6448536269514722  # standard normal quantile at 0.95


@dataclass(frozen=True, kw_only=True, slots=True)
class LengthDist:
    """A segment length in tokens: lognormal with this median and 95th percentile, clipped.

    ``sigma = ln(p95 / median) / z_0.95``; ``p95 == median`` gives a constant length.
    """

    median: float
    p95: float
    minimum: int = 1
    maximum: int = 32768

    def __post_init__(self) -> None:
        if not (0 < self.median <= self.p95):
            raise ValueError(f"need 0 < median <= p95, got median={self.median}, p95={self.p95}")
        if not 1 <= self.minimum <= self.maximum:
            raise ValueError(f"need 1 <= minimum <= maximum, got {self.minimum}, {self.maximum}")

    @property
    def sigma(self) -> float:
        return math.log(self.p95 / self.median) / _Z95

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray:
        x = rng.lognormal(mean=math.log(self.median), sigma=self.sigma, size=size)
        return np.clip(np.rint(x), self.minimum, self.maximum).astype(np.int64)


@dataclass(frozen=True, kw_only=True, slots=True)
class SyntheticConfig:
    """A workload: depth weights (depth -> relative frequency) and per-segment length laws."""

    depth_table: Mapping[int, float] = field(default_factory=lambda: dict(PAPER_SAMPLED_DEPTHS))
    human: LengthDist = LengthDist(median=46, p95=89)
    reasoning: LengthDist = LengthDist(median=96, p95=213)
    response: LengthDist = LengthDist(median=8, p95=29)
    empty_reasoning: float = 0.0  # probability that a turn's reasoning is "" (still trained)
    num_conversations: int = 1000  # how many a ``synthetic:NAME`` data spec yields

    def __post_init__(self) -> None:
        if not self.depth_table or any(d < 1 or w < 0 for d, w in self.depth_table.items()) \
                or sum(self.depth_table.values()) <= 0:
            raise ValueError("depth_table must map depths >= 1 to non-negative weights, not all zero")
        if not 0.0 <= self.empty_reasoning <= 1.0:
            raise ValueError(f"empty_reasoning must be a probability, got {self.empty_reasoning}")


WORKLOADS: dict[str, SyntheticConfig] = {
    # The paper's depth distribution; segment lengths measured with builtin:qwen3 on the bundled
    # MathChat sample (human 46/89, non-empty reasoning 96/213, response 8/29 tokens, median/P95).
    "mathchat-sync": SyntheticConfig(),
    # The same depths with long reasoning, as from a reasoning model: where one-pass gains most.
    "mathchat-sync-long": SyntheticConfig(human=LengthDist(median=60, p95=200),
                                          reasoning=LengthDist(median=600, p95=2000),
                                          response=LengthDist(median=150, p95=500)),
    # Long reasoning over many turns (the paper's depths from 6 on): the multi-turn reasoning workload
    # make gpu-check times (onepass.bench.gpu_plan).
    "mathchat-deep-long": SyntheticConfig(depth_table={d: w for d, w in PAPER_SAMPLED_DEPTHS.items() if d >= 6},
                                          human=LengthDist(median=60, p95=200),
                                          reasoning=LengthDist(median=600, p95=2000),
                                          response=LengthDist(median=150, p95=500)),
}
DEFAULT_WORKLOAD = "mathchat-sync"


def single_token_words(tokenizer: Any, words: Sequence[str] = WORDS) -> tuple[str, ...]:
    """The words of ``words`` that ``tokenizer`` encodes as one token as "w", " w", "W" and " W"."""
    forms = [f for w in words for f in (w, " " + w, w.capitalize(), " " + w.capitalize())]
    ids = tokenizer(forms, add_special_tokens=False)["input_ids"]
    keep = tuple(w for k, w in enumerate(words) if all(len(ids[4 * k + j]) == 1 for j in range(4)))
    if len(keep) < 20:
        raise ValueError(f"only {len(keep)} of {len(words)} words are single tokens for this tokenizer; "
                         "pass a word list in its vocabulary")
    if len(tokenizer(".", add_special_tokens=False)["input_ids"]) != 1:
        raise ValueError("'.' is not a single token for this tokenizer")
    return keep


def text_of_length(n: int, rng: np.random.Generator, words: Sequence[str] = WORDS) -> str:
    """``n`` tokens of text: sentences of 5-14 words; a period ends each sentence but the last.

    Never ends with punctuation, so a template's following ``\\n`` cannot merge into it.
    """
    if n < 1:
        raise ValueError(f"a segment needs at least one token, got {n}")
    picked = [words[i] for i in rng.integers(0, len(words), size=n).tolist()]
    return _text(n, iter(picked), iter(rng.integers(5, 15, size=n // 6 + 1).tolist()))


def _text(n: int, picked: Iterator[str], sizes: Iterator[int]) -> str:
    """Consume words and sentence sizes; every sentence but the last uses >= 6 tokens, so
    ``n // 6 + 1`` sizes always suffice."""
    out: list[str] = []
    left = n
    while left > 0:
        size = next(sizes)
        take = left if left <= size + 1 else size  # the last sentence takes the rest, no period
        sentence = [next(picked) for _ in range(take)]
        sentence[0] = sentence[0].capitalize()
        left -= take
        out.append(" ".join(sentence) + ("." if left else ""))
        left -= 1 if left else 0
    return " ".join(out)


def _depths(table: Mapping[int, float]) -> tuple[np.ndarray, np.ndarray]:
    depths = np.array(sorted(table), dtype=np.int64)
    weights = np.array([table[d] for d in depths], dtype=np.float64)
    return depths, weights / weights.sum()


def conversation_record(i: int, seed: int, config: SyntheticConfig, words: Sequence[str] = WORDS,
                        depths: tuple[np.ndarray, np.ndarray] | None = None) -> dict[str, Any]:
    """Synthetic conversation ``i`` of stream ``seed``: a ``messages`` record plus its intended
    ``lengths`` ([human, reasoning, response] tokens per turn)."""
    rng = np.random.default_rng([seed, i])
    depths, probs = depths or _depths(config.depth_table)
    depth = int(rng.choice(depths, p=probs))
    h = config.human.sample(rng, depth)
    t = config.reasoning.sample(rng, depth)
    r = config.response.sample(rng, depth)
    t[rng.random(depth) < config.empty_reasoning] = 0
    # all randomness of the text in two draws (numpy calls are slow one by one)
    total = int(h.sum() + t.sum() + r.sum())
    picked = iter([words[j] for j in rng.integers(0, len(words), size=total).tolist()])
    sizes = iter(rng.integers(5, 15, size=total // 6 + 3 * depth).tolist())
    messages: list[dict[str, str]] = []
    for k in range(depth):
        messages.append({"role": "user", "content": _text(int(h[k]), picked, sizes)})
        reasoning = _text(int(t[k]), picked, sizes) if t[k] else ""
        messages.append({"role": "assistant", "content": _text(int(r[k]), picked, sizes),
                         "reasoning_content": reasoning})
    return {"id": f"synthetic-{seed}-{i}", "messages": messages,
            "lengths": [[int(a), int(b), int(c)] for a, b, c in zip(h, t, r)]}


def iter_generate(seed: int = 0, config: SyntheticConfig = SyntheticConfig(), *,
                  tokenizer: Any = None) -> Iterator[dict[str, Any]]:
    """An endless stream of synthetic records (cut it with ``itertools.islice``)."""
    words = single_token_words(tokenizer) if tokenizer is not None else WORDS
    depths = _depths(config.depth_table)
    for i in itertools.count():
        yield conversation_record(i, seed, config, words, depths)


def generate(num_conversations: int, seed: int = 0, *, depth_table: Mapping[int, float] | None = None,
             lengths: Mapping[str, LengthDist] | None = None, config: SyntheticConfig | None = None,
             tokenizer: Any = None) -> list[dict[str, Any]]:
    """``num_conversations`` synthetic records (OpenAI ``messages`` + ``lengths``), seeded.

    ``depth_table`` (depth -> weight) and ``lengths`` ({"human"|"reasoning"|"response": LengthDist})
    override ``config`` (default: the ``mathchat-sync`` workload). With a ``tokenizer``, text uses
    only words that are single tokens for it, so the intended lengths hold for it too.
    """
    if num_conversations < 0:
        raise ValueError(f"num_conversations must be >= 0, got {num_conversations}")
    base = config or WORKLOADS[DEFAULT_WORKLOAD]
    unknown = set(lengths or ()) - set(SEGMENTS)
    if unknown:
        raise ValueError(f"unknown segment(s) {', '.join(sorted(unknown))}; have {', '.join(SEGMENTS)}")
    kw: dict[str, Any] = dict(lengths or {})
    if depth_table is not None:
        kw["depth_table"] = dict(depth_table)
    cfg = SyntheticConfig(**{**{f: getattr(base, f) for f in SyntheticConfig.__dataclass_fields__}, **kw})
    return list(itertools.islice(iter_generate(seed, cfg, tokenizer=tokenizer), num_conversations))


def generate_conversations(num_conversations: int, seed: int = 0, **kwargs: Any) -> list:
    """:func:`generate`, parsed into validated :class:`~onepass.conversation.parse.Conversation` records."""
    return [parse_record(r, source=f"synthetic seed {seed}", index=i)
            for i, r in enumerate(generate(num_conversations, seed, **kwargs))]


# ---------------------------------------------------------------------------------------------
# agent conversations: harnesses whose system prompt and tools every conversation repeats
#
# Agent and tool-calling data repeat the same system prompt and tools in every conversation (the
# real tau-bench airline and BFCL sets in ../shared/data/agent/ begin with 3-7k tokens of them),
# which is where sharing a prefix across conversations (onepass.layout.share) pays; the benchmark needs
# that shape at any size. A *harness* is a system prompt and tool schemas (2-4.5k tokens with
# Qwen3's template); a conversation of harness (i // 2) % harnesses runs 4-20 turns, each a user
# request, up to one tool call answered by a tool result, then an answer; every assistant message
# (each a view) has a short reasoning Qwen3 drops from later turns. Conversations come in pairs of
# one harness, so the first four already hold two harnesses with two conversations each.

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
    reasoning: tuple[int, int] = (5, 20)
    tool_result: tuple[int, int] = (10, 60)
    answer: tuple[int, int] = (5, 25)
    calls: tuple[int, int] = (0, 1)  # tool calls before the answer of a turn
    num_conversations: int = 30  # how many a ``synthetic:NAME`` data spec yields


AGENT_WORKLOADS: dict[str, AgentConfig] = {
    # three harnesses of 1.5k / 2.5k / 3.5k prompt tokens and ten tools (2.4-4.4k tokens with Qwen3's
    # template), 4-20 turns of 0-1 tool calls each, short reasoning on every assistant message
    "agent": AgentConfig(),
}


def _words(rng: np.random.Generator, n: int) -> str:
    """``n`` tokens of the one-token words (:func:`text_of_length`'s text, from this rng)."""
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
    and ``tool`` results, its harness's ``tools``, and ``harness``.

    >>> recs = [agent_record(i, 0, AGENT_WORKLOADS["agent"]) for i in range(7)]
    >>> [r["harness"] for r in recs], recs[0]["messages"][0]["role"]
    ([0, 0, 1, 1, 2, 2, 0], 'system')
    >>> recs[0]["tools"] == recs[1]["tools"] and recs[0]["messages"][0] == recs[6]["messages"][0]
    True
    """
    h = (i // 2) % config.harnesses
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


def workload_names() -> tuple[str, ...]:
    """Every ``synthetic:NAME``: the MathChat-shaped workloads and the agent ones (:data:`AGENT_WORKLOADS`)."""
    return (*WORKLOADS, *AGENT_WORKLOADS)


def workload(name: str) -> SyntheticConfig:
    if name not in WORKLOADS:
        raise UsageError(f"unknown synthetic workload {name!r}; have {', '.join(workload_names())}")
    return WORKLOADS[name]


def iter_records(name: str, seed: int = 0) -> Iterator[dict[str, Any]]:
    """An endless stream of workload ``name``'s records (MathChat-shaped or agent)."""
    if name in AGENT_WORKLOADS:
        return iter_agent(seed, AGENT_WORKLOADS[name])
    return iter_generate(seed, workload(name))


def iter_workload(name: str, seed: int = 0) -> Iterator[dict[str, Any]]:
    """The ``synthetic:NAME`` data spec: that workload's ``num_conversations`` records, seed 0."""
    n = AGENT_WORKLOADS[name].num_conversations if name in AGENT_WORKLOADS else workload(name).num_conversations
    return itertools.islice(iter_records(name, seed), n)
