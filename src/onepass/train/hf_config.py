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
process, saying what is done instead. The checks ``SFTConfig.__post_init__`` makes
(``loss_type``, the deprecated ``chunked_nll``, ``pad_token``, ``keep_end``, ``bfd-requeue``) are made
here with messages that say the same; the ones ``SFTTrainer.__init__`` makes are in
:mod:`onepass.train.trainer.trainer`.

Add a field (a TRL release adds one and ``tests/train/test_hf_config.py`` fails naming it): the field on
:class:`OnePassConfig` with TRL's name, type and default, a row of :data:`SFT_FIELDS` saying what
onepass does with it ("as TRL", or what differs and why), and the row of the docs/train.md table (the
test compares them). A default onepass changes is a row of :data:`DEFAULT_DIFFERENCES` too.

The one-pass settings: ``schedule`` (default ``budget``: one tree per
conversation, split into several trees where it is longer than ``max_length``),
``weighting``, ``completion_format``, ``template_kwargs``, ``reasoning``, ``template_date`` (the date a
chat template that reads the clock renders; None: today, resolved when the config is built and shown in
``to_dict()``), ``train_greeting``, ``allow_inexact``; ``max_tokens`` is an alias of ``max_length``. They stay flat
fields (an ``SFTConfig`` drop-in, read by ``HfArgumentParser``) and are built
once into a :class:`~onepass.prepare.config.DataConfig` (:attr:`OnePassConfig.data_config`,
the schedule parsed there, the date resolved there), which is all the data preparation reads. The data
settings' fields are generated from DataConfig's (:func:`with_data_settings`; where the flat spelling differs,
a row of :data:`FLAT_SPELLING`), so their names, defaults, help texts and checks are DataConfig's; the ranges
of the ``TrainingArguments`` hyper-parameters are ``onepass train``'s (:mod:`onepass.train.hyperparams`).

    >>> args = OnePassConfig("out", max_length=2048, report_to="none", use_cpu=True)
    >>> args.schedule, args.max_tokens, args.weighting, args.learning_rate
    ('budget', 2048, 'token', 2e-05)
    >>> args.data_config.schedule_spec, args.data_config.max_tokens
    (Schedule(kind='budget', k=0), 2048)
"""

from __future__ import annotations

import json
import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from transformers import TrainingArguments

from onepass.prepare.config import DataConfig
from onepass.settings import Leaf, leaves
from onepass.train.config import TrainConfigError
from onepass.train.hyperparams import check_hyperparameters, epochs_counted

log = logging.getLogger("onepass")

# TRL's SFTConfig fields (beyond TrainingArguments, or re-defaulted by it) -> what onepass does with each.
# "as TRL" means the same meaning and code path; anything else says what differs. A TRL release that adds a
# field fails tests/train/test_hf_config.py until it is listed here (and in docs/train.md).
SFT_FIELDS: dict[str, str] = {
    "learning_rate": "as TRL (2e-5)",
    "logging_steps": "as TRL (10)",
    "gradient_checkpointing": "as TRL (on); PEFT models get enable_input_require_grads as in TRL; "
                              "activation_checkpointing (transformers' new name) is taken too, and the default "
                              "raises no v6 FutureWarning",
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
    "dataset_text_field": "as TRL: a text record is language modeling (EOS appended, every token trained), one "
                          "plain causal row",
    "dataset_kwargs": "as TRL: skip_prepare_dataset=True takes tokenized rows (input_ids, labels) or one-pass "
                      "rows as they are",
    "dataset_num_proc": "as TRL: that many processes render the conversations (with a progress bar)",
    "eos_token": "as TRL: set on the tokenizer and the model's config and generation config; the chat "
                 "template decides what ends a turn",
    "max_length": "as TRL for text, prompt-completion and tokenized rows (truncated, fully masked ones dropped); "
                  "for conversations the tree budget: one longer than this is split into several trees (schedule "
                  "budget), a single turn longer than this is a counted skip (truncating a tree is not N-pass's "
                  "truncation)",
    "truncation_mode": "as TRL for TRL's rows (keep_end deprecated, with TRL's warning); trees are never cut",
    "shuffle_dataset": "as TRL: the conversations are shuffled with seed before rendering",
    "packing": "as TRL: trees of several conversations packed into rows of max_length tokens (best-fit "
               "decreasing); a step is then per_device_train_batch_size rows, as in TRL",
    "packing_strategy": "as TRL for TRL's rows (bfd truncates, bfd_split splits, wrapped cuts one stream); "
                        "trees are packed whole (bfd; wrapped would cut them, a warning says so)",
    "padding_free": "as TRL: a micro-batch is one row (its rows concatenated), any attention backend; as TRL, "
                    "refused without packing while max_length is set",
    "pad_to_multiple_of": "as TRL: rows are padded to a multiple of it",
    "eval_packing": "as TRL: packing for the eval datasets (None: packing)",
    "completion_only_loss": "as TRL for prompt-completion rows (None: the completion only); conversations "
                            "train their assistant turns",
    "assistant_only_loss": "None by default (see the differences); True: TRL's assistant masks on prompt-completion "
                           "rows; False: conversations as TRL renders them, one sequence, every token trained",
    "loss_type": "as TRL: nll, or dft (each target's cross entropy times its detached probability; exact on a "
                 "tree, since views sharing a target share its probability)",
    "activation_offloading": "as TRL: saved activations go to CPU memory (torch.autograd.graph.save_on_cpu)",
    "pad_token": "as TRL: set on the tokenizer and the model config (onepass pads with its own untrained "
                 "positions)",
}

# Defaults that differ from SFTConfig's, each with its reason.
DEFAULT_DIFFERENCES: dict[str, str] = {
    "assistant_only_loss": "None (TRL: False): a conversation trains its assistant turns, each turn in the context "
                           "the model sees at that turn (the per-turn N-pass loss, in one pass); TRL's False trains "
                           "one rendering of the conversation, prompts included (set False for that). Left None on "
                           "data with conversations, the trainer says so at construction in one WARNING line, once; "
                           "True keeps onepass's loss and says nothing",
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


def check_ranges(args: TrainingArguments) -> None:
    """The hyper-parameters in range (:mod:`onepass.train.hyperparams`, the table ``onepass train`` reads);
    ``num_train_epochs`` only where it counts (no ``max_steps``), as the Trainer reads it. A field the installed
    release declares optional with ``None`` as its default, left ``None``, is not given (transformers 5.2's
    deprecated ``warmup_ratio``) and is not checked; ``None`` where the release's default is a number is."""
    fields = getattr(type(args), "__dataclass_fields__", {})
    unset = {name for name, f in fields.items() if f.default is None and getattr(args, name, 0) is None}
    names = tuple(n for n in epochs_counted(args.max_steps <= 0) if n not in unset)
    check_hyperparameters(args, names=names, error=TrainConfigError)


