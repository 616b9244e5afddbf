"""Several processes: what the launcher asks for is what runs, and FSDP2 on 2 CPU ranks equals one process.

The two-rank runs go through ``accelerate launch`` with the shipped
``configs/accelerate-fsdp-cpu.yaml`` (gloo), as a user would start them; the
one-process reference runs in this process on the same global batch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from onepass.train.config import TrainConfigError, load_config
from onepass.train.distributed import accelerate_predates_fsdp, asked_mode, check_launch
from onepass.train.run.loop import train

from ranks import fsdp_refused, rank_env as env, run_ranks
from strategies import synthetic_conversations

CONFIGS = Path(__file__).parents[2] / "configs"
ACCELERATE = [sys.executable, "-m", "accelerate.commands.launch"]

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "chats.jsonl"
    path.write_text("\n".join(json.dumps(c) for c in synthetic_conversations(12)) + "\n")
    return path


def rel(a, b):
    return abs(a - b) / max(abs(a), abs(b), 1e-300)


def test_the_mode_asked_for_is_read_from_the_launchers_environment():
    assert asked_mode({}) == "single"
    assert asked_mode({"WORLD_SIZE": "2"}) == "ddp"
    assert asked_mode({"WORLD_SIZE": "2", "ACCELERATE_USE_FSDP": "true"}) == "fsdp"
    assert asked_mode({"WORLD_SIZE": "2", "ACCELERATE_USE_DEEPSPEED": "True"}) == "deepspeed"
    assert asked_mode({"WORLD_SIZE": "1", "ACCELERATE_USE_FSDP": "false"}) == "single"


def test_accelerate_cpu_launch_of_several_processes_is_refused(tmp_path):
    """accelerate's --cpu launcher starts one process whatever --num_processes says: an error, not a quiet run."""
    cpu = {"ACCELERATE_USE_CPU": "True"}
    argv = ["/x/bin/accelerate", "launch", "--num_processes", "2", "--cpu", "-m", "onepass.train.cli", "--tiny", "q"]
    with pytest.raises(TrainConfigError, match="asked for 2 processes with --cpu .* starts one"):
        check_launch(cpu, argv)
    config = tmp_path / "multi-cpu.yaml"
    config.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_CPU\nnum_processes: 3\n"
                      "use_cpu: true\nmixed_precision: 'no'\n")
    with pytest.raises(TrainConfigError, match="asked for 3 processes"):
        check_launch(cpu, ["accelerate", "launch", "--config_file", str(config), "script.py"])
    with pytest.raises(TrainConfigError, match="asked for 2 processes"):
        check_launch(cpu, ["/x/python", "-m", "accelerate.commands.launch", "--cpu", "--num_processes=2", "s.py"])
    check_launch(cpu, ["accelerate", "launch", "--num_processes", "1", "--cpu", "script.py"])  # one asked, one ran
    check_launch({**cpu, "WORLD_SIZE": "2"}, argv)  # a launcher that did start the ranks
    check_launch({}, argv)  # not started by accelerate


def test_an_fsdp_request_that_would_run_something_else_is_an_error(monkeypatch, tmp_path):
    """One process with accelerate's FSDP variables set runs no FSDP: refused in one line."""
    from accelerate.state import AcceleratorState

    from onepass.train.distributed import make_accelerator

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    AcceleratorState._reset_state(True)
    try:
        expected = ("needs accelerate>=" if accelerate_predates_fsdp()  # refused before it is made (test-min)
                    else "asked for fsdp but this process would run single over 1")
        with pytest.raises(TrainConfigError, match=expected):
            make_accelerator(cpu=True, mixed_precision="no")
    finally:
        AcceleratorState._reset_state(True)


def test_a_single_process_run_says_so(tmp_path, chats):
    lines = []
    result = train(load_config(None, dict(tiny="qwen3", data=str(chats), max_steps=1, progress=False,
                                          save_model=False, output_dir=str(tmp_path / "one"))), log=lines.append)
    assert lines[0] == "parallelism: one process on cpu"
    metrics = json.loads(result.metrics_path.read_text())
    assert metrics["distributed"] == {"mode": "single", "world_size": 1, "backend": None, "device": "cpu",
                                      "fsdp_version": None, "launcher": "none", "sp_size": 1}


