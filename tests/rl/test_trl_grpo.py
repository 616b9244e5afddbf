"""TRL's GRPOTrainer with one-pass log-probs: the same per-token log-probs as TRL's own path; a step runs."""

from __future__ import annotations

import pytest
import torch

from onepass.model.tiny import tiny_model

trl = pytest.importorskip("trl")


def test_onepass_grpo_trainer_matches_trl_and_trains(qwen3_tokenizer, tmp_path, one_thread, monkeypatch):
    from datasets import Dataset

    import onepass.rl.trl_grpo as trl_grpo
    from onepass.rl.trl_grpo import onepass_grpo_trainer

    calls = []
    real = trl_grpo.padded_token_logprobs

    def counted(*args, **kw):
        calls.append(args[1].shape)
        return real(*args, **kw)

    monkeypatch.setattr(trl_grpo, "padded_token_logprobs", counted)

    tokenizer = qwen3_tokenizer
    model = tiny_model("qwen3", len(tokenizer), dtype=torch.float32, attn_implementation="sdpa")
    data = Dataset.from_list([{"prompt": "Count to three."}, {"prompt": "Name a colour."}] * 2)
    args = trl.GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                          max_completion_length=6, max_steps=1, report_to="none", use_cpu=True, logging_steps=1,
                          temperature=1.0, save_strategy="no", bf16=False)
    trainer = onepass_grpo_trainer(onepass_max_tokens=256)(
        model=model, reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions],
        args=args, train_dataset=data, processing_class=tokenizer)

    prompts = [tokenizer(t).input_ids for t in ("a b c d", "a b c e f", "a b")]
    completions = [[11, 12, 13], [11, 14], [15, 16, 17]]
    p, c = max(map(len, prompts)), max(map(len, completions))
    ids = torch.zeros(3, p + c, dtype=torch.long)
    mask = torch.zeros(3, p + c, dtype=torch.long)
    for b, (x, y) in enumerate(zip(prompts, completions)):
        ids[b, p - len(x):p], ids[b, p:p + len(y)] = torch.tensor(x), torch.tensor(y)
        mask[b, p - len(x):p + len(y)] = 1
    got, got_ent, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, c, compute_entropy=True)
    want, want_ent, _ = trl.GRPOTrainer._get_per_token_logps_and_entropies(trainer, trainer.model, ids, mask, c,
                                                                           compute_entropy=True)
    kept = mask[:, p:].bool()
    assert torch.allclose(got[kept], want[kept], atol=1e-4)
    assert torch.allclose(got_ent[kept], want_ent[kept], atol=1e-4)
    calls.clear()
    result = trainer.train()  # one GRPO step end to end through the one-pass path
    assert calls and torch.isfinite(torch.tensor(result.training_loss))
