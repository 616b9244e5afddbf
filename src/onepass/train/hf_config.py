"""``OnePassConfig``: TRL's ``SFTConfig``, field for field, plus the one-pass settings.

Why this module exists: a user moving a TRL script to one-pass should change
class names, not arguments. :class:`OnePassConfig` subclasses
``transformers.TrainingArguments`` (not TRL's ``SFTConfig``: TRL is an
optional dependency and ``import onepass`` must not need it) and mirrors every
field ``SFTConfig`` adds or re-defaults, with TRL's name, type and default
(``tests/train/test_hf_config.py`` compares the two classes field by field and
fails on a TRL field this module does not list in :data:`SFT_FIELDS`).

Where onepass does something else than TRL, the reason is written here once:
:data:`DEFAULT_DIFFERENCES` (a default we changed) and :data:`SFT_FIELDS` (what
each TRL field does here); ``docs/train.md`` shows both as a table (tested). A
value onepass cannot honour is accepted and logs one WARNING line, once per
process, saying what is done instead; a value that would change the objective
without saying so (``loss_type='dft'``) is refused in one line.

The one-pass settings: ``schedule`` (default ``budget``: one tree per
conversation, split into several trees where it is longer than ``max_length``),
``weighting``, ``completion_format``, ``template_kwargs``, ``reasoning``,
``allow_inexact``; ``max_tokens`` is an alias of ``max_length``. They stay flat
fields (an ``SFTConfig`` drop-in, read by ``HfArgumentParser``) and are built
once into a :class:`~onepass.data_config.DataConfig` (:attr:`OnePassConfig.data_config`,
the schedule parsed there), which is all the data preparation reads; their
help texts and checks are DataConfig's.

    >>> args = OnePassConfig("out", max_length=2048, report_to="none", use_cpu=True)
    >>> args.schedule, args.max_tokens, args.weighting, args.learning_rate
    ('budget', 2048, 'token', 2e-05)
    >>> args.data_config.schedule_spec, args.data_config.max_tokens
    (Schedule(kind='budget', k=0), 2048)
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

from transformers import TrainingArguments

from onepass.data_config import DataConfig, data_field_help

log = logging.getLogger("onepass")

# TRL's SFTConfig fields (beyond TrainingArguments, or re-defaulted by it) -> what onepass does with each.
# "as TRL" means the same meaning and code path; anything else says what differs. A TRL release that adds a
# field fails tests/train/test_hf_config.py until it is listed here (and in docs/train.md).
SFT_FIELDS: dict[str, str] = {
    "learning_rate": "as TRL (2e-5)",
    "logging_steps": "as TRL (10)",
    "gradient_checkpointing": "as TRL (on); PEFT models get enable_input_require_grads as in TRL",
    "bf16": "as TRL (on unless fp16), except on a machine without bf16 support: off, with a warning "
            "(TRL stops there)",
    "lr_scheduler_kwargs": "as TRL",
    "use_liger_kernel": "as TRL: layer kernels only, its fused cross entropy is refused (one-pass computes the loss)",
    "torch_empty_cache_steps": "as TRL",
    "model_init_kwargs": "as TRL: from_pretrained keyword arguments when model is a string",
    "trust_remote_code": "as TRL: forwarded to the model's and the tokenizer's from_pretrained",
    "router_aux_loss_coef": "not added: a MoE load-balancing loss over a tree's tokens is not N-pass's; a value "
                            "other than 0 logs a warning",
    "chat_template_path": "as TRL: a .jinja/.j2 file, or a tokenizer folder or hub id whose template is copied "
                          "(onepass also takes builtin:NAME); saved with every checkpoint",
    "dataset_text_field": "a plain-text column has no turns: a dataset with only this column is refused "
                          "(one-pass trains conversations)",
    "dataset_kwargs": "as TRL: skip_prepare_dataset=True takes datasets of one-pass rows as they are",
    "dataset_num_proc": "as TRL: that many processes render the conversations (with a progress bar)",
    "eos_token": "as TRL: set on the tokenizer and the model's config and generation config; the chat "
                 "template decides what ends a turn",
    "max_length": "the tree budget: a conversation longer than this is split into several trees (schedule "
                  "budget), a single turn longer than this is a counted skip; TRL truncates instead",
    "truncation_mode": "onepass never truncates; keep_end logs a warning",
    "shuffle_dataset": "as TRL: the conversations are shuffled with seed before rendering",
    "packing": "as TRL: trees of several conversations packed into rows of max_length tokens (best-fit "
               "decreasing); a step is then per_device_train_batch_size rows, as in TRL",
    "packing_strategy": "bfd and bfd_split as TRL's bfd (trees are split by the schedule, never cut); "
                        "wrapped (cuts sequences) packs with bfd, with a warning",
    "padding_free": "as TRL: a micro-batch is one row (its rows concatenated), any attention backend",
    "pad_to_multiple_of": "as TRL: rows are padded to a multiple of it",
    "eval_packing": "as TRL: packing for the eval datasets (None: packing)",
    "completion_only_loss": "onepass trains the assistant turns only: False logs a warning",
    "assistant_only_loss": "True by default (see the differences); False logs a warning",
    "loss_type": "nll as TRL; dft is refused (not implemented for the one-pass loss)",
    "activation_offloading": "as TRL: saved activations go to CPU memory (torch.autograd.graph.save_on_cpu)",
    "pad_token": "as TRL: set on the tokenizer and the model config (onepass pads with its own untrained "
                 "positions)",
}

# Defaults that differ from SFTConfig's, each with its reason.
DEFAULT_DIFFERENCES: dict[str, str] = {
    "assistant_only_loss": "True (TRL: False): the one-pass loss is the per-turn N-pass loss, which trains the "
                           "assistant turns only; TRL's default trains the prompts too",
}

_WARNED: set[str] = set()


def warn_once(key: str, message: str) -> None:
    """One WARNING line per ``key`` per process: what onepass does instead of what was asked."""
    if key not in _WARNED:
        _WARNED.add(key)
        log.warning("onepass: %s", message)


def _json(value: Any, name: str) -> dict[str, Any]:
    """A ``dict | str | None`` field (HfArgumentParser passes dicts as JSON text) as a dict."""
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise ValueError(f"{name} must be a mapping or JSON text of one, got {value!r}") from None
    if not isinstance(value, dict):
        raise TypeError(f"{name} must be a mapping, got {value!r}")
    return value


def _bf16_supported(args: TrainingArguments) -> bool:
    """The check ``TrainingArguments`` makes before it accepts ``bf16=True``."""
    from transformers.utils import is_torch_bf16_gpu_available, is_torch_xla_available

    return bool(args.use_cpu or is_torch_bf16_gpu_available() or is_torch_xla_available())


def _h(text: str) -> dict[str, Any]:
    return {"help": text}


@dataclass
class OnePassConfig(TrainingArguments):
    """``SFTConfig``'s fields with TRL's defaults, plus the one-pass settings (see the module doc)."""

    _VALID_DICT_FIELDS = [*TrainingArguments._VALID_DICT_FIELDS, "model_init_kwargs", "dataset_kwargs"]

    # TrainingArguments fields that TRL re-defaults
    learning_rate: float = field(default=2e-5, metadata=_h("The initial learning rate for AdamW."))
    logging_steps: float = field(default=10, metadata=_h("Log every X updates steps (a float < 1: a ratio of "
                                                         "the total steps)."))
    gradient_checkpointing: bool = field(default=True, metadata=_h("Recompute activations in the backward pass."))
    bf16: bool | None = field(default=None, metadata=_h("bf16 mixed precision; None: on unless fp16 (off, with "
                                                        "a warning, where the machine has no bf16)."))
    lr_scheduler_kwargs: dict | str | None = field(default=None, metadata=_h("Extra lr_scheduler arguments."))
    use_liger_kernel: bool = field(default=False, metadata=_h("Liger layer kernels (not its fused loss)."))
    torch_empty_cache_steps: int | None = field(
        default=None, metadata=_h("Steps between torch.<device>.empty_cache() calls (None: never)."))

    # SFTConfig: the model
    model_init_kwargs: dict[str, Any] | str | None = field(
        default=None, metadata=_h("from_pretrained keyword arguments when model is a string"))
    trust_remote_code: bool = field(default=False, metadata=_h("allow models/tokenizers with custom code"))
    router_aux_loss_coef: float | None = field(
        default=None, metadata=_h("MoE load-balancing loss coefficient; not added by onepass (a warning)"))
    chat_template_path: str | None = field(
        default=None, metadata=_h("a .jinja file, a tokenizer folder or hub id, or builtin:NAME: the chat template"))
    # SFTConfig: the data
    dataset_text_field: str = field(default="text", metadata=_h("plain-text column (refused: no turns)"))
    dataset_kwargs: dict[str, Any] | str | None = field(
        default=None, metadata=_h("{\"skip_prepare_dataset\": true}: the datasets are one-pass rows already"))
    dataset_num_proc: int | None = field(default=None, metadata=_h("processes that render the conversations"))
    eos_token: str | None = field(default=None, metadata=_h("the tokenizer's (and model's) end-of-sequence token"))
    max_length: int | None = field(
        default=1024, metadata=_h("tree token budget: longer conversations are split into several trees"))
    truncation_mode: str = field(default="keep_start", metadata={
        "help": "accepted; onepass never truncates", "choices": ["keep_end", "keep_start"]})
    shuffle_dataset: bool = field(default=False, metadata=_h("shuffle the conversations (seed) before rendering"))
    packing: bool = field(default=False, metadata=_h("pack trees of several conversations into rows of "
                                                     "max_length tokens; a step then counts rows"))
    packing_strategy: str = field(default="bfd", metadata={
        "help": "bfd | bfd_split (the same here) | wrapped (packs with bfd)", "choices": ["bfd", "bfd_split",
                                                                                           "wrapped"]})
    padding_free: bool = field(default=False, metadata=_h("one row per micro-batch (rows concatenated)"))
    pad_to_multiple_of: int | str | None = field(default="auto", metadata=_h("pad rows to a multiple of this"))
    eval_packing: bool | None = field(default=None, metadata=_h("pack the eval datasets (None: packing)"))
    # SFTConfig: the loss
    completion_only_loss: bool | None = field(
        default=None, metadata=_h("accepted; one-pass always trains on the assistant turns only"))
    assistant_only_loss: bool = field(
        default=True, metadata=_h("accepted; one-pass always trains on the assistant turns only"))
    loss_type: str = field(default="nll", metadata={"help": "nll (dft is not implemented for one-pass)",
                                                    "choices": ["nll", "dft", "chunked_nll"]})
    activation_offloading: bool = field(default=False, metadata=_h("keep saved activations in CPU memory"))
    pad_token: str | None = field(default=None, metadata=_h("deprecated in TRL; the tokenizer's pad token"))

    # one-pass
    # (the data settings of DataConfig, flat; default schedule budget: one tree per conversation, split to fit
    # max_length; help and choices are DataConfig's)
    schedule: str = field(default="budget", metadata=data_field_help("schedule"))
    weighting: str = field(default="token", metadata=data_field_help("weighting"))
    max_tokens: int | None = field(default=None, metadata=_h("alias of max_length"))
    completion_format: str | None = field(default=None, metadata=data_field_help("completion_format"))
    template_kwargs: dict | str | None = field(
        default=None, metadata=_h("extra chat template variables, e.g. {\"enable_thinking\": false}"))
    reasoning: str = field(default="keep", metadata=data_field_help("reasoning"))
    share_prefix: bool = field(default=True, metadata=data_field_help("share_prefix"))  # with packing
    share_window: int | None = field(default=None, metadata=data_field_help("share_window"))
    allow_inexact: bool = field(
        default=False, metadata=_h("train even when the exactness guard finds one-pass != N-pass"))

    def __post_init__(self) -> None:
        if self.bf16 is None:
            self.bf16 = not self.fp16 and _bf16_supported(self)
            if not self.fp16 and not self.bf16:
                warn_once("bf16", "bf16=None: this machine has no bf16 support, training in float32 (TRL stops "
                                  "here; pass use_cpu=True for bf16 on CPU, or bf16=False to silence this)")
        if getattr(self, "activation_checkpointing", False) is None and self.gradient_checkpointing:
            self.activation_checkpointing = True  # TRL's default, under transformers' new name (no FutureWarning)
        super().__post_init__()
        if self.max_tokens is not None:
            if self.max_length not in (None, 1024, self.max_tokens):
                raise ValueError(f"max_length={self.max_length} and max_tokens={self.max_tokens} disagree; "
                                 "max_tokens is an alias of max_length: set one")
            self.max_length = self.max_tokens
        self.max_tokens = self.max_length
        self.template_kwargs = _json(self.template_kwargs, "template_kwargs")
        self.model_init_kwargs = _json(self.model_init_kwargs, "model_init_kwargs") or None
        self.dataset_kwargs = _json(self.dataset_kwargs, "dataset_kwargs") or None
        if isinstance(self.pad_to_multiple_of, str):
            text = self.pad_to_multiple_of.lower()
            self.pad_to_multiple_of = None if text in ("auto", "none", "null") else int(text)
        if self.loss_type == "chunked_nll":
            self.loss_type = "nll"
        if self.loss_type != "nll":
            raise ValueError(f"loss_type={self.loss_type!r} is not implemented for the one-pass loss; use 'nll'")
        self.data_config  # built (and checked) now: a bad schedule or weighting is one line here
        self._warn_unhonoured()

    def _warn_unhonoured(self) -> None:
        """One WARNING line, once, for each value onepass does not do as TRL would."""
        if self.completion_only_loss is False or not self.assistant_only_loss:
            warn_once("assistant_only_loss", "completion_only_loss/assistant_only_loss=False: one-pass trains on the "
                                             "assistant turns only (the loss of N-pass SFT); prompts are never trained")
        if self.truncation_mode == "keep_end":
            warn_once("truncation_mode", "truncation_mode='keep_end': onepass never truncates; a conversation over "
                                         "max_length is split into trees, a turn over it is a counted skip")
        if self.packing_strategy == "wrapped" and (self.packing or self.eval_packing):
            warn_once("packing_strategy", "packing_strategy='wrapped' cuts sequences, which would cut trees: "
                                          "packing with 'bfd' (best-fit decreasing) instead")
        if self.router_aux_loss_coef:
            warn_once("router_aux_loss_coef", f"router_aux_loss_coef={self.router_aux_loss_coef}: the MoE "
                                              "load-balancing loss is not added (over a tree's tokens it is not "
                                              "N-pass's); training on the cross entropy alone")

    @property
    def dataset_prepared(self) -> bool:
        """``dataset_kwargs={"skip_prepare_dataset": True}``: the datasets hold one-pass rows already."""
        return bool((self.dataset_kwargs or {}).get("skip_prepare_dataset", False))

    def _data_values(self) -> dict[str, Any]:
        return {"schedule": self.schedule, "max_tokens": self.max_length, "weighting": self.weighting,
                "completion_format": self.completion_format, "reasoning": self.reasoning,
                "template_kwargs": dict(self.template_kwargs or {}), "share_prefix": self.share_prefix,
                "share_window": self.share_window}

    @property
    def data_config(self) -> DataConfig:
        """The data settings as one :class:`~onepass.data_config.DataConfig` (``max_tokens`` is ``max_length``;
        ``pack`` False: ``packing`` packs the trees of several conversations, :mod:`onepass.train.hf_data`).
        Built, and the schedule parsed, once; again only after one of the fields was set to another value."""
        values = self._data_values()
        built = self.__dict__.get("_data_config")
        if built is None or built[0] != values:
            built = (values, DataConfig(**values))
            self.__dict__["_data_config"] = built
        return built[1]

    def render_config(self) -> Any:
        """How conversations are rendered: ``data_config.render``."""
        return self.data_config.render
