"""The benchmark harness: its FLOP accounting by hand, its ratios, and a tiny end-to-end run."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from onepass.bench import harness as bench
from onepass.bench.report import headline, markdown
from onepass.bench.settings import layout_setting
from onepass.layout.flops import ModelShape, train_flops, visible_pairs
from onepass.cli import main
from onepass.layout.tree import build_layout
from onepass.layout.view import View
import warm


def V(tokens, num_prompt):
    return View(tokens=np.asarray(tokens), num_prompt=num_prompt, turn=0)


def test_visible_pairs_and_flops_by_hand():
    views = [V([1, 2, 3], 1), V([1, 4], 1)]  # tree: h t r | h' s  (h duplicated: targets differ)
    layout = build_layout(views)
    assert visible_pairs(layout) == 1 + 2 + 3 + 1 + 2
    shape = ModelShape(name="x", num_layers=1, hidden=2, num_heads=1, num_kv_heads=1, head_dim=2,
                             ffn=2, vocab=5)
    per_token, per_pair, per_target = (shape.linear_flops_per_token, shape.attention_flops_per_pair,
                                       shape.head_flops_per_target)
    expected = 3 * (per_token * 5 + per_pair * 9 + per_target * 3)
    assert train_flops([layout], shape) == expected
    assert train_flops([layout], shape, dense=True) == 3 * (per_token * 5 + per_pair * 15 + per_target * 3)


def test_ratios_use_the_same_backend_group_and_packing():
    def row(setting, conv_s, mem):
        return {"setting": setting, "backend": "sdpa", "depth_group": "all", "conversations_per_s": conv_s,
                "peak_memory_bytes": mem}

    rows = [row("n-pass", 1.0, 10), row("n-pass-packed", 2.0, 20), row("one-pass", 1.5, 8),
            row("one-pass-packed", 3.0, 21)]
    bench.add_ratios(rows, {"all": 2.0})
    by = {r["setting"]: r for r in rows}
    assert by["one-pass-packed"]["speedup_vs_n_pass_packed"] == 1.5
    assert by["one-pass-packed"]["memory_vs_n_pass_packed"] == 21 / 20
    assert by["one-pass-packed"]["fraction_of_ideal"] == 1.5 / 2.0
    assert by["one-pass"]["fraction_of_ideal"] == 1.5 / 2.0  # against unpacked N-pass
    assert by["n-pass"]["fraction_of_ideal"] is None
    assert by["one-pass-packed"]["best_epoch_fraction_of_ideal"] is None  # no epoch times given


def test_best_epoch_ratio_takes_each_settings_fastest_epoch():
    def row(setting, conv_s, best):
        return {"setting": setting, "backend": "sdpa", "depth_group": "all", "conversations_per_s": conv_s,
                "peak_memory_bytes": None, "epoch_seconds_best": best}

    rows = [row("n-pass-packed", 1.0, 8.0), row("one-pass-packed", 1.5, 4.0)]
    bench.add_ratios(rows, {"all": 2.5})
    one = rows[1]
    assert one["speedup_vs_n_pass_packed"] == 1.5 and one["fraction_of_ideal"] == 1.5 / 2.5  # medians
    assert one["best_epoch_speedup_vs_n_pass_packed"] == 2.0 and one["best_epoch_fraction_of_ideal"] == 2.0 / 2.5
    assert "(fastest epochs: 2.00x, 80%)" in "\n".join(headline({"settings": rows, "ideal_speedup": {"all": 2.5}}))


def _setting(name, seconds, *, tokens, rows):
    return {"setting": name, "backend": "sdpa", "depth_group": "all", "conversations_per_s": 10 / min(seconds),
            "tokens_per_s": tokens / min(seconds), "memory_vs_n_pass_packed": None, "fraction_of_ideal": None,
            "useful_flop_utilisation": None, "epoch_seconds_spread": 0.0,
            "peak_memory_bytes": None, "epoch_seconds": seconds, "epoch_seconds_best": min(seconds),
            "work": {"rows": rows, "tokens": tokens, "visible_pairs": tokens * 10, "dense_pairs": tokens * 20,
                     "targets": 50}}


def test_a_headline_past_the_flop_token_bound_is_reported_as_disturbed_timing():
    """N-pass packed slowed by load during its epochs: 4.6x where 1.28x more tokens allow 1.28x at most."""
    rows = [_setting("n-pass-packed", [46.5, 46.0], tokens=128, rows=4),
            _setting("one-pass-packed", [10.0, 10.1], tokens=100, rows=4)]
    bench.add_ratios(rows, {"all": 1.2})
    (line,) = headline({"settings": rows, "ideal_speedup": {"all": 1.2}})
    assert "timing disturbed (median 4.6" in line and "of the ideal" not in line
    check = rows[1]["speed_ratio_vs_n_pass_packed"]
    assert check["disturbed"] and check["bound"] == 1.28 and rows[0]["speed_ratio_vs_n_pass_packed"] is None
    table = markdown({"settings": rows, "ideal_speedup": {"all": 1.2}, "matmul_peak_flops": 1e9,
                      "device": {"device": "cpu", "gpu": None, "cpu": "x", "threads": 2},
                      "versions": {"torch": "t", "transformers": "t"},
                      "workload": {"name": "w", "conversations": 1, "views": 2, "model_shape": "tiny",
                                   "dtype": "float32", "max_tokens": 4096, "repeats": 2}})
    assert "(disturbed timing)" in table


def test_a_headline_within_the_bound_quotes_the_bound():
    rows = [_setting("n-pass-packed", [12.0, 12.2], tokens=128, rows=4),
            _setting("one-pass-packed", [10.0, 10.1], tokens=100, rows=4)]
    bench.add_ratios(rows, {"all": 1.2})
    (line,) = headline({"settings": rows, "ideal_speedup": {"all": 1.2}})
    assert "within the FLOP/token bound of 1.28x" in line and "disturbed" not in line


@pytest.mark.e2e
@pytest.mark.slow  # a whole benchmark run, each setting in a process of its own (still run by make test)
def test_bench_writes_summary_table_and_plots(tmp_path, monkeypatch):
    """Each setting timed in a warm process of its own (tests/warm.py: torch and transformers already imported),
    not a spawned fresh one: the spawn itself is tests/bench/test_bench_trl.py's."""
    monkeypatch.setattr(bench, "time_in_subprocess",
                        lambda job, timer=None: warm.call(timer or bench.time_training, job, timeout=600))
    out = tmp_path / "bench"
    assert main(["bench", "--out", str(out), "--conversations", "4", "--repeats", "1",
                 "--settings", "n-pass-packed,one-pass-packed", "--max-tokens", "2048"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    for key in ("device", "versions", "workload", "ideal_speedup", "settings"):
        assert key in summary
    assert summary["ideal_speedup"]["all"] > 1
    required = {"setting", "backend", "depth_group", "conversations_per_s", "tokens_per_s", "peak_memory_bytes",
                "speedup_vs_n_pass_packed", "memory_vs_n_pass_packed", "fraction_of_ideal",
                "useful_flop_utilisation"}
    assert [(s["backend"], s["setting"]) for s in summary["settings"]] == [
        ("sdpa", "n-pass-packed"), ("sdpa", "one-pass-packed"),
        ("onepass_cpu", "n-pass-packed"), ("onepass_cpu", "one-pass-packed")]  # the CPU default backends
    assert all(required <= set(s) for s in summary["settings"])
    assert (out / "table.md").read_text().count("| one-pass-packed |") == 2
    assert (out / "speedup.png").read_bytes()[:4] == b"\x89PNG"


def test_workload_names_are_data_specs_with_the_same_conversations(capsys):
    import dataclasses

    import pytest

    from onepass.bench.cli import load_workload, workload_spec
    from onepass.data.mathchat import load_sample
    from onepass.data.synthetic import generate_conversations

    assert workload_spec(None, None) == ("mathchat", "builtin:mathchat")
    assert workload_spec(None, "synthetic") == ("synthetic", "synthetic:mathchat-sync")
    assert workload_spec("chats.jsonl", None) == ("chats.jsonl", "chats.jsonl")

    def strip(convs):
        return [dataclasses.replace(c, source="") for c in convs]

    # what --workload timed before it became a name for a spec
    assert strip(load_workload("synthetic:mathchat-sync", 5)) == strip(generate_conversations(5, seed=0))
    assert load_workload("builtin:mathchat", 5) == load_sample(limit=5)
    with pytest.raises(SystemExit) as e:
        main(["bench", "--out", "o", "--data", "builtin:mathchat", "--workload", "synthetic"])
    assert e.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


def test_shape_and_layers_run_the_cut_model_and_report_the_full_depth(tmp_path, monkeypatch, capsys):
    """``--shape qwen3-0.6b --layers 2``: real widths and vocabulary, 2 of 28 layers; FLOPs of both, labelled.

    The timer is replaced (a real-vocabulary step is minutes of CPU): this checks what is run and reported.
    """
    from onepass.layout.flops import MODEL_SHAPES

    jobs = []

    def fake_timer(job, timer=None):
        jobs.append(job)
        return bench.Timing(epoch_seconds=[1.0], peak_memory_bytes=1)

    monkeypatch.setattr(bench, "time_in_subprocess", fake_timer)
    monkeypatch.setattr(bench, "matmul_peak_flops", lambda device, dtype: 1e9)
    out = tmp_path / "b"
    assert main(["bench", "--out", str(out), "--shape", "qwen3-0.6b", "--layers", "2", "--conversations", "2",
                 "--repeats", "1", "--settings", "n-pass-packed,one-pass-packed", "--backends", "sdpa",
                 "--device", "cpu"]) == 0
    assert "layers: 2 run of 28" in capsys.readouterr().out
    full = MODEL_SHAPES["qwen3-0.6b"]
    assert {j.vocab for j in jobs} == {full.vocab}  # the real vocabulary, not compacted
    assert all(j.shape_kwargs["num_hidden_layers"] == 2 and j.shape_kwargs["hidden_size"] == full.hidden
               and j.shape_kwargs["tie_word_embeddings"] for j in jobs)
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["workload"]["layers"], summary["workload"]["full_layers"]) == (2, 28)
    for s in summary["settings"]:
        assert s["useful_flops"] < s["useful_flops_full_depth"] < 14 * s["useful_flops"]  # head + embed not scaled
    assert main(["bench", "--out", str(out), "--model-shape", "qwen3-0.6b", "--layers", "0"]) == 2  # old name kept


def test_hybrid_arch_times_a_qwen35_and_reports_state_passing(qwen3_tokenizer, one_thread):
    """``--arch qwen3.5``: the config's own 3:1 Gated DeltaNet / attention pattern at the shape's sizes; the
    recurrent layers run chain by chain and the chain loop's cost lands in the summary (in-process, tiny)."""
    import dataclasses

    from onepass.data.mathchat import load_sample
    from onepass.errors import UsageError
    from onepass.layout.geometry import row_chains
    from onepass.render import render_views
    from onepass.model.tiny import tiny_config
    from onepass.verify.check import compact_vocab

    shape = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=16, tie_word_embeddings=False)
    kwargs = bench.arch_kwargs("qwen3.5", shape)
    assert tiny_config("qwen3.5", 50, **kwargs).layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert bench.arch_kwargs("qwen3", shape) == shape
    with pytest.raises(UsageError, match="unknown bench architecture"):
        bench.arch_kwargs("mamba", shape)
    views, vocab = compact_vocab([render_views(c, qwen3_tokenizer) for c in load_sample(limit=2)])
    rows = layout_setting(views, "one-pass-packed", 4096)
    job = bench.Job(rows=rows, vocab=vocab, shape_kwargs=shape, dtype="float32", backend="sdpa", device="cpu",
                    seed=0, repeats=1, threads=1, warmup=0, arch="qwen3.5")
    timing = bench.time_training(job)
    chains = sum(len(row_chains(r.kv_end)) for r in rows)
    assert timing.chains == 3 * chains  # three Gated DeltaNet layers, every chain once per step
    assert 0 < timing.chain_loop_seconds < timing.epoch_seconds[0] and timing.chain_mixer_seconds > 0
    summary = bench.summarise("one-pass-packed", "sdpa", "all", rows, timing, 2, 1.0, 1e9)
    assert 0 < summary["state_passing_fraction_of_step"] < 1 and summary["recurrent_chain_calls"] == 3 * chains
    qwen3 = bench.time_training(dataclasses.replace(job, arch="qwen3"))
    assert qwen3.chains is None  # no recurrent layers: nothing reported


