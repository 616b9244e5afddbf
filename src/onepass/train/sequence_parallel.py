"""Sequence parallelism in a run: the degree asked for (as accelerate names it), its mesh, who shares data.

Why this module exists: ``sp_size`` S splits each row over S processes (:mod:`onepass.ulysses`); the
other ``world / S`` groups run data parallel. How a launch asks for it, and what a process then is, is
decided here, once:

- :func:`sequence_parallel_size`: ``sp_size`` (``--sp-size``) or an accelerate config's
  ``parallelism_config_sp_size`` (exported as ``PARALLELISM_CONFIG_SP_SIZE``), checked against the
  launch in one line (they differ, tensor or context parallelism, DeepSpeed's ALST, one process, a
  degree that does not divide the processes);
- :func:`sequence_mesh`: this process's :class:`~onepass.ulysses.comm.SequenceShard` on a ``(dp, sp)``
  device mesh;
- :func:`data_parallel`: the data-parallel world and rank the data order uses (the S ranks of a row
  take the same units).

accelerate 1.15 would hand ``parallelism_config_sp_size`` to DeepSpeed's ALST, which drops the mask,
or refuse it on CPU ranks; :func:`onepass.train.distributed.without_accelerate_parallelism` keeps it
from building its own. docs/distributed.md says what was reused and why.

    >>> sequence_parallel_size(1, {"ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_SP_SIZE": "2",
    ...                            "WORLD_SIZE": "4"})
    2
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from onepass.train.config import TrainConfigError
from onepass.train.distributed import PARALLELISM_ENV, asked_mode
from onepass.ulysses.comm import SequenceShard, TorchGroup

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


def sequence_mesh(accelerator: Any, sp_size: int) -> SequenceShard | None:
    """This process's :class:`onepass.ulysses.comm.SequenceShard` on a ``(dp, sp)`` device mesh (consecutive
    ranks share a row), or None for ``sp_size`` 1. FSDP2 keeps sharding over every rank (the flattened
    mesh, as torchtitan shards over dp x cp) and DDP averages over every rank: with each rank's loss the
    sum over its shard and the global normaliser, the gradient is one process's (onepass.train.run.step)."""
    if sp_size <= 1:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    world = accelerator.num_processes
    mesh = init_device_mesh(accelerator.device.type, (world // sp_size, sp_size), mesh_dim_names=("dp", "sp"))
    group = TorchGroup(mesh.get_group("sp"))
    return SequenceShard(group=group, rank=group.rank)


def data_parallel(accelerator: Any, shard: SequenceShard | None) -> tuple[int, int]:
    """(data-parallel world, this process's data-parallel rank): the processes, or their groups of ``sp_size``
    consecutive ranks that split one row (``shard``: :func:`sequence_mesh`'s)."""
    degree = 1 if shard is None else shard.degree
    return accelerator.num_processes // degree, accelerator.process_index // degree
