"""Recurrent token mixers (Gated DeltaNet, Mamba2, short convolutions) on a tree: chains.py (pure
layout), tree.py (each registered mixer run chain by chain from its parent chain's end states),
float64.py (the kernels' float32 casts made float64 for verification)."""
