"""Is one-pass exact for this model? Checked on a tiny float64 twin before training.

    twin.py                a tiny random twin of any config: same class and layer types, small sizes
    check.py               the check (``check_exact``), its result and the one-line refusal
    sequence_parallel.py   is sequence parallelism exact for this model? the twin split over simulated ranks

It runs :func:`onepass.verify.check.run_verify` on the twin and judges it by the one rule
(:mod:`onepass.verify.divergence`); which conversations it checks is taken as the run prepares them
(:mod:`onepass.prepare.guard_sample`).

``onepass train``, ``OnePassTrainer`` and ``onepass verify`` use it; see docs/design.md.
"""

from onepass.lazy import package_getattr

# loaded on first use: onepass.guard.check imports torch, onepass.guard.twin does not
__all__ = ["TOLERANCE", "GuardResult", "InexactModelError", "builtin_conversations", "check_exact",
           "check_exact_once", "enforce", "sample_views", "views_for_check"]
_SAMPLE = ("builtin_conversations", "sample_views", "views_for_check")
__getattr__ = package_getattr(__name__, {
    name: f"onepass.{'prepare.guard_sample' if name in _SAMPLE else 'guard.check'}:{name}" for name in __all__})
