"""Dataset statistics: hand-counted FLOPs on a tiny tree, agreement with prepare, the depth figure."""

from __future__ import annotations

import json

import numpy as np
import pytest

from onepass.data.sources import load_conversations
from onepass.data.stats import compute_stats, percentiles, plot_depths
from onepass.layout.flops import MODEL_SHAPES, ModelShape, TokenCounts, conversation_counts, flops, model_shape
from onepass.prepare.pipeline import PrepareConfig, prepare
from onepass.layout.tree import build_layout
from onepass.layout.view import View


def view(tokens, num_prompt):
    return View(tokens=np.asarray(tokens, dtype=np.int64), num_prompt=num_prompt, turn=0)


def test_counts_of_the_docstring_example():
    # view A = 4 tokens, view B = 6 tokens sharing A's first 3: one-pass has 7 nodes
    a, b = view([1, 2, 3, 4], 3), view([1, 2, 3, 5, 6, 7], 5)
    c = conversation_counts([a, b], build_layout([a, b]))
    assert (c.n_pass_tokens, c.one_pass_tokens) == (10, 7)
    assert (c.n_pass_pairs, c.one_pass_pairs) == (4 * 5 // 2 + 6 * 7 // 2, 1 + 2 + 3 + 4 + 4 + 5 + 6) == (31, 25)
    assert c.targets == 1 + 1


def test_flops_formula_by_hand():
    shape = ModelShape(name="toy", num_layers=2, hidden=8, num_heads=2, num_kv_heads=1, head_dim=4, ffn=16, vocab=10)
    # linear: 2*2*(8*(8+2*4) + 8*8 + 3*8*16) = 4*(128 + 64 + 384) = 2304; attention: 4*2*8 = 64; head 2*8*10 = 160
    per = (shape.linear_flops_per_token, shape.attention_flops_per_pair, shape.head_flops_per_target)
    assert per == (2304, 64, 160)
    counts = TokenCounts(n_pass_tokens=10, one_pass_tokens=7, n_pass_pairs=31, one_pass_pairs=25, targets=2)
    assert flops(counts, shape) == (2304 * 10 + 64 * 31 + 160 * 2, 2304 * 7 + 64 * 25 + 160 * 2)


def test_model_shape_from_a_config(tmp_path):
    cfg = {"num_hidden_layers": 36, "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
           "head_dim": 128, "intermediate_size": 12288, "vocab_size": 151936}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    shape = model_shape(str(tmp_path))
    assert shape.linear_flops_per_token == MODEL_SHAPES["qwen3-8b"].linear_flops_per_token
    # ~2 x 6.95e9 non-embedding linear parameters per token for Qwen3-8B
    assert shape.linear_flops_per_token / 2 == pytest.approx(6.95e9, rel=0.01)
    with pytest.raises(ValueError, match="unknown model shape"):
        model_shape("gpt-5")


def test_percentiles():
    p = percentiles(range(1, 101))
    assert p["count"] == 100 and p["p50"] == 50.5 and p["p95"] == 95.05 and p["max"] == 100
    assert percentiles([]) == {"count": 0}


def test_stats_agree_with_prepare(qwen3_tokenizer):
    convs = load_conversations("builtin:mathchat", limit=10).conversations
    convs += load_conversations("builtin:mathchat").conversations[150:160]
    stats = compute_stats(convs, qwen3_tokenizer, shape="qwen3-0.6b")
    _, prepared = prepare(convs, qwen3_tokenizer, PrepareConfig())
    assert stats.tokens["n_pass_tokens"] == prepared.n_pass_tokens
    assert stats.tokens["one_pass_tokens"] == prepared.one_pass_tokens
    assert stats.tokens["targets"] == prepared.target_tokens
    assert stats.depths == {2: 10, 3: 10}
    assert stats.segments["human"]["count"] == 50 and stats.segments["response"]["count"] == 50
    assert stats.characteristic_length["reasoning"] == stats.segments["reasoning"]["p95"]
    assert 1.0 < stats.attention_speedup and 1.0 < stats.ideal_speedup < stats.token_ratio + 0.5
    assert json.loads(json.dumps(stats.to_dict()))["depths"] == {"2": 10, "3": 10}
    assert "ideal speedup for qwen3-0.6b" in stats.summary()


def test_depths_only_without_a_tokenizer():
    stats = compute_stats(load_conversations("synthetic:mathchat-sync", limit=50).conversations)
    assert sum(stats.depths.values()) == 50 and stats.tokens == {} and stats.ideal_speedup == 0.0


def test_plot_depths_writes_a_png(tmp_path):
    out = plot_depths({1: 10, 2: 5}, tmp_path / "f" / "depths.png", before={1: 100, 2: 50, 3: 1})
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_gpu_tiles_by_hand():
    """View A = 200 tokens, view B = A's first 150 + 150 more. FA2 varlen: 2 + 1 and 3 + 2 + 1 causal tiles = 9.
    One-pass row of 350 nodes in 3 blocks: all 6 lower tiles are non-empty (B's suffix, block 2, sees the
    shared prefix in blocks 0 and 1). Attention ratio 9 / 6."""
    from onepass.attention.blocks import block_plan
    from onepass.data.stats import gpu_cost
    from onepass.layout.flops import causal_tiles, tile_step_flops

    a = view(np.arange(200) + 10, 10)
    b = view(np.concatenate([np.arange(150) + 10, np.arange(150) + 500]), 160)
    layout = build_layout([a, b])
    plan = block_plan(layout.kv_end, 128)
    assert len(layout) == 350 and plan.num_partial + plan.num_full == 6
    assert causal_tiles(200) + causal_tiles(300) == 9
    shape = MODEL_SHAPES["qwen3-8b"]
    counts = conversation_counts([a, b], layout)
    cost = gpu_cost(counts, 9, 6, shape)
    assert cost["attention_ratio"] == 1.5
    assert cost["step_ratio"] == (tile_step_flops(shape, tokens=500, tiles=9, targets=counts.targets)
                                  / tile_step_flops(shape, tokens=350, tiles=6, targets=counts.targets))


def test_stats_report_the_gpu_cost_model(qwen3_tokenizer, capsys):
    from onepass.cli import main

    assert main(["data", "stats", "--data", "builtin:mathchat", "--limit", "5", "--model", "qwen3-8b",
                 "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "GPU cost (128x128 tiles): FlexAttention one-pass" in out and "predicted attention" in out
    stats = compute_stats(load_conversations("builtin:mathchat", limit=5).conversations, qwen3_tokenizer)
    g = stats.gpu_cost
    assert g["n_pass_tiles"] > g["one_pass_tiles"] > 0 and g["step_ratio"] > 1.0
