"""Which parallelism a run asked for, which one it got, and getting the one it asked for.

Why this module exists: a launcher's request and what actually runs can differ
silently. Tried on CPU with accelerate 1.x: ``accelerate launch --cpu
--num_processes 2`` starts *one* process (its simple launcher; more CPU ranks
need mpirun); an ``FSDP`` config starts two processes that then run DDP,
because accelerate turns FSDP on only for GPU-like devices (``state.py``: the
``MULTI_CPU`` type never becomes ``FSDP``). A run must say what ran, and a run
that would not be what was asked for must stop with one line.

    asked (the launcher's environment)        got (the Accelerator)
    ACCELERATE_USE_DEEPSPEED=true  deepspeed   DistributedType.DEEPSPEED
    ACCELERATE_USE_FSDP=true       fsdp        DistributedType.FSDP
    WORLD_SIZE > 1                 ddp         MULTI_CPU / MULTI_GPU / ...
    nothing                        single      NO

On CPU, :func:`make_accelerator` gives FSDP back its meaning: the state is
switched to ``FSDP`` with the plugin accelerate's launcher described
(``FSDP_*`` variables), so ``accelerator.prepare`` runs accelerate's own FSDP2
path (``fully_shard`` per decoder layer, gloo) - the path a GPU user's FSDP
config takes. ``describe`` is what the first log line and ``metrics.json``
(``distributed``) say.

Sequence parallelism (one row split over ``sp_size`` processes, :mod:`onepass.parallel`) is asked for
the way accelerate names it: ``sp_size`` (``--sp-size``) or an accelerate config's
``parallelism_config_sp_size`` (``PARALLELISM_CONFIG_SP_SIZE``). accelerate 1.15 runs that degree
through DeepSpeed's ALST only, which cannot carry a tree mask, and under FSDP it would run plain
data parallelism; so onepass takes the request over (:mod:`onepass.train.sequence_parallel`), builds
its own ``(dp, sp)`` device mesh and keeps accelerate from building one
(:func:`without_accelerate_parallelism`).

    >>> asked_mode({"ACCELERATE_USE_FSDP": "true", "WORLD_SIZE": "2"}), asked_mode({})
    ('fsdp', 'single')
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from onepass.model.private_names import private
from onepass.train.config import TrainConfigError

MODES = ("single", "ddp", "fsdp", "deepspeed")
FSDP_ACCELERATE = "1.14"  # the first accelerate whose FSDP2 path runs on CPU ranks (1.13: mixed Tensor and DTensor)
STREAM_ACCELERATE = "1.13"  # the first accelerate whose batch dispatcher (streams) passes a batch's non-tensor fields


def _flag(env: Mapping[str, str], name: str) -> bool:
    return env.get(name, "false").strip().lower() in ("1", "true", "yes")


def asked_mode(env: Mapping[str, str] | None = None) -> str:
    """The parallelism the launcher asked for, read from its environment (one of :data:`MODES`)."""
    env = os.environ if env is None else env
    if _flag(env, "ACCELERATE_USE_DEEPSPEED"):
        return "deepspeed"
    if _flag(env, "ACCELERATE_USE_FSDP"):
        return "fsdp"
    return "ddp" if int(env.get("WORLD_SIZE", "1") or 1) > 1 else "single"


@dataclass(frozen=True, kw_only=True)
class Distributed:
    """What ran: written to ``metrics.json`` as ``distributed`` and said in the run's first log line."""

    mode: str  # single | ddp | fsdp | deepspeed
    world_size: int
    backend: str | None  # the process group's backend (gloo, nccl), None for one process
    device: str
    fsdp_version: int | None = None
    launcher: str = "none"  # accelerate | torchrun | none
    sp_size: int = 1  # sequence parallelism: each row split over this many processes (world = dp x sp)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def line(self) -> str:
        how = {"single": "one process", "ddp": "DDP", "fsdp": f"FSDP{self.fsdp_version or ''}",
               "deepspeed": "DeepSpeed"}[self.mode]
        over = "" if self.mode == "single" else f" over {self.world_size} processes ({self.backend})"
        sp = (f", sequence parallel {self.sp_size} x data parallel {self.world_size // self.sp_size}"
              if self.sp_size > 1 else "")
        via = "" if self.launcher == "none" else f", launched by {self.launcher}"
        return f"parallelism: {how}{over} on {self.device}{sp}{via}"


def _launcher(env: Mapping[str, str]) -> str:
    if "ACCELERATE_DYNAMO_BACKEND" in env:  # exported by every accelerate launcher, set by no Accelerator
        return "accelerate"
    return "torchrun" if "TORCHELASTIC_RUN_ID" in env or "LOCAL_RANK" in env else "none"


