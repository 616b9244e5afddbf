"""The training run's settings: one frozen record, loaded from YAML plus overrides.

Why this module exists: a run is reproducible only if everything that shapes
it is in one place that is saved beside the outputs (``train_config.yaml``)
and checked on ``--resume``. Every mistake a user can make here (an unknown
key, a bad value, QLoRA on a CPU, data or a model that is not there) is a
:class:`TrainConfigError`: a ``ValueError`` whose message is one line saying
what was wrong and what to do, which ``onepass`` prints as
``onepass: error: ...``.

    >>> cfg = load_config(None, {"tiny": "qwen3", "data": "builtin:mathchat", "max_tokens": 4096})
    >>> cfg.data_config.schedule, cfg.data_config.max_tokens, cfg.per_device_train_batch_size
    ('one-pass', 4096, 1)

Key names follow ``transformers.TrainingArguments`` (``learning_rate``,
``per_device_train_batch_size``, ``gradient_accumulation_steps``,
``num_train_epochs``, ``lr_scheduler_type``, ``optim``, ``report_to``, ...).
The short names of earlier releases (``lr``, ``batch_size``, ``grad_accum``,
``epochs``, ...: :data:`DEPRECATED_KEYS`) are still read, with one warning line
naming the new key. The fields are the one source of truth: ``onepass train``'s
flags are generated from them (:mod:`onepass.train.cli`). The data settings
(``schedule``, ``max_tokens``, ``pack``, ``weighting``, ``completion_format``,
``reasoning``, ``template_kwargs``) are one :class:`~onepass.prepare.config.DataConfig`,
``data_config``, the one ``onepass prepare`` uses; in a YAML file (and in
:meth:`TrainConfig.to_dict`) they are top-level keys like the others.

Batch vocabulary: a *unit* is one conversation (raw data, prepared on the fly:
all of its trees) or one row (a prepared directory). One optimizer step covers
``per_device_train_batch_size * gradient_accumulation_steps * world_size``
units; each process takes ``per_device_train_batch_size`` units per
micro-batch, ``gradient_accumulation_steps`` micro-batches per step.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from onepass.prepare.config import DATA_KEYS, DataConfig, data_config_hints
from onepass.model.dtypes import dtype_names
from onepass.errors import ConfigError
from onepass.files import atomic_write_text
from onepass.model.tiny import TINY_ARCHS
from onepass.train.hyperparams import check_hyperparameters, epochs_counted

FINETUNES = ("full", "lora", "qlora")
OPTIMIZERS = ("adamw", "sgd", "adamw_8bit", "paged_adamw_8bit")
OPTIMIZER_ALIASES = {"adamw_torch": "adamw", "adamw_torch_fused": "adamw"}  # HF names of the same
LR_SCHEDULERS = ("constant", "linear", "cosine")
MIXED_PRECISION = ("no", "bf16")
REPORT_TO = ("tensorboard", "wandb", "mlflow", "trackio", "comet_ml", "aim", "clearml", "dvclive", "swanlab")
# accelerate's tracker names (accelerate.utils.LoggerType); which are installed is checked when a run starts

DEPRECATED_KEYS = {"lr": "learning_rate", "batch_size": "per_device_train_batch_size",
                   "grad_accum": "gradient_accumulation_steps", "epochs": "num_train_epochs",
                   "lr_scheduler": "lr_scheduler_type", "optimizer": "optim", "adam_eps": "adam_epsilon"}
"""Short key names of earlier releases -> the ``TrainingArguments`` names; read for one more release."""

log = logging.getLogger("onepass")


class TrainConfigError(ConfigError):
    """A training setting that cannot work; the message is one line and says what to do."""


def _meta(help: str, group: str, *, flags: tuple[str, ...] = ()) -> dict[str, Any]:
    """The ``--help`` line, group and extra names of a field's generated flag (onepass.train.cli)."""
    return {"help": help, "group": group, "flags": flags}


