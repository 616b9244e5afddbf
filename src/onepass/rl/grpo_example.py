"""A tiny GRPO loop on a scripted multi-turn task, on CPU: ``python -m onepass.rl.grpo_example``.

Why this module exists: it shows the whole use of :mod:`onepass.rl` in one screen,
and the test suite runs it. The task: the environment shows a digit d each turn;
the policy thinks (two free tokens inside <think> ... </think>) and answers; the
answer is right if it is (d + 1) mod 10. As with reasoning models' templates, the
next turn's prompt keeps earlier answers and drops earlier thinking, so turn k+1
is not an extension of turn k::

    turn 0 prompt   <bos> <user> 3 <asst>
    turn 0 sampled  <think> 7 1 </think> 4 <eos>              (<think>, </think>, <eos>: forced, mask 0)
    reward          half for a digit, half for the right one (3 + 1 = 4), averaged over turns
    turn 1 prompt   <bos> <user> 3 <asst> 4 <eos> <user> 8 <asst>        (no 7 1: thinking dropped)

Each step: sample a group of G trajectories per task (recording the sampler's
log-probs), reward = fraction of right answers, advantage = reward normalised in
the group, then one :func:`onepass.rl.losses.policy_loss` on the one-pass rows
(every turn of a group in one prefix tree, one forward per row).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from onepass.rl.layout import layout_rollouts
from onepass.rl.losses import PolicyLossConfig, policy_loss
from onepass.rl.rollouts import trajectories_from_records
from onepass.model.tiny import tiny_model

BOS, USER, ASSISTANT, THINK, END_THINK, EOS = range(6)
DIGIT0 = 6  # digits 0..9 are ids 6..15
VOCAB = 16


@dataclass(frozen=True, kw_only=True, slots=True)
class StepLog:
    step: int
    reward: float
    loss: float
    clip_fraction: float
    rows: int
    one_pass_tokens: int
    per_turn_tokens: int


def _next_tokens(model: torch.nn.Module, ids: list[list[int]], gen: torch.Generator, forced: int | None = None
                 ) -> tuple[list[int], list[float]]:
    """Per sequence (all of one length), the next token (sampled from the whole vocabulary, or ``forced``)
    and its log-prob under the model: one batched forward."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(ids), use_cache=False).logits[:, -1].double()
    logp = torch.log_softmax(logits, -1)
    if forced is None:
        tokens = torch.multinomial(logp.exp(), 1, generator=gen)[:, 0]
    else:
        tokens = torch.full((len(ids),), forced)
    return tokens.tolist(), logp.gather(1, tokens[:, None])[:, 0].tolist()


def reward(answer: int, digit: int) -> float:
    """Half for answering with a digit, half for the right one, (digit + 1) mod 10."""
    return 0.5 * (DIGIT0 <= answer < DIGIT0 + 10) + 0.5 * (answer - DIGIT0 == (digit + 1) % 10)


def rollout_group(model: torch.nn.Module, digits: Sequence[int], size: int, gen: torch.Generator
                  ) -> tuple[list[list[dict]], np.ndarray]:
    """``size`` trajectories on the same digits: per turn the prompt, the completion, the sampler's
    log-probs and the mask; and each trajectory's mean reward."""
    histories = [[BOS] for _ in range(size)]
    trajectories: list[list[dict]] = [[] for _ in range(size)]
    rewards = np.zeros(size)
    for d in digits:
        prompts = [h + [USER, DIGIT0 + d, ASSISTANT] for h in histories]
        ids = [list(p) for p in prompts]
        logprobs: list[list[float]] = [[] for _ in range(size)]
        mask: list[int] = []
        for trained, forced in ((0, THINK), (1, None), (1, None), (0, END_THINK), (1, None), (0, EOS)):
            tokens, lps = _next_tokens(model, ids, gen, forced)  # forced tokens: scored, not trained
            for j in range(size):
                ids[j].append(tokens[j])
                logprobs[j].append(lps[j])
            mask.append(trained)
        for j in range(size):
            completion = ids[j][len(prompts[j]):]
            answer = completion[4]
            rewards[j] += reward(answer, d) / len(digits)
            trajectories[j].append({"prompt_ids": prompts[j], "completion_ids": completion,
                                    "logprobs": logprobs[j], "mask": list(mask)})
            histories[j] = prompts[j] + [answer, EOS]  # the thinking is dropped from the next prompt
    return trajectories, rewards


def train(*, steps: int = 10, tasks: int = 2, group_size: int = 8, turns: int = 3, lr: float = 1e-2,
          seed: int = 0, log: bool = True) -> list[StepLog]:
    """Run the loop; returns one :class:`StepLog` per step."""
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    model = tiny_model("qwen3", VOCAB, dtype=torch.float32, seed=seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    config = PolicyLossConfig(clip_low=0.2, clip_high=0.28, normalize="token", tis_cap=2.0)  # DAPO-style
    out = []
    for step in range(steps):
        model.eval()
        records, rewards = [], []
        for task in range(tasks):
            digits = rng.integers(0, 10, turns).tolist()
            group, r = rollout_group(model, digits, group_size, gen)
            advantages = (r - r.mean()) / (r.std() + 1e-6)
            for trajectory, a in zip(group, advantages):
                for t in trajectory:
                    t["advantage"] = float(a)
                records.append({"group": f"step{step}-task{task}", "turns": trajectory})
            rewards.extend(r.tolist())
        batch = layout_rollouts(trajectories_from_records(records, source=f"step {step}"))
        model.train()
        optimizer.zero_grad()
        result = policy_loss(model, batch, config, old=[[t["logprobs"] for t in rec["turns"]] for rec in records],
                             backward=True)
        optimizer.step()
        entry = StepLog(step=step, reward=float(np.mean(rewards)), loss=float(result.loss),
                        clip_fraction=result.clip_fraction, rows=len(batch.rows),
                        one_pass_tokens=batch.one_pass_tokens, per_turn_tokens=batch.per_turn_tokens)
        out.append(entry)
        if log:
            print(f"step {step}: reward {entry.reward:.3f}  loss {entry.loss:+.4f}  clipped {entry.clip_fraction:.2f}  "
                  f"{entry.rows} rows, {entry.one_pass_tokens} tokens (per-turn: {entry.per_turn_tokens})")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m onepass.rl.grpo_example", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    start = time.perf_counter()
    logs = train(steps=args.steps, seed=args.seed)
    print(f"reward {logs[0].reward:.3f} -> {logs[-1].reward:.3f} in {len(logs)} steps, "
          f"{time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
