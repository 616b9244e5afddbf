"""Sequence parallelism in training: 2 and 4 CPU ranks (gloo, float64) take the steps of one process.

Each run splits every row over ``sp_size`` ranks (every tree is longer than a rank's share: each rank
holds a quarter or a half of it), three steps, then the loss sequence and the final weights are held
against one process on the same global batch to 1e-9 relative (measured: ~1e-14). Both sides run the
model float64 all the way (tests/train/float64_train.py): transformers' RMSNorms, MoE routers and
recurrent scans compute in float32 in a float64 model, and a gradient summed over other groups of tokens
(a rank's shard) rounds differently there, by ~1e-8 (measured: Qwen3.5's norms 2e-7, DeepSeek-V3's router
4e-8), as it does for one-pass against N-pass (docs/design.md). Dense, windows + sinks
+ MoE (gpt-oss), MoE with latent attention (DeepSeek-V3), and hybrids (Qwen3.5 Gated DeltaNet, Nemotron-H
Mamba2): with DDP (torchrun) and with FSDP2 on a 2 x 2 (dp x sp) mesh through the shipped accelerate
config, with LoRA and gradient checkpointing. One launch at a time: 4 ranks on 2 shared cores is slow.
The one-process refusals run without any launch.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from onepass.train.config import TrainConfigError, load_config
from onepass.train.sequence_parallel import sequence_parallel_size
from onepass.train.run.loop import train

from float64_train import float64_load_model
from ranks import fsdp_refused, rank_env as env, run_ranks
from strategies import synthetic_conversations

CONFIGS = Path(__file__).parents[2] / "configs"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
ACCELERATE = [sys.executable, "-m", "accelerate.commands.launch"]
SCRIPT = str(Path(__file__).parents[1] / "float64_train.py")  # onepass.train.cli with float64 norms, routers, kernels
TOL = 1e-9

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "chats.jsonl"
    path.write_text("\n".join(json.dumps(c) for c in synthetic_conversations(8)) + "\n")
    return path


def rel(a, b):
    return abs(a - b) / max(abs(a), abs(b), 1e-300)


def settings(arch, extra):
    return dict(tiny=arch, dtype="float64", max_steps=3, learning_rate=3e-3, seed=0, device="cpu", progress=False,
                **extra)


def flags(values):
    out = []
    for key, value in values.items():
        flag = "--" + key.replace("_", "-")
        out += [flag] if value is True else [f"--no-{flag[2:]}"] if value is False else [flag, str(value)]
    return out


def one_process(tmp_path, chats, arch, extra, monkeypatch):
    import onepass.train.run.loop as loop_module

    monkeypatch.setattr(loop_module, "load_model", float64_load_model(loop_module.load_model))
    return train(load_config(None, dict(data=str(chats), output_dir=str(tmp_path / "one"), **settings(arch, extra))),
                 log=lambda _m: None)


def launch(tmp_path, chats, arch, extra, *, launcher, processes, sp_size):
    out = tmp_path / "split"
    values = dict(settings(arch, extra), data=str(chats), output_dir=str(out))
    if launcher == "torchrun":
        cmd = [*TORCHRUN, "--nproc_per_node", str(processes), SCRIPT, *flags(values), "--sp-size", str(sp_size)]
    else:  # the shipped accelerate config: FSDP2, parallelism_config_sp_size 2 over 4 processes
        cmd = [*ACCELERATE, "--config_file", str(CONFIGS / "accelerate-fsdp-sp-cpu.yaml"), SCRIPT, *flags(values)]
    proc = run_ranks(cmd, env(), timeout=900)
    return out, proc


def assert_same_run(one, out, proc, *, arch, world, sp_size, mode):
    from safetensors.torch import load_file

    assert proc.returncode == 0, proc.stderr[-6000:]
    first = proc.stderr.lstrip().splitlines()[0]
    assert first.startswith(f"parallelism: {mode} over {world} processes (gloo) on cpu, sequence parallel {sp_size} "
                            f"x data parallel {world // sp_size}"), first
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["distributed"]["sp_size"] == sp_size and metrics["distributed"]["world_size"] == world
    assert metrics["sequence_parallel"]["sp_size"] == sp_size and metrics["config"]["sp_size"] == sp_size
    if one.eval_loss is not None:  # the held-out loss, each row split over the ranks too
        assert rel(one.eval_loss, metrics["eval_loss"]) <= TOL, (one.eval_loss, metrics["eval_loss"])
    split = [h["loss"] for h in metrics["history"]]
    assert len(split) == len(one.losses) == 3
    assert max(rel(a, b) for a, b in zip(one.losses, split)) <= TOL, (arch, one.losses, split)
    assert [h["tokens"] for h in metrics["history"]] == [h["tokens"] for h in
                                                          json.loads(one.metrics_path.read_text())["history"]]
    lora = (one.final_dir / "adapter_model.safetensors").exists()
    name = "adapter_model.safetensors" if lora else "model.safetensors"
    w1, w2 = load_file(str(one.final_dir / name)), load_file(str(out / "final" / name))
    assert w1.keys() == w2.keys() and len(w1) > 0
    worst = max(w1, key=lambda k: float((w1[k] - w2[k]).norm()) / max(float(w1[k].norm()), 1e-300))
    assert float((w1[worst] - w2[worst]).norm()) <= TOL * float(w1[worst].norm()), (arch, worst)
    assert all(w.dtype == torch.float64 for w in w2.values())


LORA = dict(finetune="lora", lora_r=4, lora_dropout=0.0, gradient_checkpointing=True)

RUNS = [  # (arch, extra settings, launcher, processes, sp_size)
    ("qwen3", dict(per_device_train_batch_size=2, eval_data="CHATS"), "torchrun", 2, 2),  # dense, DDP, eval loss
    ("gpt-oss", dict(LORA, per_device_train_batch_size=2), "torchrun", 2, 2),  # windows, sinks, MoE; LoRA, checkpoints
    ("qwen3.5", dict(per_device_train_batch_size=2), "torchrun", 2, 2),  # hybrid: Gated DeltaNet
    ("deepseek-v3", dict(per_device_train_batch_size=2), "torchrun", 4, 4),  # MoE, latent attention, 4 ranks
    ("nemotron-h", dict(per_device_train_batch_size=2, gradient_checkpointing=True), "torchrun", 4, 4),  # Mamba2;
    # 2 key/value heads over 4 ranks: each repeated twice
    ("qwen3", dict(per_device_train_batch_size=1), "accelerate", 4, 2),  # FSDP2 on a 2 x 2 (dp x sp) mesh
]


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("arch, extra, launcher, processes, sp_size", RUNS,
                         ids=[f"{r[0]}-{r[2]}-{r[3]}ranks-sp{r[4]}" for r in RUNS])
def test_split_rows_take_the_steps_of_one_process(tmp_path, chats, monkeypatch, arch, extra, launcher, processes,
                                                  sp_size):
    # one process, same global batch: per_device x dp groups (the accelerate run: 1 x 2 groups)
    extra = {k: str(chats) if v == "CHATS" else v for k, v in extra.items()}
    reference = dict(extra, per_device_train_batch_size=extra["per_device_train_batch_size"] * processes // sp_size)
    one = one_process(tmp_path, chats, arch, reference, monkeypatch)
    out, proc = launch(tmp_path, chats, arch, extra, launcher=launcher, processes=processes, sp_size=sp_size)
    if launcher == "accelerate" and fsdp_refused(proc):  # an accelerate older than FSDP on CPU ranks (test-min)
        return
    assert_same_run(one, out, proc, arch=arch, world=processes, sp_size=sp_size,
                    mode="FSDP2" if launcher == "accelerate" else "DDP")


# ---------------------------------------------------------------------------------------------
# what cannot run as asked: one line each, before any work


PC = {"ACCELERATE_USE_PARALLELISM_CONFIG": "true"}


@pytest.mark.parametrize("sp_size, environ, error", [
    (2, {}, "sp_size 2 splits each row over 2 processes, but this is one process: launch with torchrun"),
    (3, {"WORLD_SIZE": "4"}, "sp_size 3 does not divide the 4 processes"),
    (2, {**PC, "PARALLELISM_CONFIG_SP_SIZE": "4", "WORLD_SIZE": "4"},
     "sp_size 2 and the accelerate config's parallelism_config_sp_size 4 differ"),
    (1, {**PC, "PARALLELISM_CONFIG_CP_SIZE": "2", "WORLD_SIZE": "2"}, "parallelism_config_cp_size 2: onepass runs "
                                                                        "data x sequence parallelism only"),
    (1, {**PC, "PARALLELISM_CONFIG_SP_SIZE": "2", "ACCELERATE_USE_DEEPSPEED": "true", "WORLD_SIZE": "2"},
     "under DeepSpeed runs its ALST/Ulysses, which drops the attention mask"),
    (1, {**PC, "PARALLELISM_CONFIG_SP_SIZE": "2", "PARALLELISM_CONFIG_DP_SHARD_SIZE": "4", "WORLD_SIZE": "4"},
     "parallelism_config sizes give 4 x 2 processes but 4 run"),
])
def test_a_degree_that_cannot_run_as_asked_is_refused_in_one_line(sp_size, environ, error):
    with pytest.raises(TrainConfigError, match=error) as e:
        sequence_parallel_size(sp_size, environ)
    assert "\n" not in str(e.value)


def test_the_accelerate_request_is_the_degree_in_effect():
    assert sequence_parallel_size(1, {}) == 1
    assert sequence_parallel_size(2, {"WORLD_SIZE": "4"}) == 2
    asked = {**PC, "PARALLELISM_CONFIG_SP_SIZE": "2", "PARALLELISM_CONFIG_DP_SHARD_SIZE": "2", "WORLD_SIZE": "4"}
    assert sequence_parallel_size(1, asked) == 2 and sequence_parallel_size(2, asked) == 2
    assert sequence_parallel_size(1, {"PARALLELISM_CONFIG_SP_SIZE": "2", "WORLD_SIZE": "2"}) == 1  # not exported


def test_a_one_process_run_asked_for_sequence_parallelism_stops_before_any_work(tmp_path, chats):
    with pytest.raises(TrainConfigError, match="sp_size 2 splits each row over 2 processes, but this is one process"):
        train(load_config(None, dict(data=str(chats), output_dir=str(tmp_path / "x"), **settings("qwen3", {}),
                                     sp_size=2)))
    assert not (tmp_path / "x").exists()


def test_sp_size_is_a_flag_a_key_and_validated(tmp_path):
    from onepass.train.cli import main

    assert load_config(None, dict(tiny="qwen3", data="x", sp_size=4)).sp_size == 4
    with pytest.raises(TrainConfigError, match="sp_size must be >= 1, got 0"):
        load_config(None, dict(tiny="qwen3", data="x", sp_size=0))
    assert main(["--tiny", "qwen3", "--data", "builtin:mathchat", "--sp-size", "2", "--output-dir",
                 str(tmp_path / "run")]) == 2  # one line, exit 2: one process


def test_onepass_trainer_asked_for_sequence_parallelism_in_one_process_stops_in_one_line(tmp_path, monkeypatch):
    """OnePassConfig(sp_size=N) or an accelerate config's parallelism_config_sp_size splits rows over N processes;
    in one process that is one line, as for onepass train. HF's own parallelism_config sp_size would hand the
    degree to DeepSpeed's ALST (no tree mask): one line naming onepass's setting."""
    import datasets

    from onepass.model.tiny import tiny_model
    from onepass.train import OnePassConfig, OnePassTrainer

    rows = datasets.Dataset.from_list([{"input_ids": [1, 2, 3], "position_ids": [0, 1, 2], "kv_end": [3, 3, 3],
                                        "targets": [2, 3, -100], "weights": [1.0, 1.0, 0.0]}])
    model = tiny_model("qwen3", 100, dtype=torch.float64, attn_implementation="sdpa")
    with pytest.raises(TrainConfigError, match="^sp_size must be >= 1, got 0$"):
        OnePassTrainer(model=model, args=OnePassConfig(str(tmp_path), use_cpu=True, report_to="none", sp_size=0),
                       train_dataset=rows)
    with pytest.raises(TrainConfigError, match="^sp_size 2 splits each row over 2 processes, but this is one process"):
        OnePassTrainer(model=model, args=OnePassConfig(str(tmp_path), use_cpu=True, report_to="none", sp_size=2),
                       train_dataset=rows)
    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")  # the same asked by an accelerate config
    monkeypatch.setenv("PARALLELISM_CONFIG_SP_SIZE", "4")
    with pytest.raises(TrainConfigError, match="^sp_size 4 splits each row over 4 processes, but this is one process"):
        OnePassTrainer(model=model, args=OnePassConfig(str(tmp_path), use_cpu=True, report_to="none"),
                       train_dataset=rows)
    monkeypatch.delenv("ACCELERATE_USE_PARALLELISM_CONFIG")
    # an accelerate before ParallelismConfig (1.4, make test-min) cannot ask for it this way at all
    ParallelismConfig = pytest.importorskip("accelerate.parallelism_config",  # noqa: N806 - a class
                                            reason="absent: this accelerate has no ParallelismConfig").ParallelismConfig
    args = OnePassConfig(str(tmp_path), use_cpu=True, report_to="none", parallelism_config=ParallelismConfig(sp_size=2))
    with pytest.raises(TrainConfigError, match=r"^OnePassTrainer splits rows over processes itself: set sp_size=2 "):
        OnePassTrainer(model=model, args=args, train_dataset=rows)


# ---------------------------------------------------------------------------------------------
# OnePassTrainer: the same split, through HF's Trainer


def branching_rows(num, vocab, seed=0):
    """``num`` tree rows of 30-60 tokens: a shared history and two turns branching off it (chains and segments
    cross the shard boundary of 2 ranks)."""
    import numpy as np

    from onepass.layout.tree import build_layout
    from onepass.layout.view import View

    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(num):
        history, a, b = (rng.integers(1, vocab, n) for n in rng.integers(8, 20, 3))
        rows.append(build_layout([View(tokens=np.concatenate([history, a]), num_prompt=len(history), turn=0),
                                  View(tokens=np.concatenate([history, b]), num_prompt=len(history) - 2, turn=1)]))
    return rows


@pytest.mark.multiprocess
@pytest.mark.slow
def test_onepass_trainer_split_over_two_ranks_takes_the_steps_of_one_process(tmp_path):
    """OnePassConfig(sp_size=2) on 2 gloo ranks (each row split over both: one data-parallel group, so the same
    global batch of 2 rows) against one process, float64: the logged losses of 3 steps and the final weights."""
    from onepass.train.trainer.data import rows_dataset

    from ranks import rank_env

    vocab = 64
    data = tmp_path / "rows"
    rows_dataset(branching_rows(4, vocab)).save_to_disk(str(data))
    script = str(Path(__file__).parent / "trainer" / "hf_trainer_script.py")
    env = rank_env()
    one = run_ranks([sys.executable, script, str(data), str(tmp_path / "one"), "2", str(vocab)], env, timeout=300)
    assert one.returncode == 0, one.stderr[-3000:]
    two = run_ranks([*TORCHRUN, "--nproc_per_node", "2", script, str(data), str(tmp_path / "two"), "2", str(vocab),
                     "", "2"], env, timeout=400)
    assert two.returncode == 0, two.stderr[-6000:]
    a, b = (json.loads((tmp_path / side / "result.json").read_text()) for side in ("one", "two"))
    assert b["distributed"]["sp_size"] == 2 and b["world_size"] == 2 and a["sequence_parallel"] is None
    assert b["sequence_parallel"]["checked"] and b["sequence_parallel"]["sp_size"] == 2
    assert len(a["losses"]) == len(b["losses"]) == 3
    assert max(rel(x, y) for x, y in zip(a["losses"], b["losses"])) <= TOL, (a["losses"], b["losses"])
    assert rel(a["weight_norm"], b["weight_norm"]) <= 1e-12 and a["weight_norm"] != a["initial_weight_norm"]
