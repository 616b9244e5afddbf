"""onepass: fine-tune reasoning models on multi-turn conversations in one forward pass per conversation."""

__version__ = "0.1.0"  # the distribution's version is pyproject.toml's; tests/test_install.py keeps them equal