@pytest.mark.multiprocess
def test_accelerate_launch_cpu_with_two_processes_stops_in_one_line(tmp_path, chats):
    cmd = [*ACCELERATE, "--num_processes", "2", "--cpu", "-m", "onepass.train.cli", "--tiny", "qwen3",
           "--data", str(chats), "--max-steps", "1", "--output-dir", str(tmp_path / "run"), "--no-progress"]
    proc = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "onepass: error: accelerate launch was asked for 2 processes with --cpu" in proc.stderr
    assert "onepass.train" not in proc.stderr.split("onepass: error:")[0]  # no traceback of ours before the line
    assert not (tmp_path / "run").exists()


_TWICE = """
import sys
from onepass.train.cli import main
first = main([*sys.argv[2:], "--output-dir", sys.argv[1] + "/first"])
print("FIRST", first, file=sys.stderr, flush=True)
sys.exit(main([*sys.argv[2:], "--output-dir", sys.argv[1] + "/second"]))
"""


@pytest.mark.multiprocess
def test_a_second_run_in_a_launch_whose_group_has_ended_is_one_line(tmp_path, chats):
    """`onepass train` ends its launch's process group when it returns (shutdown); a second run in the same
    ranks used to die in its first collective with a traceback ("Default process group has not been
    initialized": accelerate takes the ended group for started). Now: one line, before any work."""
    (tmp_path / "twice.py").write_text(_TWICE)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(tmp_path / "twice.py"), str(tmp_path), "--tiny", "qwen3", "--data", str(chats), "--max-steps", "1",
           "--device", "cpu", "--no-progress", "--no-save-model"]
    proc = run_ranks(cmd, env(), timeout=300)
    assert proc.returncode != 0 and proc.stderr.count("FIRST 0") == 2, proc.stderr[-3000:]
    assert "onepass: error: this process already ended its launch's process group" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "second").exists()


def fsdp_two_ranks(tmp_path, chats, name, steps, extra, *, launcher=False):
    out = tmp_path / name
    cmd = [*ACCELERATE, "--config_file", str(CONFIGS / "accelerate-fsdp-cpu.yaml"), "-m", "onepass.train.cli",
           "--tiny", "qwen3", "--data", str(chats), "--dtype", "float64", "--per-device-train-batch-size", "1",
           "--max-steps", str(steps), "--learning-rate", "3e-3", "--seed", "0", "--device", "cpu",
           "--output-dir", str(out), "--no-progress", *extra]
    proc = run_ranks(cmd, env(), timeout=400, launcher=launcher)
    if fsdp_refused(proc):
        return None, proc
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert proc.stderr.lstrip().startswith("parallelism: FSDP2 over 2 processes (gloo) on cpu, launched by accelerate")
    assert "Reducer" not in proc.stderr and "DistributedDataParallel" not in proc.stderr  # no DDP underneath
    return out, proc


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("finetune", ["full", "lora"])
def test_fsdp_on_two_cpu_ranks_takes_the_steps_of_one_process(tmp_path, chats, finetune):
    """Tree layout, chunked head (the default), float64; LoRA with gradient checkpointing."""
    from safetensors.torch import load_file

    steps = 3
    lora = dict(finetune="lora", lora_r=4, lora_dropout=0.0, gradient_checkpointing=True) if finetune == "lora" else {}
    flags = ["--finetune", "lora", "--lora-r", "4", "--lora-dropout", "0", "--gradient-checkpointing"] if lora else []
    one = train(load_config(None, dict(tiny="qwen3", data=str(chats), dtype="float64", per_device_train_batch_size=2,
                                       max_steps=steps, learning_rate=3e-3, seed=0, progress=False,
                                       output_dir=str(tmp_path / "one"), **lora)), log=lambda _m: None)
    # full: accelerate's own launcher, as a user runs it; lora: its ranks started warm (tests/ranks.py)
    out, _ = fsdp_two_ranks(tmp_path, chats, "two", steps, flags, launcher=finetune == "full")
    if out is None:  # refused in one line by an accelerate older than FSDP_ACCELERATE (make test-min)
        return
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["distributed"] == {"mode": "fsdp", "world_size": 2, "backend": "gloo", "device": "cpu",
                                      "fsdp_version": 2, "launcher": "accelerate", "sp_size": 1}
    assert metrics["schedule"] == "one-pass" and metrics["units_per_step"] == 2
    two = [h["loss"] for h in metrics["history"]]
    assert len(two) == len(one.losses) == steps
    assert max(rel(a, b) for a, b in zip(one.losses, two)) <= 1e-12, (one.losses, two)
    assert (out / "checkpoints" / f"step-{steps:06d}" / "accelerate").is_dir()  # saved sharded, through accelerate
    name = "adapter_model.safetensors" if lora else "model.safetensors"
    w1, w2 = load_file(str(one.final_dir / name)), load_file(str(out / "final" / name))
    assert w1.keys() == w2.keys() and len(w1) > 0
    moved = [k for k in w1 if "lora_B" in k] if lora else list(w1)
    assert any(float(w1[k].norm()) > 0 for k in moved)
    for k in w1:
        assert float((w1[k] - w2[k]).norm()) <= 1e-12 * max(float(w1[k].norm()), 1.0), k
    assert all(w.dtype == torch.float64 for w in w2.values())


