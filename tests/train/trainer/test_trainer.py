"""OnePassTrainer: HF's Trainer with the one-pass loss takes the same steps as N-pass.

The conversations are the small synthetic reasoning set of test_train (real
Qwen3 template and vocabulary, ids compacted to those that occur), so a float64
step of a tiny Qwen3 costs milliseconds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from onepass.conversation.parse import parse_record
from onepass.train.trainer.trainer import OnePassCollator, OnePassTrainer, conversation_dataset, rows_dataset
from onepass.train.distributed import STREAM_ACCELERATE, accelerate_older_than
from onepass.loss import view_loss_reference
from onepass.model.precision import float64_norms
from onepass.render import render_views
from onepass.model.tiny import tiny_model
from onepass.layout.tree import IGNORE, Layout

from ranks import fsdp_refused, run_ranks
from strategies import synthetic_conversations
import warm

HERE = Path(__file__).parent


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models run fastest on one thread


@pytest.fixture(scope="module")
def convs():
    return [parse_record(c, index=i) for i, c in enumerate(synthetic_conversations(8))]


def compact(*datasets):
    """Renumber the ids that occur in any of ``datasets`` to 0..V-1 (the same map for all)."""
    ids = np.unique(np.concatenate([np.concatenate([np.asarray(x) for x in d["input_ids"]] +
                                                   [np.asarray(t)[np.asarray(t) != IGNORE] for t in d["targets"]])
                                    for d in datasets]))

    def remap(item):
        t = np.asarray(item["targets"])
        return {"input_ids": np.searchsorted(ids, item["input_ids"]),
                "targets": np.where(t == IGNORE, IGNORE, np.searchsorted(ids, np.where(t == IGNORE, ids[0], t)))}

    return [d.map(remap) for d in datasets], ids


@pytest.fixture(scope="module")
def datasets_(convs, qwen3_tokenizer):
    one = conversation_dataset(convs, qwen3_tokenizer, schedule="one-pass")
    n = conversation_dataset(convs, qwen3_tokenizer, schedule="n-pass")
    (one, n), ids = compact(one, n)
    return one, n, ids


def make_model(vocab):
    model = tiny_model("qwen3", vocab, dtype=torch.float64, attn_implementation="sdpa")
    assert float64_norms(model)[0] > 0
    return model.train()


def make_trainer(tmp_path, model, train, **overrides):
    from transformers import TrainingArguments

    values = dict(output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=1,
                  learning_rate=3e-3, max_steps=4, logging_steps=1, save_strategy="no", report_to=[],
                  seed=0, data_seed=0, use_cpu=True, disable_tqdm=True, lr_scheduler_type="constant",
                  dataloader_num_workers=0)
    values.update(overrides)
    return OnePassTrainer(model=model, args=TrainingArguments(**values), train_dataset=train)


def rel(a, b):
    return abs(a - b) / max(abs(a), abs(b), 1e-30)


def step_losses(trainer):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def test_a_dataset_item_is_one_conversation_and_keeps_every_trained_token(datasets_, convs):
    one, n, _ = datasets_
    assert len(one) == len(n) == len(convs)
    for a, b in zip(one, n):
        # the weight sum of a conversation is its N-pass count of trained tokens in both schedules
        assert sum(a["weights"]) == sum(b["weights"]) == sum(np.asarray(b["targets"]) != IGNORE)
        assert len(a["input_ids"]) <= len(b["input_ids"])


@pytest.mark.parametrize("weighting", ["token", "turn"])
def test_compute_loss_is_the_n_pass_mean_over_the_whole_step(tmp_path, convs, qwen3_tokenizer, weighting):
    """Two micro-batches normalised by the weight sum of both = the N-pass weighted mean over all views."""
    from onepass.layout.schedule import view_weights
    from onepass.layout.tree import build_layout
    from onepass.verify.check import compact_vocab

    views = [render_views(c, qwen3_tokenizer) for c in convs[:4]]
    views, vocab = compact_vocab(views)
    weights = [view_weights(vs, weighting) for vs in views]
    ds = rows_dataset([build_layout(vs, w) for vs, w in zip(views, weights)])
    model = make_model(vocab)
    trainer = make_trainer(tmp_path, model, ds)
    collate = OnePassCollator()
    batches = [collate([ds[0], ds[1]]), collate([ds[2], ds[3]])]
    total = trainer._get_num_items_in_batch(batches, torch.device("cpu"))
    expected = sum(w * (len(v.tokens) - max(v.num_prompt, 1))
                   for vs, ws in zip(views, weights) for v, w in zip(vs, ws))
    assert rel(float(total), expected) <= 1e-12
    with torch.no_grad():
        ours = sum(float(trainer.compute_loss(model, b, num_items_in_batch=total)) for b in batches)
        reference = sum(float(view_loss_reference(model, v, w)) for vs, ws in zip(views, weights)
                        for v, w in zip(vs, ws)) / expected
    assert rel(ours, reference) <= 1e-12


def test_one_pass_and_n_pass_take_the_same_steps_through_the_trainer(tmp_path, datasets_):
    one, n, ids = datasets_
    runs = {}
    for name, ds in (("one", one), ("n", n)):
        model = make_model(len(ids))
        trainer = make_trainer(tmp_path / name, model, ds, gradient_accumulation_steps=2, max_steps=4,
                               per_device_train_batch_size=1)
        trainer.train()
        runs[name] = (step_losses(trainer), {k: v.detach().clone() for k, v in model.state_dict().items()})
    (l1, w1), (ln, wn) = runs["one"], runs["n"]
    assert len(l1) == len(ln) == 4
    assert max(rel(a, b) for a, b in zip(l1, ln)) <= 1e-9
    moved = max(float((w1[k] - make_model(len(ids)).state_dict()[k]).norm()) for k in w1)
    assert moved > 1e-3  # the run trained
    for k in w1:
        assert float((w1[k] - wn[k]).norm()) <= 1e-9 * max(float(w1[k].norm()), 1.0), k


def test_gradient_accumulation_equals_one_bigger_batch(tmp_path, datasets_):
    one, _, ids = datasets_
    weights = []
    for bs, accum in ((4, 1), (2, 2), (1, 4)):
        model = make_model(len(ids))
        make_trainer(tmp_path / f"{bs}x{accum}", model, one, per_device_train_batch_size=bs,
                     gradient_accumulation_steps=accum, max_steps=2, optim="sgd").train()
        weights.append(model.state_dict())
    for w in weights[1:]:
        for k in w:
            assert float((w[k] - weights[0][k]).norm()) <= 1e-9 * max(float(w[k].norm()), 1.0), k


def test_evaluate_reports_the_weighted_mean(tmp_path, datasets_):
    one, n, ids = datasets_
    model = make_model(len(ids))
    trainer = make_trainer(tmp_path, model, one, per_device_eval_batch_size=len(one))
    a = trainer.evaluate(one)["eval_loss"]
    b = trainer.evaluate(n)["eval_loss"]
    assert rel(a, b) <= 1e-9


def test_items_without_row_columns_and_flash_attention_are_clear_errors(tmp_path, datasets_):
    one, _, ids = datasets_
    with pytest.raises(ValueError, match="item 0 has no position_ids, kv_end"):
        OnePassCollator()([{"input_ids": [1, 2]}])
    model = make_model(len(ids))
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="cannot apply a tree mask"):
        make_trainer(tmp_path, model, one)


def test_no_trainable_conversation_is_an_error_naming_the_skip(convs, qwen3_tokenizer):
    with pytest.raises(ValueError, match="record 0, message 1: view of .* longer than max_tokens=4"):
        conversation_dataset(convs, qwen3_tokenizer, max_tokens=4)


def test_cpu_fast_backend_serves_the_trainer(tmp_path, datasets_):
    from onepass.attention.backends import default_backend

    one, n, ids = datasets_
    backend = default_backend("cpu")
    losses = []
    for ds in (one, n):
        model = tiny_model("qwen3", len(ids), dtype=torch.float64, attn_implementation=backend).train()
        float64_norms(model)
        trainer = make_trainer(tmp_path / str(len(losses)), model, ds, max_steps=2)
        trainer.train()
        losses.append(step_losses(trainer))
    assert max(rel(a, b) for a, b in zip(*losses)) <= 1e-9


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, datasets_):
    """The one-process reference run of ``hf_trainer_script.py``, made once for the three two-rank runs held
    against it (the same data and arguments each time): ``(its output folder, the environment, a function of a
    test's folder giving the script's arguments for the two-rank run into it)``."""
    one, _, ids = datasets_
    root = tmp_path_factory.mktemp("one_process")
    data = root / "data"
    one.save_to_disk(str(data))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    script = str(HERE / "hf_trainer_script.py")
    single = warm.run([sys.executable, script, str(data), str(root / "one"), "2", str(len(ids))],
                      env=env, capture_output=True, text=True, timeout=300)
    assert single.returncode == 0, single.stderr[-3000:]
    return root / "one", env, lambda tmp_path: [script, str(data), str(tmp_path / "two"), "1", str(len(ids))]


def _results_match(one, tmp_path):
    """Both runs' results, after checking the two-rank run took the one-process run's steps."""
    a = json.loads((one / "result.json").read_text())
    b = json.loads((tmp_path / "two" / "result.json").read_text())
    assert len(a["losses"]) == len(b["losses"]) == 3
    assert max(rel(x, y) for x, y in zip(a["losses"], b["losses"])) <= 1e-9
    assert rel(a["weight_norm"], b["weight_norm"]) <= 1e-12
    assert a["weight_norm"] != a["initial_weight_norm"]
    return a, b


@pytest.mark.multiprocess
@pytest.mark.slow
def test_torchrun_two_processes_match_one(tmp_path, one_process):
    one, env, two_args = one_process
    args = two_args(tmp_path)
    # one try: a teardown abort or a hang is a failure, with every process's Python stacks (tests/ranks.py)
    two = run_ranks([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                     *args], env, timeout=300)
    assert two.returncode == 0, two.stderr[-6000:]
    a, b = _results_match(one, tmp_path)
    assert a["world_size"] == 1 and b["world_size"] == 2


@pytest.mark.multiprocess
@pytest.mark.skipif(accelerate_older_than(STREAM_ACCELERATE), reason=f"streams need accelerate>={STREAM_ACCELERATE}: "
                    "OnePassTrainer refuses them in one line below (test_a_stream_refuses_an_accelerate_older_...)")
def test_a_streamed_dataset_on_two_ranks_takes_the_steps_of_one_process(tmp_path, datasets_):
    """An IterableDataset under DDP: each rank reads its share of the stream (dispatch_batches=False, as TRL),
    so 2 ranks of batch 1 take the global batches of one process of batch 2, in order: the same 3 steps in
    float64. (accelerate's own dispatcher would gather the batches on rank 0 and fail on the rows' host copy:
    accelerate #4111, still so in 1.15.)"""
    one, _, ids = datasets_
    data = tmp_path / "data"
    one.save_to_disk(str(data))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    script = str(HERE / "hf_trainer_script.py")
    single = warm.run([sys.executable, script, str(data), str(tmp_path / "one"), "2", str(len(ids)), "", "1",
                       "stream"], env=env, capture_output=True, text=True, timeout=300)
    assert single.returncode == 0, single.stderr[-3000:]
    two = run_ranks([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", script,
                     str(data), str(tmp_path / "two"), "1", str(len(ids)), "", "1", "stream"], env, timeout=300)
    assert two.returncode == 0, two.stderr[-6000:]
    a, b = _results_match(tmp_path / "one", tmp_path)
    assert a["world_size"] == 1 and b["world_size"] == 2 and b["distributed"]["mode"] == "ddp"


_TWICE = """
import sys
sys.path.insert(0, sys.argv[1])
from hf_trainer_script import main
from onepass.train.distributed import shutdown
main(sys.argv[2], sys.argv[3] + "/first", 1, int(sys.argv[4]))
shutdown()
print("FIRST DONE", file=sys.stderr, flush=True)
main(sys.argv[2], sys.argv[3] + "/second", 1, int(sys.argv[4]))
"""


@pytest.mark.multiprocess
def test_a_second_trainer_after_the_group_has_ended_is_refused_before_any_work(tmp_path, datasets_):
    """OnePassTrainer after shutdown() in the same launch: the same one refusal as a second `onepass train`
    (tests/train/test_distributed.py), when HF's accelerator is made, not a failure in the first collective."""
    one, _, ids = datasets_
    data = tmp_path / "data"
    one.save_to_disk(str(data))
    (tmp_path / "twice.py").write_text(_TWICE)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    two = run_ranks([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                     str(tmp_path / "twice.py"), str(HERE), str(data), str(tmp_path), str(len(ids))], env, timeout=300)
    assert two.returncode != 0 and two.stderr.count("FIRST DONE") == 2, two.stderr[-3000:]
    assert "this process already ended its launch's process group" in two.stderr, two.stderr[-3000:]
    assert "Default process group has not been initialized" not in two.stderr
    assert (tmp_path / "first" / "result.json").exists() and not (tmp_path / "second").exists()


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("launch", ["accelerate-config", "torchrun-fsdp-args"])
def test_fsdp_on_two_cpu_ranks_matches_one_process(tmp_path, one_process, launch):
    """OnePassTrainer runs FSDP2 (not DDP) under accelerate launch with configs/accelerate-fsdp-cpu.yaml, and
    under torchrun with TrainingArguments(fsdp="full_shard auto_wrap")."""
    one, env, two_args = one_process
    args = two_args(tmp_path)
    config = Path(__file__).parents[3] / "configs" / "accelerate-fsdp-cpu.yaml"
    launcher = (["-m", "accelerate.commands.launch", "--config_file", str(config)] if launch == "accelerate-config"
                else ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"])
    fsdp = [] if launch == "accelerate-config" else ["full_shard auto_wrap"]
    two = run_ranks([sys.executable, *launcher, *args, *fsdp], env, timeout=400)
    if fsdp_refused(two):  # an accelerate older than onepass's FSDP-on-CPU floor (make test-min)
        return
    assert two.returncode == 0, two.stderr[-6000:]
    assert "Reducer" not in two.stderr and "DistributedDataParallel" not in two.stderr
    a, b = _results_match(one, tmp_path)
    assert a["distributed"]["mode"] == "single"
    assert b["distributed"] == {"mode": "fsdp", "world_size": 2, "backend": "gloo", "device": "cpu",
                                "fsdp_version": 2, "launcher": launch.split("-")[0], "sp_size": 1}


@pytest.mark.requires_cuda
def test_deepspeed_zero2_through_the_trainer_matches_plain(tmp_path, datasets_):
    pytest.importorskip("deepspeed")
    one, n, ids = datasets_
    config = Path(__file__).parents[3] / "configs" / "deepspeed-zero2.json"
    losses = []
    for ds in (one, n):
        model = tiny_model("qwen3", len(ids), dtype=torch.float32, attn_implementation="flex_attention",
                           device="cuda").train()
        trainer = make_trainer(tmp_path / str(len(losses)), model, ds, use_cpu=False, deepspeed=str(config),
                               max_steps=3)
        trainer.train()
        losses.append(step_losses(trainer))
    assert max(rel(a, b) for a, b in zip(*losses)) <= 1e-4


def test_trained_rows_equal_layouts(datasets_):
    """The collator turns dataset items back into the rows they were made of."""
    one, _, _ = datasets_
    batch = OnePassCollator()([one[0]])
    row = Layout(**{k: np.asarray(one[0][k]) for k in ("input_ids", "position_ids", "kv_end", "targets", "weights")})
    assert torch.equal(batch["kv_end"][0], torch.as_tensor(row.kv_end))
    assert torch.equal(batch["targets"][0], torch.as_tensor(row.targets))


def test_lora_model_trains_through_the_trainer(tmp_path, datasets_):
    """A peft LoRA model (what most users fine-tune) takes the same steps under both schedules."""
    from peft import LoraConfig, get_peft_model

    one, n, ids = datasets_
    runs = []
    for ds in (one, n):
        torch.manual_seed(0)  # LoRA's A matrices are drawn from the global generator
        model = get_peft_model(make_model(len(ids)), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                                 lora_dropout=0.0),
                               autocast_adapter_dtype=False)  # keep the adapter float64 like the model
        trainer = make_trainer(tmp_path / str(len(runs)), model, ds, max_steps=3)
        trainer.train()
        runs.append((step_losses(trainer), {k: v.detach().clone() for k, v in model.named_parameters()
                                            if v.requires_grad}))
    (l1, w1), (ln, wn) = runs
    assert len(l1) == 3 and max(rel(a, b) for a, b in zip(l1, ln)) <= 1e-9, (l1, ln)
    assert any(float(w1[k].norm()) > 0 for k in w1 if "lora_B" in k)  # the adapter trained (B starts at 0)
    assert w1 and all(float((w1[k] - wn[k]).norm()) <= 1e-9 * max(float(w1[k].norm()), 1.0) for k in w1)
