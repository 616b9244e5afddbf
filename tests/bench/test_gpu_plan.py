"""``make gpu-check``'s speed plan, dry run on CPU: shapes, rows, FLOP bounds, the table's columns, time boxes.

The GPU run is one call of minutes; everything about it that needs no GPU is checked here, fast: the
plan at Qwen3-8B width (the real agent data that travels in the tree, the synthetic long-reasoning
MathChat), and the figures the table derives from measured epochs, by hand.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from onepass.bench import gpu_plan, gpu_speed
from onepass.bench.gpu_check import BOXES, MARGIN_SECONDS, TOTAL_SECONDS
from onepass.layout.flops import MODEL_SHAPES, train_flops
from onepass.layout.view import View


@pytest.fixture(scope="module")
def dry_run():
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = gpu_speed.main(["--dry-run", "--seconds", str(BOXES["speed"])])
    return rc, out.getvalue()


@pytest.mark.e2e
def test_the_dry_run_plans_every_workload_at_8b_width_and_fits_the_speed_box(dry_run):
    rc, output = dry_run
    assert rc == 0, output[-2000:]
    plan = json.loads(output.strip().splitlines()[-1])
    shape = plan["shape"]
    assert (shape["hidden"], shape["ffn"], shape["num_heads"], shape["num_kv_heads"], shape["vocab"]) == (
        4096, 12288, 32, 8, 151936) and 2 <= shape["num_layers"] <= 4 and plan["full_layers"] == 36
    assert plan["row_tokens"] == 32768
    settings = {s["key"]: s for s in plan["settings"]}
    for workload in ("mathchat", "mathchat-deep-long", "tau-bench-airline", "bfcl"):
        baseline = settings[f"{workload}/n-pass-packed/onepass_varlen"]
        assert baseline["bound"] == 1.0 and len(baseline["rows"]) >= 3
        for backend in ("flex_attention", "onepass_varlen"):
            one = settings[f"{workload}/one-pass-packed/{backend}"]
            assert 2 <= len(one["rows"]) <= 3 and one["bound"] > 1.2 and one["padded"] == (backend == "flex_attention")
    for workload in ("tau-bench-airline", "bfcl"):  # sharing across conversations: a bound past one-pass's
        for backend in ("flex_attention", "onepass_varlen"):
            shared = settings[f"{workload}/one-pass-packed-shared/{backend}"]
            assert shared["bound"] > settings[f"{workload}/one-pass-packed/{backend}"]["bound"] * 1.2
    assert settings["tau-bench-airline/one-pass-packed/onepass_varlen"]["bound"] > 8  # tau-bench: ~9x less work
    for workload in ("mathchat", "mathchat-deep-long"):  # no prefix shared across conversations: said, not timed
        assert f"{workload}/one-pass-packed-shared/flex_attention" not in settings
        assert any(f"{workload}: one-pass-packed-shared: no prefix shared" in n for n in plan["notes"])
    assert all(max(s["rows"]) <= 32768 for s in plan["settings"])
    # the table's columns, printed with nothing measured yet
    assert plan["columns"] == list(gpu_plan.COLUMNS)
    header = next(line for line in output.splitlines() if line.startswith("| workload |"))
    assert header == "| " + " | ".join(gpu_plan.COLUMNS) + " |"
    # the time boxes add up: the whole call, and inside the speed box at a conservative rate two timed rounds
    assert sum(BOXES.values()) + MARGIN_SECONDS <= TOTAL_SECONDS <= 7 * 60
    budget = plan["budget"]
    assert budget["rounds"] >= 2 and budget["total"] <= BOXES["speed"] and budget["rate"] <= 400e12


def test_the_mathchat_workload_is_long_reasoning_over_six_turns_or_more():
    from onepass.data.sources import load_conversations

    conversations = load_conversations("synthetic:mathchat-deep-long", limit=9).conversations
    assert len(conversations) == 9
    assert min(sum(m.role == "assistant" for m in c.messages) for c in conversations) >= 6


def V(tokens, num_prompt, turn=0):
    return View(tokens=np.asarray(tokens), num_prompt=num_prompt, turn=turn)


def test_the_figures_of_measured_epochs_by_hand():
    """Two conversations, N-pass baseline vs one-pass on flex: paired per-round ratios, the fraction of the
    FLOP bound, utilisation against the matmul rate, memory against the baseline, compile time."""
    head = list(range(10, 40))
    convs = [[V(head + [1, 2, 3], 30, 0), V(head + [1, 2, 3, 4, 5, 6], 33, 1)],
             [V(head + [7, 8], 30, 0), V(head + [7, 8, 9, 9], 32, 1)]]
    plan = gpu_plan.build_plan({"w": convs}, shape=MODEL_SHAPES["tiny"], layers=2, row_tokens=128, vocab=64,
                               timed=(gpu_plan.BASELINE, ("one-pass-packed", "flex_attention")))
    base, one = plan.timed
    assert one.bound == pytest.approx(train_flops(base.rows, plan.shape) / train_flops(one.rows, plan.shape))
    measured = {base.key: {"epoch_seconds": [2.0, 2.2, 2.0], "peak_memory_bytes": 2**30},
                one.key: {"epoch_seconds": [1.0, 1.0, 1.25], "peak_memory_bytes": 2**31, "compile_seconds": 40.0}}
    rows = gpu_plan.figures(plan, measured, matmul_flops=1e12)
    b, o = rows
    assert b["vs flash N-pass"] == 1.0 and b["fraction of bound"] is None
    assert o["vs flash N-pass"] == pytest.approx(2.0)  # the per-round ratios 2.0, 2.2, 1.6: their median
    assert o["fraction of bound"] == pytest.approx(2.0 / one.bound)
    assert o["tokens/s"] == pytest.approx(one.tokens / 1.0)
    assert o["useful-FLOP utilisation"] == pytest.approx(one.useful_flops / 1.0 / 1e12)
    assert o["memory vs flash N-pass"] == 2.0 and o["peak memory GiB"] == 2.0 and o["compile s"] == 40.0
    assert o["speed_ratio"]["paired"] and o["speed_ratio"]["bound"] >= 1
    md = gpu_plan.table(rows)
    assert md.splitlines()[2].startswith(f"| w | n-pass-packed | onepass_varlen | {len(base.rows)} | ")
    assert "| 2.00x |" in md.splitlines()[3] and "| 40.0 |" in md.splitlines()[3]
