"""TRL's docs, a custom SFTConfig: eos_token, dataset_num_proc, packing, chat_template_path as a tokenizer folder.

Usage: python SCRIPT MODEL_DIR DATA_JSONL OUTPUT_DIR   (tests/train/test_sft_scripts.py renames the classes)
"""

# ruff: noqa: I001, RUF100  (the user script being ported, kept as written)
import sys

from datasets import load_dataset
from trl import SFTConfig, SFTTrainer

model_dir, data, output_dir = sys.argv[1:4]
dataset = load_dataset("json", data_files=data, split="train")
training_args = SFTConfig(
    output_dir=output_dir,
    max_length=512,
    eos_token="<|im_end|>",
    dataset_num_proc=2,
    packing=True,
    chat_template_path=model_dir,
    per_device_train_batch_size=2,
    max_steps=2,
    logging_steps=1,
    report_to="none",
    use_cpu=True,
)
trainer = SFTTrainer(model=model_dir, args=training_args, train_dataset=dataset)
trainer.train()
