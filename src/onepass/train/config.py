"""The training run's settings: one frozen record of components, loaded from YAML plus overrides.

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
naming the new key.

The settings are nested, one frozen record per concern (:class:`ModelConfig`, :class:`InputConfig` holding the
:class:`~onepass.prepare.config.DataConfig` ``onepass prepare`` uses, :class:`FinetuneConfig`,
:class:`OptimConfig`, :class:`HardwareConfig`, :class:`OutputConfig`), each checking its own settings when
it is built; :class:`TrainConfig` holds them and checks what spans them. A config is read flat
(``cfg.learning_rate``, ``cfg.data_config``), written flat (YAML, :meth:`TrainConfig.to_dict`) and built from
flat values (:func:`config_from_dict`): the keys users type do not show the nesting. Each setting is declared
once, as a :func:`onepass.settings.setting` field carrying its help, extra flag names, choices or range and
whether ``--resume`` compares it; ``onepass train``'s flags (:mod:`onepass.train.cli`), the YAML keys
(:func:`config_keys`), the checks, :data:`RESUME_KEYS` / :data:`PATH_KEYS` and the ranges ``OnePassConfig``
shares (:mod:`onepass.train.hyperparams`) are generated from the fields.

Add a setting: one ``setting(...)`` field in the component it belongs to (its default, help, and ``choices``
or ``range=``; ``resume=True`` if a resumed run must keep it, ``path=True`` if it names a file, ``hf=True`` if
``TrainingArguments`` has it with the same meaning); a rule involving other settings goes in :func:`_validate`.
``tests/test_settings.py`` adds one this way and finds it as a flag, a YAML key, a check and a resume key.

Batch vocabulary: a *unit* is one conversation (raw data, prepared on the fly:
all of its trees) or one row (a prepared directory). One optimizer step covers
``per_device_train_batch_size * gradient_accumulation_steps * world_size``
units; each process takes ``per_device_train_batch_size`` units per
micro-batch, ``gradient_accumulation_steps`` micro-batches per step.
"""

from __future__ import annotations

import difflib
import logging
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from onepass.prepare.config import DataConfig
from onepass.model.dtypes import dtype_names
from onepass.errors import ConfigError
from onepass.files import atomic_write_text
from onepass.model.tiny import TINY_ARCHS
from onepass.settings import (
    SEED_LIMIT,
    Range,
    check_settings,
    component,
    build,
    flat_dict,
    flat_paths,
    leaves,
    path_keys,
    replace_flat,
    resume_keys,
    setting,
)

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


_AT_LEAST_ONE_OR_UNSET = Range(low=1, integer=True, optional=True, note="(or unset)")
NO_CLIPPING = "0, a negative value or none: no clipping, as in transformers"


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    """Which model and tokenizer: exactly one of ``model`` / ``tiny`` (checked by :class:`TrainConfig`)."""

    model: str | None = setting(None, "a hub id or a local directory of a HF causal LM", resume=True, path=True)
    tiny: str | None = setting(None, "a random tiny model of this architecture (qwen3, llama, ...): tests, demos",
                               choices=TINY_ARCHS, what="tiny architecture", resume=True)
    tiny_config: dict[str, Any] = setting(help="tiny model size overrides, e.g. hidden_size=128", default_factory=dict,
                                          resume=True)
    compact_vocab: bool = setting(True, "tiny only: renumber the token ids that occur to 0..V-1", resume=True)
    tokenizer: str | None = setting(None, "tokenizer spec (default: the model's; builtin:qwen3 with --tiny)",
                                    resume=True, path=True)
    chat_template: str | None = setting(None, "a .jinja file or builtin:NAME replacing the tokenizer's template",
                                        resume=True, path=True)

    def __post_init__(self) -> None:
        check_settings(self, TrainConfigError)


