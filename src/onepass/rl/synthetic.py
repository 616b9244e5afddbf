"""Seeded rollouts for tests and benchmarks: rendered by a real chat template, or shaped like agent traces.

Why this module exists: exactness must be shown on rollouts nobody wrote for the
test, in the shape a real trainer produces them. :func:`template_rollouts` builds
groups of multi-turn conversations (synthetic words that are single tokens for the
tokenizer, :mod:`onepass.data.synthetic`) and renders every turn with the
tokenizer's own chat template (:func:`onepass.render.render_views`): with Qwen3's
template turn k+1's prompt drops turn k's reasoning, exactly the case RL
frameworks cannot score as one sequence. Trajectories of a group share their first
prompt and often the first words of each reasoning (as sampled answers do).

:func:`agent_rollouts` skips the template and draws token ids in the shape of agent
traces (a group of G trajectories, 2-8 turns of reasoning 0.5-4k tokens, a tool
call and a tool result per turn; earlier reasoning dropped from later prompts),
with :func:`keep_all_reasoning_ids`, the sequence a "keep all reasoning" shortcut
scores instead (one forward per trajectory, but later turns conditioned on
reasoning they never saw when sampled: not the sampled distribution).

No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from onepass.conversation import parse_record
from onepass.data.synthetic import single_token_words, text_of_length
from onepass.render import RenderConfig, render_views


def _group_advantages(rng: np.random.Generator, n: int) -> np.ndarray:
    rewards = rng.normal(size=n)
    return (rewards - rewards.mean()) / (rewards.std() + 1e-6)  # GRPO: rewards normalised within the group


def template_rollouts(tokenizer: Any, *, num_groups: int, group_size: int, seed: int, max_turns: int = 3,
                      template_kwargs: dict[str, Any] | None = None, system: str | None = None
                      ) -> list[dict[str, Any]]:
    """Rollout records (see :mod:`onepass.rl.rollouts`) whose turns the tokenizer's template rendered;
    ``system``: a system prompt every group's conversations begin with (groups then share a prefix)."""
    rng = np.random.default_rng(seed)
    words = single_token_words(tokenizer)
    config = RenderConfig(template_kwargs=template_kwargs or {})
    records = []
    for g in range(num_groups):
        depth = int(rng.integers(1, max_turns + 1))
        users = [text_of_length(int(rng.integers(4, 16)), rng, words) for _ in range(depth)]
        openings = [text_of_length(3, rng, words) for _ in range(depth)]
        advantages = _group_advantages(rng, group_size)
        for j in range(group_size):
            messages = []
            for k in range(depth):
                reasoning = "" if rng.random() < 0.15 else \
                    f"{openings[k]} {text_of_length(int(rng.integers(2, 24)), rng, words)}"
                messages += [{"role": "user", "content": users[k]},
                             {"role": "assistant", "content": text_of_length(int(rng.integers(1, 8)), rng, words),
                              "reasoning_content": reasoning}]
            head = [{"role": "system", "content": system}] if system is not None else []
            conv = parse_record({"messages": head + messages}, source=f"template rollouts seed {seed}",
                                index=len(records))
            turns = []
            for view in render_views(conv, tokenizer, config):
                n = view.num_completion
                mask = np.ones(n, dtype=int)
                if n > 4 and rng.random() < 0.3:  # a span not trained (a tool output inside the completion)
                    a = int(rng.integers(0, n - 2))
                    mask[a:a + 2] = 0
                turns.append({"prompt_ids": view.tokens[:view.num_prompt].tolist(),
                              "completion_ids": view.tokens[view.num_prompt:].tolist(),
                              "advantage": float(advantages[j]),
                              "logprobs": (-rng.exponential(1.0, n)).tolist(), "mask": mask.tolist()})
            records.append({"group": f"seed{seed}-group{g}", "turns": turns})
    return records


@dataclass(frozen=True, kw_only=True, slots=True)
class AgentShape:
    """Token lengths of an agent trace (ranges are inclusive, drawn uniformly)."""

    group_size: int = 8
    turns: tuple[int, int] = (2, 8)
    task: tuple[int, int] = (300, 800)  # system prompt + task, shared by the group
    reasoning: tuple[int, int] = (500, 4000)
    action: tuple[int, int] = (20, 80)  # the tool call (kept in later prompts)
    observation: tuple[int, int] = (50, 400)  # the tool result (the next turn's new prompt tokens)

    def scaled(self, factor: float) -> AgentShape:
        """Every length times ``factor`` (at least 1): the same shape, smaller, for a CPU run."""
        def s(r: tuple[int, int]) -> tuple[int, int]:
            return max(1, round(r[0] * factor)), max(1, round(r[1] * factor))
        return AgentShape(group_size=self.group_size, turns=self.turns, task=s(self.task),
                          reasoning=s(self.reasoning), action=s(self.action), observation=s(self.observation))


def agent_rollouts(num_groups: int, *, seed: int, vocab_size: int, shape: AgentShape = AgentShape()
                   ) -> list[dict[str, Any]]:
    """Rollout records shaped like agent traces; turn k's prompt holds earlier actions and results, no reasoning.

    Each turn also carries ``reasoning_tokens`` (for :func:`keep_all_reasoning_ids`); :func:`strip_extra`
    drops it before the record is parsed.
    """
    rng = np.random.default_rng(seed)

    def draw(r: tuple[int, int]) -> list[int]:
        return rng.integers(0, vocab_size, int(rng.integers(r[0], r[1] + 1))).tolist()

    records = []
    for g in range(num_groups):
        task = draw(shape.task)
        advantages = _group_advantages(rng, shape.group_size)
        for j in range(shape.group_size):
            history, turns = list(task), []
            for _ in range(int(rng.integers(shape.turns[0], shape.turns[1] + 1))):
                reasoning, action = draw(shape.reasoning), draw(shape.action)
                completion = reasoning + action
                turns.append({"prompt_ids": list(history), "completion_ids": completion,
                              "advantage": float(advantages[j]), "reasoning_tokens": len(reasoning)})
                history += action + draw(shape.observation)
            records.append({"group": f"agent-{seed}-{g}", "turns": turns})
    return records


def keep_all_reasoning_ids(record: dict[str, Any]) -> list[int]:
    """The one sequence the "keep all reasoning" shortcut scores for an :func:`agent_rollouts` record:
    the first prompt, then per turn its completion and the new prompt tokens of the next turn."""
    turns = record["turns"]
    out = list(turns[0]["prompt_ids"])
    for k, turn in enumerate(turns):
        out += turn["completion_ids"]
        if k + 1 < len(turns):
            before = len(turn["prompt_ids"]) + len(turn["completion_ids"]) - turn["reasoning_tokens"]
            out += turns[k + 1]["prompt_ids"][before:]
    return out


def strip_extra(record: dict[str, Any]) -> dict[str, Any]:
    """An :func:`agent_rollouts` record without its bookkeeping (``reasoning_tokens``): a valid rollout record."""
    return {"group": record["group"],
            "turns": [{k: v for k, v in t.items() if k != "reasoning_tokens"} for t in record["turns"]]}