def test_arch_reaches_every_job_and_the_summary(tmp_path, monkeypatch, capsys):
    """``--arch qwen3.5`` is what each timed job builds and what the summary names; TRL's baseline (a Qwen3)
    is refused with it rather than timed as a different model."""
    jobs = []

    def fake_timer(job, timer=None):
        jobs.append(job)
        return bench.Timing(epoch_seconds=[2.0], peak_memory_bytes=1, chain_loop_seconds=0.1,
                            chain_mixer_seconds=0.5, chains=30)

    monkeypatch.setattr(bench, "time_in_subprocess", fake_timer)
    monkeypatch.setattr(bench, "matmul_peak_flops", lambda device, dtype: 1e9)
    out = tmp_path / "b"
    assert main(["bench", "--out", str(out), "--arch", "qwen3.5", "--conversations", "2", "--repeats", "1",
                 "--settings", "n-pass-packed,one-pass-packed", "--backends", "sdpa", "--device", "cpu"]) == 0
    assert [j.arch for j in jobs] == ["qwen3.5", "qwen3.5"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["workload"]["arch"] == "qwen3.5" and summary["workload"]["name"] == "mathchat"
    assert [s["state_passing_fraction_of_step"] for s in summary["settings"]] == [0.05, 0.05]
    assert "state passing 5.0% of the step" in (out / "table.md").read_text()
    capsys.readouterr()
    assert main(["bench", "--out", str(out), "--arch", "qwen3.5", "--settings", "trl-sft-packed"]) == 2
    assert "times a Qwen3" in capsys.readouterr().err
    assert main(["bench", "--out", str(out), "--arch", "mamba"]) == 2


def test_interleaved_timing_alternates_settings_and_a_failing_one_leaves_the_others(one_thread):
    """``--interleave`` (the GPU check's speed step): epochs A B A B, every model resident; a setting that
    fails before timing is one line and no figures, the others are timed."""
    views = [[V([1, 2, 3, 4], 2), V([1, 2, 3, 4, 5, 6], 4)], [V([7, 8, 9], 1)]]
    rows = {s: layout_setting(views, s, 64) for s in ("n-pass-packed", "one-pass-packed")}
    job = bench.Job(rows=rows["n-pass-packed"], vocab=10, shape_kwargs={}, dtype="float32", backend="sdpa",
                    device="cpu", seed=0, repeats=2, threads=1, warmup=1, tensor_memory=False)
    jobs = [job, dataclasses.replace(job, rows=rows["one-pass-packed"], tensor_memory=True),
            dataclasses.replace(job, backend="surely_no_such_backend")]
    lines: list[str] = []
    timings = bench.time_interleaved(jobs, log=lines.append)
    assert [len(t.epoch_seconds) for t in timings] == [2, 2, 0]
    assert [t.peak_memory_bytes is not None for t in timings] == [True, True, False]
    # the allocator's figures after the epochs, where asked (--quick): the part a layout changes beside the whole
    assert timings[0].peak_tensor_bytes is None
    assert 0 < timings[1].peak_forward_backward_bytes <= timings[1].peak_tensor_bytes
    failed = [line for line in lines if "failed before timing" in line]
    assert len(failed) == 1 and failed[0].startswith("surely_no_such_backend (")
    epochs = [line.split(" (")[0] for line in lines if line.startswith("epoch ")]
    assert epochs == ["epoch 1 sdpa", "epoch 1 sdpa", "epoch 2 sdpa", "epoch 2 sdpa"]
    rows_per_epoch = [line.split("(")[1].split(" rows")[0] for line in lines if line.startswith("epoch ")]
    assert rows_per_epoch[:2] == [str(len(rows["n-pass-packed"])), str(len(rows["one-pass-packed"]))]


def test_quick_interleaves_its_settings_in_one_process(monkeypatch, tmp_path):
    """``--quick`` times its settings' epochs interleaved in this process (A B A B), as the demo does; on
    b757769 each ran in a process of its own minutes apart, and one-pass packed read 134% of its FLOP bound."""
    calls = []

    def interleaved(jobs, log=print):
        calls.append([(j.backend, len(j.rows), j.tensor_memory) for j in jobs])
        return [bench.Timing(epoch_seconds=[2.0, 2.0], epoch_cpu_seconds=[1.0, 1.0]) for _ in jobs]

    def separately(job, timer=None):
        raise AssertionError("--quick timed a setting in a process of its own")

    monkeypatch.setattr(bench, "time_interleaved", interleaved)
    monkeypatch.setattr(bench, "time_in_subprocess", separately)
    out = tmp_path / "quick"
    assert main(["bench", "--quick", "--out", str(out), "--conversations", "2", "--backends", "onepass_cpu",
                 "--settings", "n-pass-packed,one-pass-packed"]) == 0
    assert len(calls) == 1 and [b for b, _, _ in calls[0]] == ["onepass_cpu", "onepass_cpu"]
    assert all(memory for _, _, memory in calls[0])  # the tensor-memory figures are kept
    settings = json.loads((out / "summary.json").read_text())["settings"]
    assert all(s["interleaved"] for s in settings) and settings[1]["speed_ratio_vs_n_pass_packed"]["paired"]


def test_interleaved_ratios_are_paired_and_the_flash_baseline_is_compared_across_backends():
    def row(setting, backend, seconds, tokens, mem):
        return {"setting": setting, "backend": backend, "depth_group": "all", "conversations_per_s": 10 / seconds[0],
                "peak_memory_bytes": mem, "epoch_seconds": seconds, "epoch_seconds_best": min(seconds),
                "interleaved": True, "work": {"rows": 4, "tokens": tokens, "visible_pairs": tokens * 10,
                                              "dense_pairs": tokens * 20, "targets": 50}}

    rows = [row("n-pass-packed", "flex_attention", [2.0, 2.2], 150, 30),
            row("one-pass-packed", "flex_attention", [1.5, 1.65], 100, 40),
            row("n-pass-packed", "onepass_varlen", [1.8, 2.0], 150, 20)]
    bench.add_ratios(rows, {"all": 1.5})
    one = rows[1]
    assert one["speedup_vs_n_pass_packed"] == pytest.approx(4 / 3) and one["speed_ratio_vs_n_pass_packed"]["paired"]
    assert one["speedup_vs_flash_n_pass_packed"] == pytest.approx(1.2)
    assert one["speed_ratio_vs_flash_n_pass_packed"]["paired"] and one["memory_vs_flash_n_pass_packed"] == 2.0
    assert rows[2]["speedup_vs_flash_n_pass_packed"] is None  # not against itself
    (line,) = headline({"settings": rows, "ideal_speedup": {"all": 1.5}})
    assert "vs N-pass packed on torch's flash varlen kernel: 1.20x, memory 2.00x" in line


def test_onepass_varlen_times_tree_rows_too_and_says_it_runs_its_reference_off_cuda(capsys, tmp_path, one_thread):
    """The gathered tree path serves one-pass rows (they used to be skipped: a varlen kernel could not
    express a tree); off CUDA it is the CPU reference kernel, said in one line."""
    out = tmp_path / "bench"
    assert main(["bench", "--out", str(out), "--conversations", "2", "--repeats", "1", "--interleave",
                 "--settings", "n-pass-packed,one-pass-packed", "--backends", "onepass_varlen", "--device", "cpu",
                 "--max-tokens", "2048"]) == 0
    assert "onepass_varlen off CUDA runs its reference kernel" in capsys.readouterr().out
    settings = json.loads((out / "summary.json").read_text())["settings"]
    assert [(s["backend"], s["setting"]) for s in settings] == [("onepass_varlen", "n-pass-packed"),
                                                                ("onepass_varlen", "one-pass-packed")]
    assert settings[1]["speedup_vs_flash_n_pass_packed"] == pytest.approx(settings[1]["speedup_vs_n_pass_packed"])


@pytest.mark.e2e
def test_bench_interleave_end_to_end_on_cpu(tmp_path, one_thread):
    out = tmp_path / "bench"
    assert main(["bench", "--out", str(out), "--conversations", "3", "--repeats", "2", "--interleave",
                 "--settings", "n-pass-packed,one-pass-packed", "--backends", "sdpa", "--device", "cpu",
                 "--max-tokens", "2048"]) == 0
    settings = json.loads((out / "summary.json").read_text())["settings"]
    assert [s["setting"] for s in settings] == ["n-pass-packed", "one-pass-packed"]
    assert all(s["interleaved"] and s["epochs"] == 2 for s in settings)
    assert settings[1]["speed_ratio_vs_n_pass_packed"]["paired"] is True
