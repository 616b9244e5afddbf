"""The chunked LM head equals the plain one (full logits, then weighted CE): loss and every gradient, float64."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

from onepass import head as head_mod
from onepass.bench.head_precision import half_head_errors
from onepass.head import chunked_lm_head_loss, head_mode, plain_lm_head_loss
from onepass.loss import batch_loss
from onepass.model.tiny import tiny_model
from onepass.layout.tree import IGNORE

TOL = 1e-12
VOCAB = 50


def max_diff(got, want):
    return max(float((g - w).abs().max()) if g.numel() else 0.0 for g, w in zip(got, want, strict=True))


def linear_case(num_targets: int, *, bias: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    head = nn.Linear(8, VOCAB, bias=bias, dtype=torch.float64)
    with torch.no_grad():
        head.weight.copy_(torch.randn(VOCAB, 8, generator=gen, dtype=torch.float64))
        if bias:
            head.bias.copy_(torch.randn(VOCAB, generator=gen, dtype=torch.float64))
    hidden_TD = torch.randn(num_targets, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    targets_T = torch.randint(0, VOCAB, (num_targets,), generator=gen)
    weights_T = torch.rand(num_targets, generator=gen, dtype=torch.float64)
    weights_T[::3] = 0.0  # untrained-but-present targets
    return head, hidden_TD, targets_T, weights_T


def loss_and_grads(loss_fn, tensors):
    for t in tensors:
        t.grad = None
    loss = loss_fn()
    loss.backward()
    return [loss.detach()] + [t.grad.clone() for t in tensors]


@pytest.mark.parametrize("chunk", [1, 3, 7, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_chunked_linear_head_equals_plain(chunk, bias):
    head, hidden_TD, targets_T, weights_T = linear_case(7, bias=bias)
    tensors = [hidden_TD, *head.parameters()]
    want = loss_and_grads(lambda: plain_lm_head_loss(hidden_TD, head, targets_T, weights_T), tensors)
    got = loss_and_grads(lambda: chunked_lm_head_loss(hidden_TD, head, targets_T, weights_T, chunk=chunk), tensors)
    assert max_diff(got, want) <= TOL
    assert float(want[0]) > 0


def test_zero_weights_and_no_targets_give_zero_loss_and_gradients():
    head, hidden_TD, targets_T, _ = linear_case(5, bias=True)
    got = loss_and_grads(lambda: chunked_lm_head_loss(hidden_TD, head, targets_T, torch.zeros(5, dtype=torch.float64),
                                                      chunk=2), [hidden_TD, head.weight])
    assert all(float(t.abs().max()) == 0.0 for t in got)
    empty_TD = torch.zeros(0, 8, dtype=torch.float64, requires_grad=True)
    loss = chunked_lm_head_loss(empty_TD, head, targets_T[:0], torch.zeros(0, dtype=torch.float64))
    loss.backward()
    assert float(loss.detach()) == 0.0


def test_head_mode_comes_from_the_argument_then_the_environment(monkeypatch):
    assert head_mode() == "chunked"
    monkeypatch.setenv(head_mod.MODE_ENV, "plain")
    assert head_mode() == "plain" and head_mode("chunked") == "chunked"
    with pytest.raises(ValueError, match="not one of"):
        head_mode("fused")


def model_batch(seed: int = 0, length: int = 12):
    gen = torch.Generator().manual_seed(seed)
    targets = torch.randint(0, VOCAB, (1, length), generator=gen)
    targets[0, :3] = IGNORE
    weights = torch.rand(1, length, generator=gen, dtype=torch.float64) * (targets != IGNORE)
    weights[0, 5] = 0.0
    return {"input_ids": torch.randint(0, VOCAB, (1, length), generator=gen),
            "position_ids": torch.arange(length)[None], "kv_end": torch.arange(1, length + 1)[None],
            "targets": targets, "weights": weights}


def model_loss_and_grads(model, batch, mode):
    params = [p for p in model.parameters() if p.requires_grad]
    model.zero_grad(set_to_none=True)
    loss = batch_loss(model, batch, lm_head=mode)
    loss.backward()
    return [loss.detach()] + [p.grad.clone() for p in params]


def assert_chunked_equals_plain(model, monkeypatch, chunk=4):
    monkeypatch.setenv(head_mod.CHUNK_ENV, str(chunk))
    batch = model_batch()
    want = model_loss_and_grads(model, batch, "plain")
    got = model_loss_and_grads(model, batch, "chunked")
    assert max_diff(got, want) <= TOL
    assert float(want[0]) > 0


@pytest.mark.parametrize("tied", [False, True])
def test_batch_loss_chunked_equals_plain_on_a_model(one_thread, monkeypatch, tied):
    """Tied: the head weight is the embedding weight; both gradients land in the one tensor."""
    model = tiny_model("qwen3", VOCAB, dtype=torch.float64, tie_word_embeddings=tied)
    head = model.get_output_embeddings()
    assert (head.weight is model.get_input_embeddings().weight) == tied
    calls = []
    monkeypatch.setattr(head_mod._ChunkedLinearCE, "apply", lambda *a: calls.append(1) or orig_apply(*a))
    assert_chunked_equals_plain(model, monkeypatch)
    assert calls, "the chunked route was not taken"


orig_apply = head_mod._ChunkedLinearCE.apply


def test_batch_loss_chunked_equals_plain_with_lora_on_the_head(one_thread, monkeypatch):
    """peft wraps lm_head: each chunk calls the LoRA module itself under checkpoint."""
    from peft import LoraConfig, get_peft_model

    base = tiny_model("qwen3", VOCAB, dtype=torch.float64)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"],
                                            lora_dropout=0.0))
    for name, p in model.named_parameters():  # B starts at zero: make the adapter count
        if "lora_B" in name:
            p.data.normal_(generator=torch.Generator().manual_seed(1))
    head = model.get_output_embeddings()
    assert type(head) is not nn.Linear and hasattr(head, "lora_A")
    assert_chunked_equals_plain(model, monkeypatch, chunk=3)


def test_a_model_that_changes_its_head_output_takes_the_plain_path(one_thread, monkeypatch):
    """Granite divides logits by ``logits_scaling`` after the head: the identity check must notice it."""
    model = tiny_model("granite-4-hybrid", VOCAB, dtype=torch.float64, logits_scaling=2.0)
    monkeypatch.setattr(head_mod, "_POST_HEAD_FIELDS", ())  # hide the config field: the runtime check decides
    batch = model_batch()
    want = model_loss_and_grads(model, batch, "plain")
    with pytest.warns(UserWarning, match="changes what its LM head returns"):
        got = model_loss_and_grads(model, batch, "chunked")
    assert max_diff(got, want) <= TOL
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # decided once per model
        model_loss_and_grads(model, batch, "chunked")


MEMORY_SCRIPT = """
import resource, sys, torch
from torch import nn
from onepass.head import chunked_lm_head_loss
torch.manual_seed(0)
T, V, D = 1024, 151936, 16  # D only sets the time, not the [T, V] memory
head = nn.Linear(D, V, bias=False)
hidden = torch.randn(T, D, requires_grad=True)
targets, weights = torch.randint(0, V, (T,)), torch.rand(T)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
chunked_lm_head_loss(hidden, head, targets, weights, chunk=int(sys.argv[1]), mode=sys.argv[2]).backward()
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
"""


def test_chunked_head_peak_memory_is_far_below_the_logits():
    """T=1024 targets at Qwen3's vocabulary: [T, V] float32 is 0.6 GB; the chunked head stays under a quarter.

    A fresh process, so ru_maxrss (Linux: KiB) measures this work alone (measured: ~93 MiB at chunk 32;
    mode=plain or chunk=T grow it by ~1.8 GiB and fail).
    """
    run = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT, "32", "chunked"], capture_output=True, text=True,
                         check=True, env={"OMP_NUM_THREADS": "1", "PATH": "",
                                          "MALLOC_MMAP_THRESHOLD_": str(2**20)})  # big frees go back to the OS
    peak = int(run.stdout.split()[-1])
    assert peak < 1024 * 151936 * 4 / 4, f"peak grew by {peak / 2**20:.0f} MiB"


def test_chunked_head_peak_does_not_grow_with_the_number_of_chunks():
    """Four chunks of 256 targets peak like one: a chunk's [C, V] is freed before the next one's.

    A one-pass row holds more targets than an N-pass row, so more chunks; before the buffers were
    freed chunk by chunk, backward held ~5 [C, V] at once from the second chunk on (one-pass packed
    peaked ~0.5 GiB above N-pass packed at Qwen3-0.6B width). Now: logits + logsumexp's temporary.
    """
    run = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT, "256", "chunked"], capture_output=True, text=True,
                         check=True, env={"OMP_NUM_THREADS": "1", "PATH": "",
                                          "MALLOC_MMAP_THRESHOLD_": str(2**20)})
    peak, chunk_logits = int(run.stdout.split()[-1]), 256 * 151936 * 4
    assert peak < 2.5 * chunk_logits, f"peak grew by {peak / chunk_logits:.1f} chunks of [C, V] logits"


def test_a_half_model_that_upcasts_its_logits_keeps_the_chunked_head(one_thread):
    """NemotronH returns ``lm_head(h).float()``: an exact upcast, so the chunked head (bf16 logits, then float32,
    as the model's own path) stands in for it, with no fallback."""
    model = tiny_model("nemotron-h", VOCAB, dtype=torch.bfloat16)
    batch = model_batch()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("error", message="onepass")
        want = batch_loss(model, batch, lm_head="plain")
        got = batch_loss(model, batch, lm_head="chunked")
    assert getattr(model.get_output_embeddings(), "_onepass_head_checked", False)
    assert got.dtype == want.dtype == torch.float32 and float((got - want).abs()) <= 1e-6 * float(want)


def test_accuracy_and_entropy_sums_are_the_same_on_every_head_path():
    """TRL's mean_token_accuracy and entropy (OnePassTrainer's logs): weighted sums from the chunked head
    equal those from full logits, computed here by hand."""
    from onepass.head import chunked_lm_head_loss

    gen = torch.Generator().manual_seed(0)
    hidden_TD = torch.randn(7, 5, generator=gen, dtype=torch.float64)
    head = torch.nn.Linear(5, 11, bias=False).double()
    targets_T = torch.randint(0, 11, (7,), generator=gen)
    weights_T = torch.rand(7, generator=gen, dtype=torch.float64)
    logits_TV = head(hidden_TD).detach()
    p_TV = logits_TV.softmax(-1)
    expected = {"weight": weights_T.sum(), "correct": (weights_T * (logits_TV.argmax(-1) == targets_T)).sum(),
                "entropy": (weights_T * -(p_TV * p_TV.log()).sum(-1)).sum()}
    for mode, chunk in (("chunked", 3), ("chunked", 100), ("plain", 3)):
        stats: dict = {}
        chunked_lm_head_loss(hidden_TD, head, targets_T, weights_T, chunk=chunk, mode=mode, stats=stats)
        for key, value in expected.items():
            assert torch.allclose(stats[key].double(), value, rtol=1e-5), (mode, chunk, key)


# ---------------------------------------------------------------------------------------------
# precision: one dtype rule for every head matmul (head_dtype)

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_head_is_as_close_to_float64_as_a_plain_half_head(dtype, device="cpu"):
    """The bf16 / fp16 chunked head against float64, beside a plain HF head in the same dtype (measured,
    docs/measured.md: bf16 CPU loss ~1e-5, gradients ~4e-3, the plain head's to 1%; the gradients' error is
    their own rounding to the weight's dtype)."""
    for seed in range(3):
        ours, plain = half_head_errors(device, dtype, seed)
        assert ours[0] <= 1.5 * plain[0] + 1e-6, (seed, ours, plain)  # loss
        assert ours[1] <= 1.05 * plain[1] and ours[2] <= 1.05 * plain[2], (seed, ours, plain)  # dh, dW
        assert ours[0] < 1e-4 and max(ours[1:]) < 1e-2, (seed, ours)


@pytest.mark.requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_head_on_cuda_sums_in_float32_on_tensor_cores(dtype):
    """On CUDA the head's half GEMMs sum and write in float32 (torch.mm's out_dtype), and stay as close to
    float64 as a plain HF head in the same dtype (gpu-check runs this: the figure for docs/measured.md)."""
    assert head_mod.fp32_out_gemm("cuda"), "this torch has no float32-output half GEMM on CUDA"
    test_a_half_head_is_as_close_to_float64_as_a_plain_half_head(dtype, device="cuda")


@pytest.mark.parametrize("sums_in_place", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_tensor_core_route_multiplies_half_inputs_into_float32(monkeypatch, dtype, sums_in_place):
    """The CUDA route, run on CPU: torch.mm / torch.addmm with ``out_dtype`` stood in for by what the kernel computes
    (the half inputs' exact product summed in float32). Every head GEMM (logits, dh, dW) takes ``dtype`` inputs
    (b757769: dW took the float32 softmax gradient and a float32 copy of h: CUDA cores), and the result is as
    close to float64 as a plain head. ``sums_in_place=False``: a torch whose addmm refuses a float32 sum
    (issue pytorch#154086) adds float32 products slice by slice."""
    real_mm, real_addmm = torch.mm, torch.addmm
    calls = []

    def tensor_core(a, b, out_dtype):
        assert a.dtype == b.dtype and a.dtype in head_mod.HALF and out_dtype == torch.float32, (a.dtype, b.dtype)
        calls.append((a.dtype, tuple(a.shape)))
        return a.float() @ b.float()  # the half values' products, summed in float32

    def mm(a, b, *, out_dtype=None, **kwargs):
        return real_mm(a, b, **kwargs) if out_dtype is None else tensor_core(a, b, out_dtype)

    def addmm(sum_, a, b, *, out_dtype=None, out=None, **kwargs):
        if out_dtype is None:
            return real_addmm(sum_, a, b, out=out, **kwargs)
        if not sums_in_place:
            raise RuntimeError("self and mat2 must have the same dtype, but got Float and BFloat16")
        return out.copy_(sum_ + tensor_core(a, b, out_dtype))

    monkeypatch.setattr(torch, "mm", mm)
    monkeypatch.setattr(torch, "addmm", addmm)
    monkeypatch.setattr(head_mod, "SUM_SLICE", 700)  # V = 2000: three slices
    head_mod.fp32_out_gemm.cache_clear()
    head_mod.fp32_sum_gemm.cache_clear()
    try:
        assert head_mod.fp32_out_gemm("cpu") and head_mod.fp32_sum_gemm("cpu") == sums_in_place
        calls.clear()
        ours, plain = half_head_errors("cpu", dtype, 0)
    finally:
        head_mod.fp32_out_gemm.cache_clear()
        head_mod.fp32_sum_gemm.cache_clear()
    T, D, V, C = 256, 128, 2000, 64  # half_head_errors' shape and chunk
    d_w = [(V, C)] if sums_in_place else [(700, C), (700, C), (600, C)]
    per_chunk_backward = [(C, D), (C, V), *d_w]  # the logits again, dh = g W, dW += g^T h
    assert calls == [(dtype, s) for s in [(C, D)] * (T // C) + per_chunk_backward * (T // C)], calls
    assert ours[0] <= 1.5 * plain[0] + 1e-6 and ours[1] <= 1.05 * plain[1] and ours[2] <= 1.05 * plain[2], (ours, plain)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_float32_and_float64_heads_run_the_ops_they_always_ran(monkeypatch, dtype):
    """No cast, no float32-output GEMM: the float32 / float64 head is the op sequence it was (bitwise)."""
    def refuse(*args, **kwargs):
        raise AssertionError("a half-precision route was taken")

    monkeypatch.setattr(head_mod, "_mm", refuse)
    monkeypatch.setattr(head_mod, "_addmm_", refuse)
    head, hidden_TD, targets_T, weights_T = linear_case(9, bias=True)
    head, hidden_TD = head.to(dtype), hidden_TD.detach().to(dtype).requires_grad_(True)
    chunked_lm_head_loss(hidden_TD, head, targets_T, weights_T.to(dtype), chunk=4).backward()
    assert hidden_TD.grad is not None and head.weight.grad.dtype == dtype


def test_the_head_dtype_rule():
    """The model's own head under autocast multiplies in the autocast dtype (float64 excepted), else in its own."""
    bf16, fp16 = torch.bfloat16, torch.float16
    assert head_mod.head_dtype(fp16, bf16) == bf16  # fp16 weights under bf16 mixed precision (issue 45)
    assert head_mod.head_dtype(torch.float32, bf16) == bf16 and head_mod.head_dtype(torch.float64, bf16) == torch.float64
    assert head_mod.head_dtype(bf16, None) == bf16 and head_mod.head_dtype(torch.float32, None) == torch.float32
    assert head_mod.accumulate_dtype(bf16) == head_mod.accumulate_dtype(fp16) == torch.float32
    assert head_mod.fp32_out_gemm("cpu") is False  # torch has no such CPU kernel: the float32 GEMM sums dW


def autocast_forward(model, dtype):
    """The model as accelerate runs it under mixed precision: its forward under autocast, the loss outside."""
    forward = torch.autocast("cpu", dtype=dtype)(model.forward)

    class Autocast:
        config, get_output_embeddings = model.config, model.get_output_embeddings
        dtype = model.dtype

        def __call__(self, **kwargs):
            return forward(**kwargs)

    return Autocast()


@pytest.mark.parametrize("mode", ["chunked", "plain"])
def test_fp16_weights_under_bf16_autocast_train(one_thread, mode):
    """Issue 45: fp16 weights under bf16 mixed precision crashed in the LM head (``expected m1 and m2 to have the
    same dtype``: the model hands its head float32 states, the head's weight is fp16). Now the head multiplies in
    bf16, as the model's own head does under that autocast: the loss equals the model's own logits' loss."""
    from onepass.layout.tree import row_from_columns
    from onepass.loss import layouts_to_batch

    model = tiny_model("qwen3", VOCAB, dtype=torch.float16, attn_implementation="sdpa")
    ids = [(7 * i + 3) % VOCAB for i in range(16)]
    batch = layouts_to_batch([row_from_columns({"input_ids": ids, "position_ids": list(range(16)),
                                                "kv_end": [16] * 16, "targets": ids[1:] + [IGNORE],
                                                "weights": [0.0] * 4 + [1.0] * 11 + [0.0]})])
    view = autocast_forward(model, torch.bfloat16)
    loss = batch_loss(view, batch, lm_head=mode)
    loss.backward()
    assert torch.isfinite(loss) and model.get_output_embeddings().weight.grad is not None
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(input_ids=batch["input_ids"]).logits[0].float()  # one causal row: the plain forward
    keep = batch["targets"][0] != IGNORE
    want = (torch.nn.functional.cross_entropy(logits[keep], batch["targets"][0, keep], reduction="none")
            * batch["weights"][0, keep].float()).sum()
    assert float((loss.detach() - want).abs()) <= 1e-3 * float(want), (float(loss), float(want))
