"""The argument checks TRL's ``SFTTrainer.__init__`` makes, made for ``OnePassTrainer`` with messages that say
the same (TRL's wording where it is a drop-in's, ours where it says more).

Why this module exists: a config TRL rejects must not be accepted by a drop-in for it, and a user who
moves a script should meet the same error at the same place. Each function is one group of TRL's checks,
in TRL's order; :class:`~onepass.train.trainer.trainer.OnePassTrainer` calls them. The checks of
``SFTConfig.__post_init__`` are in :mod:`onepass.train.hf_config`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from onepass.model.couplings import base_model, is_peft
from onepass.train.core import sft_rows

log = logging.getLogger("onepass")


def first_record(dataset: Any) -> Any:
    """The dataset's first record (TRL's ``dataset_sample``), None for an empty one."""
    if isinstance(dataset, (list, tuple)):
        return dataset[0] if dataset else None
    return next(iter(dataset), None)


def check_train_dataset(train_dataset: Any, args: Any) -> Any:
    """``train_dataset`` is required and a ``Dataset`` or ``IterableDataset`` (onepass also takes a list of
    records); an ``IterableDataset`` trains with ``dispatch_batches=False``, as in TRL. Returns its first
    record."""
    import datasets

    if train_dataset is None:
        raise ValueError("`train_dataset` is required")
    if isinstance(train_dataset, datasets.IterableDataset):
        if args.accelerator_config.dispatch_batches is True:
            log.warning("onepass: an IterableDataset trains with dispatch_batches=False (as in TRL)")
        args.accelerator_config.dispatch_batches = False
    elif not isinstance(train_dataset, (datasets.Dataset, list, tuple)):
        raise TypeError(f"`train_dataset` must be a `Dataset` or `IterableDataset` (or a list of records), got "
                        f"`{type(train_dataset).__name__}`.")
    return first_record(train_dataset)


def check_processing_class(processing_class: Any) -> None:
    from transformers import PreTrainedTokenizerBase, ProcessorMixin

    if processing_class is not None and not isinstance(processing_class, (PreTrainedTokenizerBase, ProcessorMixin)):
        raise TypeError("The `processing_class` must be either a `PreTrainedTokenizerBase` or a `ProcessorMixin`")


def check_vision(first: Any, tokenizer: Any) -> None:
    """TRL's check: a record with ``image``/``images`` needs a vision-language model; onepass trains text
    models only, so it is one line either way."""
    if isinstance(first, Mapping) and ("image" in first or "images" in first):
        from transformers import ProcessorMixin

        if not isinstance(tokenizer, ProcessorMixin):
            raise ValueError("The dataset appears to be vision-related (contains 'image' or 'images' keys), but "
                             "the provided model does not seem to be a vision-language model: onepass trains text "
                             "models (drop the image column, or use SFTTrainer for a vision-language model)")
        raise ValueError("the dataset has an 'image'/'images' column: onepass trains text-only models, where one "
                         "pass per conversation is exact; use SFTTrainer for vision-language models")


def check_peft_config(peft_config: Any) -> None:
    if peft_config is None:
        return
    try:
        from peft import PeftConfig
    except ImportError:
        raise ImportError("You passed `peft_config` but the `peft` library is not installed: pip install peft"
                          ) from None
    if not isinstance(peft_config, PeftConfig):
        raise TypeError(f"`peft_config` must be a `peft.PeftConfig` instance (e.g. `peft.LoraConfig`), got "
                        f"{type(peft_config).__name__}.")


def padding_free(args: Any) -> bool:
    """TRL's rule: ``padding_free``, or packing with ``bfd``/``bfd_split`` (its rows are documents side by side)."""
    return bool(args.padding_free or (args.packing and args.packing_strategy in {"bfd", "bfd_split"}))


