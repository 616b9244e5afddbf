"""Recurrent token mixers (Gated DeltaNet, Mamba2, short convolutions) on a tree: tree.py (each
registered mixer run chain by chain from its parent chain's end states; the chains are
onepass.layout.geometry's). Their kernels made float64 for verification: onepass.model.float64."""
