"""Shared fixtures and markers. The suite runs offline on CPU, one thread per process; CUDA tests skip cleanly."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One thread per process, here and in every process a test starts (they inherit the environment): the models are
# tiny, and with pytest -n 2 on 2 cores two threads per worker only spin waiting on each other (a tiny float64
# verify took 7 s of CPU on two threads of a busy machine, 0.3 s on one). Set them to try more.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("requires_cuda") and not torch.cuda.is_available():
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))


def promised_refusal(error: BaseException) -> str | None:
    """``"refused: <line>"`` for a one-line CouplingError (or the guard's refusal carrying one: what ``onepass
    train`` stops with) that names a transformers release newer than the installed one (what onepass promises
    on the older releases `make test-compat` and `make test-min` run), ``"absent: <line>"`` for an
    architecture the installed release does not have; None for anything else, which stays a failure (a refusal
    on a release it names as working is a regression)."""
    import re

    import transformers
    from packaging.version import Version

    from onepass.guard.check import InexactModelError
    from onepass.model.couplings import CouplingError
    from onepass.model.tiny import ArchitectureAbsent

    line = str(error)
    if isinstance(error, ArchitectureAbsent):
        return f"absent: {line}"
    needs = re.search(r"transformers>=(\d+\.\d+(?:\.\d+)?)", line)
    coupling = isinstance(error, CouplingError) or isinstance(error, InexactModelError) and \
        line.startswith("one-pass is refused for ")  # the guard's line for a CouplingError: onepass train's refusal
    if coupling and "\n" not in line and needs \
            and Version(transformers.__version__) < Version(needs.group(1)):
        return f"refused: {line}"
    return None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A test stopped by a promised refusal (:func:`promised_refusal`) is reported as skipped, with the line."""
    outcome = yield
    report = outcome.get_result()
    if report.failed and call.excinfo is not None and report.when in ("setup", "call"):
        reason = promised_refusal(call.excinfo.value)
        if reason is not None:
            report.outcome = "skipped"
            report.longrepr = (str(item.path), item.location[1] or 0, reason)


@pytest.fixture(scope="session")
def qwen3_tokenizer():
    """The real Qwen3 vocabulary and chat template, built offline (cached after the first build)."""
    from onepass.render.tokenizer import load_tokenizer

    return load_tokenizer("builtin:qwen3")


@pytest.fixture
def with_template(qwen3_tokenizer):
    """Set the shared Qwen3 tokenizer's chat template for one test (loading a fresh one takes seconds)."""
    before = qwen3_tokenizer.chat_template

    def swap(template: str):
        qwen3_tokenizer.chat_template = template
        return qwen3_tokenizer

    yield swap
    qwen3_tokenizer.chat_template = before


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run fastest on one thread, and do not crawl when other processes share the cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_adapter(tmp_path_factory, qwen3_tokenizer):
    """A float64 tiny Qwen3 (300 ids) saved as a base with the Qwen3 tokenizer, and a LoRA adapter on it with
    non-zero B (so merging it matters): ``(base_dir, adapter_dir, peft_model)``, for ``onepass export``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from onepass.model.tiny import tiny_model

    root = tmp_path_factory.mktemp("export")
    base_dir, adapter_dir = root / "base", root / "adapter"
    tiny_model("qwen3", 300, dtype=torch.float64, seed=0).save_pretrained(base_dir)
    qwen3_tokenizer.save_pretrained(base_dir)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float64)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        lora = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                               init_lora_weights=False, task_type="CAUSAL_LM"))
    lora.eval()
    lora.save_pretrained(adapter_dir)
    return base_dir, adapter_dir, lora