def _f(default: Any, help: str, group: str, *, flags: tuple[str, ...] = ()) -> Any:
    """A config field with an immutable default."""
    return field(default=default, metadata=_meta(help, group, flags=flags))


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Every setting of a run; the names follow ``transformers.TrainingArguments`` where it has one."""

    # model: exactly one of model / tiny
    model: str | None = _f(None, "a hub id or a local directory of a HF causal LM", "model")
    tiny: str | None = _f(None, "a random tiny model of this architecture (qwen3, llama, ...): tests, demos", "model")
    tiny_config: dict[str, Any] = field(default_factory=dict, metadata=_meta(
        "tiny model size overrides, e.g. hidden_size=128", "model"))
    compact_vocab: bool = _f(True, "tiny only: renumber the token ids that occur to 0..V-1", "model")
    tokenizer: str | None = _f(None, "tokenizer spec (default: the model's; builtin:qwen3 with --tiny)", "model")
    chat_template: str | None = _f(None, "a .jinja file or builtin:NAME replacing the tokenizer's template",
                                   "model")
    # data
    data: str | None = _f(None, "conversations (.jsonl/.json/.parquet, a folder of them, a saved dataset, "
                          "builtin:mathchat, synthetic:NAME, a hub id) or rows written by onepass prepare", "data")
    eval_data: str | None = _f(None, "held-out data in the same forms; eval loss at the end (and eval_steps)",
                               "data")
    limit: int | None = _f(None, "use only the first N conversations (rows for a prepared dir)", "data")
    data_config: DataConfig = field(default_factory=DataConfig, metadata=_meta(
        "the data settings (schedule, max_tokens, pack, weighting, train_turns, completion_format, reasoning, "
        "template_kwargs): top-level keys in YAML, one flag each", "data"))
    max_batch_tokens: int | None = _f(None, "split a micro-batch into forward passes of <= N padded tokens "
                                      "(same loss)", "data")
    allow_inexact: bool = _f(False, "train even when the exactness guard finds that one-pass is not the N-pass "
                             "loss for this model (the guard's result is recorded in metrics.json)", "data")
    # fine-tuning
    finetune: str = _f("full", "full (default) | lora | qlora (4-bit NF4, CUDA only)", "fine-tuning")
    lora_r: int = _f(16, "LoRA rank", "fine-tuning")
    lora_alpha: float = _f(32.0, "LoRA alpha", "fine-tuning")
    lora_dropout: float = _f(0.05, "LoRA dropout", "fine-tuning")
    lora_target_modules: str | tuple[str, ...] = _f("all-linear", "all-linear (default) or a comma list: "
                                                    "q_proj,v_proj", "fine-tuning")
    # optimisation
    optim: str = _f("adamw", "adamw (default; adamw_torch is the same) | sgd | adamw_8bit | paged_adamw_8bit",
                    "optimisation")
    learning_rate: float = _f(2e-5, "peak learning rate", "optimisation")
    weight_decay: float = _f(0.0, "AdamW weight decay", "optimisation")
    adam_beta1: float = _f(0.9, "AdamW beta1", "optimisation")
    adam_beta2: float = _f(0.999, "AdamW beta2", "optimisation")
    adam_epsilon: float = _f(1e-8, "AdamW epsilon", "optimisation")
    lr_scheduler_type: str = _f("linear", "linear (default) | cosine | constant", "optimisation")
    warmup_ratio: float = _f(0.0, "warmup as a fraction of the steps", "optimisation")
    warmup_steps: int = _f(0, "warmup steps (wins over warmup_ratio when > 0)", "optimisation")
    num_train_epochs: float = _f(1.0, "passes over the data", "optimisation")
    max_steps: int | None = _f(None, "optimizer steps (overrides num_train_epochs)", "optimisation")
    per_device_train_batch_size: int = _f(1, "conversations (or prepared rows) per micro-batch per process",
                                          "optimisation")
    gradient_accumulation_steps: int = _f(1, "micro-batches per optimizer step", "optimisation")
    max_grad_norm: float | None = _f(1.0, "gradient clipping norm (0, negative or none: no clipping, as in "
                                     "transformers)", "optimisation")
    # numerics and hardware
    dtype: str = _f("float32", "weights: float32 (default) | bfloat16 | float64", "numerics and hardware")
    mixed_precision: str = _f("no", "no (default) | bf16 (autocast the forward pass)", "numerics and hardware")
    gradient_checkpointing: bool = _f(False, "recompute activations in the backward pass", "numerics and hardware")
    attention: str = _f("auto", "auto (flex_attention on CUDA, else sdpa) | sdpa | eager | flex_attention | a "
                        "registered backend", "numerics and hardware", flags=("--backend",))
    device: str = _f("auto", "auto (default) | cpu | cuda | cuda:N", "numerics and hardware")
    length_buckets: int = _f(4, "flex_attention: each forward pass (its rows side by side) padded to one of at most "
                             "N lengths chosen from the run's passes, one compile each; 0: every new length "
                             "compiles", "numerics and hardware")
    sp_size: int = _f(1, "sequence parallelism: split each row over this many processes (Ulysses; accelerate's "
                      "parallelism_config_sp_size works too); the processes must be a multiple of it",
                      "numerics and hardware")
    # outputs
    output_dir: str = _f("runs/train", "where metrics, checkpoints and the final model go", "outputs",
                         flags=("--out",))
    overwrite_output_dir: bool = _f(False, "start a new run in an output_dir that holds another run (its "
                                    "checkpoints are removed); without it that is refused unless --resume",
                                    "outputs", flags=("--overwrite",))
    seed: int = _f(0, "data order and initialisation seed", "outputs")
    logging_steps: int = _f(1, "write metrics every N steps", "outputs")
    save_steps: int | None = _f(None, "checkpoint every N steps (and always at the end)", "outputs")
    save_total_limit: int | None = _f(2, "checkpoints to keep", "outputs")
    eval_steps: int | None = _f(None, "eval loss every N steps (needs eval_data)", "outputs")
    report_to: tuple[str, ...] = _f((), "trackers through accelerate: tensorboard, wandb, mlflow, trackio, "
                                    "comet_ml, aim, clearml, dvclive, swanlab (comma list), all, or none",
                                    "outputs")
    run_name: str | None = _f(None, "the run's name in the trackers (default: the output_dir's name)", "outputs")
    progress: bool = _f(True, "a progress bar", "outputs")
    save_model: bool = _f(True, "save_pretrained into OUTPUT_DIR/final at the end", "outputs")

    def __post_init__(self) -> None:
        _validate(self)

    def to_dict(self) -> dict[str, Any]:
        """Plain values by config key (the data settings flattened in, as a YAML file has them)."""
        out: dict[str, Any] = {}
        for key, value in dataclasses.asdict(self).items():
            if key == "data_config":
                out.update(self.data_config.to_dict())
            else:
                out[key] = list(value) if isinstance(value, tuple) else value
        return out

    def replace(self, **changes: Any) -> TrainConfig:
        """A copy with ``changes``; a data setting (``schedule=...``) changes ``data_config``."""
        data = {k: changes.pop(k) for k in DATA_KEYS if k in changes}
        if data:
            changes["data_config"] = changes.get("data_config", self.data_config).replace(**data)
        return dataclasses.replace(self, **changes)


def _fail(message: str) -> typing.NoReturn:
    raise TrainConfigError(message)


def _one_of(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        _fail(f"unknown {name} {value!r}; use one of {', '.join(allowed)}")


def _validate(c: TrainConfig) -> None:
    if c.data is None:
        _fail("no training data: set data (a conversations file, builtin:mathchat or a prepared directory)")
    if (c.model is None) == (c.tiny is None):
        _fail("set exactly one of model (a hub id or local directory) and tiny (an architecture for "
              f"a random tiny model: {', '.join(TINY_ARCHS)})")
    if c.tiny is not None:
        _one_of("tiny architecture", c.tiny, TINY_ARCHS)
    if not isinstance(c.data_config, DataConfig):
        _fail(f"data_config must be a DataConfig, got {type(c.data_config).__name__}")
    try:
        c.data_config.check_share_window()
    except ConfigError as e:
        _fail(str(e))
    _one_of("finetune", c.finetune, FINETUNES)
    _one_of("optim", c.optim, OPTIMIZERS)
    _one_of("lr_scheduler_type", c.lr_scheduler_type, LR_SCHEDULERS)
    _one_of("dtype", c.dtype, dtype_names(trains=True))
    _one_of("mixed_precision", c.mixed_precision, MIXED_PRECISION)
    for r in c.report_to:
        _one_of("report_to tracker", r, REPORT_TO)
    for name in ("per_device_train_batch_size", "gradient_accumulation_steps", "logging_steps", "lora_r", "sp_size"):
        if getattr(c, name) < 1:
            _fail(f"{name} must be >= 1, got {getattr(c, name)}")
    if c.length_buckets < 0:
        _fail(f"length_buckets must be >= 0 (0: no length buckets), got {c.length_buckets}")
    for name in ("max_batch_tokens", "max_steps", "save_steps", "eval_steps", "limit",
                 "save_total_limit"):
        value = getattr(c, name)
        if value is not None and value < 1:
            _fail(f"{name} must be >= 1 (or unset), got {value}")
    check_hyperparameters(c, names=epochs_counted(c.max_steps is None), error=TrainConfigError)  # OnePassConfig's too
    if c.eval_steps is not None and c.eval_data is None:  # else no eval would ever run, without a word
        _fail("eval_steps needs eval_data (the held-out data to evaluate): set eval_data, or drop eval_steps")
    if c.finetune == "qlora" and c.tiny is not None:
        _fail("qlora loads a saved model in 4 bits: save the tiny model and pass its directory as model")
    if c.finetune == "qlora" and c.dtype == "float64":
        _fail("qlora computes in bfloat16 or float32, not float64")
    if c.optim.endswith("8bit") and c.device == "cpu":
        _fail(f"optim {c.optim} (bitsandbytes) needs a CUDA GPU; use adamw on CPU")
    if c.finetune == "qlora" and c.device == "cpu":
        _fail(QLORA_ON_CPU)


QLORA_ON_CPU = ("qlora (4-bit NF4 through bitsandbytes) needs a CUDA GPU; on CPU use finetune: lora "
                "(or full)")


# ---------------------------------------------------------------------------------------------
# YAML + overrides -> TrainConfig


def _hints() -> dict[str, Any]:
    """Each config key's type (the data settings' from DataConfig)."""
    hints = typing.get_type_hints(TrainConfig)
    del hints["data_config"]
    return {**hints, **data_config_hints()}


def _coerce(name: str, value: Any, hint: Any) -> Any:
    """``value`` as the type of field ``name`` (YAML reads ``1e-4`` as a string, lists as lists)."""
    args = typing.get_args(hint)
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(name, value, arg)
            except TrainConfigError as e:
                errors.append(str(e))
        _fail(errors[0] if errors else f"{name} must be set")
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no"):
            return value.lower() in ("true", "yes")
        _fail(f"{name} must be true or false, got {value!r}")
    if hint in (int, float):
        if isinstance(value, bool):
            _fail(f"{name} must be a number, got {value!r}")
        try:
            number = hint(value) if not isinstance(value, str) else hint(float(value) if hint is float
                                                                          else int(value))
        except (TypeError, ValueError):
            _fail(f"{name} must be {'an integer' if hint is int else 'a number'}, got {value!r}")
        if hint is int and isinstance(value, float) and value != int(value):
            _fail(f"{name} must be an integer, got {value!r}")
        return number
    if hint is str:
        if isinstance(value, str):
            return value
        _fail(f"{name} must be a string, got {value!r}")
    if origin is tuple:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            _fail(f"{name} must be a list of strings, got {value!r}")
        return tuple(value)
    if origin is dict or hint is dict:
        if not isinstance(value, Mapping):
            _fail(f"{name} must be a mapping, got {value!r}")
        return dict(value)
    return value


def config_keys() -> list[str]:
    """Every key of a config file (the data settings by their own names, not ``data_config``)."""
    out: list[str] = []
    for f in dataclasses.fields(TrainConfig):
        out.extend(DATA_KEYS if f.name == "data_config" else (f.name,))
    return out


def rename_deprecated(values: Mapping[str, Any], where: str) -> dict[str, Any]:
    """``values`` with the short names of :data:`DEPRECATED_KEYS` renamed, one warning line per old key.

    >>> rename_deprecated({"lr": 0.1, "seed": 1}, "x.yaml")
    {'learning_rate': 0.1, 'seed': 1}
    """
    out: dict[str, Any] = {}
    for key, value in values.items():
        new = DEPRECATED_KEYS.get(key)
        if new is None:
            out[key] = value
            continue
        if new in values:
            _fail(f"{where} sets both {key!r} and {new!r}; keep {new!r} ({key!r} is its deprecated name)")
        log.warning("onepass: config key %r in %s is deprecated; use %r (the old name is read until the next "
                    "release)", key, where, new)
        out[new] = value
    return out


def _check_keys(values: Mapping[str, Any], where: str) -> None:
    known = config_keys()
    for key in values:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; known keys: {', '.join(known)}"
            _fail(f"unknown config key {key!r} in {where}{hint}")


def config_from_dict(values: Mapping[str, Any], *, where: str = "the config") -> TrainConfig:
    """A validated :class:`TrainConfig` from plain values (YAML types are coerced)."""
    values = rename_deprecated(values, where)
    _check_keys(values, where)
    hints = _hints()
    report = values.get("report_to")
    if report in ("none", None, [], ["none"]):
        values = {**values, "report_to": ()}
    elif report == "all" or report == ["all"]:
        values = {**values, "report_to": REPORT_TO}
    if values.get("optim") in OPTIMIZER_ALIASES:
        values = {**values, "optim": OPTIMIZER_ALIASES[values["optim"]]}
    values = {k: _coerce(k, v, hints[k]) for k, v in values.items()}
    try:
        data_config = DataConfig(**{k: values.pop(k) for k in DATA_KEYS if k in values})
    except ConfigError as e:  # one line, as a TrainConfigError like every other bad setting
        _fail(str(e))
    return TrainConfig(**values, data_config=data_config)


def read_yaml(path: str | Path) -> dict[str, Any]:
    import yaml

    p = Path(path)
    if not p.is_file():
        _fail(f"config file not found: {path}")
    try:
        values = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as e:
        first = str(e).splitlines()[0] if str(e) else "invalid YAML"
        _fail(f"{path}: not valid YAML ({first})")
    if not isinstance(values, dict):
        _fail(f"{path}: expected a mapping of config keys, got {type(values).__name__}")
    return values


def load_config(path: str | Path | None, overrides: Mapping[str, Any] | None = None) -> TrainConfig:
    """The config in ``path`` (YAML; may be None) with ``overrides`` (None values ignored) applied."""
    values = rename_deprecated(read_yaml(path), str(path)) if path is not None else {}
    _check_keys(values, str(path))
    changes = rename_deprecated({k: v for k, v in (overrides or {}).items() if v is not None}, "the overrides")
    _check_keys(changes, "the overrides")
    merged = {**values, **changes}
    if "tiny" in changes:  # a flag picks the model source: it replaces the file's
        merged.pop("model", None)
    if "model" in changes:
        merged.pop("tiny", None)
    return config_from_dict(merged, where=str(path) if path is not None else "the overrides")


def write_yaml(config: TrainConfig, path: str | Path) -> None:
    """The config as YAML (atomically); a failed write (a full disk) is one :class:`TrainConfigError` line."""
    import yaml

    try:
        atomic_write_text(path, yaml.safe_dump(config.to_dict(), sort_keys=False))
    except OSError as e:
        _fail(f"cannot write {path} ({e.strerror or e}): free space or choose another output_dir")


# Settings that must match for --resume to continue the same run (the rest may change,
# e.g. max_steps to train longer, save_steps, logging). The optimizer's hyper-parameters are here
# because the checkpoint's optimizer and scheduler state would silently keep the old values.
RESUME_KEYS = ("model", "tiny", "tiny_config", "compact_vocab", "tokenizer", "chat_template", "completion_format",
               "template_kwargs", "reasoning", "train_turns", "data", "eval_data", "limit", "schedule", "max_tokens",
               "pack", "weighting", "finetune", "lora_r", "lora_alpha", "lora_dropout",
               "lora_target_modules", "optim", "learning_rate", "weight_decay", "adam_beta1", "adam_beta2",
               "adam_epsilon", "lr_scheduler_type", "warmup_ratio", "warmup_steps", "max_grad_norm",
               "per_device_train_batch_size", "gradient_accumulation_steps", "seed", "dtype", "mixed_precision",
               "sp_size")
PATH_KEYS = ("model", "tokenizer", "chat_template", "data", "eval_data")  # compared as resolved paths