# ---------------------------------------------------------------------------------------------
# shipped configs, checked against the libraries' own schemas (no GPU needed)


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIGS.glob("accelerate-*.yaml")))
def test_shipped_accelerate_configs_pass_accelerates_schema(name):
    from onepass.train.distributed import FSDP_ACCELERATE, check_accelerate_config

    try:
        cluster = check_accelerate_config(CONFIGS / name)
    except TrainConfigError as e:  # an older accelerate (make test-min) may not know FSDP2's keys: then say so
        assert accelerate_predates_fsdp(), e
        assert f"the shipped configs are for accelerate>={FSDP_ACCELERATE}" in str(e)
        return
    assert cluster.num_processes >= 2


@pytest.mark.parametrize("edit, error", [
    (("fsdp_config:\n  fsdp_version: 2", "fsdp_config:\n  fsdp_version: 2\n  fsdp_reshard_after_forwad: true"),
     "fsdp_config has key.* accelerate launch does not know: fsdp_reshard_after_forwad"),
    (("distributed_type: FSDP", "distributed_type: FSDP\nnum_proceses: 2"), "unknown keys"),
    (("fsdp_state_dict_type: SHARDED_STATE_DICT", "fsdp_state_dict_type: SHARDED"), "fsdp_config"),
])
def test_a_misspelled_accelerate_config_key_or_value_is_refused(tmp_path, edit, error):
    from onepass.train.distributed import check_accelerate_config

    text = (CONFIGS / "accelerate-fsdp-cpu.yaml").read_text()
    assert edit[0] in text
    bad = tmp_path / "bad.yaml"
    bad.write_text(text.replace(edit[0], edit[1]))
    with pytest.raises(TrainConfigError, match=error):
        check_accelerate_config(bad)


def test_qlora_quantization_config_is_built_and_checked_on_cpu():
    from onepass.train.run.model import quantization_config, qlora_settings

    config = load_config(None, dict(model="x", data="x", finetune="qlora", dtype="bfloat16"))
    built = quantization_config(config)
    assert built.load_in_4bit and built.bnb_4bit_quant_type == "nf4" and built.bnb_4bit_use_double_quant
    assert built.bnb_4bit_compute_dtype == torch.bfloat16
    with pytest.raises(TrainConfigError, match="BitsAndBytesConfig takes no bnb_4bit_quant_typ"):
        quantization_config(config, {**qlora_settings(config), "bnb_4bit_quant_typ": "nf4"})
    with pytest.raises(TrainConfigError, match="bnb_4bit_quant_type 'nf5'"):
        quantization_config(config, {**qlora_settings(config), "bnb_4bit_quant_type": "nf5"})


