"""A drop-in for TRL's ``SFTTrainer``: ``transformers.Trainer`` with the one-pass loss (and so DeepSpeed, FSDP,
callbacks, hub push).

Why this module exists: many users already drive training through HF's
``Trainer`` (directly, or through TRL, LLaMA-Factory or axolotl, which
subclass it). :class:`OnePassTrainer` takes every keyword TRL's
``SFTTrainer`` takes, in its order (``model`` as a name or a model,
``quantization_config``, ``peft_config``, ``formatting_func``, ``callbacks``,
...), and :class:`~onepass.train.hf_config.OnePassConfig` every ``SFTConfig``
field, so a TRL script becomes a one-pass script by changing the import and
the class names (``docs/train.md``; ``tests/train/test_sft_scripts.py`` runs
TRL's own ``trl/scripts/sft.py`` so renamed). It keeps what the Trainer does
and changes only what one-pass needs:

- the datasets are prepared by :mod:`onepass.train.trainer.data` (one item per
  conversation, or packed rows of ``max_length`` tokens with ``packing``); every
  other type SFTTrainer takes (text, prompt-completion, tokenized rows) is TRL's
  row, a plain causal sequence (:mod:`onepass.train.core.sft_rows`), so its loss is TRL's;
- SFTTrainer's argument checks are made (:mod:`onepass.train.trainer.sft_checks`);
- the collator stacks rows and pads them with self-only, untrained positions;
- ``compute_loss`` builds the tree mask from ``kv_end`` for the model's
  attention backend, passes ``position_ids``, asks for logits only at targets
  and returns the weighted cross entropy divided by the sum of target weights
  of the whole optimizer step (all gradient-accumulation micro-batches, all
  processes): with token weighting that is the N-pass number of trained
  tokens, so the loss and gradients equal N-pass; it logs TRL's
  ``num_tokens``, ``mean_token_accuracy`` and ``entropy`` (weighted as the loss);
- ``train()`` first runs the exactness guard (:mod:`onepass.guard`) on a tiny
  float64 twin of the model and refuses, in one line, a model for which
  one-pass is not the N-pass loss, unless ``allow_inexact=True``; at the end it
  writes ``loss.png`` into ``output_dir``.

    from datasets import load_dataset
    from onepass.train import OnePassConfig, OnePassTrainer

    dataset = load_dataset("json", data_files="chats.jsonl", split="train")   # a messages column
    args = OnePassConfig("out", max_length=8192, learning_rate=1e-4)
    trainer = OnePassTrainer(model="Qwen/Qwen3-0.6B", args=args, train_dataset=dataset,
                             peft_config=LoraConfig(r=16))     # the tokenizer is the model's
    trainer.train()

A model given by name is loaded with an attention backend that serves a tree
mask unless ``model_init_kwargs`` names one: ``flex_attention`` on CUDA,
``onepass_cpu`` on CPU (:func:`onepass.attention.default_backend`). DataParallel
(several GPUs in one process) is refused: launch with ``torchrun`` or ``accelerate launch``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from transformers import Trainer, TrainingArguments

from onepass.attention.backends import check_backend, model_backend
from onepass.batch import host_rows
from onepass.conversation.parse import Conversation
from onepass.model.couplings import checkpointing_on
from onepass.errors import UsageError
from onepass.layout.geometry import branches
from onepass.head import add_logit_stats, weighted_ce
from onepass.loss import ForwardView, batch_dft_loss, batch_loss, dft_sum, forward_plan, row_losses
from onepass.model.private_names import private
from onepass.layout.row_check import model_vocab
from onepass.train.trainer import sft_checks
from onepass.train.config import TrainConfigError
from onepass.train.hf_config import OnePassConfig, warn_once
from onepass.train.trainer.data import (  # noqa: F401  (conversation_dataset & co: their documented import path)
    GuardInputs,
    OnePassCollator,
    conversation_dataset,
    parse_dataset,
    prepared_dataset,
    rows_dataset,
)
from onepass.train.trainer.records import as_rows  # noqa: F401  (its import path in tests and scripts)
from onepass.model.couplings import base_model, is_peft, is_prompt_learning, loaded_from
from onepass.train.core.guard import run_guard
from onepass.train.core.normalise import loss_scale, weighted_mean
from onepass.train.checkpoint import NonFiniteWeightsError, non_finite_weights
from onepass.train.distributed import asked_mode, check_fsdp_accelerate, honour_request, without_accelerate_parallelism
from onepass.train.sequence_parallel import check_split, parallel_dims, share_batches, split_model, trainer_sp_size
from onepass.train.trainer.model import chat_template_of, load_model, load_tokenizer, set_special_tokens
from onepass.train.trainer.stream import check_dataset_rows, check_streams, is_stream, trainer_rows
from onepass.train.core.report import plot_losses
from onepass.layout.tree import COLUMNS, IGNORE

log = logging.getLogger("onepass")


def as_onepass_config(args: Any, model: Any) -> OnePassConfig:
    """``args`` as a :class:`OnePassConfig`: ``None`` gives ``OnePassConfig("NAME-onepass")``; a plain
    ``TrainingArguments`` keeps its values and gets the one-pass/SFT defaults for the rest (as TRL does)."""
    if args is None:
        name = model if isinstance(model, str) else loaded_from(model)
        return OnePassConfig(f"{str(name).rstrip('/').split('/')[-1] or 'model'}-onepass")
    if isinstance(args, OnePassConfig):
        return args
    if isinstance(args, TrainingArguments):
        values = args.to_dict()
        values["hub_token"] = args.hub_token  # to_dict hides it
        return OnePassConfig(**values)
    raise TypeError(f"args must be a OnePassConfig or TrainingArguments, got {type(args).__name__}")


TRAINER_PRIVATES = ("transformers.Trainer._set_signature_columns_if_needed",
                    "transformers.Trainer._get_num_items_in_batch", "transformers.Trainer._prepare_inputs")
"""Trainer's private methods :class:`OnePassTrainer` overrides or calls
(:data:`onepass.model.private_names.PRIVATE_NAMES`)."""


# The steps of OnePassTrainer.__init__ before Trainer's own init, in order.


def _check_overridable(compute_loss_func: Callable | None) -> None:
    """Trainer's private methods overridden or called here still exist (one line if gone); no
    ``compute_loss_func``: the loss is one-pass's."""
    for label in TRAINER_PRIVATES:
        private(label)
    if compute_loss_func is not None:
        raise UsageError("compute_loss_func: OnePassTrainer's loss is the one-pass loss (logits exist only at "
                         "the targets); subclass it and override compute_loss to change it")


