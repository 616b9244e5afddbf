"""Supervised fine-tuning of a chat model with LoRA: a `messages` dataset, the tokenizer saved with checkpoints.

Usage: python SCRIPT MODEL_DIR DATA_JSONL OUTPUT_DIR
(tests/train/test_sft_scripts.py: trl_sft.py and onepass_sft.py differ only in the import and the class names)
"""

# ruff: noqa: I001, RUF100  (the import order of the user script being ported, kept as written)
import sys

from datasets import load_dataset
from peft import LoraConfig
from transformers import AutoTokenizer
from onepass.train import OnePassConfig, OnePassTrainer

model_dir, data, output_dir = sys.argv[1:4]
tokenizer = AutoTokenizer.from_pretrained(model_dir)
dataset = load_dataset("json", data_files=data, split="train")
peft_config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")
args = OnePassConfig(output_dir=output_dir, max_steps=2, per_device_train_batch_size=2, learning_rate=1e-3,
                 logging_steps=1, save_steps=2, report_to="none", use_cpu=True, seed=0, max_length=1024)
trainer = OnePassTrainer(model=model_dir, args=args, train_dataset=dataset, processing_class=tokenizer,
                     peft_config=peft_config)
trainer.train()
trainer.save_model()