def test_eight_bit_optimizer_names_are_transformers_names_and_bitsandbytes_classes():
    from transformers.training_args import OptimizerNames

    from onepass.train.config import OPTIMIZERS
    from onepass.train.run.optimizer import BNB_OPTIMIZERS

    assert sorted(BNB_OPTIMIZERS) == sorted(o for o in OPTIMIZERS if o.endswith("8bit"))
    assert set(BNB_OPTIMIZERS) <= {o.value for o in OptimizerNames}  # what TrainingArguments(optim=...) takes
    bnb = pytest.importorskip("bitsandbytes", reason="bitsandbytes not installed: class names unchecked")
    for cls in BNB_OPTIMIZERS.values():
        assert isinstance(getattr(bnb.optim, cls), type), cls


@pytest.mark.multiprocess
def test_a_launch_that_hangs_fails_with_every_process_stack_and_leaves_none_behind(tmp_path):
    """tests/ranks.py: what replaced the retries; a hung rank is killed with its stack, not retried beside."""
    pid_file = tmp_path / "child.pid"
    code = ("import subprocess, sys, time; "
            "c = subprocess.Popen([sys.executable, '-c', 'import time\\ndef waiting_rank():\\n time.sleep(600)\\n"
            "waiting_rank()']); "
            f"open({str(pid_file)!r}, 'w').write(str(c.pid)); time.sleep(600)")
    with pytest.raises(AssertionError, match="did not finish in 3 s") as caught:
        run_ranks([sys.executable, "-c", code], dict(os.environ), timeout=3)
    assert "waiting_rank" in str(caught.value)  # the child's Python stack, from faulthandler on SIGABRT
    child = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):  # killed with the launch (reaped by init: give it 5 s)
        for _ in range(50):
            os.kill(child, 0)
            time.sleep(0.1)


def test_fsdp_on_cpu_refuses_an_accelerate_older_than_its_floor():
    """accelerate 1.4-1.13 fail FSDP on CPU ranks deep in a step (1.13: 'aten.mm.default got mixed torch.Tensor
    and DTensor'; measured with make test-min); onepass stops first, in one line."""
    from onepass.train.distributed import FSDP_ACCELERATE, check_fsdp_accelerate

    with pytest.raises(TrainConfigError, match=r"FSDP on CPU ranks needs accelerate>=1\.14 \(installed: 1\.13\.0\)"):
        check_fsdp_accelerate("1.13.0")
    check_fsdp_accelerate(FSDP_ACCELERATE)


def test_a_stream_refuses_an_accelerate_older_than_its_floor(monkeypatch, qwen3_tokenizer, tmp_path):
    """accelerate before 1.13 dispatches a stream's batches by concatenating every field as a tensor and dies on
    the rows' host copy (make test-min's floor, 1.4): OnePassTrainer refuses the stream in one line when it is
    made (276772d: the first step died inside accelerate), map-style data is untouched."""
    import accelerate
    import datasets

    from onepass.model.tiny import tiny_model
    from onepass.train import OnePassConfig, OnePassTrainer
    from onepass.train.distributed import STREAM_ACCELERATE, check_stream_accelerate

    with pytest.raises(TrainConfigError, match=r"^a streamed dataset needs accelerate>=1\.13 \(installed: 1\.12\.0\)"):
        check_stream_accelerate("1.12.0")
    check_stream_accelerate(STREAM_ACCELERATE)
    monkeypatch.setattr(accelerate, "__version__", "1.12.0")
    records = [{"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4."}]}] * 2
    args = OnePassConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, max_steps=1)
    model = tiny_model("qwen3", vocab_size=len(qwen3_tokenizer))
    with pytest.raises(TrainConfigError, match="^a streamed dataset needs accelerate>="):
        OnePassTrainer(model=model, args=args, processing_class=qwen3_tokenizer,
                       train_dataset=datasets.Dataset.from_list(records).to_iterable_dataset())
    with pytest.raises(TrainConfigError, match="^a streamed dataset needs accelerate>="):
        OnePassTrainer(model=model, args=args, processing_class=qwen3_tokenizer, train_dataset=datasets.Dataset.from_list(records),
                       eval_dataset={"held": datasets.Dataset.from_list(records).to_iterable_dataset()})
    OnePassTrainer(model=model, args=args, processing_class=qwen3_tokenizer,
                   train_dataset=datasets.Dataset.from_list(records))