def _model_of(model: Any, args: OnePassConfig, quantization_config: Any) -> tuple[Any, Any]:
    """The model (loaded when given by name) and where it was loaded from."""
    if isinstance(model, str):
        model_id = model
        model = load_model(model, args, quantization_config)
    else:
        model_id = loaded_from(model)
        if quantization_config is not None:
            warn_once("quantization_config", "quantization_config is ignored: the model is already loaded")
        if args.model_init_kwargs is not None:
            warn_once("model_init_kwargs", "model_init_kwargs are ignored: the model is already loaded")
    return model, model_id


def _processing_class_of(processing_class: Any, model: Any, model_id: Any, args: OnePassConfig, sample: Any) -> Any:
    """The tokenizer (default: the model's, as TRL finds it; none for a model built from a config), checked,
    with ``chat_template_path``'s template and the special tokens the settings name."""
    if processing_class is None and model_id:
        try:
            processing_class = load_tokenizer(model_id, args)
        except OSError as e:  # a model built from a config: fine for datasets of rows
            log.info("onepass: no tokenizer at %s (%s); datasets of conversations need processing_class",
                     model_id, str(e).splitlines()[0])
    sft_checks.check_processing_class(processing_class)
    if processing_class is not None and args.chat_template_path is not None:
        processing_class.chat_template = chat_template_of(args.chat_template_path, args)
    if processing_class is not None:
        set_special_tokens(processing_class, model, args)
    sft_checks.check_vision(sample, processing_class)
    return processing_class


def _with_adapter(model: Any, peft_config: Any, args: OnePassConfig) -> Any:
    """The model with ``peft_config``'s adapter (as TRL: input gradients on under gradient checkpointing,
    QLoRA adapters in bfloat16)."""
    sft_checks.check_peft_config(peft_config)
    if peft_config is not None:
        from peft import get_peft_model

        if is_peft(model):
            raise UsageError("a PeftModel and a peft_config were both given: merge and unload the adapter "
                             "first, or drop peft_config to continue training the adapter")
        model = get_peft_model(model, peft_config)
    if is_peft(model) and checkpointing_on(args):
        model.enable_input_require_grads()  # as TRL: else no gradient reaches checkpointed LoRA layers
    if getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False):
        for name, param in model.named_parameters():  # QLoRA adapters in bf16, as TRL (not DoRA magnitudes)
            if param.requires_grad and "lora_magnitude_vector" not in name:
                param.data = param.data.to(torch.bfloat16)
    return model


