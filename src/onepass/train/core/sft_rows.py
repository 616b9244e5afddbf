"""TRL's SFT dataset types as canonical rows: what ``SFTTrainer`` trains, where one-pass has nothing to share.

Why this module exists: ``OnePassTrainer`` takes every dataset ``SFTTrainer`` takes. A conversation is
rendered view by view and laid out as a tree (:mod:`onepass.train.trainer.data`); every other record is one
plain causal sequence, tokenized exactly as TRL tokenizes it (the same EOS rule, the same
``apply_chat_template`` calls, the completion mask from the common prefix, the labels from the masks,
``max_length`` truncation, fully masked examples dropped), and expressed as our canonical row:

    tokens        t0  t1  t2  t3          labels (TRL)  -100 -100  t2  t3
    input_ids     t0  t1  t2  t3
    position_ids   0   1   2   3
    kv_end         4   4   4   4          (every key is seen by the rest of the document: causal)
    targets     -100  t2  t3 -100         (shifted: position p predicts labels[p + 1])
    weights        0   1   1   0

so the one-pass loss of such a row is TRL's loss on it, token for token, and a step's normaliser (the
sum of weights) is TRL's number of label tokens. The kinds, per record (a dataset may mix them):

- ``text``: a ``dataset_text_field`` string (language modeling), EOS appended, every token trained;
- ``prompt_completion``: standard (strings) or conversational (messages) prompt and completion; the
  completion alone is trained unless ``completion_only_loss=False``;
- ``pretokenized``: ``input_ids`` with optional ``labels`` / ``assistant_masks`` / ``completion_mask``;
- ``messages``: a conversation; one-pass views (:mod:`onepass.train.trainer.data`) unless
  ``assistant_only_loss=False``, which asks for TRL's row (the whole rendering, every token trained).

No torch here: numpy and the tokenizer only.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from onepass.errors import DataError
from onepass.render.clock import TEMPLATE_DATE
from onepass.render.template import apply_template
from onepass.layout.tree import IGNORE, Layout

TEXT, PROMPT_COMPLETION, PRETOKENIZED, MESSAGES = "text", "prompt_completion", "pretokenized", "messages"
MASK_COLUMNS = ("assistant_masks", "completion_mask")
_CHAT_KEYS = ("prompt", "completion", "messages")


def is_conversational(record: Mapping[str, Any]) -> bool:
    """A record whose ``prompt``, ``completion`` or ``messages`` is a list of role/content messages
    (TRL's test; ShareGPT ``from``/``value`` turns are converted before)."""
    for key in _CHAT_KEYS:
        value = record.get(key)
        if isinstance(value, list) and value and isinstance(value[0], Mapping) and "role" in value[0]:
            return True
    return False


def is_sharegpt(record: Mapping[str, Any]) -> bool:
    """TRL's ``from``/``value`` conversations (``is_conversational_from_value``)."""
    value = record.get("conversations")
    return isinstance(value, list) and bool(value) and isinstance(value[0], Mapping) and \
        "from" in value[0] and "value" in value[0]


def record_kind(record: Mapping[str, Any], text_field: str) -> str:
    """Which of TRL's dataset types ``record`` is (see the module doc); ``messages`` for anything
    onepass reads as a conversation (``messages``, ``conversations``, ``interactions``, ...)."""
    if "input_ids" in record:
        return PRETOKENIZED
    if "prompt" in record and "completion" in record:
        return PROMPT_COMPLETION
    if isinstance(record.get(text_field), str) and not is_conversational(record):
        return TEXT
    return MESSAGES


@dataclass(frozen=True, kw_only=True)
class SftSettings:
    """How TRL tokenizes and labels a record (``SFTConfig``'s data and loss fields)."""

    text_field: str = "text"
    completion_only_loss: bool | None = None  # None: True for prompt-completion records, as TRL
    assistant_only_loss: bool = False  # here: TRL's assistant masks (generation markers) on chat rows
    chat_template: str | None = None  # the template with {% generation %} markers, when assistant_only_loss
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    template_date: str | None = None  # the date a clock-reading template renders (DataConfig.template_date)
    max_length: int | None = None
    truncation_mode: str = "keep_start"
    truncate: bool = True  # False when packing: packing cuts to max_length itself


@dataclass(frozen=True, kw_only=True)
class SftRow:
    """One TRL row: its tokens and TRL's labels (``-100`` where nothing is trained)."""

    input_ids: tuple[int, ...]
    labels: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def trained(self) -> bool:
        """TRL keeps a truncated example while any label is set (even the first, which nothing predicts)."""
        return any(label != IGNORE for label in self.labels)


def _tools(record: Mapping[str, Any]) -> Any:
    tools = record.get("tools")
    return json.loads(tools) if isinstance(tools, str) else tools


def _chat(tokenizer: Any, messages: list, settings: SftSettings, record: Mapping[str, Any], **kwargs: Any
          ) -> dict[str, list[int]]:
    """``apply_chat_template(messages, tokenize=True)`` with the record's tools and ``chat_template_kwargs``
    (TRL's ``_tokenize``), the run's ``template_kwargs`` under them."""
    call = {"chat_template": settings.chat_template, **dict(settings.template_kwargs),
            **dict(record.get("chat_template_kwargs") or {}), **kwargs}
    if settings.template_date is not None:
        call[TEMPLATE_DATE] = settings.template_date
    out = apply_template(tokenizer, messages, tools=_tools(record), kwargs=call, tokenize=True)
    return {k: list(v) for k, v in out.items() if k in ("input_ids", "assistant_masks")}


def _text_ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text=text)["input_ids"])


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _with_eos(text: str, eos: str | None) -> str:
    return text if eos is None or text.endswith(eos) else text + eos


