"""TRL's GRPOTrainer with one-pass log-probs: the same per-token log-probs as TRL's own path; a step runs."""

from __future__ import annotations

import copy

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


def test_a_batch_whose_completions_are_all_masked_trains_as_trls_does(qwen3_tokenizer, tmp_path, one_thread):
    """``mask_truncated_completions=True`` and every completion truncated (2 tokens: a random model's EOS has
    odds of 1 in 150,000): the installed trl's GRPOTrainer logs a loss of 0 and goes on, its gradient zero, and
    so does the one-pass adapter (at b757769 its first backward raised "element 0 of tensors does not require
    grad": its log-probs of a batch with nothing kept were plain zeros, off the graph)."""
    from datasets import Dataset

    from onepass.rl.trl_grpo import onepass_grpo_trainer

    torch.manual_seed(0)
    model = tiny_model("qwen3", len(qwen3_tokenizer), dtype=torch.float32, attn_implementation="sdpa")
    data = Dataset.from_list([{"prompt": "Count to three."}, {"prompt": "Name a colour."}] * 2)
    runs = {}
    for cls in (trl.GRPOTrainer, onepass_grpo_trainer(onepass_max_tokens=256)):
        args = trl.GRPOConfig(output_dir=str(tmp_path / cls.__name__), per_device_train_batch_size=4,
                              num_generations=4, max_completion_length=2, max_steps=2, report_to="none",
                              use_cpu=True, logging_steps=1, temperature=1.0, save_strategy="no", bf16=False,
                              mask_truncated_completions=True, seed=0)
        trainer = cls(model=copy.deepcopy(model), reward_funcs=lambda completions, **kw: [1.0] * len(completions),
                      args=args, train_dataset=data, processing_class=qwen3_tokenizer)
        trainer.train()
        logs = [h for h in trainer.state.log_history if "loss" in h]
        assert [h["completions/clipped_ratio"] for h in logs] == [1.0, 1.0]  # every completion truncated
        runs[cls.__name__] = ([h["loss"] for h in logs], [h["grad_norm"] for h in logs], trainer.model)
    (trl_losses, trl_norms, trl_model), (losses, norms, ours) = runs["GRPOTrainer"], runs["OnePassGRPOTrainer"]
    assert losses == trl_losses == [0.0, 0.0] and norms == trl_norms == [0.0, 0.0]
    for (name, p), q, before in zip(ours.named_parameters(), trl_model.parameters(), model.parameters()):
        assert torch.equal(p, q) and torch.equal(p, before), name  # a zero gradient: neither moved a weight
