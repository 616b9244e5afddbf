"""Sequence parallelism in one process: the all-to-all layout against slicing, then whole models split over
simulated ranks (threads) against one process, float64, loss and every gradient <= 1e-9 relative.

The multi-process runs (gloo ranks, training steps) are tests/train/test_sequence_parallel.py; these are
the same exchanges over :class:`onepass.parallel.comm.ThreadGroup`, fast enough for every architecture.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import numpy as np
import pytest
import torch

import onepass.mixers.tree as tree
from onepass.attention.cpu import register as register_onepass_cpu
from onepass.data.mathchat import load_sample
from onepass.loss import layouts_to_batch
from onepass.layout.pack import pack_layouts
from onepass.model.precision import float64_norms
from onepass.render import render_views
from onepass.layout.schedule import parse_schedule, schedule_views
from onepass.model.tiny import tiny_model
from onepass.parallel.comm import ThreadGroup, run_ranks
from onepass.parallel.forward import KWARG, take
from onepass.guard.sequence_parallel import split_loss_and_grads, whole_loss_and_grads
from onepass.verify.divergence import max_rel_grad_diff, rel_diff
from onepass.parallel.model import install, is_installed, layer_shapes, uninstall
from onepass.parallel.plan import SequenceParallelError, forward_volume, head_split, padded_length, shard_range
from onepass.verify.check import compact_vocab

pytestmark = pytest.mark.usefixtures("one_thread")
TOL = 1e-9


# ---------------------------------------------------------------------------------------------
# the plan


def test_heads_split_or_repeat_their_key_value_heads_or_are_refused_in_one_line():
    assert head_split(8, 8, 4).local_heads == 2 and head_split(8, 8, 4).local_kv_heads == 2
    assert head_split(8, 4, 2).kv_repeat == 1 and head_split(8, 4, 2).local_kv_heads == 2
    split = head_split(8, 2, 4)  # more ranks than key/value heads: each repeated twice, one per rank
    assert (split.kv_repeat, split.local_heads, split.local_kv_heads) == (2, 2, 1)
    assert head_split(8, 1, 8).kv_repeat == 8
    with pytest.raises(SequenceParallelError, match="sp_size 3 does not divide the 8 attention heads of Qwen3$"
                       .replace("$", ": each rank")):
        head_split(8, 8, 3, where="Qwen3")
    with pytest.raises(SequenceParallelError, match="sp_size 4 and the 6 key/value heads .* do not divide one another"):
        head_split(12, 6, 4)
    for bad in (head_split.__name__,):  # messages are one line
        assert "\n" not in bad


def test_a_row_is_padded_to_equal_contiguous_shards():
    assert padded_length(389, 4) == 392 and padded_length(8, 2) == 8
    assert [shard_range(392, 4, r) for r in range(4)] == [(0, 98), (98, 196), (196, 294), (294, 392)]


def test_rows_are_padded_as_layouts_to_batch_pads_them():
    """pad_batch (a collated batch to a multiple of the degree) == layouts_to_batch at that length."""
    from onepass.batch import HOST, HostRows
    from onepass.loss import pad_batch
    from onepass.layout.tree import row_from_columns

    rows = [row_from_columns({"input_ids": [5, 6, 7], "position_ids": [0, 1, 2], "kv_end": [3, 3, 3],
                              "targets": [6, 7, -100], "weights": [1.0, 1.0, 0.0]}),
            row_from_columns({"input_ids": [5, 9], "position_ids": [0, 1], "kv_end": [2, 2], "targets": [9, -100],
                              "weights": [1.0, 0.0]})]
    padded = pad_batch(layouts_to_batch(rows), 4)
    want = layouts_to_batch(rows, length=4)
    host, want_host = padded.pop(HOST), want.pop(HOST)  # the rows on the host are padded alike
    assert padded.keys() == want.keys() and all(torch.equal(padded[k], want[k]) for k in want)
    assert all(np.array_equal(getattr(host, f), getattr(want_host, f)) for f in HostRows.__dataclass_fields__)
    want[HOST] = want_host
    assert padded["kv_end"].tolist() == [[3, 3, 3, 4], [2, 2, 3, 4]]
    assert pad_batch(want, 2)["kv_end"] is want["kv_end"]  # already a multiple: unchanged


def test_the_first_log_line_says_the_degree_in_effect():
    from onepass.train.distributed import Distributed

    ddp = Distributed(mode="fsdp", world_size=4, backend="gloo", device="cpu", fsdp_version=2, launcher="accelerate",
                      sp_size=2)
    assert ddp.line() == ("parallelism: FSDP2 over 4 processes (gloo) on cpu, sequence parallel 2 x data parallel 2, "
                          "launched by accelerate")
    assert ddp.to_dict()["sp_size"] == 2
    one = Distributed(mode="single", world_size=1, backend=None, device="cpu")
    assert one.line() == "parallelism: one process on cpu" and one.to_dict()["sp_size"] == 1


# ---------------------------------------------------------------------------------------------
# the exchanges, against slicing the whole tensors (the slow reference)


def _grads_on_ranks(degree, inputs, op, weights):
    """Each simulated rank: out = op(shard, its input); loss = sum(out * its weight); returns (outs, grads)."""
    def rank(shard):
        x = inputs[shard.rank].clone().requires_grad_(True)
        out = op(shard, x)
        (g,) = torch.autograd.grad((out * weights[shard.rank]).sum(), [x])
        return out.detach(), g
    return run_ranks(degree, rank)


@pytest.mark.parametrize("degree", [2, 4])
def test_to_heads_gives_each_rank_every_position_of_its_heads(degree):
    gen = torch.Generator().manual_seed(degree)
    B, H, L, D = 2, 8, 12, 3
    x_BHLD = torch.randn(B, H, L, D, generator=gen, dtype=torch.float64)
    h = H // degree
    want = [x_BHLD[:, r * h:(r + 1) * h] for r in range(degree)]  # rank r: heads r, every position
    weights = [torch.randn(w.shape, generator=gen, dtype=torch.float64) for w in want]
    inputs = [x_BHLD.chunk(degree, dim=2)[r] for r in range(degree)]  # rank r holds its positions, every head
    got = _grads_on_ranks(degree, inputs, lambda shard, x: shard.to_heads(x), weights)
    # the gradient of sum_r <to_heads(x_r), w_r> with respect to the whole x: w_r in head slot r
    grad_BHLD = torch.cat(weights, dim=1)
    for r, (out, grad) in enumerate(got):
        assert torch.equal(out, want[r])
        assert torch.equal(grad, grad_BHLD.chunk(degree, dim=2)[r])


@pytest.mark.parametrize("degree", [2, 3])
def test_to_sequence_is_the_inverse_and_gather_sequence_an_all_gather(degree):
    gen = torch.Generator().manual_seed(degree)
    B, L, H, D = 1, 12, 6, 2
    out_BLHD = torch.randn(B, L, H, D, generator=gen, dtype=torch.float64)
    h = H // degree
    inputs = [out_BLHD[:, :, r * h:(r + 1) * h] for r in range(degree)]  # rank r: every position, its heads
    weights = [torch.randn(B, L // degree, H, D, generator=gen, dtype=torch.float64) for _ in range(degree)]
    got = _grads_on_ranks(degree, inputs, lambda shard, x: shard.to_sequence(x), weights)
    for r, (out, grad) in enumerate(got):
        assert torch.equal(out, out_BLHD.chunk(degree, dim=1)[r])
        assert torch.equal(grad, torch.cat(weights, dim=1)[:, :, r * h:(r + 1) * h])
    x_BLE = torch.randn(2, 3 * degree, 4, generator=gen, dtype=torch.float64)
    inputs = list(x_BLE.chunk(degree, dim=1))
    weights = [torch.randn(x_BLE.shape, generator=gen, dtype=torch.float64) for _ in range(degree)]
    got = _grads_on_ranks(degree, inputs, lambda shard, x: shard.gather_sequence(x), weights)
    for r, (out, grad) in enumerate(got):  # every rank sees the whole row; a shard's gradient sums every rank's
        assert torch.equal(out, x_BLE)
        assert torch.allclose(grad, sum(weights).chunk(degree, dim=1)[r], rtol=0, atol=1e-15)


def test_a_rank_that_fails_stops_the_others_with_its_error():
    def rank(shard):
        if shard.rank == 1:
            raise ValueError("rank 1 broke")
        return shard.gather_sequence(torch.zeros(1, 2))
    with pytest.raises(ValueError, match="rank 1 broke"):
        run_ranks(3, rank, timeout=30)


# ---------------------------------------------------------------------------------------------
# whole models: split over simulated ranks == one process


@pytest.fixture(scope="module")
def rows(qwen3_tokenizer):
    """Two MathChat conversations as one-pass trees (~370 tokens each), and the same packed into one row."""
    views, vocab = compact_vocab([render_views(c, qwen3_tokenizer) for c in load_sample(limit=2)])
    trees = [schedule_views(v, parse_schedule("one-pass")).layouts[0] for v in views]
    return trees, pack_layouts(trees, sum(len(t) for t in trees)), vocab


def exact_model(arch, vocab, backend):
    register_onepass_cpu()
    model = tiny_model(arch, vocab, dtype=torch.float64, attn_implementation=backend)
    float64_norms(model)
    return model


CASES = [  # (arch, backend, degree): dense, windows + sinks + MoE, latent attention, each hybrid kind
    ("qwen3", "onepass_cpu", 2), ("qwen3", "sdpa", 4), ("llama", "eager", 2),
    ("gpt-oss", "onepass_cpu", 4), ("gpt-oss", "eager", 2), ("olmo3", "onepass_cpu", 4),
    ("mistral-window", "sdpa", 2), ("deepseek-v3", "onepass_cpu", 2),
    ("qwen3.5", "onepass_cpu", 2), ("nemotron-h", "onepass_cpu", 4), ("lfm2", "sdpa", 2),
    ("falcon-h1", "onepass_cpu", 2),
]


@pytest.mark.parametrize("arch, backend, degree", CASES)
def test_split_over_ranks_equals_one_process(rows, arch, backend, degree):
    """Two trees of different lengths in one batch (padded), and both packed in one row."""
    trees, packed, vocab = rows
    model = exact_model(arch, vocab, backend)
    for batch in (layouts_to_batch(trees), layouts_to_batch(packed)):
        want_loss, want = whole_loss_and_grads(model, batch)
        got_loss, got = split_loss_and_grads(model, batch, degree)
        uninstall(model)
        assert rel_diff(got_loss, want_loss) <= TOL, (got_loss, want_loss)
        grad_diff, worst = max_rel_grad_diff(want, got)
        assert grad_diff <= TOL, (worst, grad_diff)
        assert any(float(g.norm()) > 0 for g in want.values())


def test_installed_models_name_the_wrapped_backend_and_masks_stay_the_backends(rows):
    from onepass.attention.backends import attention_mask_for, model_backend

    trees, _, vocab = rows
    model = exact_model("qwen3", vocab, "onepass_cpu")
    install(model, 2)
    assert is_installed(model) and model.config._attn_implementation == "onepass_sp:onepass_cpu"
    assert model_backend(model) == "onepass_cpu"
    batch = layouts_to_batch(trees)
    assert attention_mask_for(model, batch["kv_end"]).dtype == torch.long  # the onepass_cpu mask, whole rows
    assert "_attn_implementation" not in model.config.to_json_string()  # never saved
    uninstall(model)
    assert model.config._attn_implementation == "onepass_cpu"


def test_a_misordered_exchange_is_caught(rows, monkeypatch):
    """The tests can fail: the shards of the other ranks laid out in the wrong order inside attention (each
    query then meets keys that are not its ancestors) is not one process."""
    from onepass.parallel.comm import SequenceShard

    trees, _, vocab = rows
    model = exact_model("qwen3", vocab, "sdpa")
    batch = layouts_to_batch(trees)
    want_loss, _ = whole_loss_and_grads(model, batch)
    monkeypatch.setattr(SequenceShard, "to_heads",
                        lambda self, x: torch.cat(self.exchange(x.chunk(self.degree, dim=1))[::-1], dim=2))
    got_loss, _ = split_loss_and_grads(model, batch, 2)
    uninstall(model)
    assert rel_diff(got_loss, want_loss) > 1e-6


def test_without_the_gather_a_recurrent_mixer_scans_only_its_shard(rows, monkeypatch):
    """The tests can fail: a mixer run on its shard alone (a chain's state lost at the boundary) differs."""
    trees, _, vocab = rows
    model = exact_model("qwen3.5", vocab, "onepass_cpu")
    batch = layouts_to_batch(trees[:1])
    want_loss, _ = whole_loss_and_grads(model, batch)
    original = tree._tree_forward

    def shard_only(module, forward, cache_kw, *args, **kwargs):
        plan = take(kwargs)
        local = ((tree.Chain(start=0, end=args[0].shape[1] if args else kwargs["hidden_states"].shape[1],
                             parent=-1, depth=0),),) * len(plan.chains)
        assert plan.shard is not None
        return original(module, forward, cache_kw, *args, **{KWARG: replace(plan, chains=local, shard=None)},
                        **kwargs)

    monkeypatch.setattr(tree, "_tree_forward", shard_only)
    tree.uninstall(model)
    got_loss, _ = split_loss_and_grads(model, batch, 2)
    tree.uninstall(model)
    assert rel_diff(got_loss, want_loss) > 1e-6


# ---------------------------------------------------------------------------------------------
# what the plan says each rank sends, against what it sends


class CountingGroup(ThreadGroup):
    """A ThreadGroup that counts the elements each rank sends to other ranks."""

    def __init__(self, size):
        super().__init__(size)
        self.sent = [0] * size

    def all_to_all(self, sends, rank):
        self.sent[rank] += sum(s.numel() for j, s in enumerate(sends) if j != rank)
        return super().all_to_all(sends, rank)


@pytest.mark.parametrize("arch, degree", [("qwen3", 2), ("qwen3", 4), ("deepseek-v3", 2), ("nemotron-h", 2)])
def test_the_planned_volume_is_what_a_forward_pass_sends(rows, monkeypatch, arch, degree):
    import onepass.parallel.comm as comm
    from onepass.loss import batch_loss

    trees, _, vocab = rows
    model = exact_model(arch, vocab, "onepass_cpu")
    install(model, degree)
    copies = [copy.deepcopy(model) for _ in range(degree)]  # each rank its own model, as each process has
    group = CountingGroup(degree)
    monkeypatch.setattr(comm, "ThreadGroup", lambda size, timeout=120.0: group)
    batch = layouts_to_batch(trees[:1])
    with torch.no_grad():
        run_ranks(degree, lambda shard: batch_loss(copies[shard.rank], batch, shard=shard))
    planned = forward_volume(layer_shapes(model), length=len(trees[0]), degree=degree)
    assert planned.total > 0 and group.sent == [planned.total] * degree
    assert (planned.mixers > 0) == (arch == "nemotron-h")


def test_rl_scoring_split_over_ranks_equals_one_process():
    """Per-token log-probs of multi-turn rollouts (onepass.rl) with each row split over 2 ranks: every rank gets
    every log-prob, and a loss replicated on the ranks (divided by S) gives one process's gradient."""
    from onepass.rl.layout import layout_rollouts
    from onepass.rl.logprobs import token_logprobs
    from onepass.rl.rollouts import trajectories_from_records
    from onepass.rl.synthetic import AgentShape, agent_rollouts, strip_extra

    records = agent_rollouts(1, seed=0, vocab_size=64, shape=AgentShape().scaled(0.02))
    batch = layout_rollouts(trajectories_from_records([strip_extra(r) for r in records]))
    model = exact_model("qwen3", 64, "onepass_cpu")
    named = [(n, p) for n, p in model.named_parameters()]
    want = token_logprobs(model, batch, entropy=True)
    want_grads = torch.autograd.grad(want.flat().sum(), [p for _, p in named])
    degree = 2
    install(model, degree)
    copies = [copy.deepcopy(model) for _ in range(degree)]

    def rank(shard):
        mine = copies[shard.rank]
        got = token_logprobs(mine, batch, entropy=True, shard=shard)
        grads = torch.autograd.grad(got.flat().sum() / degree, list(mine.parameters()))
        return got.detach(), grads

    results = run_ranks(degree, rank)
    for got, _ in results:
        assert rel_diff(got.flat(), want.flat().detach()) <= TOL
        assert rel_diff(torch.cat([e for turns in got.entropy for e in turns]),
                   torch.cat([e.detach() for turns in want.entropy for e in turns])) <= TOL
    got_grads = {name: sum(r[1][i] for r in results) for i, (name, _) in enumerate(named)}
    grad_diff, worst = max_rel_grad_diff(dict(zip(got_grads, want_grads)), got_grads)
    assert grad_diff <= TOL, (worst, grad_diff)
    assert len(batch.rows) >= 1 and max(len(r) for r in batch.rows) > degree
