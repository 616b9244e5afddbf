"""TRL's docs, "PEFT": train a LoRA adapter from a model name, then continue training the saved PeftModel
(no processing_class: TRL finds the tokenizer from the model, and from the PeftModel's base model).

Usage: python SCRIPT MODEL_DIR DATA_JSONL OUTPUT_DIR   (tests/train/test_sft_scripts.py renames the classes)
"""

# ruff: noqa: I001, RUF100  (the user script being ported, kept as written)
import sys

from datasets import load_dataset
from peft import LoraConfig, PeftModel
from transformers import AutoModelForCausalLM
from trl import SFTConfig, SFTTrainer

model_dir, data, output_dir = sys.argv[1:4]
dataset = load_dataset("json", data_files=data, split="train")
args = SFTConfig(output_dir=output_dir, max_steps=1, report_to="none", use_cpu=True, save_strategy="no")
trainer = SFTTrainer(model_dir, args=args, train_dataset=dataset,
                     peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM"))
trainer.train()
trainer.save_model(output_dir + "/adapter")

base = AutoModelForCausalLM.from_pretrained(model_dir)
model = PeftModel.from_pretrained(base, output_dir + "/adapter", is_trainable=True)
trainer = SFTTrainer(model=model, args=args, train_dataset=dataset)
trainer.train()
trainer.save_model(output_dir + "/continued")
