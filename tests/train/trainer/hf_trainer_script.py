"""Run by tests/train/trainer/test_trainer.py alone, under ``torchrun`` or ``accelerate launch``: train 3 steps, write result.json.

Usage: hf_trainer_script.py DATA_DIR OUT_DIR PER_DEVICE_BATCH VOCAB [FSDP, e.g. "full_shard auto_wrap"] [SP_SIZE]
[stream: the saved dataset streamed, an IterableDataset]
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch


def main(data: str, out: str, batch: int, vocab: int, fsdp: str = "", sp_size: str = "1", stream: str = "") -> None:
    import datasets
    from transformers import TrainingArguments

    from onepass.train.hf_config import OnePassConfig
    from onepass.train.trainer.trainer import OnePassTrainer
    from onepass.model.precision import float64_norms
    from onepass.model.tiny import tiny_model

    torch.set_num_threads(1)
    model = tiny_model("qwen3", vocab, dtype=torch.float64, attn_implementation="sdpa").train()
    float64_norms(model)
    initial = float(torch.cat([p.detach().flatten() for p in model.parameters()]).norm())
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=batch, learning_rate=3e-3, max_steps=3,
                             logging_steps=1, save_strategy="no", report_to=[], seed=0, data_seed=0, use_cpu=True,
                             disable_tqdm=True, lr_scheduler_type="constant",
                             ddp_backend="gloo" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None,
                             dataloader_num_workers=0, fsdp=fsdp)
    if int(sp_size) > 1:  # each row split over sp_size ranks: OnePassConfig's own setting
        args = OnePassConfig(**{**args.to_dict(), "sp_size": int(sp_size)})
    dataset = datasets.load_from_disk(data)
    trainer = OnePassTrainer(model=model, args=args,
                             train_dataset=dataset.to_iterable_dataset() if stream == "stream" else dataset)
    trainer.train()
    state = trainer.accelerator.get_state_dict(trainer.model)  # gathered from every rank under FSDP
    if trainer.is_world_process_zero():
        norm = float(torch.cat([v.detach().flatten() for v in state.values()]).norm())
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "result.json").write_text(json.dumps({
            "world_size": trainer.args.world_size, "distributed": trainer.distributed.to_dict(),
            "sequence_parallel": trainer.sequence_parallel,
            "initial_weight_norm": initial, "weight_norm": norm,
            "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h]}))


if __name__ == "__main__":
    from onepass.train.distributed import shutdown

    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), *sys.argv[5:])
    shutdown()  # after main's trainer and DDP model are gone (see shutdown: the teardown deadlock)
