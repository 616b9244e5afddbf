"""Shared fixtures and markers. The suite runs offline on CPU; CUDA tests skip cleanly."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("requires_cuda") and not torch.cuda.is_available():
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))


@pytest.fixture(scope="session")
def qwen3_tokenizer():
    """The real Qwen3 vocabulary and chat template, built offline (cached after the first build)."""
    from onepass.tokenizer import load_tokenizer

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