def labels_from(input_ids: Sequence[int], masks: Sequence[Sequence[int]]) -> list[int]:
    """TRL's ``build_labels``: a token is trained where every mask is 1."""
    return [t if all(bits) else IGNORE for t, *bits in zip(input_ids, *masks)]


def per_token_columns(record: Mapping[str, Any], *, where: str) -> list[int]:
    """``record``'s ``input_ids``, after checking that each column given beside them (``labels``,
    ``assistant_masks``, ``completion_mask``) has one entry per token. A shorter one would be broadcast
    (``labels`` [10, 20] under ``input_ids`` [10, 20, 30, 40] trained as targets [20, 20, 20]), a longer
    one fail deep in numpy; TRL's collator refuses both shapes, so here they are one line naming the record.

    >>> per_token_columns({"input_ids": [10, 20, 30, 40], "labels": [10, 20]}, where="train_dataset record 3")
    Traceback (most recent call last):
    ...
    onepass.errors.DataError: train_dataset record 3: labels has 2 entries, input_ids 4: a token-level column needs one entry per token of input_ids
    """
    ids = list(record["input_ids"])
    for name in ("labels", *MASK_COLUMNS):
        column = record.get(name)
        if column is not None and len(column) != len(ids):
            raise DataError(f"{where}: {name} has {len(column)} entries, input_ids {len(ids)}: a token-level "
                            "column needs one entry per token of input_ids")
    return ids


def given_row(record: Mapping[str, Any], *, where: str) -> SftRow:
    """A tokenized record as it is (``skip_prepare_dataset``, or ``labels`` given): its ``labels``, or every
    token trained; the columns checked (:func:`per_token_columns`)."""
    ids = per_token_columns(record, where=where)
    labels = record.get("labels")
    return SftRow(input_ids=tuple(int(x) for x in ids),
                  labels=tuple(int(x) for x in (ids if labels is None else labels)))


def _check_prompt_completion(record: Mapping[str, Any], where: str) -> None:
    """A prompt and a completion both text (standard) or both messages (conversational): mixed, the
    template would be handed a message list joined to a string's characters (a raw ``TypeError`` deep in
    transformers)."""
    kinds = {key: "text" if isinstance(record[key], str) else "messages" for key in ("prompt", "completion")}
    if len(set(kinds.values())) > 1:
        raise DataError(f"{where}: the prompt is {kinds['prompt']} and the completion is {kinds['completion']}: "
                        "give both as text (a standard prompt-completion record) or both as lists of messages "
                        "(a conversational one)")


def tokenize_record(record: Mapping[str, Any], kind: str, tokenizer: Any, settings: SftSettings, *,
                    where: str = "a record") -> SftRow:
    """``record`` tokenized and labelled as ``SFTTrainer._prepare_dataset`` does, before truncation. A
    record of a shape TRL refuses is one :class:`~onepass.errors.DataError` line starting with ``where``."""
    masks: list[Sequence[int]] = []
    if kind == PRETOKENIZED:
        ids = per_token_columns(record, where=where)
        if record.get("labels") is not None:
            return given_row(record, where=where)
        if record.get("assistant_masks") is not None:
            masks.append(record["assistant_masks"])
        if settings.completion_only_loss and record.get("completion_mask") is not None:
            masks.append(record["completion_mask"])
    elif kind == TEXT:
        ids = _text_ids(tokenizer, _with_eos(record[settings.text_field], tokenizer.eos_token))
    elif kind == PROMPT_COMPLETION:
        _check_prompt_completion(record, where)
        if is_conversational(record):
            prompt_ids = _chat(tokenizer, list(record["prompt"]), settings, record,
                               add_generation_prompt=True)["input_ids"]
            full = _chat(tokenizer, list(record["prompt"]) + list(record["completion"]), settings, record,
                         return_assistant_tokens_mask=settings.assistant_only_loss)
            ids = full["input_ids"]
            if "assistant_masks" in full:
                masks.append(full["assistant_masks"])
        else:
            prompt_ids = _text_ids(tokenizer, record["prompt"])
            ids = _text_ids(tokenizer, record["prompt"] + _with_eos(record["completion"], tokenizer.eos_token))
        start = common_prefix_length(prompt_ids, ids)
        completion_only = True if settings.completion_only_loss is None else settings.completion_only_loss
        if completion_only:
            masks.append([0] * start + [1] * (len(ids) - start))
    else:  # MESSAGES as TRL renders them: one sequence, every token trained (or TRL's assistant masks)
        full = _chat(tokenizer, list(record["messages"]), settings, record,
                     return_assistant_tokens_mask=settings.assistant_only_loss)
        ids = full["input_ids"]
        if "assistant_masks" in full:
            masks.append(full["assistant_masks"])
    if settings.assistant_only_loss and masks and kind != PRETOKENIZED and 1 not in masks[0]:
        raise ValueError("assistant_only_loss=True, but an example has no assistant tokens: the chat template "
                         "does not mark them (it needs {% generation %} markers)")
    return SftRow(input_ids=tuple(int(x) for x in ids), labels=tuple(labels_from(ids, masks)))


