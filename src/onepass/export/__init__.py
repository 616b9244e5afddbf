"""``onepass export``: a LoRA adapter merged into its base model (``merge``), its parser (``cli``, no torch)."""
