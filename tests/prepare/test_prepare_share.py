"""``onepass prepare --pack`` shares prefixes across conversations by default, on the real agent data.

tau-bench airline and BFCL conversations (``../shared/data/agent/``, Qwen3 template and vocabulary)
begin with thousands of tokens of policy and tool schemas. Prepared with ``--pack`` they now give rows
whose loss terms (context, target, weight) are exactly those of ``--no-share-prefix`` (one tree per
conversation, the rows of before), in fewer tokens; the streamed output equals the in-memory path on
one and two processes, the window keeps sharing among consecutive conversations, stats.json says what
was shared, ``onepass data stats`` reports the shared-prefix tokens and their bound, and ``onepass
bench`` measures the shared setting against one-pass packed.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from onepass.bench import harness as bench
from onepass.bench.settings import layout_setting
from onepass.bench.report import markdown
from onepass.cli import main
from onepass.data.sources import load_conversations
from onepass.prepare.parallel import iter_prepared
from onepass.prepare.pipeline import PrepareConfig, PrepareStats, load_rows, prepare, write_dataset, write_prepared
from onepass.layout.share import loss_terms, same_terms

AGENT = Path(__file__).resolve().parents[3] / "shared" / "data" / "agent"


def _subset(tmp_path, name, n, every=1):
    if not (AGENT / f"{name}.jsonl").exists():
        pytest.skip(f"{AGENT / name}.jsonl is not here")
    lines = (AGENT / f"{name}.jsonl").read_text(encoding="utf-8").splitlines()
    path = tmp_path / f"{name}.jsonl"
    path.write_text("\n".join(itertools.islice(lines[::every], n)) + "\n", encoding="utf-8")
    return path


def _rows(path):
    return load_rows(path)


@pytest.mark.parametrize("name,every", [("taubench_airline", 1), ("bfcl_base", 7)])
def test_prepare_pack_shares_prefixes_with_the_same_loss_terms(tmp_path, qwen3_tokenizer, name, every):
    data = _subset(tmp_path, name, 12, every)
    out = {}
    for flag in ("--share-prefix", "--no-share-prefix"):
        assert main(["prepare", "--data", str(data), "--pack", "--max-tokens", "32768", flag, "--no-progress",
                     "--out", str(tmp_path / flag)]) == 0
        out[flag] = (_rows(tmp_path / flag), json.loads((tmp_path / flag / "stats.json").read_text()))
    (shared, st), (apart, sa) = out["--share-prefix"], out["--no-share-prefix"]
    assert same_terms(loss_terms(shared), loss_terms(apart))
    assert st["row_tokens"] < 0.75 * sa["row_tokens"] and all(len(r) <= 32768 for r in shared)
    assert st["shared"]["tokens_unshared"] == sa["row_tokens"] == st["scheduled_tokens"]
    assert st["shared"]["shared_prefix_tokens"] == sa["row_tokens"] - st["row_tokens"]
    assert st["shared"]["trees_shared"] >= 2 and "shared" not in sa
    assert {k: v for k, v in st.items() if k not in ("shared", "rows", "row_tokens", "padding_tokens",
                                                     "padding_fraction")} == \
        {k: v for k, v in sa.items() if k not in ("rows", "row_tokens", "padding_tokens", "padding_fraction")}


@pytest.mark.parametrize("num_proc,window", [(1, None), (2, 3)])
def test_streamed_shared_rows_equal_the_in_memory_path(tmp_path, qwen3_tokenizer, num_proc, window):
    data = _subset(tmp_path, "bfcl_base", 10, every=9)
    config = PrepareConfig(max_tokens=20000, pack=True, share_window=window, weighting="turn")
    report = load_conversations(data, strict=False)
    rows, stats = prepare(report.conversations, qwen3_tokenizer, config)
    reference = write_dataset(rows, stats, tmp_path / "reference")
    streamed = PrepareStats()
    got = write_prepared(iter_prepared(data, qwen3_tokenizer, config, streamed, num_proc=num_proc, units=True),
                         streamed, config, tmp_path / "streamed")
    assert json.loads((got / "stats.json").read_text()) == json.loads((reference / "stats.json").read_text())
    for a, b in zip(load_rows(got), load_rows(reference), strict=True):
        assert a.input_ids.tolist() == b.input_ids.tolist() and a.kv_end.tolist() == b.kv_end.tolist()
        assert a.weights.tolist() == b.weights.tolist()
    assert streamed.shared["window"] == window and streamed.shared["trees_shared"] >= 2


def test_a_narrow_window_shares_less(tmp_path, qwen3_tokenizer):
    data = _subset(tmp_path, "taubench_airline", 8)
    report = load_conversations(data, strict=False)
    tokens = {}
    for window in (None, 4, 1):
        rows, stats = prepare(report.conversations, qwen3_tokenizer,
                              PrepareConfig(max_tokens=32768, pack=True, share_window=window))
        tokens[window] = stats.row_tokens
    assert tokens[None] <= tokens[4] < tokens[1] == stats.scheduled_tokens  # window 1: nothing shared


def test_data_stats_reports_the_shared_prefix_tokens_and_their_bound(tmp_path, capsys):
    data = _subset(tmp_path, "taubench_airline", 6)
    out = tmp_path / "stats.json"
    assert main(["data", "stats", "--data", str(data), "--model", "qwen3-8b", "--no-progress",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    sh = json.loads(out.read_text())["shared"]
    assert sh["shared_row_tokens"] < sh["one_pass_row_tokens"]
    assert sh["shared_prefix_tokens"] == sh["one_pass_row_tokens"] - sh["shared_row_tokens"] > 4 * 3000
    assert 1.0 < sh["ideal_speedup"] and 1.0 < sh["gpu_cost"]["step_ratio"] and sh["ideal_speedup_vs_n_pass"] > 1
    assert "shared prefixes, rows of 32,768" in printed and "predicted attention" in printed
    assert main(["data", "stats", "--data", str(data), "--no-share-prefix", "--no-progress",
                 "--out", str(out)]) == 0
    assert json.loads(out.read_text())["shared"] == {}


def test_bench_measures_the_shared_setting_against_one_pass_packed():
    def row(setting, conv_s, epochs, tensors):
        return {"setting": setting, "backend": "onepass_cpu", "depth_group": "all", "conversations_per_s": conv_s,
                "peak_memory_bytes": None, "epoch_seconds": epochs, "epoch_seconds_best": min(epochs),
                "peak_tensor_bytes": tensors, "work": {"rows": 4, "tokens": 100, "visible_pairs": 1000,
                                                      "targets": 10}}

    rows = [row("one-pass-packed", 1.0, [10.0, 11.0], 100), row("one-pass-packed-shared", 1.5, [7.0, 6.5], 103)]
    rows[1]["work"] = {"rows": 2, "tokens": 60, "visible_pairs": 700, "targets": 10}
    bench.add_ratios(rows, {"all": 10.0}, {"all": 1.6})
    s = rows[1]
    assert s["speedup_vs_one_pass_packed"] == 1.5 and s["fraction_of_shared_bound"] == pytest.approx(1.5 / 1.6)
    assert s["best_epoch_speedup_vs_one_pass_packed"] == pytest.approx(10.0 / 6.5)
    assert s["tensor_memory_vs_one_pass_packed"] == pytest.approx(1.03)
    assert rows[0]["fraction_of_shared_bound"] is None if "fraction_of_shared_bound" in rows[0] else True
    summary = {"device": {"device": "cpu", "gpu": None, "cpu": "x", "threads": 1},
               "versions": {"torch": "t", "transformers": "t"},
               "workload": {"name": "agent", "conversations": 6, "views": 9, "model_shape": "tiny", "dtype": "float32",
                            "max_tokens": 16384, "repeats": 2},
               "ideal_speedup": {"all": 10.0}, "matmul_peak_flops": 1e9,
               "settings": [{**r, "tokens_per_s": 1.0, "speedup_vs_n_pass_packed": None, "memory_vs_n_pass_packed": None,
                             "fraction_of_ideal": None, "useful_flop_utilisation": None, "epoch_seconds_spread": 0.1,
                             "tokens": r["work"]["tokens"], "rows": r["work"]["rows"]} for r in rows]}
    text = markdown(summary)
    assert "shared prefixes vs one-pass packed (onepass_cpu, all): 1.50x" in text and "94% of its FLOP bound 1.60x" in text


def test_bench_compares_process_cpu_time_beside_the_wall_clock():
    """On a loaded CPU machine the wall clock counts the neighbours' time: the shared setting's ratio is
    also given in process CPU seconds (median and fastest epochs) and as a fraction of its bound."""
    def row(setting, wall, cpu, tensors):
        return {"setting": setting, "backend": "onepass_cpu", "depth_group": "all", "conversations_per_s": 4 / wall[0],
                "peak_memory_bytes": None, "epoch_seconds": wall, "epoch_seconds_best": min(wall),
                "epoch_cpu_seconds": cpu, "epoch_cpu_seconds_best": min(cpu), "peak_tensor_bytes": tensors,
                "work": {"rows": 2, "tokens": 100, "visible_pairs": 1000, "targets": 10}}

    rows = [row("one-pass-packed", [30.0], [10.0, 12.0, 11.0], 100),  # wall: a neighbour held the core
            row("one-pass-packed-shared", [10.0], [6.0, 5.0, 7.0], 100)]
    bench.add_ratios(rows, {"all": 10.0}, {"all": 2.5})
    s = rows[1]
    assert s["speedup_vs_one_pass_packed"] == pytest.approx(3.0)  # past the bound: the wall clock misleads
    assert s["cpu_speedup_vs_one_pass_packed"] == pytest.approx(11.0 / 6.0)
    assert s["best_cpu_epoch_speedup_vs_one_pass_packed"] == pytest.approx(10.0 / 5.0)
    assert s["best_cpu_epoch_fraction_of_shared_bound"] == pytest.approx(2.0 / 2.5)
    assert s["cpu_fraction_of_shared_bound"] == pytest.approx(11.0 / 6.0 / 2.5)
    rows[0]["epoch_cpu_seconds"] = []  # not measured (TRL's timer): no CPU ratio, not a made-up one
    bench.add_ratios(rows, {"all": 10.0}, {"all": 2.5})
    assert rows[1]["cpu_speedup_vs_one_pass_packed"] is None and rows[1]["cpu_fraction_of_shared_bound"] is None


def test_the_layouts_bench_times_for_the_shared_setting_keep_the_loss_terms(qwen3_tokenizer, tmp_path):
    from onepass.render import render_views

    convs = load_conversations("synthetic:agent", strict=False, limit=4).conversations
    views = [render_views(c, qwen3_tokenizer) for c in convs]
    one = layout_setting(views, "one-pass-packed", 16384)
    shared = layout_setting(views, "one-pass-packed-shared", 16384)
    assert same_terms(loss_terms(one), loss_terms(shared))
    assert sum(map(len, shared)) < sum(map(len, one)) and all(len(r) <= 16384 for r in shared)


def test_a_tool_held_out_until_a_later_turn_on_real_bfcl_data_keeps_the_loss_terms(qwen3_tokenizer):
    """BFCL base conversations turned into BFCL's miss_func shape: the first function called after the second user
    turn is left out of the record's tools and given back there (that message's own ``tools``: the full list). The
    views before it render the shorter tool block, the later ones the full one; the one-pass rows sharing
    prefixes across conversations hold exactly the loss terms of the N-pass views (each its own tree)."""
    if not (AGENT / "bfcl_base.jsonl").exists():
        pytest.skip(f"{AGENT / 'bfcl_base.jsonl'} is not here")
    lines = (AGENT / "bfcl_base.jsonl").read_text(encoding="utf-8").splitlines()[::9]
    records, held = [], []
    for line in lines:
        record = json.loads(line)
        users = [i for i, m in enumerate(record["messages"]) if m["role"] == "user"]
        if len(users) < 2:
            continue
        called = [c["function"]["name"] for m in record["messages"] for c in m.get("tool_calls") or ()]
        before = {c["function"]["name"] for m in record["messages"][:users[1]] for c in m.get("tool_calls") or ()}
        name = next((n for n in called if n not in before), None)
        if name is None:
            continue
        record["messages"][users[1]]["tools"] = record["tools"]
        record["tools"] = [t for t in record["tools"] if t["function"]["name"] != name]
        records.append(record)
        held.append(name)
        if len(records) == 3:
            break
    assert len(records) == 3
    from onepass.conversation.parse import parse_record

    convs = [parse_record(r, source="bfcl_miss_func", index=i) for i, r in enumerate(records)]
    def names(tools):
        return {t["function"]["name"] for t in tools}

    for conv, name in zip(convs, held):
        change = conv.tool_changes[0]
        assert name not in names(conv.tools_at(change - 1)) and name in names(conv.tools_at(change))
    shared, stats = prepare(convs, qwen3_tokenizer, PrepareConfig(pack=True, max_tokens=65536))
    npass, _ = prepare(convs, qwen3_tokenizer, PrepareConfig(schedule="n-pass"))
    assert stats.shared["trees_shared"] >= 2 and not stats.skipped
    assert same_terms(loss_terms(shared), loss_terms(npass))