def _fit_model_to_loss(model: Any, args: OnePassConfig) -> None:
    """The model checked against the settings; what would add to or bypass the one-pass loss turned off:
    liger's fused linear cross entropy, a mixture of experts' router logits (its load-balancing loss, said)."""
    sft_checks.check_model(model, args)
    if args.use_liger_kernel:
        args.liger_kernel_config = {**(args.liger_kernel_config or {}), "fused_linear_cross_entropy": False}
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if getattr(text, "output_router_logits", None) is not None and getattr(text, "router_aux_loss_coef", 0):
        warn_once("moe_aux_loss", f"{type(base_model(model)).__name__} has a load-balancing loss "
                                  "(router_aux_loss_coef): onepass does not add it (TRL does); training on the "
                                  "cross entropy alone")
    if hasattr(text, "output_router_logits"):
        text.output_router_logits = False  # the router logits would feed the loss onepass does not add


def _datasets_of(train_dataset: Any, eval_dataset: Any, model: Any, processing_class: Any, args: OnePassConfig, *,
                 formatting_func: Callable[[dict], Any] | None) -> tuple[Any, Any]:
    """The train rows (:func:`onepass.train.trainer.stream.trainer_rows`: the dataset and the guard's inputs) and
    the eval dataset (or mapping of them) prepared; every row checked against the model's vocabulary as
    ``onepass train`` checks a prepared folder."""
    if args.dataset_prepared and formatting_func is not None:
        warn_once("formatting_func", "formatting_func is ignored: dataset_kwargs skip_prepare_dataset=True")
    vocab = model_vocab(model)
    check_streams(train_dataset, eval_dataset)  # before anything is read
    train = trainer_rows(train_dataset, processing_class, args, source="train_dataset", vocab_size=vocab,
                         formatting_func=formatting_func)
    eval_packing = args.packing if args.eval_packing is None else args.eval_packing
    if isinstance(eval_dataset, Mapping):
        eval_dataset = {k: trainer_rows(v, processing_class, args, source=f"eval_dataset[{k!r}]", vocab_size=vocab,
                                        packing=eval_packing, formatting_func=formatting_func).dataset
                        for k, v in eval_dataset.items()}
    else:
        eval_dataset = trainer_rows(eval_dataset, processing_class, args, source="eval_dataset", vocab_size=vocab,
                                    packing=eval_packing, formatting_func=formatting_func).dataset
    return train, eval_dataset