def describe(accelerator: Any, env: Mapping[str, str] | None = None, *, sp_size: int = 1) -> Distributed:
    """The parallelism ``accelerator`` runs (not what was asked for); ``sp_size``: the sequence-parallel
    degree in effect (:func:`onepass.train.sequence_parallel.parallel_dims`)."""
    import torch.distributed as dist

    env = os.environ if env is None else env
    kind = str(accelerator.distributed_type).split(".")[-1]
    mode = {"NO": "single", "FSDP": "fsdp", "DEEPSPEED": "deepspeed"}.get(kind, "ddp")
    plugin = getattr(accelerator.state, "fsdp_plugin", None) if mode == "fsdp" else None
    backend = dist.get_backend() if dist.is_available() and dist.is_initialized() else None
    return Distributed(mode=mode, world_size=accelerator.num_processes, backend=backend,
                       device=accelerator.device.type, launcher=_launcher(env),
                       fsdp_version=getattr(plugin, "fsdp_version", None), sp_size=sp_size)


def check_launch(env: Mapping[str, str] | None = None, parent_argv: Sequence[str] | None = None) -> None:
    """Refuse ``accelerate launch --cpu`` asked for N > 1 processes: accelerate started one (needs mpirun).

    accelerate's simple launcher (``--cpu`` / ``use_cpu: true``) runs the script once and
    sets ``ACCELERATE_USE_CPU`` but no ``WORLD_SIZE``; the process count it was given is only
    on its own command line (or in its config file), so both are read back from the parent.
    """
    env = os.environ if env is None else env
    if "ACCELERATE_USE_CPU" not in env or "WORLD_SIZE" in env or "PMI_SIZE" in env or "OMPI_COMM_WORLD_SIZE" in env:
        return
    argv = list(parent_argv) if parent_argv is not None else _parent_argv()
    asked = _accelerate_num_processes(argv)
    if asked is not None and asked > 1:
        raise TrainConfigError(
            f"accelerate launch was asked for {asked} processes with --cpu / use_cpu: true, which starts one "
            "(accelerate's CPU launcher needs mpirun for more); for CPU ranks over gloo use "
            "--config_file configs/accelerate-fsdp-cpu.yaml (FSDP) or --multi_gpu --num_processes N (DDP), "
            "without --cpu")


def _parent_argv() -> list[str]:
    try:
        raw = Path(f"/proc/{os.getppid()}/cmdline").read_bytes()
    except OSError:
        return []
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def _accelerate_num_processes(argv: Sequence[str]) -> int | None:
    """``--num_processes`` of an ``accelerate launch`` command line, else its config file's; None if neither."""
    starts = [i for i, a in enumerate(argv) if a in ("launch", "accelerate.commands.launch")]
    if not starts:  # `accelerate launch ...` or `python -m accelerate.commands.launch ...`
        return None
    from accelerate.commands.launch import launch_command_parser

    rest = list(argv[starts[0] + 1:])
    args, _ = launch_command_parser().parse_known_args(rest)
    if args.num_processes is not None:
        return int(args.num_processes)
    if args.config_file:
        from accelerate.commands.config.config_args import load_config_from_file

        return int(load_config_from_file(args.config_file).num_processes or 1)
    return None


_PREFIXED = {"fsdp_config": "fsdp_", "fp8_config": "fp8_", "dynamo_config": "dynamo_"}


def check_accelerate_config(path: str | Path) -> Any:
    """An accelerate config file, checked against accelerate's own schema; returns its ``ClusterConfig``.

    accelerate refuses unknown top-level keys when it reads the file, but copies the keys of
    ``fsdp_config`` / ``deepspeed_config`` / ... onto its launch arguments and ignores any it
    has no argument for, so a misspelled ``fsdp_reshard_after_forwad`` would quietly be the
    default. Each one must be an argument of ``accelerate launch`` (the name it maps to, as
    ``accelerate launch`` maps it); an FSDP config's plugin is then built from what the
    launcher would export, so a bad value fails here too.
    """
    from accelerate.commands.config.config_args import load_config_from_file

    try:
        cluster = load_config_from_file(str(path))
    except (ValueError, TypeError) as e:  # e.g. a top-level key the installed accelerate predates
        raise TrainConfigError(f"{path}: {e}{_older_accelerate()}") from None
    known = {a.dest for a in private("accelerate launch_command_parser()._actions")}
    for name, section in vars(cluster).items():
        if not isinstance(section, dict):
            continue
        prefix = _PREFIXED.get(name, "")
        unknown = [k for k in section if (k if k.startswith(prefix) else prefix + k) not in known]
        if unknown:
            raise TrainConfigError(f"{path}: {name} has key(s) accelerate launch does not know: "
                                   f"{', '.join(sorted(unknown))}{_older_accelerate()}")
    if str(cluster.distributed_type).split(".")[-1] == "FSDP":
        _fsdp_plugin_of(cluster, path)
    return cluster