@dataclass(frozen=True, kw_only=True, slots=True)
class InputConfig:
    """What the run learns from and how it becomes rows (:class:`~onepass.prepare.config.DataConfig`, the one
    ``onepass prepare`` uses), and how a micro-batch is cut into forward passes."""

    data: str | None = setting(None, "conversations (.jsonl/.json/.parquet, a folder of them, a saved dataset, "
                               "builtin:mathchat, synthetic:NAME, a hub id) or rows written by onepass prepare",
                               resume=True, path=True)
    eval_data: str | None = setting(None, "held-out data in the same forms; eval loss at the end (and eval_steps)",
                                    resume=True, path=True)
    limit: int | None = setting(None, "use only the first N conversations (rows for a prepared dir)",
                                range=_AT_LEAST_ONE_OR_UNSET, resume=True)
    data_config: DataConfig = component(DataConfig)
    """The data settings (schedule, max_tokens, pack, weighting, train_turns, ...): top-level keys in YAML, one
    flag each, as ``onepass prepare`` has them."""
    max_batch_tokens: int | None = setting(None, "split a micro-batch into forward passes of <= N padded tokens "
                                           "(same loss)", range=_AT_LEAST_ONE_OR_UNSET)
    allow_inexact: bool = setting(False, "train even when the exactness guard finds that one-pass is not the N-pass "
                                  "loss for this model (the guard's result is recorded in metrics.json)")

    def __post_init__(self) -> None:
        if not isinstance(self.data_config, DataConfig):
            raise TrainConfigError(f"data_config must be a DataConfig, got {type(self.data_config).__name__}")
        check_settings(self, TrainConfigError)


@dataclass(frozen=True, kw_only=True, slots=True)
class FinetuneConfig:
    """Which weights train: all of them, or a LoRA adapter (on a 4-bit model: QLoRA)."""

    finetune: str = setting("full", "full (default) | lora | qlora (4-bit NF4, CUDA only)", choices=FINETUNES,
                            resume=True)
    lora_r: int = setting(16, "LoRA rank", range=Range(low=1, integer=True), resume=True)
    lora_alpha: float = setting(32.0, "LoRA alpha", range=Range(low=0.0, low_open=True), resume=True)
    lora_dropout: float = setting(0.05, "LoRA dropout", range=Range(low=0.0, high=1.0, high_open=True), resume=True)
    lora_target_modules: str | tuple[str, ...] = setting("all-linear", "all-linear (default) or a comma list: "
                                                         "q_proj,v_proj", resume=True)

    def __post_init__(self) -> None:
        check_settings(self, TrainConfigError)


_SAME_AS_HF = dict(resume=True, hf=True)  # TrainingArguments' setting: OnePassConfig checks the same range


@dataclass(frozen=True, kw_only=True, slots=True)
class OptimConfig:
    """The optimizer, its schedule and the step: the ``TrainingArguments`` names, ranges and meanings."""

    optim: str = setting("adamw", "adamw (default; adamw_torch is the same) | sgd | adamw_8bit | paged_adamw_8bit",
                         choices=OPTIMIZERS, resume=True)
    learning_rate: float = setting(2e-5, "peak learning rate", range=Range(low=0.0), **_SAME_AS_HF)
    weight_decay: float = setting(0.0, "AdamW weight decay", range=Range(low=0.0), **_SAME_AS_HF)
    adam_beta1: float = setting(0.9, "AdamW beta1", range=Range(low=0.0, high=1.0, high_open=True), **_SAME_AS_HF)
    adam_beta2: float = setting(0.999, "AdamW beta2", range=Range(low=0.0, high=1.0, high_open=True), **_SAME_AS_HF)
    adam_epsilon: float = setting(1e-8, "AdamW epsilon", range=Range(low=0.0), **_SAME_AS_HF)
    lr_scheduler_type: str = setting("linear", "linear (default) | cosine | constant", choices=LR_SCHEDULERS,
                                     resume=True)
    warmup_ratio: float = setting(0.0, "warmup as a fraction of the steps",
                                  range=Range(low=0.0, high=1.0, high_open=True), **_SAME_AS_HF)
    warmup_steps: int = setting(0, "warmup steps (wins over warmup_ratio when > 0)", range=Range(low=0.0),
                                **_SAME_AS_HF)
    num_train_epochs: float = setting(1.0, "passes over the data", range=Range(low=0.0, low_open=True), hf=True)
    max_steps: int | None = setting(None, "optimizer steps (overrides num_train_epochs)",
                                    range=_AT_LEAST_ONE_OR_UNSET)
    per_device_train_batch_size: int = setting(1, "conversations (or prepared rows) per micro-batch per process",
                                               range=Range(low=1, integer=True), **_SAME_AS_HF)
    gradient_accumulation_steps: int = setting(1, "micro-batches per optimizer step", range=Range(low=1, integer=True),
                                               **_SAME_AS_HF)
    max_grad_norm: float | None = setting(1.0, "gradient clipping norm (0, negative or none: no clipping, as in "
                                          "transformers)", range=Range(optional=True, meaning=NO_CLIPPING),
                                          **_SAME_AS_HF)

    def __post_init__(self) -> None:  # epochs count only without max_steps (both configs then ignore them, as HF)
        check_settings(self, TrainConfigError, skip=() if self.max_steps is None else ("num_train_epochs",))


