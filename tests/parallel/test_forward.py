"""The forward contract: a one-pass forward carries one record (mask, chains, shard) under one model keyword.

What the model is called with is recorded (a wrapper around its forward) for a dense model, a hybrid and
a row split over simulated ranks; the keyword's name is spelled by one module only.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from onepass.attention.cpu import register as register_onepass_cpu
from onepass.layout.geometry import batch_chains
from onepass.layout.tree import build_layout
from onepass.layout.view import View
from onepass.loss import batch_loss, layouts_to_batch
from onepass.model.tiny import tiny_model
from onepass.parallel.comm import run_ranks
from onepass.parallel.forward import KWARG, ForwardPlan, take
from onepass.parallel.model import install

pytestmark = pytest.mark.usefixtures("one_thread")
PLAIN = {"input_ids", "position_ids", "attention_mask", "logits_to_keep", "use_cache"}


@pytest.fixture(autouse=True)
def onepass_cpu():
    register_onepass_cpu()


def row():
    history, a, b = np.arange(1, 12), np.arange(12, 18), np.arange(18, 25)
    return build_layout([View(tokens=np.concatenate([history, a]), num_prompt=8, turn=0),
                         View(tokens=np.concatenate([history, b]), num_prompt=9, turn=1)])


def calls_of(model):
    """Every model call's keywords, recorded (the model's own forward still runs)."""
    seen = []
    forward = model.forward

    def recording(*args, **kwargs):
        seen.append(dict(kwargs))
        return forward(*args, **kwargs)

    model.forward = recording
    return seen


def test_a_hybrid_forward_carries_one_record_with_its_chains_and_mask():
    model = tiny_model("qwen3.5", 32, dtype=torch.float64, attn_implementation="onepass_cpu")
    seen = calls_of(model)
    batch = layouts_to_batch([row()])
    batch_loss(model, batch)
    (kwargs,) = seen
    assert set(kwargs) == PLAIN | {KWARG}
    plan = kwargs[KWARG]
    assert isinstance(plan, ForwardPlan) and plan.shard is None
    assert plan.mask is kwargs["attention_mask"]
    assert plan.chains == batch_chains(batch["kv_end"].numpy())


def test_a_dense_forward_in_one_process_is_a_plain_hf_call():
    """Nothing reads the record (no mixers, no shard): the model gets the mask and nothing of onepass's."""
    model = tiny_model("qwen3", 32, dtype=torch.float64, attn_implementation="onepass_cpu")
    seen = calls_of(model)
    batch_loss(model, layouts_to_batch([row()]))
    assert set(seen[0]) == PLAIN


def test_a_row_split_over_ranks_carries_each_ranks_shard_in_the_same_record():
    model = tiny_model("qwen3", 32, dtype=torch.float64, attn_implementation="onepass_cpu")
    install(model, 2)
    copies = [copy.deepcopy(model) for _ in range(2)]  # each rank its own model, as each process has
    seen = [calls_of(m) for m in copies]
    batch = layouts_to_batch([row()])
    with torch.no_grad():
        run_ranks(2, lambda shard: batch_loss(copies[shard.rank], batch, shard=shard))
    for rank, (kwargs,) in enumerate(seen):
        assert set(kwargs) == PLAIN | {KWARG}
        plan = kwargs[KWARG]
        assert plan.shard.rank == rank and plan.shard.degree == 2 and plan.chains is None


def test_a_layer_takes_the_record_out_of_its_keywords():
    plan = ForwardPlan(mask="m")
    kwargs = {KWARG: plan, "other": 1}
    assert take(kwargs) is plan and kwargs == {"other": 1} and take(kwargs) is None


def test_only_the_contract_module_spells_the_keyword():
    """The keyword is named once (onepass.parallel.forward); no other module picks a onepass_* keyword out of
    ``**kwargs`` (the side channels onepass_sp and onepass_chains are gone)."""
    src = Path(__file__).parents[2] / "src" / "onepass"
    spelled = {p.relative_to(src).as_posix() for p in src.rglob("*.py") if f'"{KWARG}"' in p.read_text()}
    assert spelled == {"parallel/forward.py"}
    picked = re.compile(r"""kwargs\.(?:pop|get)\(\s*["']onepass_""")
    assert not [p.name for p in src.rglob("*.py") if picked.search(p.read_text())]