def _older_accelerate() -> str:
    """A hint when the installed accelerate predates the one the shipped configs are written for."""
    import accelerate

    if not accelerate_predates_fsdp():
        return ""
    return f" (accelerate {accelerate.__version__}; the shipped configs are for accelerate>={FSDP_ACCELERATE})"


def _fsdp_plugin_of(cluster: Any, path: str | Path) -> Any:
    """The ``FullyShardedDataParallelPlugin`` each rank would build from ``cluster`` (launcher's variables)."""
    from unittest import mock

    from accelerate.utils import FullyShardedDataParallelPlugin

    env = {"ACCELERATE_USE_FSDP": "true"}
    for key, value in cluster.fsdp_config.items():
        name = (key if key.startswith("fsdp_") else "fsdp_" + key)[len("fsdp_"):].upper()
        env["FSDP_" + name] = str(value)
    with mock.patch.dict(os.environ, env):
        try:
            return FullyShardedDataParallelPlugin()
        except (ValueError, TypeError, KeyError) as e:
            raise TrainConfigError(f"{path}: fsdp_config: {e}") from None


def make_accelerator(*, cpu: bool, mixed_precision: str, env: Mapping[str, str] | None = None,
                     **kwargs: Any) -> Any:
    """``Accelerator(cpu=..., mixed_precision=..., **kwargs)`` running the parallelism the launcher asked for.

    On CPU an FSDP request is honoured (accelerate would run DDP): the shared state is switched
    to ``FSDP`` with the launcher's plugin before ``prepare``. Then the mode in effect must be
    the one asked for, else :class:`TrainConfigError`.
    """
    from accelerate import Accelerator

    env = os.environ if env is None else env
    check_launch(env)
    if cpu and asked_mode(env) == "fsdp":
        check_fsdp_accelerate()  # an older accelerate fails inside Accelerator() already
    with without_accelerate_parallelism():
        accelerator = Accelerator(cpu=cpu, mixed_precision=mixed_precision, **kwargs)
    honour_request(accelerator, env)
    return accelerator


def honour_request(accelerator: Any, env: Mapping[str, str] | None = None, *, asked: str | None = None,
                   fsdp_plugin_args: Mapping[str, Any] | None = None, sp_size: int = 1) -> Distributed:
    """Make ``accelerator`` (just made, nothing prepared yet) run what was asked for, or refuse.

    ``asked``: the mode, when not the launcher's (``TrainingArguments(fsdp=...)`` asks for FSDP
    with ``fsdp_plugin_args``, the plugin's settings). Used by :func:`make_accelerator` and by
    ``OnePassTrainer`` for the accelerator HF's Trainer makes. Returns what will run (with ``sp_size``, the
    sequence-parallel degree in effect).
    """
    env = os.environ if env is None else env
    if _GROUP_ENDED and int(env.get("WORLD_SIZE", "1")) > 1:  # accelerate takes the ended group for started
        raise TrainConfigError(
            "this process already ended its launch's process group (shutdown() after a run: `onepass train` "
            "does it when it returns); a second multi-process run needs a launch of its own, or train each "
            "run in it and call shutdown() once after the last")
    asked = asked or asked_mode(env)
    if asked == "fsdp" and _kind(accelerator) == "MULTI_CPU":
        _fsdp_on_cpu(accelerator, str(accelerator.mixed_precision), fsdp_plugin_args)
    got = describe(accelerator, env, sp_size=sp_size)
    if asked in ("fsdp", "deepspeed") and got.mode != asked or asked == "ddp" and got.mode == "single":
        raise TrainConfigError(
            f"the launcher asked for {asked} but this process would run {got.mode} over {got.world_size} "
            f"process(es) on {got.device}: check the accelerate config (distributed_type, num_processes, use_cpu) "
            "and that every process sees the same devices")
    return got


def _kind(accelerator: Any) -> str:
    return str(accelerator.distributed_type).split(".")[-1]


def _fsdp_on_cpu(accelerator: Any, mixed_precision: str, plugin_args: Mapping[str, Any] | None = None) -> None:
    """accelerate's FSDP state on CPU ranks (gloo): what ``AcceleratorState`` does for GPUs, done here."""
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(**(plugin_args or {}))  # else from the launcher's FSDP_* variables
    if plugin.fsdp_version != 2:
        raise TrainConfigError(f"FSDP on CPU runs FSDP2 only (fully_shard); the accelerate config has "
                               f"fsdp_version: {plugin.fsdp_version}: set fsdp_version: 2")
    if mixed_precision != "no":
        plugin.set_mixed_precision(mixed_precision)
    accelerator_state = private("accelerate.state.AcceleratorState._shared_state")
    accelerator_state["fsdp_plugin"] = plugin
    accelerator_state["distributed_type"] = DistributedType.FSDP
    private("accelerate.state.PartialState._shared_state")["distributed_type"] = DistributedType.FSDP