def _h(text: str) -> dict[str, Any]:
    return {"help": text}


# DataConfig's settings as OnePassConfig spells them, where that differs from DataConfig's field (the rest: its
# name, type, default, help and choices). ``None``: not a field (TRL's ``packing`` packs).
FLAT_SPELLING: dict[str, dict[str, Any] | None] = {
    "pack": None,
    "schedule": {"type": "str", "default": "budget"},  # one tree per conversation, split to fit max_length
    "max_tokens": {"help": "alias of max_length"},
    "template_kwargs": {"type": "dict | str | None", "default": None,  # JSON text on HfArgumentParser's command line
                        "help": "extra chat template variables, e.g. {\"enable_thinking\": false}"},
    "template_date": {"type": "str | None"},
}


def with_data_settings(source: type) -> Callable[[type], type]:
    """A class decorator (under ``@dataclass``) adding each setting of ``source`` (a
    :class:`~onepass.prepare.config.DataConfig`) as a flat field, spelled as :data:`FLAT_SPELLING` says, and
    recording ``source`` as the record :attr:`OnePassConfig.data_config` builds: a data setting is declared once,
    on DataConfig, and ``OnePassConfig`` (its fields, ``HfArgumentParser``'s flags, ``to_dict``) follows."""

    def add(cls: type) -> type:
        for leaf in leaves(source):
            spelling = FLAT_SPELLING.get(leaf.name, {})
            if spelling is None:
                continue
            cls.__annotations__[leaf.name] = spelling.get("type", leaf.field.type)
            meta = {"help": spelling["help"]} if "help" in spelling else _flat_help(leaf)
            setattr(cls, leaf.name, field(default=spelling.get("default", leaf.default), metadata=meta))
        cls.DATA_CONFIG = source  # type: ignore[attr-defined]
        return cls

    return add


def _flat_help(leaf: Leaf) -> dict[str, Any]:
    """``help`` and ``choices`` as ``HfArgumentParser`` reads them."""
    choices = leaf.meta["choices"]
    return {"help": leaf.meta["help"], **({"choices": list(choices)} if choices else {})}


