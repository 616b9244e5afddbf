"""Exact one-pass per-token log-probs and policy losses for multi-turn RL rollouts.

    rollouts.py   token-in/token-out trajectories (JSONL / Python), validated; no torch
    layout.py     all turns of a group in one prefix tree, packed into rows, and each turn's slot; no torch
    logprobs.py   ``token_logprobs(model, batch)``: one forward per row; the per-turn reference beside it
    losses.py     clipped surrogate (GRPO / DAPO / Dr.GRPO), KL, truncated IS, reverse-KL distillation
    verify.py     one-pass vs per-turn log-probs and gradients (``onepass verify --rollouts``); cli.py its command
    padded.py     the same for a padded batch (TRL GRPOTrainer's [B, P + C]; SkyRL's left-padded blocks)
    trl_grpo.py   TRL's GRPOTrainer with its per-token log-probs from one-pass rows
    skyrl.py      SkyRL's model wrapper, policy/reference workers and entry point on one-pass rows (skyrl optional)
    synthetic.py  rollouts from a real chat template, and agent-trace-shaped ones for the benchmark; no torch
    grpo_example.py  a tiny GRPO loop on a scripted multi-turn task, on CPU

See docs/rl.md. Example::

    batch = layout_rollouts(read_rollouts("rollouts.jsonl"), max_tokens=16384)
    with torch.no_grad():
        old = token_logprobs(model, batch).logprobs
    out = policy_loss(model, batch, PolicyLossConfig(clip_high=0.28), old=old, backward=True)
"""

from onepass.lazy import package_getattr

_WHERE = {
    "Trajectory": "rollouts", "Turn": "rollouts", "RolloutError": "rollouts", "read_rollouts": "rollouts",
    "trajectories_from_records": "rollouts",
    "RolloutBatch": "layout", "layout_rollouts": "layout",
    "TokenLogprobs": "logprobs", "token_logprobs": "logprobs", "token_logprobs_reference": "logprobs",
    "PolicyLossConfig": "losses", "policy_loss": "losses", "policy_loss_reference": "losses",
    "padded_token_logprobs": "padded", "window_token_logprobs": "padded",
}
__all__ = sorted(_WHERE)  # torch is imported only by the modules that need it

__getattr__ = package_getattr(__name__, {name: f"onepass.rl.{module}:{name}" for name, module in _WHERE.items()})
