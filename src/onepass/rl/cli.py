"""``onepass verify --rollouts FILE``: the RL check's command-line side (its flags: onepass.verify.cli).

Why this module exists: ``verify`` takes conversations or RL rollouts; the rollout path
reads token ids, not text, so it needs no tokenizer, and reports per-token log-prob
differences, not loss differences. Last line: one JSON object
(:class:`onepass.rl.verify.RLVerifyReport`); exit 1 if not equal.
"""

from __future__ import annotations

import argparse
import json

from onepass.rl.rollouts import check_vocab, read_rollouts
from onepass.rl.verify import compact_rollouts, run_rl_verify
from onepass.verify.check import refusal_as_json, tolerance, verify_model
from onepass.verify.cli import verify_limit


def verify_rollouts(args: argparse.Namespace) -> int:
    """The model is loaded as ``onepass verify`` loads it (:func:`onepass.verify.check.verify_model`). ``args.limit``
    (>= 1, given by the user or verify's default: :func:`onepass.verify.cli.verify_limit`) caps the
    trajectories checked."""
    tol = tolerance(args)
    limit_given = verify_limit(args)
    trajectories = read_rollouts(args.rollouts)  # a bad record: one line naming file, line and turn
    if args.limit is not None and len(trajectories) > args.limit:
        default = "" if limit_given else ", verify's default"
        print(f"checking the first {args.limit} of {len(trajectories)} trajectories (--limit {args.limit}{default})")
        trajectories = trajectories[:args.limit]
    vocab = None
    if not args.model:
        trajectories, vocab = compact_rollouts(trajectories)
    with refusal_as_json(args):
        model, label, backend = verify_model(args, vocab)
        check_vocab(trajectories, model.get_input_embeddings().num_embeddings)
        result = run_rl_verify(trajectories, model, max_tokens=args.max_tokens, tolerance=tol)
    print(f"model: {label}, {args.dtype}, attention {backend}")
    print(f"{result.num_trajectories} trajectories, {result.num_turns} turns, {result.num_completion_tokens} "
          f"completion tokens: per-turn {result.per_turn_tokens} tokens vs one-pass {result.one_pass_tokens} "
          f"in {result.num_rows} rows ({result.token_ratio:.2f}x fewer)")
    print(f"max |log-prob diff| {result.max_abs_logprob_diff:.3g}  max |entropy diff| "
          f"{result.max_abs_entropy_diff:.3g}  loss rel diff {result.rel_loss_diff:.3g}  max rel grad diff "
          f"{result.max_rel_grad_diff:.3g}  -> {result.verdict.word} within {tol:g}")
    if result.verdict.where is not None:  # the first layer whose output at a tree node differs from per-turn
        print(result.verdict.located(result.worst_parameter))
    print(json.dumps({**result.to_dict(), "attention": backend}))
    return 0 if result.equal else 1
