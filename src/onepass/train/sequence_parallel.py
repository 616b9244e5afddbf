"""Sequence parallelism in a run: the degree asked for (as accelerate names it), its mesh, who shares data.

Why this module exists: ``sp_size`` S splits each row over S processes (:mod:`onepass.parallel`); the
other ``world / S`` groups run data parallel. How a launch asks for it, and what a process then is, is
decided here, once:

- :func:`sequence_parallel_size`: ``sp_size`` (``--sp-size``) or an accelerate config's
  ``parallelism_config_sp_size`` (exported as ``PARALLELISM_CONFIG_SP_SIZE``), checked against the
  launch in one line (they differ, tensor or context parallelism, DeepSpeed's ALST, one process, a
  degree that does not divide the processes);
- :func:`check_split`: before any work, the model's heads split over the degree and its tiny float64 twin
  split over simulated ranks takes one process's loss and gradients (the guard's split mode,
  :mod:`onepass.guard.sequence_parallel`); what metrics.json records;
- :func:`share_batches`: an accelerate data loader of ``OnePassTrainer`` made to hand the ranks of a row
  the same batches (``onepass train`` orders its units by the data-parallel rank itself);
- :func:`parallel_dims`: the run's layout, one :class:`ParallelDims` built once from the accelerator
  and passed down: the data-parallel, sequence-parallel and sharding degrees, this process's ranks in
  each, the ``(dp, sp)`` device mesh and its :class:`~onepass.parallel.comm.SequenceShard` (torchtitan's
  ``ParallelDims`` is the model: one object, every degree and rank derived from it).

accelerate 1.15 would hand ``parallelism_config_sp_size`` to DeepSpeed's ALST, which drops the mask,
or refuse it on CPU ranks; :func:`onepass.train.distributed.without_accelerate_parallelism` keeps it
from building its own. docs/distributed.md says what was reused and why.

    >>> sequence_parallel_size(1, {"ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_SP_SIZE": "2",
    ...                            "WORLD_SIZE": "4"})
    2
    >>> dims = ParallelDims(world=4, rank=3, sp=2)   # (the shard: a mesh's, when sp > 1)
    >>> dims.dp, dims.dp_rank, dims.sp_rank, dims.counts_rows
    (2, 1, 1, False)
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from onepass.attention.backends import model_backend
from onepass.guard.sequence_parallel import check_sequence_parallel
from onepass.model.couplings import base_model, is_prompt_learning
from onepass.train.checkpoint import is_sharded
from onepass.train.config import TrainConfigError
from onepass.train.distributed import PARALLELISM_ENV, asked_mode
from onepass.parallel.comm import SequenceShard, TorchGroup
from onepass.parallel.model import check_degree, install


def _accelerate_sizes(env: Mapping[str, str]) -> dict[str, int]:
    """The sizes of an accelerate ``parallelism_config`` the launcher exported ({} when none)."""
    if env.get(PARALLELISM_ENV, "false").strip().lower() not in ("1", "true", "yes"):
        return {}
    out = {}
    for name in ("dp_replicate", "dp_shard", "tp", "cp", "sp"):
        raw = env.get(f"PARALLELISM_CONFIG_{name.upper()}_SIZE", "1") or "1"
        try:
            out[name] = int(raw)
        except ValueError:
            raise TrainConfigError(f"the accelerate config's parallelism_config_{name}_size is {raw!r}, not a "
                                   "number") from None
    return out


def accelerate_sp_size(env: Mapping[str, str] | None = None) -> int:
    """The ``parallelism_config_sp_size`` an accelerate launch exported (1 when none)."""
    return _accelerate_sizes(os.environ if env is None else env).get("sp", 1)


def sequence_parallel_size(sp_size: int, env: Mapping[str, str] | None = None) -> int:
    """The sequence-parallel degree asked for: ``sp_size`` (``--sp-size``) or the accelerate config's
    ``parallelism_config_sp_size``; one :class:`TrainConfigError` line for what cannot run as asked (they
    differ, tensor or context parallelism, DeepSpeed's ALST, a degree that does not divide the processes,
    a degree above one process)."""
    env = os.environ if env is None else env
    sizes = _accelerate_sizes(env)
    asked = sizes.get("sp", 1)
    if sp_size > 1 and asked > 1 and sp_size != asked:
        raise TrainConfigError(f"sp_size {sp_size} and the accelerate config's parallelism_config_sp_size {asked} "
                               "differ; set one of them")
    degree = max(sp_size, asked)
    for name in ("tp", "cp"):
        if sizes.get(name, 1) > 1:
            raise TrainConfigError(f"the accelerate config asks for parallelism_config_{name}_size "
                                   f"{sizes[name]}: onepass runs data x sequence parallelism only (cp is torch's "
                                   "ring attention for causal masks, which cannot carry a tree); use "
                                   "parallelism_config_sp_size")
    if degree > 1 and asked_mode(env) == "deepspeed":
        raise TrainConfigError(f"sequence parallelism (sp_size {degree}) under DeepSpeed runs its ALST/Ulysses, "
                               "which drops the attention mask and rebuilds a causal one from the position ids: it "
                               "cannot carry a tree; launch FSDP (configs/accelerate-fsdp-sp-cpu.yaml) or DDP")
    world = int(env.get("WORLD_SIZE", "1") or 1)
    if degree > 1 and world == 1:
        raise TrainConfigError(f"sp_size {degree} splits each row over {degree} processes, but this is one "
                               f"process: launch with torchrun --nproc_per_node {degree} or accelerate launch "
                               "(configs/accelerate-fsdp-sp-cpu.yaml)")
    if world % degree:
        raise TrainConfigError(f"sp_size {degree} does not divide the {world} processes: each row is split over "
                               f"sp_size processes and the rest run data parallel; launch a multiple of {degree}")
    data = sizes.get("dp_replicate", 1) * sizes.get("dp_shard", 1)
    if sizes and data > 1 and data * degree != world:
        raise TrainConfigError(f"the accelerate config's parallelism_config sizes give {data} x {degree} processes "
                               f"but {world} run; make dp_shard_size x sp_size the number of processes")
    return degree


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class ParallelDims:
    """How a run's processes share the work: ``world = dp x sp``, consecutive ranks split one row.

    ``sp``: the sequence-parallel degree (each row over ``sp`` processes, :mod:`onepass.parallel`); the
    ``dp = world / sp`` groups take different units. ``sharded``: FSDP shards the parameters over every
    rank (the flattened ``dp x sp`` mesh, as torchtitan shards over dp x cp). ``shard``: this process's
    place in its row's group (None when ``sp`` is 1); ``mesh``: the ``(dp, sp)`` device mesh it came from.
    Built once (:func:`parallel_dims`) and handed to what needs a degree or a rank; nothing else keeps one.
    """

    world: int
    rank: int
    sp: int = 1
    sharded: bool = False
    shard: SequenceShard | None = None
    mesh: Any = None

    def __post_init__(self) -> None:
        assert self.sp >= 1 and self.world % self.sp == 0, (self.world, self.sp)
        assert self.shard is None or (self.shard.degree == self.sp and self.shard.rank == self.sp_rank)

    @property
    def dp(self) -> int:
        """The data-parallel world: the groups of ``sp`` ranks that take different units."""
        return self.world // self.sp

    @property
    def dp_rank(self) -> int:
        """This process's group: the data order's rank (the ``sp`` ranks of a row take the same units)."""
        return self.rank // self.sp

    @property
    def sp_rank(self) -> int:
        return self.rank % self.sp

    @property
    def counts_rows(self) -> bool:
        """Whether this process counts its rows' weights and tokens: one rank per row (they are the group's)."""
        return self.sp_rank == 0


def parallel_dims(accelerator: Any, sp_size: int) -> ParallelDims:
    """The run's :class:`ParallelDims`, built once: for ``sp_size`` > 1 a ``(dp, sp)`` device mesh (consecutive
    ranks share a row) and this process's :class:`~onepass.parallel.comm.SequenceShard` on its ``sp`` group.
    FSDP2 keeps sharding over every rank and DDP averages over every rank: with each rank's loss the sum
    over its shard and the global normaliser, the gradient is one process's (onepass.train.run.step)."""
    world, rank, sharded = accelerator.num_processes, accelerator.process_index, is_sharded(accelerator)
    if sp_size <= 1:
        return ParallelDims(world=world, rank=rank, sharded=sharded)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(accelerator.device.type, (world // sp_size, sp_size), mesh_dim_names=("dp", "sp"))
    group = TorchGroup(mesh.get_group("sp"))
    return ParallelDims(world=world, rank=rank, sp=sp_size, sharded=sharded,
                        shard=SequenceShard(group=group, rank=group.rank), mesh=mesh)


def check_split(model_or_config: Any, degree: int, *, backend: str | None = None,
                log: Callable[[str], None]) -> dict[str, Any]:
    """Before any training with ``degree`` > 1: the model's heads split over that many ranks
    (:func:`onepass.parallel.model.check_degree`), and its tiny float64 twin split over simulated ranks takes
    one process's loss and gradients (:func:`onepass.guard.sequence_parallel.check_sequence_parallel`); one
    :class:`~onepass.parallel.plan.SequenceParallelError` line otherwise. ``backend``: the run's attention
    (default: the model's). Logs what runs; returns what metrics.json records (``sequence_parallel``)."""
    is_model = isinstance(model_or_config, torch.nn.Module)
    config = model_or_config.config if is_model else model_or_config
    backend = backend or model_backend(model_or_config)
    model_or_config = base_model(model_or_config) if is_model else model_or_config
    split = check_degree(config, degree)
    result = check_sequence_parallel(model_or_config, degree, backend=backend)
    repeated = f", key/value heads repeated {split.kv_repeat}x" if split and split.kv_repeat > 1 else ""
    heads = (f"{split.local_heads} of {split.heads} heads per rank inside attention{repeated}" if split
             else "no attention")
    log(f"sequence parallelism: each row split over {degree} processes, {heads}; exact on a float64 twin "
        f"split over {result['twin_degree']} simulated ranks (gradients within {result['max_rel_grad_diff']:.0e})")
    return {"sp_size": degree, **({"heads_per_rank": split.local_heads, "kv_repeat": split.kv_repeat}
                                  if split else {}), **result}


def trainer_sp_size(args: Any) -> int:
    """``OnePassTrainer``'s degree: ``args.sp_size`` or the accelerate config's (:func:`sequence_parallel_size`,
    checked against the launch only when one of them asks for more than 1). HF's own ``parallelism_config``
    ``sp_size`` is one line: transformers would run it through DeepSpeed's ALST, which drops the tree mask."""
    if args.sp_size < 1:
        raise TrainConfigError(f"sp_size must be >= 1, got {args.sp_size}")
    hf = getattr(getattr(args, "parallelism_config", None), "sp_size", None) or 1
    if hf > 1:
        raise TrainConfigError(f"OnePassTrainer splits rows over processes itself: set sp_size={hf} instead of "
                               f"parallelism_config's sp_size {hf} (HF would run it through DeepSpeed's ALST, which "
                               "drops the tree mask; docs/distributed.md)")
    return sequence_parallel_size(args.sp_size) if max(args.sp_size, accelerate_sp_size()) > 1 else 1


def split_model(model: Any, dims: ParallelDims, args: Any) -> None:
    """``OnePassTrainer``'s (unwrapped) model made sequence-parallel when ``dims.sp`` > 1: its heads checked
    and its attention wrapped (:func:`onepass.parallel.model.install`); the nll loss of a causal LM only."""
    if dims.sp == 1:
        return
    if args.loss_type == "dft" or is_prompt_learning(model):
        raise TrainConfigError(f"sequence parallelism (sp_size {dims.sp}) in OnePassTrainer runs the nll loss of a "
                               "causal LM: not loss_type='dft', not a prompt-learning model")
    install(model, dims.sp)


def share_batches(dataloader: Any, dims: ParallelDims) -> Any:
    """``dataloader`` (prepared by accelerate, sharded over every process) handing the ``sp`` ranks of a row
    the same batches: its batch sampler sharded over the ``dp`` groups instead, as transformers' Trainer
    re-shards a rank-aware sampler. A stream (an iterable dataset, which accelerate dispatches from the
    first process) is one line: it cannot be re-sharded here."""
    if dims.sp == 1:
        return dataloader
    sampler = getattr(dataloader, "batch_sampler", None)
    if not (hasattr(sampler, "num_processes") and hasattr(sampler, "process_index")):
        raise TrainConfigError(f"sequence parallelism (sp_size {dims.sp}) in OnePassTrainer reads a dataset of "
                               "rows by index; this one is a stream (an iterable dataset): pass a map-style "
                               "dataset (datasets.Dataset), or train with onepass train --sp-size")
    sampler.num_processes, sampler.process_index = dims.dp, dims.dp_rank
    return dataloader