def record_row(record: Mapping[str, Any], tokenizer: Any, settings: SftSettings, *, where: str = "a record") -> SftRow:
    """``record`` (any of TRL's types) as TRL's row: its kind (:func:`record_kind`), tokenized and labelled
    (:func:`tokenize_record`), truncated as TRL truncates it (:func:`truncated`). What ``OnePassTrainer`` and
    ``onepass train`` both make of a record that is not a one-pass conversation."""
    row = tokenize_record(record, record_kind(record, settings.text_field), tokenizer, settings, where=where)
    return truncated(row, settings)


def truncated(row: SftRow, settings: SftSettings) -> SftRow:
    """``max_length`` truncation as TRL's (keep_start, or the deprecated keep_end); none when packing."""
    n = settings.max_length
    if n is None or not settings.truncate or len(row) <= n:
        return row
    cut = slice(None, n) if settings.truncation_mode == "keep_start" else slice(-n, None)
    return SftRow(input_ids=row.input_ids[cut], labels=row.labels[cut])


def causal_layout(row: SftRow) -> Layout:
    """One document as a canonical row: causal (``kv_end`` = its end), positions 0..n-1, position ``p``
    trains ``labels[p + 1]`` with weight 1."""
    n = len(row)
    labels = np.asarray(row.labels, dtype=np.int64)
    targets = np.full(n, IGNORE, dtype=np.int64)
    targets[:-1] = labels[1:]
    return Layout(input_ids=np.asarray(row.input_ids, dtype=np.int64), position_ids=np.arange(n, dtype=np.int64),
                  kv_end=np.full(n, n, dtype=np.int64), targets=targets,
                  weights=(targets != IGNORE).astype(np.float64))


def split_row(row: SftRow, max_length: int) -> list[SftRow]:
    """``bfd_split``: a row longer than ``max_length`` cut into pieces of ``max_length`` (the last shorter),
    each its own document."""
    return [SftRow(input_ids=row.input_ids[i:i + max_length], labels=row.labels[i:i + max_length])
            for i in range(0, len(row), max_length)]


def wrapped_rows(rows: Sequence[SftRow], max_length: int) -> list[SftRow]:
    """TRL's ``wrapped`` packing: every row's tokens and labels concatenated and cut every ``max_length``
    tokens; each piece is one causal sequence (documents see the ones before them in the piece, as in TRL)."""
    ids = [t for r in rows for t in r.input_ids]
    labels = [t for r in rows for t in r.labels]
    return [SftRow(input_ids=tuple(ids[i:i + max_length]), labels=tuple(labels[i:i + max_length]))
            for i in range(0, len(ids), max_length)]


def labels_view(layout: Layout) -> np.ndarray:
    """A ``labels`` column for code that looks for one: ``labels[p]`` is ``input_ids[p]`` where the
    position before it trains that token and ``p`` continues its document (its depth is one more), else
    -100. For a causal row that is TRL's labels (but for the first token of each document, which
    nothing predicts); for a tree it shows the trained tokens laid out first in depth-first order."""
    labels = np.full(len(layout), IGNORE, dtype=np.int64)
    if len(layout) > 1:
        nxt = (layout.position_ids[1:] == layout.position_ids[:-1] + 1) & \
              (layout.targets[:-1] == layout.input_ids[1:])
        labels[1:] = np.where(nxt, layout.input_ids[1:], IGNORE)
    return labels


def seq_lengths(layout: Layout) -> list[int]:
    """The lengths of a row's documents (trees or sequences; each starts at depth 0): TRL's packing column."""
    starts = np.flatnonzero(layout.position_ids == 0)
    if len(starts) == 0:
        return [len(layout)]
    return np.diff(np.append(starts, len(layout))).tolist()