def accelerate_version(version: str | None = None) -> str:
    """``version``, or the installed accelerate's when None."""
    if version is None:
        import accelerate

        version = accelerate.__version__
    return version


def accelerate_older_than(floor: str, version: str | None = None) -> bool:
    """Is ``version`` (default: the installed accelerate) older than ``floor``?"""
    from packaging.version import Version

    return Version(accelerate_version(version)) < Version(floor)


def accelerate_predates_fsdp(version: str | None = None) -> bool:
    """Is ``version`` (default: the installed accelerate) older than :data:`FSDP_ACCELERATE`?"""
    return accelerate_older_than(FSDP_ACCELERATE, version)


def check_fsdp_accelerate(version: str | None = None) -> None:
    """FSDP on CPU ranks needs accelerate >= :data:`FSDP_ACCELERATE`: measured on 1.4-1.13, its FSDP2 path
    either knows no ``fsdp_version`` or wraps the model so that a step fails with ``aten.mm.default got
    mixed torch.Tensor and DTensor``. One line instead, before any process has started training."""
    version = accelerate_version(version)
    if accelerate_predates_fsdp(version):
        raise TrainConfigError(f"FSDP on CPU ranks needs accelerate>={FSDP_ACCELERATE} (installed: {version}); "
                               "pip install -U accelerate, or launch DDP (accelerate launch --num_processes N)")


def check_stream_accelerate(version: str | None = None) -> None:
    """A streamed dataset (an ``IterableDataset``) reaches the model through accelerate's batch dispatcher, which
    before accelerate :data:`STREAM_ACCELERATE` concatenates every field of a batch as a tensor and fails on the
    rows' host copy (``HostRows``, "Can only concatenate tensors"; measured on 1.4, 1.11 and 1.12 at the floor,
    make test-min). One line instead, when the trainer is given the stream, before anything trains."""
    version = accelerate_version(version)
    if accelerate_older_than(STREAM_ACCELERATE, version):
        raise TrainConfigError(f"a streamed dataset needs accelerate>={STREAM_ACCELERATE} (installed: {version}); "
                               "pip install -U accelerate, or pass a map-style Dataset")


# ---------------------------------------------------------------------------------------------
# accelerate's parallelism_config: read by onepass.train.sequence_parallel, never built by accelerate

PARALLELISM_ENV = "ACCELERATE_USE_PARALLELISM_CONFIG"  # set by accelerate launch for a parallelism_config


@contextlib.contextmanager
def without_accelerate_parallelism() -> Iterator[None]:
    """Inside, accelerate builds no ``ParallelismConfig`` from the launcher's variables: with ``sp_size`` it
    would route to DeepSpeed, or refuse on CPU ranks; onepass runs the request itself
    (:func:`onepass.train.sequence_parallel.parallel_dims`)."""
    saved = os.environ.pop(PARALLELISM_ENV, None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ[PARALLELISM_ENV] = saved


def shutdown() -> None:
    """End the process group after a finished run, in the order that cannot deadlock (no-op for one process).

    Call it once the model, its DDP wrapper and the accelerator are out of scope. The two-rank
    teardown flake, caught with py-spy on a hung rank (gloo, load 9 on 2 cores):

        main thread   pybind dealloc of DDP's Reducer (GIL held) -> ~ProcessGroupGloo -> thread.join
        gloo worker   ~AsyncAllgatherWork -> decref of a Python tensor -> waits for the GIL

    The Reducer held the group's last reference (``destroy_process_group`` had dropped the
    registry's), so the join ran with the GIL held while a worker was still freeing finished
    work. During interpreter finalisation the same race aborts instead ('terminate called
    without an active exception': the worker cannot take the GIL). So: free the wrappers while
    the group is still registered (``gc.collect``), let the workers finish with the GIL free
    (``barrier`` waits without it), then drop the last reference on idle workers.
    """
    import gc

    import torch.distributed as dist

    global _GROUP_ENDED
    if not (dist.is_available() and dist.is_initialized()):
        return
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    _GROUP_ENDED = True  # accelerate would take it for started in the next Accelerator: honour_request refuses


_GROUP_ENDED = False  # shutdown() ended this process's group: a launch's ranks meet once (torchrun's store)


__all__ = ["FSDP_ACCELERATE", "MODES", "Distributed", "accelerate_predates_fsdp", "asked_mode", "check_accelerate_config", "check_fsdp_accelerate", "check_launch", "describe", "honour_request", "make_accelerator",
           "shutdown", "without_accelerate_parallelism"]