def completion_only_loss(args: Any, sample: Any) -> bool:
    """TRL's: ``args.completion_only_loss``, or (None) whether the first record is prompt-completion."""
    if args.completion_only_loss is not None:
        return bool(args.completion_only_loss)
    return isinstance(sample, Mapping) and "prompt" in sample and "completion" in sample


def check_data_settings(args: Any, sample: Any, *, data_collator: Any, formatting_func: Any) -> None:
    """TRL's checks of the data settings against the first record and the collator."""
    if padding_free(args):
        if data_collator is not None:
            raise ValueError("Passing a custom data collator is not supported when using padding-free.")
        if args.per_device_train_batch_size == 1 and not args.packing:
            log.warning("onepass: padding_free with per_device_train_batch_size=1 concatenates nothing (as in TRL: "
                        "use a batch size of at least 2)")
    if args.assistant_only_loss and isinstance(sample, Mapping):
        kind = sft_rows.record_kind(sample, args.dataset_text_field)
        chat = kind == sft_rows.MESSAGES or (kind == sft_rows.PROMPT_COMPLETION and sft_rows.is_conversational(sample))
        if not chat:
            raise ValueError("You set `assistant_only_loss=True`, but the dataset is not conversational. This option "
                             "is only supported for conversational datasets.")
    if padding_free(args) and not args.packing and args.max_length is not None:
        raise ValueError("When `padding_free=True` without packing, `max_length` is not enforced. Either enable "
                         "packing (e.g., `packing=True, packing_strategy='bfd'`), provide already truncated inputs, "
                         "or set `max_length=None`.")
    if not args.dataset_prepared and completion_only_loss(args, sample) and formatting_func is not None:
        raise ValueError("A formatting function was provided while `completion_only_loss=True`, which is "
                         "incompatible. Using a formatter converts the dataset to a language modeling type, "
                         "conflicting with completion-only loss. To resolve this, apply your formatting function "
                         "before passing the dataset, or disable `completion_only_loss`.")


def check_model(model: Any, args: Any) -> None:
    """TRL's checks of the model against the settings: a PEFT adapter on the LM head, a load-balancing
    coefficient for a model without a router, Liger's fused cross entropy, selective checkpointing."""
    if is_peft(model):
        from peft.tuners.tuners_utils import BaseTunerLayer

        if isinstance(model.get_output_embeddings(), BaseTunerLayer):
            raise ValueError("Applying a PEFT adapter to `lm_head` is not supported: the loss projects the hidden "
                             "states with `lm_head.weight` in chunks, so the adapter would never be trained. Remove "
                             "`'lm_head'` from your `target_modules`.")
    config = base_model(model).config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if args.router_aux_loss_coef and not hasattr(text, "output_router_logits"):
        raise ValueError(f"`router_aux_loss_coef` is set to {args.router_aux_loss_coef} but "
                         f"{type(base_model(model)).__name__} is not a Mixture-of-Experts model that returns its "
                         "router logits, so there is no auxiliary loss to weight.")
    if args.use_liger_kernel and (args.liger_kernel_config or {}).get("fused_linear_cross_entropy"):
        raise ValueError('`liger_kernel_config={"fused_linear_cross_entropy": True}` is not supported: the one-pass '
                         "loss projects the hidden states at the targets itself")
    kwargs = args.gradient_checkpointing_kwargs or {}
    if kwargs.get("selective"):
        if not args.gradient_checkpointing:
            raise ValueError("`gradient_checkpointing_kwargs={'selective': True}` requires "
                             "`gradient_checkpointing=True`.")
        if kwargs.get("use_reentrant"):
            raise ValueError("`gradient_checkpointing_kwargs={'selective': True}` requires non-reentrant gradient "
                             "checkpointing. Set `use_reentrant` to `False`, or leave it unset.")
        log.warning("onepass: gradient_checkpointing_kwargs selective=True (TRL's selective activation "
                    "checkpointing) is not applied: every layer is checkpointed")
    if isinstance(args.gradient_checkpointing_kwargs, dict):
        args.gradient_checkpointing_kwargs.pop("selective", None)


