"""``onepass verify``: one-pass vs N-pass loss and gradients on the same conversations.

``check``       the measurement (:func:`~onepass.verify.check.run_verify`) and ``onepass verify --data``'s run
``divergence``  where one-pass and N-pass part (the first differing layer) and judge, the one rule for "exact"
``cli``           its parser (no torch): conversations, or ``--rollouts`` (:mod:`onepass.rl.cli`)
"""
