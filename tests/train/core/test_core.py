"""The trainer core both front ends call (onepass.train.core): one normaliser, one eval mean, one loader."""

from __future__ import annotations

import math

import numpy as np
import torch

from onepass.layout.tree import row_from_columns
from onepass.train.core.normalise import loss_scale, weighted_mean


def test_the_host_and_device_normalisers_are_one_rule():
    """``onepass train`` scales by a host float, OnePassTrainer by a device tensor: the same numbers."""
    for weight, world in [(8.0, 2), (3.0, 1), (2.5, 3)]:  # torch divides a number by a tensor as number * 1/x
        device = float(loss_scale(torch.tensor(weight, dtype=torch.float64), world))
        assert math.isclose(device, loss_scale(weight, world), rel_tol=1e-15)
    assert loss_scale(0.0, 2) == 0.0 and float(loss_scale(torch.tensor(0.0), 2)) == 0.0  # never 0/0


def test_weighted_mean_is_nan_without_weight():
    assert weighted_mean(3.0, 4.0) == 0.75 and math.isnan(weighted_mean(0.0, 0.0))


def test_eval_loss_of_rows_without_weight_is_nan_as_in_a_run():
    """eval_loss raised ZeroDivisionError where a run's eval (and OnePassTrainer's) reports NaN."""
    from onepass.model.load import ModelSpec, load_causal_lm
    from onepass.train.run.evaluation import eval_loss

    model = load_causal_lm(ModelSpec(tiny="qwen3", vocab_size=32, tiny_config={"hidden_size": 32,
                                                                              "intermediate_size": 64}))
    row = row_from_columns({"input_ids": [1, 2, 3], "position_ids": [0, 1, 2], "kv_end": [3, 3, 3],
                            "targets": [2, 3, -100], "weights": np.zeros(3)})
    assert math.isnan(eval_loss(model, [row]))
