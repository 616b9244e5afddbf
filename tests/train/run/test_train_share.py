"""Training with prefixes shared across conversations takes the steps it takes without (float64).

``onepass train --pack`` on conversations sorts each optimizer step's conversations by prefix
(:func:`onepass.train.run.data.shared_order`, within the step by default: the same conversations per
step) and merges the trees of a micro-batch's conversations that share one (:mod:`onepass.layout.share`).
Each step then covers the same conversations and is divided by the same weight sum, so the losses and
the final weights are those of the run with ``--no-share-prefix``, with fewer tokens.
``OnePassTrainer`` with ``packing`` and ``dataset_num_proc=2`` makes the same shared rows.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from onepass.data.synthetic import AgentConfig, agent_record
from onepass.model.precision import float64_norms
from onepass.layout.share import loss_terms, same_terms
from onepass.train import train
from onepass.train.config import load_config
from onepass.train.run import loop
from onepass.train.run.data import shared_order, step_units

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = AgentConfig(harnesses=2, prompt=(60, 75), tools=2, min_turns=1, max_turns=2, user=(2, 6), reasoning=(2, 5),
                    tool_result=(2, 6), answer=(1, 4), calls=(0, 1))


@pytest.fixture(scope="module")
def agent_chats(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "agent.jsonl"
    path.write_text("".join(json.dumps(agent_record(i, 3, SMALL)) + "\n" for i in range(8)), encoding="utf-8")
    return path


def run(tmp_path, name, **values):
    config = load_config(None, dict(tiny="qwen3", learning_rate=3e-3, progress=False, save_model=False,
                                    output_dir=str(tmp_path / name), seed=0, **values))
    return train(config, log=lambda _m: None)


def rel(a, b):
    return abs(a - b) / max(abs(a), abs(b), 1e-300)


def test_shared_prefixes_take_the_same_steps_with_fewer_tokens(tmp_path, agent_chats, monkeypatch):
    original = loop.load_model  # the loop's own name (imported at module level): norms in float64 too
    monkeypatch.setattr(loop, "load_model", lambda *a, **k: (lambda m: (float64_norms(m), m)[1])(original(*a, **k)))
    common = dict(data=str(agent_chats), dtype="float64", max_steps=4, per_device_train_batch_size=2,
                  gradient_accumulation_steps=2, pack=True, max_tokens=4096)
    shared = run(tmp_path, "shared", **common)
    apart = run(tmp_path, "apart", share_prefix=False, **common)
    assert max(rel(a, b) for a, b in zip(shared.losses, apart.losses)) <= 1e-10
    tokens = [sum(h["tokens"] for h in json.loads(r.metrics_path.read_text())["history"]) for r in (shared, apart)]
    assert tokens[0] < tokens[1] * 0.8  # the harness prompt and tools once per row, not once per conversation


def test_a_step_keeps_its_units_and_puts_those_sharing_a_prefix_side_by_side():
    keys = [(k % 3,) for k in range(24)]
    for step in range(3):
        plain = step_units(24, step, seed=5, per_step=8)
        grouped = step_units(24, step, seed=5, per_step=8, keys=keys)
        assert sorted(plain.tolist()) == sorted(grouped.tolist())  # the default window: one step
        assert [keys[u] for u in grouped.tolist()] == sorted(keys[u] for u in grouped.tolist())
    wide = np.concatenate([step_units(24, s, seed=5, per_step=8, keys=keys, window=24) for s in range(3)])
    assert sorted(wide.tolist()) == list(range(24))  # a wider window moves units between steps, each once
    assert [keys[u][0] for u in wide.tolist()] == sorted(k[0] for k in keys)
    assert shared_order(np.arange(4), [None, (1,), None, (0,)], 4).tolist() == [3, 1, 0, 2]


def test_onepass_trainer_packs_shared_rows_on_two_processes(agent_chats, qwen3_tokenizer):
    from onepass.conversation.parse import parse_record
    from onepass.prepare.config import DataConfig
    from onepass.train.trainer.data import prepare_rows

    convs = [parse_record(json.loads(line), source="agent", index=i)
             for i, line in enumerate(agent_chats.read_text().splitlines())]
    config = DataConfig(schedule="one-pass", max_tokens=4096)
    shared = prepare_rows(convs, qwen3_tokenizer, config, packing=True, num_proc=2)
    apart = prepare_rows(convs, qwen3_tokenizer, config.replace(share_prefix=False), packing=True, num_proc=2)
    serial = prepare_rows(convs, qwen3_tokenizer, config, packing=True, num_proc=1)

    def rows(ds):
        from onepass.layout.tree import row_from_columns
        return [row_from_columns(item) for item in ds]

    assert [r.input_ids.tolist() for r in rows(shared.dataset)] == [r.input_ids.tolist() for r in rows(serial.dataset)]
    assert same_terms(loss_terms(rows(shared.dataset)), loss_terms(rows(apart.dataset)))
    assert shared.stats.row_tokens < apart.stats.row_tokens
    assert shared.stats.shared["groups"] == 2 and shared.stats.shared["shared_prefix_tokens"] > 2 * 60
    assert apart.stats.shared is None
