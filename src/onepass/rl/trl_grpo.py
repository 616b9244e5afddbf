"""TRL's ``GRPOTrainer`` with its per-token log-probs computed from one-pass rows.

Why this module exists: TRL scores every sample of a batch ([B, P + C], prompts
left-padded) as its own sequence. The G completions of one prompt share that prompt,
and the turns of a multi-turn trajectory fed as separate samples share their
history (earlier reasoning dropped, so they are not one sequence): here the batch is
merged into one prefix tree (:func:`onepass.rl.padded.padded_token_logprobs`) and
scored with one forward per row of at most ``onepass_max_tokens`` tokens, equal to
TRL's per-sample log-probs. The one method TRL calls for log-probs
(``_get_per_token_logps_and_entropies``, TRL 1.16) is the only change; TRL's own
path runs for what this does not cover: multimodal inputs, MoE auxiliary losses and
sampling temperature != 1.

    >>> trainer = onepass_grpo_trainer(onepass_max_tokens=16384)(model=..., reward_funcs=..., args=...)  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

from onepass.private_names import private
from onepass.rl.padded import padded_token_logprobs

GRPO_LOGPS = "trl.GRPOTrainer._get_per_token_logps_and_entropies"


def onepass_grpo_trainer(onepass_max_tokens: int | None = None) -> type:
    """A ``trl.GRPOTrainer`` subclass whose per-token log-probs come from one-pass rows (TRL imported here). A trl
    whose GRPOTrainer no longer defines, calls or unpacks the overridden method as this one does is one
    :class:`~onepass.couplings.CouplingError` line here (the override would otherwise silently stop applying)."""
    from trl import GRPOTrainer

    private(GRPO_LOGPS)

    class OnePassGRPOTrainer(GRPOTrainer):
        max_tokens = onepass_max_tokens

        def _get_per_token_logps_and_entropies(self, model: Any, input_ids: Any, attention_mask: Any,
                                               logits_to_keep: int, batch_size: int | None = None,
                                               compute_entropy: bool = False, compute_aux_loss: bool = False,
                                               **multimodal: Any) -> tuple[Any, Any, Any]:
            if compute_aux_loss or self.temperature != 1.0 or any(v is not None for v in multimodal.values()):
                return super()._get_per_token_logps_and_entropies(
                    model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size,
                    compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss, **multimodal)
            with self.accelerator.autocast():
                logps, entropies = padded_token_logprobs(model, input_ids, attention_mask, logits_to_keep,
                                                         entropy=compute_entropy, max_tokens=self.max_tokens)
            return logps, entropies, None

    return OnePassGRPOTrainer
