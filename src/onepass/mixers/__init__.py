"""Recurrent token mixers (Gated DeltaNet, Mamba2, short convolutions) on a tree: tree.py (each
registered mixer run chain by chain from its parent chain's end states; the chains are
onepass.layout.geometry's), float64.py (the kernels' float32 casts made float64 for verification)."""