class OnePassTrainer(Trainer):
    """``transformers.Trainer`` whose loss is the one-pass loss, normalised as N-pass (see module doc).

    Takes every keyword of TRL's ``SFTTrainer``, in its order: ``model`` (a model, a PeftModel, or a hub id /
    folder loaded with ``args.model_init_kwargs`` and ``quantization_config``), ``args``
    (:class:`~onepass.train.hf_config.OnePassConfig`, or a ``TrainingArguments`` turned into one),
    ``data_collator``, ``train_dataset`` / ``eval_dataset`` (any dataset type SFTTrainer takes, mixed
    record by record, or one-pass rows), ``processing_class`` (the tokenizer; default: the model's, as TRL
    finds it), ``compute_metrics`` and ``preprocess_logits_for_metrics`` (evaluation then runs one more
    forward pass for every position's logits, as TRL's), ``callbacks``, ``optimizers``,
    ``optimizer_cls_and_kwargs``, ``peft_config``, ``formatting_func`` (a record -> text, as TRL, or its
    messages). ``compute_loss_func`` is refused (the loss is one-pass's; TRL deprecates it too).
    """

    def __init__(self, model: Any = None, args: Any = None, data_collator: Any = None, train_dataset: Any = None,
                 eval_dataset: Any = None, processing_class: Any = None, compute_loss_func: Callable | None = None,
                 compute_metrics: Callable | None = None, callbacks: list | None = None,
                 optimizers: tuple[Any, Any] = (None, None), optimizer_cls_and_kwargs: Any = None,
                 preprocess_logits_for_metrics: Callable | None = None, quantization_config: Any = None,
                 peft_config: Any = None, formatting_func: Callable[[dict], Any] | None = None, *,
                 allow_inexact: bool | None = None, exactness_conversations: Sequence[Conversation] | None = None
                 ) -> None:
        """``allow_inexact`` (default: ``args.allow_inexact``): train even when the exactness guard
        (:mod:`onepass.guard`, run at the start of :meth:`train`) finds that one-pass is not the
        N-pass loss for this model; ``exactness_conversations``: what it checks on (default: the first
        conversations of ``train_dataset`` when it holds conversations, :class:`GuardInputs`; for a dataset
        of rows, the bundled MathChat pair).

        The steps, in order (as TRL's ``SFTTrainer.__init__``): the arguments, the model, the tokenizer, the
        adapter, the settings checked against the model, the datasets prepared, the collator, ``Trainer``'s
        own init, then what one-pass adds to it."""
        from transformers import set_seed

        _check_overridable(compute_loss_func)
        args = as_onepass_config(args, model)
        sample = sft_checks.check_train_dataset(train_dataset, args)
        set_seed(args.seed)  # before the model: a peft adapter is initialised at random
        model, model_id = _model_of(model, args, quantization_config)
        processing_class = _processing_class_of(processing_class, model, model_id, args, sample)
        model = _with_adapter(model, peft_config, args)
        sft_checks.check_data_settings(args, sample, data_collator=data_collator, formatting_func=formatting_func)
        if processing_class is not None and getattr(processing_class, "pad_token", 1) is None:
            processing_class.pad_token = processing_class.eos_token  # as TRL: the pad token defaults to EOS
        _fit_model_to_loss(model, args)
        train, eval_dataset = _datasets_of(train_dataset, eval_dataset, model, processing_class, args,
                                           formatting_func=formatting_func)
        if data_collator is None:
            data_collator = OnePassCollator(padding_free=sft_checks.padding_free(args),
                                            pad_to_multiple_of=args.pad_to_multiple_of)
        self._formatting_func = formatting_func
        super().__init__(model=model, args=args, data_collator=data_collator, train_dataset=train.dataset,
                         eval_dataset=eval_dataset, processing_class=processing_class,
                         compute_metrics=compute_metrics, callbacks=callbacks, optimizers=optimizers,
                         optimizer_cls_and_kwargs=optimizer_cls_and_kwargs,
                         preprocess_logits_for_metrics=preprocess_logits_for_metrics)
        self._set_guard(args, allow_inexact, exactness_conversations, train.guard)
        self._check_processes()
        split_model(self.accelerator.unwrap_model(self.model), self.dims, args)  # sequence parallelism: attention
        self._set_loss_state(sample)

    _tag_names = ["trl", "sft", "onepass"]  # TRL's model-card tags, and ours

    def _set_guard(self, args: OnePassConfig, allow_inexact: bool | None,
                   exactness_conversations: Sequence[Conversation] | None, guard: GuardInputs | None) -> None:
        """What the exactness guard (:meth:`check_exactness`) runs with, and its result slot (None until then)."""
        self.allow_inexact = args.allow_inexact if allow_inexact is None else allow_inexact
        self.exactness_conversations = exactness_conversations
        self.guard_inputs: GuardInputs | None = guard  # None: the rows were given as they are
        self.exactness: Any = None  # the guard's GuardResult, once train() ran it
        self.sequence_parallel: dict[str, Any] | None = None  # the split check's (sp_size > 1), once train() ran it

    def _check_processes(self) -> None:
        """One process per GPU (DataParallel refused), on a device the model's attention backend serves."""
        if self.args.n_gpu > 1:
            raise ValueError(f"OnePassTrainer does not run DataParallel over {self.args.n_gpu} GPUs in one "
                             "process; launch one process per GPU with torchrun or accelerate launch")
        unwrapped = self.accelerator.unwrap_model(self.model)
        check_backend(model_backend(unwrapped), self.args.device)

    def _set_loss_state(self, sample: Any) -> None:
        """What ``compute_loss`` and ``log`` keep (metric sums, eval pairs, tokens), and the attributes TRL's
        callbacks and scripts read (``padding_free``, ``completion_only_loss``, no aux loss, model tags)."""
        self.label_names = ["targets"]
        # compute_loss divides by the step's weight sum itself: no extra division by grad-accum steps
        self.model_accepts_loss_kwargs = True
        self._metric_sums: dict[str, dict[str, torch.Tensor]] = {"train": {}, "eval": {}}
        self._eval_pairs: list[torch.Tensor] | None = None  # (row loss, row weight) of the evaluation running
        self._total_train_tokens = 0  # all processes, up to the last log
        self._unlogged_tokens = 0  # this process's, since (counted on the host: no wait per micro-batch)
        # what TRL's callbacks and scripts read: no load-balancing loss is added (see router_aux_loss_coef)
        self.aux_loss_enabled = False
        self.router_aux_loss_coef = 0.0
        self.padding_free = sft_checks.padding_free(self.args)
        self.completion_only_loss = sft_checks.completion_only_loss(self.args, sample)
        self.prompt_learning = is_prompt_learning(self.model)
        if hasattr(self.model, "add_model_tags"):
            self.model.add_model_tags(self._tag_names)

    def create_accelerator_and_postprocess(self) -> None:
        """HF's accelerator, running the parallelism the launcher asked for: FSDP on CPU ranks too
        (accelerate alone runs DDP there), anything else asked for and not had is an error
        (:mod:`onepass.train.distributed`)."""
        degree = trainer_sp_size(self.args)  # sequence parallelism: sp_size or the accelerate config's
        fsdp = getattr(self.args, "fsdp_plugin_args", None)  # TrainingArguments(fsdp=...) asks without the launcher
        fsdp = fsdp if fsdp and self.args.world_size > 1 else None
        if (fsdp or asked_mode() == "fsdp") and (self.args.use_cpu or not torch.cuda.is_available()):
            check_fsdp_accelerate()  # an older accelerate fails inside HF's accelerator already
        with without_accelerate_parallelism() if degree > 1 else contextlib.nullcontext():
            super().create_accelerator_and_postprocess()
        self.distributed = honour_request(self.accelerator, asked="fsdp" if fsdp else None, fsdp_plugin_args=fsdp,
                                          sp_size=degree)
        self.dims = parallel_dims(self.accelerator, degree)  # the parallel layout, built once
        self.is_fsdp_enabled = getattr(self.accelerator.state, "fsdp_plugin", None) is not None

    def check_exactness(self, inputs: GuardInputs | None = None) -> Any:
        """The exactness guard on a tiny float64 twin of the model; raises
        :class:`onepass.guard.InexactModelError` (one line) unless ``allow_inexact``. ``inputs``
        (default: what preparing ``train_dataset`` returned, :attr:`guard_inputs`): the schedule,
        conversations, tokenizer and render settings to check with; without them (rows given as they
        are) ``exactness_conversations``, else the bundled MathChat pair, with ``processing_class``."""
        inputs = self.guard_inputs if inputs is None else inputs
        if inputs is not None and inputs.schedule.kind == "n-pass":  # one view per row: nothing to check
            self.exactness = {"checked": False, "why": "n-pass rows are each one plain sequence"}
            return self.exactness
        if inputs is None and _shares_no_prefix(self.train_dataset):  # rows given as they are, read from the rows
            self.exactness = {"checked": False, "why": "no row shares a prefix between views (n-pass rows)"}
            return self.exactness
        convs = self.exactness_conversations or (inputs.conversations if inputs is not None else ())
        tokenizer = inputs.tokenizer if inputs is not None else self.processing_class
        render = inputs.render if inputs is not None else None
        sampled = inputs.views if inputs is not None and not self.exactness_conversations else None  # as prepared
        model = self.accelerator.unwrap_model(self.model)
        result, _ = run_guard(model, conversations=convs, render=render, sampled=sampled,
                              tokenizer=tokenizer if hasattr(tokenizer, "apply_chat_template") else None,
                              source="the training conversations", backend=model_backend(base_model(model)),
                              allow_inexact=self.allow_inexact, log=log.info,
                              hint="train with schedule='n-pass', or pass allow_inexact=True to train anyway")
        self.exactness = result
        return result

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train`` after the exactness guard (:meth:`check_exactness`); then ``loss.png``
        (:meth:`plot_loss`) in ``output_dir``."""
        if self.exactness is None:
            self.check_exactness()
        if self.dims.sp > 1 and self.sequence_parallel is None:  # the guard's split mode, on every process
            self.sequence_parallel = check_split(self.accelerator.unwrap_model(self.model), self.dims.sp, log=log.info)
        result = super().train(*args, **kwargs)
        self.plot_loss()
        _check_finite(self.accelerator.unwrap_model(self.model))
        return result

    def get_train_dataloader(self) -> Any:
        """``Trainer``'s; under sequence parallelism the ranks of a row read the same batches."""
        return share_batches(super().get_train_dataloader(), self.dims)

    def plot_loss(self) -> Any:
        """The logged training (and eval) losses per step as ``OUTPUT_DIR/loss.png`` (main process; None
        when nothing was logged)."""
        from pathlib import Path

        history = [h for h in self.state.log_history if "loss" in h and "step" in h]
        evals = [h for h in self.state.log_history if "eval_loss" in h and "step" in h]
        if not self.is_world_process_zero() or not (history or evals) or not self.args.output_dir:
            return None
        Path(self.args.output_dir).mkdir(parents=True, exist_ok=True)
        return plot_losses(history, evals, Path(self.args.output_dir) / "loss.png",
                           title=f"OnePassTrainer: {Path(self.args.output_dir).name}")

    def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """``Trainer.training_step``; with ``activation_offloading`` the saved activations live in CPU memory.

        accelerate is told not to scale the loss for gradient accumulation (``num_steps`` 1, as transformers
        sets it in its newer releases): transformers 5.2 hands it ``gradient_accumulation_steps``, and
        ``Accelerator.backward`` then divides every micro-batch's loss by it on top of :meth:`compute_loss`'s
        division by the whole step's weight (2 micro-batches trained half the gradient of one batch of the same
        rows). DeepSpeed scales in its own backward, which ``Trainer`` turns off; it is left as it is."""
        accelerator = self.accelerator
        if accelerator.gradient_accumulation_steps != 1 and str(accelerator.distributed_type).split(".")[-1] \
                != "DEEPSPEED":
            accelerator.gradient_accumulation_steps = 1
        offload = (torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available())
                   if getattr(self.args, "activation_offloading", False) else contextlib.nullcontext())
        with offload:
            return super().training_step(*args, **kwargs)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Adds TRL's ``num_tokens`` (row tokens trained so far, all processes), ``mean_token_accuracy``
        (targets whose argmax is right) and ``entropy`` (of the predicted distribution) since the last log,
        both weighted by the target weights as the loss is (``eval_`` prefixed in evaluation)."""
        mode = "train" if self.model.training else "eval"
        sums = self._metric_sums[mode]
        metrics: dict[str, float] = {}
        if sums:
            keys = sorted(sums)
            total = self.accelerator.reduce(torch.stack([sums[k].float() for k in keys]), reduction="sum")
            values = dict(zip(keys, total.tolist()))
            weight = values.get("weight", 0.0)
            metrics["entropy"] = values.get("entropy", 0.0) / weight if weight > 0 else 0.0
            metrics["mean_token_accuracy"] = values.get("correct", 0.0) / weight if weight > 0 else 0.0
            sums.clear()
        if mode == "train":
            tokens, self._unlogged_tokens = self._unlogged_tokens, 0
            if self.args.world_size > 1:
                tokens = int(self.accelerator.reduce(torch.tensor([tokens], device=self.args.device), "sum")[0])
            self._total_train_tokens += tokens
            metrics["num_tokens"] = float(self._total_train_tokens)
        if mode == "eval":
            metrics = {f"eval_{k}": v for k, v in metrics.items() if k != "num_tokens"}
        logs.update(metrics)
        super().log(logs, start_time)

    def _set_signature_columns_if_needed(self) -> None:
        if self._signature_columns is None:
            self._signature_columns = list(COLUMNS)

    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device) -> torch.Tensor | None:
        """The sum of target weights of the optimizer step, over every micro-batch and process."""
        if not batch_samples:
            return None
        total = torch.stack([b["weights"].sum() for b in batch_samples]).sum().to(device=device,
                                                                                   dtype=torch.float64)
        total = total if self.dims.counts_rows else torch.zeros_like(total)  # a row's weight: once per group
        if self.args.world_size > 1:
            total = self.accelerator.gather(total.reshape(1)).sum()
        return total

    def compute_loss(self, model: Any, inputs: dict[str, torch.Tensor], return_outputs: bool = False,
                     num_items_in_batch: torch.Tensor | None = None) -> Any:
        view = ForwardView(model, self.accelerator.unwrap_model(model))
        mode = "train" if model.training else "eval"
        stats: dict[str, torch.Tensor] = {}
        if self.prompt_learning:
            total = self._prompt_learning_loss(model, inputs, stats)
        elif self.args.loss_type == "dft":
            total = batch_dft_loss(view, inputs, stats=stats)
        elif mode == "eval" and self._eval_pairs is not None:  # inside evaluate(): each row's sums, counted once
            per_row = row_losses(view, inputs, stats=stats)
            total = per_row.sum()
            pairs = torch.stack([per_row.detach().double(), inputs["weights"].sum(dim=1).double()], dim=1)
            self._eval_pairs.append(self.accelerator.gather_for_metrics(pairs))  # a padded last batch: dropped
        else:
            total = batch_loss(view, inputs, stats=stats, shard=self.dims.shard if mode == "train" else None)
        sums = self._metric_sums[mode]
        for key, value in stats.items():
            sums[key] = sums[key] + value.detach() if key in sums else value.detach()
        if mode == "train" and "row_tokens" in inputs and self.dims.counts_rows:  # host rows; once per row
            self._unlogged_tokens += int(host_rows(inputs).row_tokens_B.sum())
        if num_items_in_batch is None:  # evaluation: this batch's own mean
            loss = total / inputs["weights"].sum().clamp_min(1e-12).to(total.dtype)
        else:
            # DDP / DeepSpeed average gradients over processes: undo that, the normaliser is global. A step
            # with no target weight trains nothing (as `onepass train`): 0 / 0 would make every gradient NaN
            loss = total * loss_scale(num_items_in_batch.to(total.dtype), self.accelerator.num_processes)
        return (loss, {"loss": loss}) if return_outputs else loss

    def evaluation_loop(self, dataloader: Any, description: str, prediction_loss_only: bool | None = None,
                        ignore_keys: list[str] | None = None, metric_key_prefix: str = "eval") -> Any:
        """``Trainer.evaluation_loop`` whose loss is the weighted mean the docs promise: the summed weighted
        cross entropy of every row over the sum of their weights, whatever the eval batch size (HF averages
        the batches' means, the last partial batch counted as a full one: batch size 8 and 1 gave 3.99068 and
        3.98775), each row counted once over processes; a non-finite loss is reported, not dropped."""
        self._eval_pairs = []
        try:
            output = super().evaluation_loop(dataloader, description, prediction_loss_only=prediction_loss_only,
                                             ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix)
            pairs = self._eval_pairs
        finally:
            self._eval_pairs = None
        if pairs:
            loss_sum, weight = torch.cat([p.to(pairs[0].device) for p in pairs]).sum(dim=0).tolist()
            output.metrics[f"{metric_key_prefix}_loss"] = weighted_mean(loss_sum, weight)
        return output

    def prediction_step(self, model: Any, inputs: dict[str, Any], prediction_loss_only: bool,
                        ignore_keys: list[str] | None = None) -> tuple[torch.Tensor | None, Any, Any]:
        """The loss; when ``compute_metrics`` asks for predictions, also the logits of every position (one
        more forward pass, with the row's mask: TRL's extra forward pass) and the ``labels`` view of the rows
        (``labels[p]`` the token position ``p - 1`` trains, else -100, as TRL's labels)."""
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs)
            if prediction_loss_only:
                return loss.detach(), None, None
            logits = self._full_logits(model, inputs)
        return loss.detach(), logits, _labels_of(inputs)

    def evaluate(self, eval_dataset: Any = None, ignore_keys: list[str] | None = None,
                 metric_key_prefix: str = "eval") -> dict[str, float]:
        """``Trainer.evaluate``; a dataset given here is prepared as ``train_dataset`` was (any of TRL's types,
        or conversations; a mapping of them), as TRL's ``evaluate`` does. A string names an eval dataset
        given at init."""
        if eval_dataset is not None and not isinstance(eval_dataset, str):
            packing = self.args.packing if self.args.eval_packing is None else self.args.eval_packing

            def prepared(ds: Any, source: str) -> Any:  # and checked, as every dataset of rows the trainer is given
                vocab = model_vocab(self.accelerator.unwrap_model(self.model))
                if self.args.dataset_prepared:
                    return check_dataset_rows(ds, source=source, vocab_size=vocab)
                return trainer_rows(ds, self.processing_class, self.args, source=source, vocab_size=vocab,
                                    packing=packing, formatting_func=self._formatting_func).dataset

            check_streams(eval_dataset)
            if isinstance(eval_dataset, Mapping):
                eval_dataset = {k: prepared(v, f"eval_dataset[{k!r}]") for k, v in eval_dataset.items()}
            else:
                eval_dataset = prepared(eval_dataset, "eval_dataset")
        return super().evaluate(eval_dataset=eval_dataset, ignore_keys=ignore_keys,
                                metric_key_prefix=metric_key_prefix)

    def _full_logits(self, model: Any, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """``[B, L, V]`` logits of every position of the rows, each position seeing what the tree lets it see."""
        if self.prompt_learning:
            length = inputs["input_ids"].shape[1]
            out = model(input_ids=inputs["input_ids"], attention_mask=_causal_rows_mask(inputs), use_cache=False)
            return out.logits[:, -length:]
        plan = forward_plan(ForwardView(model, self.accelerator.unwrap_model(model)), inputs)
        return model(input_ids=inputs["input_ids"], position_ids=inputs["position_ids"], use_cache=False,
                     **plan.model_kwargs()).logits

    def _prompt_learning_loss(self, model: Any, inputs: Mapping[str, torch.Tensor],
                              stats: dict[str, torch.Tensor]) -> torch.Tensor:
        """The loss through a PEFT prompt-learning model (prompt tuning, prefix tuning, p-tuning), which puts
        virtual tokens before the sequence and ignores position ids: exact, as TRL's, for rows that are each
        one causal sequence (TRL's rows, or a conversation whose views are prefixes of each other); a row
        holding a tree or several documents is one line."""
        length = inputs["input_ids"].shape[1]
        logits = model(input_ids=inputs["input_ids"], attention_mask=_causal_rows_mask(inputs),
                       use_cache=False).logits[:, -length:]
        keep = inputs["targets"] != IGNORE
        logits_TV, targets_T, weights_T = logits[keep], inputs["targets"][keep], inputs["weights"][keep]
        add_logit_stats(stats, logits_TV, targets_T, weights_T)
        if self.args.loss_type == "dft":
            return dft_sum(logits_TV, targets_T, weights_T)
        return weighted_ce(logits_TV, targets_T, weights_T)


def _causal_rows_mask(inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The ``[B, L]`` padding mask of rows that are each one causal sequence (positions 0..n-1, every key
    seen to the row's end); anything else is one line (a prompt-learning model cannot take a tree mask)."""
    ids = inputs["input_ids"]
    length = ids.shape[1]
    steps = torch.arange(length, device=ids.device)[None]
    n = inputs["kv_end"][:, :1]  # a causal row's first key is seen to the row's end
    real = steps < n
    causal = ((inputs["kv_end"] == n) | ~real).all() and ((inputs["position_ids"] == steps) | ~real).all()
    if not bool(causal):
        raise UsageError("a PEFT prompt-learning model (prompt tuning, prefix tuning, p-tuning) puts virtual tokens "
                         "before one causal sequence and drops position ids: a row holding a tree or several "
                         "documents (a conversation whose views differ, packing, padding_free) cannot go through it; "
                         "use LoRA, or assistant_only_loss=False and no packing for one sequence per conversation")
    return real.long()


def _labels_of(inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The ``labels`` view of collated rows (:func:`onepass.train.core.sft_rows.labels_view`, in torch)."""
    ids, pos, targets = inputs["input_ids"], inputs["position_ids"], inputs["targets"]
    labels = torch.full_like(ids, -100)
    nxt = (pos[:, 1:] == pos[:, :-1] + 1) & (targets[:, :-1] == ids[:, 1:])
    labels[:, 1:] = torch.where(nxt, ids[:, 1:], torch.full_like(ids[:, 1:], -100))
    return labels


def _check_finite(model: Any) -> None:
    """The trained weights hold no NaN or infinite value, else one line: the Trainer steps on with a NaN
    gradient and logs the loss without it (``logging_nan_inf_filter``), so a diverged run looked finished."""
    bad = non_finite_weights(model)
    if bad:
        raise NonFiniteWeightsError(f"training ended with NaN or infinite weights ({bad[0]}): a step's loss or gradient "
                                    "was not finite; lower the learning rate (or check the data and dtype) and train "
                                    "again from the last finite checkpoint")


def _shares_no_prefix(dataset: Any, batch: int = 1024) -> bool:
    """No tree node of any row has two children (:func:`onepass.layout.geometry.branches`): every view in the
    rows is its own sequence (N-pass rows, one or several per row), so the one-pass rule is not in play.
    False for a dataset without a ``kv_end`` column (not rows: the guard decides)."""
    if is_stream(dataset) or "kv_end" not in (getattr(dataset, "column_names", None) or ()):
        return False  # a stream is not read ahead: the guard decides
    for start in range(0, len(dataset), batch):
        if any(branches(kv_end) for kv_end in dataset[start:start + batch]["kv_end"]):
            return False
    return True