@dataclass(frozen=True, kw_only=True, slots=True)
class HardwareConfig:
    """Numerics, the device, the attention backend and sequence parallelism: how, not what, the run computes."""

    dtype: str = setting("float32", "weights: float32 (default) | bfloat16 | float64", choices=dtype_names(trains=True),
                         resume=True)
    mixed_precision: str = setting("no", "no (default) | bf16 (autocast the forward pass)", choices=MIXED_PRECISION,
                                   resume=True)
    gradient_checkpointing: bool = setting(False, "recompute activations in the backward pass")
    attention: str = setting("auto", "auto (flex_attention on CUDA, else sdpa) | sdpa | eager | flex_attention | a "
                             "registered backend", flags=("--backend",))
    device: str = setting("auto", "auto (default) | cpu | cuda | cuda:N")
    length_buckets: int = setting(4, "flex_attention: each forward pass (its rows side by side) padded to one of at "
                                  "most N lengths chosen from the run's passes, one compile each; 0: every new "
                                  "length compiles", range=Range(low=0, integer=True, note="(0: no length buckets)"))
    sp_size: int = setting(1, "sequence parallelism: split each row over this many processes (Ulysses; accelerate's "
                           "parallelism_config_sp_size works too); the processes must be a multiple of it",
                           range=Range(low=1, integer=True), resume=True)

    def __post_init__(self) -> None:
        check_settings(self, TrainConfigError)


@dataclass(frozen=True, kw_only=True, slots=True)
class OutputConfig:
    """Where the run writes, how often, and what it reports."""

    output_dir: str = setting("runs/train", "where metrics, checkpoints and the final model go", flags=("--out",))
    overwrite_output_dir: bool = setting(False, "start a new run in an output_dir that holds another run (its "
                                         "checkpoints are removed); without it that is refused unless --resume",
                                         flags=("--overwrite",))
    seed: int = setting(0, "data order and initialisation seed",
                        range=Range(low=0, high=SEED_LIMIT, high_open=True, integer=True), **_SAME_AS_HF)
    logging_steps: int = setting(1, "write metrics every N steps", range=Range(low=1, integer=True))
    save_steps: int | None = setting(None, "checkpoint every N steps (and always at the end)",
                                     range=_AT_LEAST_ONE_OR_UNSET)
    save_total_limit: int | None = setting(2, "checkpoints to keep", range=_AT_LEAST_ONE_OR_UNSET)
    eval_steps: int | None = setting(None, "eval loss every N steps (needs eval_data)", range=_AT_LEAST_ONE_OR_UNSET)
    report_to: tuple[str, ...] = setting((), "trackers through accelerate: tensorboard, wandb, mlflow, trackio, "
                                         "comet_ml, aim, clearml, dvclive, swanlab (comma list), all, or none",
                                         choices=REPORT_TO, what="report_to tracker")
    run_name: str | None = setting(None, "the run's name in the trackers (default: the output_dir's name)")
    progress: bool = setting(True, "a progress bar")
    save_model: bool = setting(True, "save_pretrained into OUTPUT_DIR/final at the end")

    def __post_init__(self) -> None:
        check_settings(self, TrainConfigError)


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    """Every setting of a run, one component per concern; the names follow ``transformers.TrainingArguments``
    where it has one. Read flat (``cfg.learning_rate``, ``cfg.data_config``: :meth:`__getattr__`), written
    flat (:meth:`to_dict`, :meth:`replace`), built from flat values (:func:`config_from_dict`)."""

    model_config: ModelConfig = component(ModelConfig, "model")
    input_config: InputConfig = component(InputConfig, "data")
    finetune_config: FinetuneConfig = component(FinetuneConfig, "fine-tuning")
    optim_config: OptimConfig = component(OptimConfig, "optimisation")
    hardware_config: HardwareConfig = component(HardwareConfig, "numerics and hardware")
    output_config: OutputConfig = component(OutputConfig, "outputs")

    def __post_init__(self) -> None:
        _validate(self)

    def __getattr__(self, name: str) -> Any:
        """A setting or a component by its flat name (``cfg.learning_rate`` is ``cfg.optim_config.learning_rate``)."""
        path = flat_paths(type(self)).get(name)
        if path is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        value: Any = self
        for part in path:
            value = getattr(value, part)
        return value

    def to_dict(self) -> dict[str, Any]:
        """Plain values by config key, flat, in declaration order (as a YAML file has them)."""
        return flat_dict(self)

    def replace(self, **changes: Any) -> TrainConfig:
        """A copy with ``changes`` by flat name (``schedule=...`` changes ``data_config``; a component by its name)."""
        return replace_flat(self, changes)


