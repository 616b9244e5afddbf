"""The scripts here are user scripts run by tests/train/test_sft_scripts.py, not test modules: never import them."""

collect_ignore = ["trl_sft.py", "onepass_sft.py", "trl_docs_peft.py", "trl_docs_config.py"]
