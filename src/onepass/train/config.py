"""The training run's settings: one frozen record, loaded from YAML plus overrides.

Why this module exists: a run is reproducible only if everything that shapes
it is in one place that is saved beside the outputs (``train_config.yaml``)
and checked on ``--resume``. Every mistake a user can make here (an unknown
key, a bad value, QLoRA on a CPU, data or a model that is not there) is a
:class:`TrainConfigError`: a ``ValueError`` whose message is one line saying
what was wrong and what to do, which ``onepass`` prints as
``onepass: error: ...``.

    >>> cfg = load_config(None, {"tiny": "qwen3", "data": "builtin:mathchat"})
    >>> cfg.schedule, cfg.batch_size, cfg.grad_accum
    ('one-pass', 1, 1)

Batch vocabulary: a *unit* is one conversation (raw data, prepared on the fly:
all of its trees) or one row (a prepared directory). One optimizer step covers
``batch_size * grad_accum * world_size`` units; each process takes
``batch_size`` units per micro-batch, ``grad_accum`` micro-batches per step.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from onepass.errors import ConfigError

FINETUNES = ("full", "lora", "qlora")
OPTIMIZERS = ("adamw", "sgd", "adamw_8bit", "paged_adamw_8bit")
LR_SCHEDULERS = ("constant", "linear", "cosine")
DTYPES = ("float32", "bfloat16", "float64")
MIXED_PRECISION = ("no", "bf16")
REPORT_TO = ("tensorboard",)


class TrainConfigError(ConfigError):
    """A training setting that cannot work; the message is one line and says what to do."""


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    # model: exactly one of model / tiny
    model: str | None = None  # a hub id or a local directory
    tiny: str | None = None  # a random tiny model of this architecture (onepass.tiny), for tests/demos
    tiny_config: dict[str, Any] = field(default_factory=dict)  # size overrides, e.g. {hidden_size: 128}
    compact_vocab: bool = True  # tiny only: renumber the token ids that occur to 0..V-1
    tokenizer: str | None = None  # default: the model's own; builtin:qwen3 for tiny
    chat_template: str | None = None
    completion_format: str | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    # data
    data: str | None = None  # conversations file, builtin:mathchat, or a prepared directory
    eval_data: str | None = None
    limit: int | None = None  # first N conversations (or rows) only
    schedule: str = "one-pass"
    max_tokens: int | None = None
    pack: bool = False  # pack each micro-batch's trees into rows of <= max_tokens
    weighting: str = "token"
    max_batch_tokens: int | None = None  # split a micro-batch into forwards of <= this many padded tokens
    allow_inexact: bool = False  # train even when the exactness guard (onepass.guard) finds one-pass != N-pass
    # fine-tuning
    finetune: str = "full"  # full | lora | qlora
    lora_r: int = 16
    lora_alpha: float = 32.0
    lora_dropout: float = 0.05
    lora_target_modules: str | tuple[str, ...] = "all-linear"
    # optimisation
    optimizer: str = "adamw"
    lr: float = 2e-5
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    lr_scheduler: str = "linear"
    warmup_ratio: float = 0.0
    warmup_steps: int = 0
    epochs: float = 1.0
    max_steps: int | None = None  # overrides epochs
    batch_size: int = 1  # units per micro-batch per process
    grad_accum: int = 1  # micro-batches per optimizer step
    max_grad_norm: float | None = 1.0
    # numerics and hardware
    dtype: str = "float32"  # weights of the loaded model
    mixed_precision: str = "no"  # "bf16": autocast the forward pass
    gradient_checkpointing: bool = False
    attention: str = "auto"  # auto | sdpa | eager | flex_attention | a registered backend name
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    # outputs
    output_dir: str = "runs/train"
    seed: int = 0
    logging_steps: int = 1
    save_steps: int | None = None  # checkpoint every N steps (and always at the end)
    save_total_limit: int | None = 2
    eval_steps: int | None = None
    report_to: tuple[str, ...] = ()
    progress: bool = True
    save_model: bool = True  # save_pretrained into output_dir/final at the end

    def __post_init__(self) -> None:
        _validate(self)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        return {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}

    def replace(self, **changes: Any) -> TrainConfig:
        return dataclasses.replace(self, **changes)


def _fail(message: str) -> typing.NoReturn:
    raise TrainConfigError(message)


def _one_of(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        _fail(f"unknown {name} {value!r}; use one of {', '.join(allowed)}")


def _validate(c: TrainConfig) -> None:
    from onepass.schedule import WEIGHTINGS, parse_schedule
    from onepass.tiny import TINY_ARCHS

    if c.data is None:
        _fail("no training data: set data (a conversations file, builtin:mathchat or a prepared directory)")
    if (c.model is None) == (c.tiny is None):
        _fail("set exactly one of model (a hub id or local directory) and tiny (an architecture for "
              f"a random tiny model: {', '.join(TINY_ARCHS)})")
    if c.tiny is not None:
        _one_of("tiny architecture", c.tiny, TINY_ARCHS)
    try:
        parse_schedule(c.schedule)
    except ValueError as e:
        _fail(str(e))
    _one_of("weighting", c.weighting, WEIGHTINGS)
    _one_of("finetune", c.finetune, FINETUNES)
    _one_of("optimizer", c.optimizer, OPTIMIZERS)
    _one_of("lr_scheduler", c.lr_scheduler, LR_SCHEDULERS)
    _one_of("dtype", c.dtype, DTYPES)
    _one_of("mixed_precision", c.mixed_precision, MIXED_PRECISION)
    for r in c.report_to:
        _one_of("report_to", r, REPORT_TO)
    if c.pack and c.max_tokens is None:
        _fail("pack needs a row budget: set max_tokens")
    for name in ("batch_size", "grad_accum", "logging_steps", "lora_r"):
        if getattr(c, name) < 1:
            _fail(f"{name} must be >= 1, got {getattr(c, name)}")
    for name in ("max_tokens", "max_batch_tokens", "max_steps", "save_steps", "eval_steps", "limit",
                 "save_total_limit"):
        value = getattr(c, name)
        if value is not None and value < 1:
            _fail(f"{name} must be >= 1 (or unset), got {value}")
    if c.lr <= 0:
        _fail(f"lr must be > 0, got {c.lr}")
    if c.epochs <= 0:
        _fail(f"epochs must be > 0, got {c.epochs}")
    if not 0 <= c.warmup_ratio < 1 or c.warmup_steps < 0:
        _fail("warmup_ratio must be in [0, 1) and warmup_steps >= 0")
    if not 0 <= c.lora_dropout < 1:
        _fail(f"lora_dropout must be in [0, 1), got {c.lora_dropout}")
    if c.finetune == "qlora" and c.tiny is not None:
        _fail("qlora loads a saved model in 4 bits: save the tiny model and pass its directory as model")
    if c.finetune == "qlora" and c.dtype == "float64":
        _fail("qlora computes in bfloat16 or float32, not float64")
    if c.optimizer.endswith("8bit") and c.device == "cpu":
        _fail(f"optimizer {c.optimizer} (bitsandbytes) needs a CUDA GPU; use adamw on CPU")
    if c.finetune == "qlora" and c.device == "cpu":
        _fail(QLORA_ON_CPU)


QLORA_ON_CPU = ("qlora (4-bit NF4 through bitsandbytes) needs a CUDA GPU; on CPU use finetune: lora "
                "(or full)")


# ---------------------------------------------------------------------------------------------
# YAML + overrides -> TrainConfig


def _hints() -> dict[str, Any]:
    return typing.get_type_hints(TrainConfig)


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
    return [f.name for f in dataclasses.fields(TrainConfig)]


def _check_keys(values: Mapping[str, Any], where: str) -> None:
    known = config_keys()
    for key in values:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; known keys: {', '.join(known)}"
            _fail(f"unknown config key {key!r} in {where}{hint}")


def config_from_dict(values: Mapping[str, Any], *, where: str = "the config") -> TrainConfig:
    """A validated :class:`TrainConfig` from plain values (YAML types are coerced)."""
    _check_keys(values, where)
    hints = _hints()
    if values.get("report_to") in ("none", None, []):
        values = {**values, "report_to": ()}
    return TrainConfig(**{k: _coerce(k, v, hints[k]) for k, v in values.items()})


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
    values = read_yaml(path) if path is not None else {}
    _check_keys(values, str(path))
    changes = {k: v for k, v in (overrides or {}).items() if v is not None}
    _check_keys(changes, "the overrides")
    merged = {**values, **changes}
    if "tiny" in changes:  # a flag picks the model source: it replaces the file's
        merged.pop("model", None)
    if "model" in changes:
        merged.pop("tiny", None)
    return config_from_dict(merged, where=str(path) if path is not None else "the overrides")


def write_yaml(config: TrainConfig, path: str | Path) -> None:
    import yaml

    Path(path).write_text(yaml.safe_dump(config.to_dict(), sort_keys=False), encoding="utf-8")


# Settings that must match for --resume to continue the same run (the rest may change,
# e.g. max_steps to train longer, save_steps, logging).
RESUME_KEYS = ("model", "tiny", "tiny_config", "compact_vocab", "data", "limit", "schedule", "max_tokens",
               "pack", "weighting", "finetune", "lora_r", "lora_alpha", "lora_dropout",
               "lora_target_modules", "optimizer", "batch_size", "grad_accum", "seed", "dtype")
