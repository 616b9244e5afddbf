"""Generators: rendered prompts in, replies out, from whichever engine serves the model.

Why this module exists: the turn-by-turn loop (:mod:`onepass.evaluate.run`)
must not care what produces the text. Everything here has one method,
``generate(prompts) -> replies``, taking prompts already rendered by the
model's own chat template, so each engine sees exactly the text the model sees
at inference and the loop stays testable with a scripted fake:

- :class:`HFGenerator`     transformers ``generate``: batched, left padding,
  greedy by default; CPU or CUDA, any dtype.
- :class:`VLLMGenerator`   vLLM's offline engine, fed token ids (no second BOS,
  no re-templating); only when ``vllm`` is installed.
- :class:`OpenAIGenerator` an OpenAI-compatible server's ``/v1/completions``
  (raw prompt: exact) through :class:`onepass.data.chat_client.ChatClient`
  (retries, timeouts).
- :class:`OpenAIChatGenerator` the same server's ``/v1/chat/completions``: it
  takes *messages* (``generate_messages``), so the server's template renders
  them. Use it for endpoints without ``/completions``.

A reply keeps the model's special tokens except the end of turn: the loop
splits ``<think>...</think>`` off it itself.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, runtime_checkable

from onepass.data.chat_client import ChatClient, ClientConfig, RequestFailed
from onepass.errors import ConfigError, OnePassError


class GenerationError(OnePassError, RuntimeError):
    """A reply that could not be had (a server that keeps failing); the evaluation stops, it never guesses."""


@runtime_checkable
class Generator(Protocol):
    def generate(self, prompts: list[str]) -> list[str]:
        """One reply per prompt, in order."""
        ...


@runtime_checkable
class MessagesGenerator(Protocol):
    def generate_messages(self, conversations: list[list[dict[str, Any]]]) -> list[str]:
        """One reply per message list, in order; the server renders them with its own template."""
        ...


def _stop_ids(model: Any, tokenizer: Any) -> list[int]:
    ids: set[int] = set()
    for value in (getattr(getattr(model, "generation_config", None), "eos_token_id", None),
                  getattr(tokenizer, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, Iterable):
            ids.update(int(v) for v in value)
    if not ids:
        raise ConfigError("neither the model's generation config nor the tokenizer names an end-of-turn "
                          "token, so generation would never stop; set tokenizer.eos_token")
    return sorted(ids)


class HFGenerator:
    """``model.generate`` on batches of ``batch_size`` prompts (left padded), ``max_new_tokens`` each.

    Greedy unless ``do_sample`` (then ``temperature``/``top_p``, seeded by ``seed``). The model is used
    where it is (its device and dtype): load it with :func:`onepass.models.load_causal_lm` or pass your own.
    """

    def __init__(self, model: Any, tokenizer: Any, *, max_new_tokens: int = 2048, batch_size: int = 8,
                 do_sample: bool = False, temperature: float = 1.0, top_p: float = 1.0, seed: int = 0,
                 progress: bool = False) -> None:
        if max_new_tokens < 1 or batch_size < 1:
            raise ConfigError(f"max_new_tokens and batch_size must be >= 1, got {max_new_tokens}, {batch_size}")
        self.model, self.tokenizer = model.eval(), tokenizer
        self.max_new_tokens, self.batch_size = max_new_tokens, batch_size
        self.do_sample, self.temperature, self.top_p, self.seed = do_sample, temperature, top_p, seed
        self.progress = progress
        self.stop_ids = _stop_ids(model, tokenizer)
        pad = tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else self.stop_ids[0]

    def _decode(self, ids: Sequence[int]) -> str:
        ids = list(ids)
        for i, t in enumerate(ids):
            if t in self.stop_ids:
                ids = ids[:i]
                break
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def generate(self, prompts: list[str]) -> list[str]:
        import torch
        from tqdm.auto import tqdm

        device = next(self.model.parameters()).device
        encoded = [self.tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
        order = sorted(range(len(prompts)), key=lambda i: -len(encoded[i]))  # similar lengths share a batch
        replies: list[str] = [""] * len(prompts)
        batches = [order[i:i + self.batch_size] for i in range(0, len(order), self.batch_size)]
        for batch in tqdm(batches, desc="generate", unit="batch", disable=not self.progress, leave=False):
            width = max(len(encoded[i]) for i in batch)
            ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, i in enumerate(batch):  # left padding: every prompt ends where generation starts
                n = len(encoded[i])
                ids[row, width - n:] = torch.tensor(encoded[i], dtype=torch.long)
                mask[row, width - n:] = 1
            sampling = dict(do_sample=True, temperature=self.temperature, top_p=self.top_p) if self.do_sample \
                else dict(do_sample=False, temperature=None, top_p=None, top_k=None)
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                torch.manual_seed(self.seed)
                with torch.no_grad():
                    out = self.model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                                              max_new_tokens=self.max_new_tokens, eos_token_id=self.stop_ids,
                                              pad_token_id=self.pad_id, **sampling)
            for row, i in enumerate(batch):
                replies[i] = self._decode(out[row, width:].tolist())
        return replies


class VLLMGenerator:
    """vLLM's offline ``LLM.generate`` on token ids (the prompt is tokenized here, without special tokens
    added, exactly as :class:`HFGenerator` does). Greedy (temperature 0) unless told otherwise."""

    def __init__(self, model: str, tokenizer: Any, *, max_new_tokens: int = 2048, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int = 0, dtype: str = "auto", progress: bool = False,
                 **engine_kwargs: Any) -> None:
        if importlib.util.find_spec("vllm") is None:
            raise ConfigError("--backend vllm needs vLLM, which is not installed: pip install vllm "
                              "(CUDA), or use --backend hf")
        import vllm

        self.tokenizer, self.progress = tokenizer, progress
        self.llm = vllm.LLM(model=model, dtype=dtype, seed=seed, **engine_kwargs)
        self.params = vllm.SamplingParams(temperature=temperature, top_p=top_p, max_tokens=max_new_tokens,
                                          seed=seed, skip_special_tokens=False)

    def generate(self, prompts: list[str]) -> list[str]:
        inputs = [{"prompt_token_ids": self.tokenizer(p, add_special_tokens=False)["input_ids"]} for p in prompts]
        outputs = self.llm.generate(inputs, self.params, use_tqdm=self.progress)
        eos = getattr(self.tokenizer, "eos_token", None)
        return [_strip_suffix(o.outputs[0].text, eos) for o in outputs]


def _strip_suffix(text: str, suffix: str | None) -> str:
    return text[: -len(suffix)] if suffix and text.endswith(suffix) else text


def _client(base_url: str, model: str, max_new_tokens: int, temperature: float, **kwargs: Any) -> Any:
    return ChatClient(ClientConfig(base_url=base_url, model=model, max_tokens=max_new_tokens,
                                   temperature=temperature, json_mode=False, **kwargs))


def answer_key(config: Any, request: Any) -> str:
    """The cache key of one request: the served model, the sampling settings and the prompt or messages."""
    import hashlib
    import json

    body = [config.model, config.max_tokens, config.temperature, request]
    return hashlib.sha256(json.dumps(body, sort_keys=True, ensure_ascii=False).encode()).hexdigest()[:32]


def _ask_all(items: Sequence[Any], ask: Any, concurrency: int, *, cache: Any | None = None,
             config: Any | None = None) -> list[str]:
    """Every item's reply, ``concurrency`` requests in flight. With ``cache`` (an append-only
    :class:`onepass.data.augment.Cache`), a reply cached by an earlier run is not requested again and
    each new one is cached as it arrives, so an interrupted paid evaluation resumes where it stopped."""
    import threading

    lock = threading.Lock()

    def one(i: int) -> str:
        key = answer_key(config, items[i]) if cache is not None else ""
        if cache is not None and key in cache.results:
            return cache.results[key]
        try:
            text = ask(items[i])[0]
        except RequestFailed as e:
            raise GenerationError(f"request {i + 1} of {len(items)} failed: {e}") from None
        if cache is not None:
            with lock:
                cache.put(key, text, model=config.model)
        return text

    with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
        return list(pool.map(one, range(len(items))))


class OpenAIGenerator:
    """An OpenAI-compatible ``/v1/completions`` endpoint (vLLM, SGLang, llama.cpp, TGI ...) given the
    rendered prompt, so the server applies no template of its own: what the model sees is exact."""

    def __init__(self, base_url: str, model: str, *, max_new_tokens: int = 2048, temperature: float = 0.0,
                 concurrency: int = 8, client: Any | None = None, cache: Any | None = None,
                 **client_kwargs: Any) -> None:
        self.client = client or _client(base_url, model, max_new_tokens, temperature, **client_kwargs)
        self.concurrency, self.cache = concurrency, cache

    def generate(self, prompts: list[str]) -> list[str]:
        return _ask_all(prompts, lambda p: self.client.complete_text(p), self.concurrency, cache=self.cache,
                        config=self.client.config)


class OpenAIChatGenerator:
    """An OpenAI-compatible ``/v1/chat/completions`` endpoint: sends messages (earlier reasoning left out,
    as a chat client does) and the server renders them with its template."""

    def __init__(self, base_url: str, model: str, *, max_new_tokens: int = 2048, temperature: float = 0.0,
                 concurrency: int = 8, client: Any | None = None, cache: Any | None = None,
                 **client_kwargs: Any) -> None:
        self.client = client or _client(base_url, model, max_new_tokens, temperature, **client_kwargs)
        self.concurrency, self.cache = concurrency, cache

    def generate_messages(self, conversations: list[list[dict[str, Any]]]) -> list[str]:
        plain = [[{k: v for k, v in m.items() if k != "reasoning_content"} for m in msgs] for msgs in conversations]
        return _ask_all(plain, lambda msgs: self.client.complete_text(messages=msgs), self.concurrency,
                        cache=self.cache, config=self.client.config)
