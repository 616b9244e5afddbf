"""RL scoring of agent-trace-shaped rollouts: one-pass vs per-turn vs the "keep all reasoning" shortcut.

Why this exists (issue 28): multi-turn GRPO with a template that drops earlier
reasoning scores each turn as its own sequence today (O(T^2) tokens per
trajectory), or scores one sequence that keeps every turn's reasoning (cheap, but
later turns are conditioned on reasoning they never saw when sampled: not the
sampled policy). One-pass scores every turn exactly from one prefix tree per group.
Rollouts: :func:`onepass.rl.synthetic.agent_rollouts` (groups of 8, 2-8 turns,
reasoning 0.5-4k tokens, a tool call and a tool result per turn), lengths scaled
by ``--scale`` for a CPU run; the token counts are also given at full scale.

Per mode: tokens run, wall and CPU seconds, peak bytes of live tensors
(:func:`onepass.bench.memory.step_memory`) for scoring (no grad: old / reference /
teacher log-probs) and for a training step (forward + backward of the clipped
surrogate). "Fraction of the token bound": (per-turn time / one-pass time) /
(per-turn tokens / one-pass tokens), 1.0 when the time saved is all the token
count allows.

    .venv/bin/python benchmarks/rl_scoring.py                  # ~1 min CPU (1 group, lengths x 0.05)
    .venv/bin/python benchmarks/rl_scoring.py --groups 2 --scale 0.1
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch
import transformers

from onepass.bench.memory import step_memory, tensor_bytes
from onepass.attention.backends import cpu_backend
from onepass.rl.layout import layout_rollouts
from onepass.rl.logprobs import token_logprobs
from onepass.rl.losses import PolicyLossConfig, policy_loss
from onepass.rl.rollouts import trajectories_from_records
from onepass.rl.synthetic import AgentShape, agent_rollouts, keep_all_reasoning_ids, strip_extra
from onepass.tiny import tiny_config, tiny_model

MODEL = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64)


def keep_all_trajectories(records: list[dict], task_lengths: list[int]) -> list:
    """The shortcut's sequences as one-turn trajectories (prompt = the task; every later token scored)."""
    out = []
    for rec, n in zip(records, task_lengths):
        ids = keep_all_reasoning_ids(rec)
        out.append({"group": rec["group"], "turns": [{"prompt_ids": ids[:n], "completion_ids": ids[n:],
                                                      "advantage": 1.0}]})
    return trajectories_from_records(out)


def timed(fn) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--groups", type=int, default=1)
    p.add_argument("--scale", type=float, default=0.05, help="every length times this (1.0: the real shape)")
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--arch", default="qwen3")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="benchmarks/results/rl-scoring")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    full = [strip_extra(r) for r in agent_rollouts(args.groups, seed=args.seed, vocab_size=args.vocab)]
    full_batch = layout_rollouts(trajectories_from_records(full))
    shape = AgentShape().scaled(args.scale)
    records = agent_rollouts(args.groups, seed=args.seed, vocab_size=args.vocab, shape=shape)
    trajs = trajectories_from_records([strip_extra(r) for r in records])
    longest = max(t.num_tokens for traj in trajs for t in traj.turns)
    batches = {
        "one-pass": layout_rollouts(trajs),
        f"one-pass, max_tokens={2 * longest}": layout_rollouts(trajs, max_tokens=2 * longest),
        "per-turn": layout_rollouts(trajs, per_turn=True),
        "keep-all-reasoning (inexact)": layout_rollouts(
            keep_all_trajectories(records, [len(r["turns"][0]["prompt_ids"]) for r in records]), per_turn=True),
    }
    backend = cpu_backend(tiny_config(args.arch, args.vocab, **MODEL), None)
    model = tiny_model(args.arch, args.vocab, dtype=torch.float32, attn_implementation=backend, **MODEL)
    params = tensor_bytes(model.parameters())
    device = torch.device("cpu")
    config = PolicyLossConfig(clip_high=0.28)
    rows = []
    for name, batch in batches.items():
        def score(batch=batch):
            with torch.no_grad():
                token_logprobs(model, batch)

        def train(batch=batch):
            policy_loss(model, batch, config, backward=True)
            model.zero_grad(set_to_none=True)

        score()  # warm-up (allocator, first-call costs)
        s_wall, s_cpu = timed(score)
        t_wall, t_cpu = timed(train)
        s_mem = step_memory(score, params, device).peak_bytes
        t_mem = step_memory(train, params, device).peak_bytes
        rows.append(dict(mode=name, tokens=batch.one_pass_tokens, rows=len(batch.rows), score_wall_s=s_wall,
                         score_cpu_s=s_cpu, score_peak_mib=s_mem / 2**20, train_wall_s=t_wall, train_cpu_s=t_cpu,
                         train_peak_mib=t_mem / 2**20))
        print(json.dumps(rows[-1]), flush=True)
    one, per = rows[0], rows[2]
    token_ratio = per["tokens"] / one["tokens"]
    summary = dict(
        token_ratio=token_ratio, full_scale_token_ratio=full_batch.per_turn_tokens / full_batch.one_pass_tokens,
        full_scale_per_turn_tokens=full_batch.per_turn_tokens, full_scale_one_pass_tokens=full_batch.one_pass_tokens,
        score_speedup_cpu=per["score_cpu_s"] / one["score_cpu_s"],
        train_speedup_cpu=per["train_cpu_s"] / one["train_cpu_s"],
        score_fraction_of_token_bound=per["score_cpu_s"] / one["score_cpu_s"] / token_ratio,
        train_fraction_of_token_bound=per["train_cpu_s"] / one["train_cpu_s"] / token_ratio)
    env = dict(python=platform.python_version(), torch=torch.__version__, transformers=transformers.__version__,
               machine=platform.processor() or platform.machine(), threads=args.threads, attention=backend,
               model=f"tiny {args.arch} {MODEL}, vocab {args.vocab}, float32", groups=args.groups, scale=args.scale,
               num_trajectories=len(trajs), num_turns=sum(len(t.turns) for t in trajs), seed=args.seed,
               argv=" ".join(sys.argv[1:]))
    lines = ["| mode | tokens | rows | score CPU s | score peak MiB | train CPU s | train peak MiB |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['tokens']:,} | {r['rows']} | {r['score_cpu_s']:.2f} | "
                     f"{r['score_peak_mib']:.0f} | {r['train_cpu_s']:.2f} | {r['train_peak_mib']:.0f} |")
    print("\n".join(lines))
    print(json.dumps(summary, indent=1))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(dict(env=env, rows=rows, summary=summary), indent=1))
    (out / "results.md").write_text("\n".join(lines) + "\n\n" + json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
