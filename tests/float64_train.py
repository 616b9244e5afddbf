"""``onepass train`` with the model float64 all the way (norms, routers, recurrent kernels), for rank launches.

Usage (what tests/train/test_sequence_parallel.py launches on every rank): float64_train.py ARGS...
(the arguments of ``python -m onepass.train.cli``). transformers' RMSNorms, MoE routers and recurrent scans
compute in float32 even in a float64 model (docs/design.md, known pitfalls), so a gradient summed over other
groups of tokens (a rank's shard, a view) rounds at 1e-8; :func:`onepass.model.precision.float64_norms` makes
them float64, on both sides of a comparison (the test's one-process run patches the same loader).
"""

from __future__ import annotations

import sys
from typing import Any


def float64_load_model(load: Any) -> Any:
    """``onepass.train.run.loop.load_model`` (the loop's name for ``onepass.train.run.model.load_model``) returning the model with float64 norms, routers and kernels."""
    from onepass.mixers import tree
    from onepass.model.precision import float64_norms

    def load_model(*args: Any, **kwargs: Any) -> Any:
        model = load(*args, **kwargs)
        tree.uninstall(model)  # the mixers' own forwards made float64 first, then run chain by chain again
        float64_norms(model)
        tree.install(model)
        return model

    return load_model


if __name__ == "__main__":
    import onepass.train.run.loop as loop_module
    from onepass.train.cli import main

    loop_module.load_model = float64_load_model(loop_module.load_model)
    sys.exit(main(sys.argv[1:]))
