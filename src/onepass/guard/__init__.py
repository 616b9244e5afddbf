"""Is one-pass exact for this model? Checked on a tiny float64 twin before training.

    twin.py         a tiny random twin of any config: same class and layer types, small sizes
    check.py        the check (``check_exact``), its result and the one-line refusal
    sample.py       which conversations: two of the run's own, as the run rendered them (no torch)
    divergence.py   which layer differs: every layer's output at every tree node vs a plain forward

``onepass train``, ``OnePassTrainer`` and ``onepass verify`` use it; see docs/design.md.
"""

from onepass.lazy import package_getattr

# loaded on first use: onepass.verify.check imports onepass.verify.divergence, and onepass.guard.check imports
# onepass.verify.check
__all__ = ["TOLERANCE", "GuardResult", "InexactModelError", "builtin_conversations", "check_exact",
           "check_exact_once", "enforce", "sample_views", "views_for_check"]
_SAMPLE = ("builtin_conversations", "sample_views", "views_for_check")
__getattr__ = package_getattr(__name__, {name: f"onepass.{'prepare.guard_sample' if name in _SAMPLE else 'guard.check'}:{name}"
                                         for name in __all__})