@dataclass
@with_data_settings(DataConfig)
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
        default=None, metadata=_h("prompt-completion rows: train the completion only (None: True, as TRL)"))
    assistant_only_loss: bool | None = field(
        default=None, metadata=_h("None: conversations train their assistant turns one-pass; True: also TRL's "
                                  "assistant masks on prompt-completion rows; False: conversations as one "
                                  "sequence, every token trained (TRL's default)"))
    loss_type: str = field(default="nll", metadata={"help": "nll, or dft (Dynamic Fine-Tuning)",
                                                    "choices": ["nll", "dft", "chunked_nll"]})
    activation_offloading: bool = field(default=False, metadata=_h("keep saved activations in CPU memory"))
    pad_token: str | None = field(default=None, metadata=_h("deprecated in TRL; the tokenizer's pad token"))

    # one-pass: the data settings of DataConfig, flat, are added by @_with_data_settings (after this field)
    allow_inexact: bool = field(
        default=False, metadata=_h("train even when the exactness guard finds one-pass != N-pass"))
    sp_size: int = field(default=1, metadata=_h("sequence parallelism: split each row over this many processes "
                                                "(Ulysses); the processes must be a multiple of it"))

    def __post_init__(self) -> None:
        if self.bf16 is None:
            self.bf16 = not self.fp16 and _bf16_supported(self)
            if not self.fp16 and not self.bf16:
                warn_once("bf16", "bf16=None: this machine has no bf16 support, training in float32 (TRL stops "
                                  "here; pass use_cpu=True for bf16 on CPU, or bf16=False to silence this)")
        if getattr(self, "activation_checkpointing", False) is None and self.gradient_checkpointing:
            self.activation_checkpointing = True  # TRL's default, under transformers' new name (no FutureWarning)
        super().__post_init__()
        check_ranges(self)
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
            warnings.warn("`loss_type='chunked_nll'` is deprecated (as in TRL); use `loss_type='nll'`, which "
                          "computes the loss the same way", FutureWarning, stacklevel=3)
            self.loss_type = "nll"
        if self.loss_type not in ("nll", "dft"):
            raise ValueError(f"Invalid `loss_type` {self.loss_type} passed. Supported values are 'nll' and 'dft'.")
        if self.pad_token is not None:
            warnings.warn("`pad_token` is deprecated (as in TRL). Set `tokenizer.pad_token` directly and pass it as "
                          "`processing_class` to the trainer instead.", FutureWarning, stacklevel=3)
        if self.packing_strategy == "bfd-requeue":
            warnings.warn("The `bfd-requeue` packing strategy has been renamed to `bfd_split` (as in TRL).",
                          FutureWarning, stacklevel=3)
            self.packing_strategy = "bfd_split"
        self.data_config.check_share_window(pack=self.packing, flag="packing=True")  # built (and checked) now: a
        # bad schedule or weighting, a share_window nothing reads, is one line here
        self._warn_unhonoured()

    def _warn_unhonoured(self) -> None:
        """One WARNING line, once, for each value onepass does not do as TRL would."""
        if self.truncation_mode == "keep_end":
            warnings.warn("The `'keep_end'` truncation mode is deprecated (as in TRL); use "
                          "`truncation_mode='keep_start'` (the default)", FutureWarning, stacklevel=3)
            warn_once("truncation_mode", "truncation_mode='keep_end' truncates TRL's rows (text, prompt-completion, "
                                         "tokenized); a conversation over max_length is split into trees, a turn "
                                         "over it is a counted skip")
        if self.packing_strategy == "wrapped" and (self.packing or self.eval_packing):
            warn_once("packing_strategy", "packing_strategy='wrapped' cuts TRL's rows as TRL does; conversation trees "
                                          "are never cut: they are packed whole (best-fit decreasing)")
        if self.router_aux_loss_coef:
            warn_once("router_aux_loss_coef", f"router_aux_loss_coef={self.router_aux_loss_coef}: the MoE "
                                              "load-balancing loss is not added (over a tree's tokens it is not "
                                              "N-pass's); training on the cross entropy alone")

    @property
    def dataset_prepared(self) -> bool:
        """``dataset_kwargs={"skip_prepare_dataset": True}``: the datasets hold one-pass rows already."""
        return bool((self.dataset_kwargs or {}).get("skip_prepare_dataset", False))

    def _data_values(self) -> dict[str, Any]:
        values = {leaf.name: getattr(self, leaf.name) for leaf in leaves(self.DATA_CONFIG)
                  if FLAT_SPELLING.get(leaf.name, {}) is not None}
        return {**values, "max_tokens": self.max_length, "template_kwargs": dict(self.template_kwargs or {})}

    @property
    def data_config(self) -> DataConfig:
        """The data settings as one :class:`~onepass.prepare.config.DataConfig` (``max_tokens`` is ``max_length``;
        ``pack`` False: ``packing`` packs the trees of several conversations, :mod:`onepass.train.trainer.data`).
        Built, and the schedule parsed, once; again only after one of the fields was set to another value."""
        values = self._data_values()
        built = self.__dict__.get("_data_config")
        if built is None or built[0] != values:
            config = self.DATA_CONFIG(**values)
            self.template_date = config.template_date  # resolved there, once: the run renders one date (to_dict)
            built = ({**values, "template_date": config.template_date}, config)
            self.__dict__["_data_config"] = built
        return built[1]

    def render_config(self) -> Any:
        """How conversations are rendered: ``data_config.render``."""
        return self.data_config.render
