"""Sharing prefixes across conversations is exact (float64, <= 1e-9): agent-shaped conversations with tools.

Small agent conversations (:mod:`onepass.data.synthetic`: two harnesses, each a system prompt and
tool schemas rendered by the real Qwen3 template; tool calls and results; reasoning Qwen3 drops from
later turns) are laid out one-pass, their trees merged where they share a prefix and packed
(:func:`onepass.share.share_rows`, what ``prepare --pack`` does by default), and the loss and every
gradient compared with the plain per-view forwards: a dense model, one with sliding windows and
attention sinks (gpt-oss), and hybrids whose recurrent layers run chain by chain (geometry's chains),
where a chain of one conversation now starts from the end state of a prefix chain another conversation
shares. ``onepass verify --pack`` says EQUAL on such a file.
"""

from __future__ import annotations

import json

import pytest
import torch

from onepass.cli import main
from onepass.conversation import parse_record
from onepass.data.synthetic import AgentConfig, agent_record
from onepass.geometry import row_chains
from onepass.precision import float64_norms
from onepass.render import render_views
from onepass.schedule import parse_schedule, schedule_views
from onepass.share import share_rows
from onepass.attention.backends import cpu_backend
from onepass.tiny import tiny_config, tiny_model
from onepass.verify import compact_vocab, run_verify

TOL = 1e-9
SMALL = AgentConfig(harnesses=2, prompt=(60, 75), tools=2, min_turns=1, max_turns=2, user=(2, 6), reasoning=(2, 5),
                    tool_result=(2, 6), answer=(1, 4), calls=(0, 1))


def small_records(n: int = 4) -> list[dict]:
    return [agent_record(i, 7, SMALL) for i in range(n)]


@pytest.fixture(scope="module")
def agent_views(qwen3_tokenizer):
    convs = [parse_record(r, source="small agent", index=i) for i, r in enumerate(small_records())]
    return compact_vocab([render_views(c, qwen3_tokenizer) for c in convs])


def shared_row_chains(views):
    trees, units = [], []
    for c, vs in enumerate(views):
        trees += schedule_views(vs, parse_schedule("one-pass")).layouts
        units.append(c)
    (row,) = share_rows(trees, units, sum(map(len, trees)))
    return trees, row


def test_the_rows_really_share_a_prefix_between_conversations(agent_views):
    views, _ = agent_views
    trees, row = shared_row_chains(views)
    assert len(row) < sum(map(len, trees)) - 2 * 60  # each harness's prompt and tools computed once
    chains = row_chains(row.kv_end)
    roots = [c for c in chains if c.parent < 0]
    assert len(roots) == 2  # one tree per harness
    for r in roots:  # the prefix chain of a harness has children of both its conversations
        kids = [c for c in chains if c.parent == chains.index(r)]
        assert len(kids) >= 2


@pytest.mark.parametrize("arch", ["qwen3", "gpt-oss", "qwen3.5", "nemotron-h", "lfm2"])
def test_shared_rows_equal_n_pass_loss_and_every_gradient(agent_views, one_thread, arch):
    views, vocab = agent_views
    backend = cpu_backend(tiny_config(arch, vocab), None)  # what onepass picks on CPU
    model = tiny_model(arch, vocab, dtype=torch.float64, attn_implementation=backend)
    float64_norms(model)
    for weighting in ("token", "turn", "conversation"):
        report = run_verify(views, model, weighting=weighting, pack=True, share=True)
        assert report.shared and report.num_rows == 1 and report.row_tokens < report.one_pass_tokens
        assert report.rel_loss_diff <= TOL, (arch, weighting, report.rel_loss_diff)
        assert report.max_rel_grad_diff <= TOL, (arch, weighting, report.max_rel_grad_diff, report.worst_parameter)


def test_onepass_verify_pack_says_equal_on_agent_data(tmp_path, capsys):
    data = tmp_path / "agent.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in small_records()), encoding="utf-8")
    assert main(["verify", "--data", str(data), "--pack", "--tiny", "gpt-oss"]) == 0
    out = capsys.readouterr().out
    last = json.loads(out.strip().splitlines()[-1])
    assert last["equal"] and last["shared"] and last["row_tokens"] < last["one_pass_tokens"]
    assert "prefixes shared across conversations" in out
    assert main(["verify", "--data", str(data), "--pack", "--no-share-prefix", "--tiny", "qwen3"]) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["equal"] and not last["shared"] and last["row_tokens"] == last["one_pass_tokens"]