def _fail(message: str) -> typing.NoReturn:
    raise TrainConfigError(message)


def _validate(c: TrainConfig) -> None:
    """What no component can check alone (each checks its own settings' choices and ranges when it is built)."""
    if c.data is None:
        _fail("no training data: set data (a conversations file, builtin:mathchat or a prepared directory)")
    if (c.model is None) == (c.tiny is None):
        _fail("set exactly one of model (a hub id or local directory) and tiny (an architecture for "
              f"a random tiny model: {', '.join(TINY_ARCHS)})")
    try:
        c.data_config.check_share_window()
    except ConfigError as e:
        _fail(str(e))
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


def _hints(config: type) -> dict[str, Any]:
    """Each config key's type."""
    return {leaf.name: leaf.hint for leaf in leaves(config)}


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


def config_keys(config: type = TrainConfig) -> list[str]:
    """Every key of a config file: every setting of ``config`` by its flat name (the data settings' too, not
    ``data_config``)."""
    return [leaf.name for leaf in leaves(config)]


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


def _check_keys(values: Mapping[str, Any], where: str, config: type = TrainConfig) -> None:
    known = config_keys(config)
    for key in values:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; known keys: {', '.join(known)}"
            _fail(f"unknown config key {key!r} in {where}{hint}")


def config_from_dict(values: Mapping[str, Any], *, where: str = "the config", config: type = TrainConfig) -> Any:
    """A validated :class:`TrainConfig` (or ``config``, a record of settings) from plain values (YAML types are
    coerced)."""
    values = rename_deprecated(values, where)
    _check_keys(values, where, config)
    hints = _hints(config)
    report = values.get("report_to")
    if report in ("none", None, [], ["none"]):
        values = {**values, "report_to": ()}
    elif report == "all" or report == ["all"]:
        values = {**values, "report_to": REPORT_TO}
    if values.get("optim") in OPTIMIZER_ALIASES:
        values = {**values, "optim": OPTIMIZER_ALIASES[values["optim"]]}
    values = {k: _coerce(k, v, hints[k]) for k, v in values.items()}
    try:
        return build(config, values)
    except TrainConfigError:
        raise
    except ConfigError as e:  # DataConfig's: one line, as a TrainConfigError like every other bad setting
        _fail(str(e))


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


RESUME_KEYS = resume_keys(TrainConfig)
"""Settings that must match for --resume to continue the same run (``resume=True``; the rest may change, e.g.
max_steps to train longer, save_steps, logging). The optimizer's hyper-parameters are among them because the
checkpoint's optimizer and scheduler state would silently keep the old values."""
PATH_KEYS = path_keys(TrainConfig)
"""The settings naming a file or folder (``path=True``): compared as resolved paths."""
