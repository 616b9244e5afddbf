"""Checkpoints that resume a run exactly: trainable weights, optimizer, scheduler, RNG, history.

Why this module exists: "resume continues the identical loss sequence" needs
every piece of state that the next step reads. The data order is a function
of (seed, step) (:mod:`onepass.train.run.data`), so a checkpoint holds only:

    checkpoints/step-000012/
      trainable.safetensors   trainable parameters by name (the adapter for LoRA)
      optimizer.pt            optimizer state
      scheduler.pt            learning-rate scheduler state
      rng-rank{r}.pt          every process's torch / CUDA / numpy / python RNG
      state.json              step, run id, the config, the loss history so far

A checkpoint is written under a temporary name and renamed when complete, so
a crash while saving leaves the previous checkpoint as the latest. Sharded
runs (FSDP, DeepSpeed through ``accelerate launch``) save through
``accelerator.save_state`` into ``accelerate/`` instead of the first three files.

Every checkpoint carries its run's id (``state.json``: ``run_id``), so pruning
to ``save_total_limit`` removes only this run's older checkpoints, and the
``.pt`` files hold tensors and plain containers only: they are read with
``torch.load(weights_only=True)``, so a checkpoint handed to ``--resume`` cannot
run code.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import random
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from onepass.errors import OnePassError
from onepass.files import publish_dir, recover_dir, temp_sibling, write_failure
from onepass.train.config import (
    DEPRECATED_KEYS,
    PATH_KEYS,
    RESUME_KEYS,
    TrainConfig,
    TrainConfigError,
)

PREFIX = "step-"


class CheckpointWriteError(OnePassError):
    """A checkpoint that could not be written (a full disk): nothing half-written is left."""


class NonFiniteWeightsError(OnePassError):
    """Weights with NaN or infinite values: never written as a checkpoint or a final model."""


def trainable_state(model: Any) -> dict[str, torch.Tensor]:
    """What a checkpoint must keep of the model: its trainable parameters, by name."""
    return {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}


def non_finite_weights(model: Any) -> list[str]:
    """The trainable parameters of ``model`` holding NaN or infinite values (this process's part of a sharded one)."""
    bad = []
    for name, p in model.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p  # a DTensor shard (FSDP2): this process's part
        if p.requires_grad and local.is_floating_point() and local.numel() and not bool(torch.isfinite(local).all()):
            bad.append(name)
    return bad


def check_finite_weights(accelerator: Any, model: Any, *, step: int) -> None:
    """Every trainable weight finite on every process (a collective), else :class:`NonFiniteWeightsError`
    naming the first bad one: a checkpoint is "the last good step" only if its weights can train on."""
    bad = non_finite_weights(accelerator.unwrap_model(model))
    count = accelerator.reduce(torch.tensor([len(bad)], device=accelerator.device), reduction="sum")
    if int(count.item()):
        raise NonFiniteWeightsError(f"the weights after step {step} hold NaN or infinite values"
                                    + (f" ({bad[0]}{' and others' if len(bad) > 1 else ''})" if bad else "")
                                    + ": nothing is saved from them; resume from the last checkpoint with a lower "
                                    "learning_rate (or check the data and dtype)")


def checkpoint_dir(output_dir: str | Path, step: int) -> Path:
    return Path(output_dir) / "checkpoints" / f"{PREFIX}{step:06d}"


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    root = Path(output_dir) / "checkpoints"
    if not root.is_dir():
        return []
    done = [p for p in root.iterdir() if p.name.startswith(PREFIX) and p.name[len(PREFIX):].isdigit()
            and (p / "state.json").is_file()]
    return sorted(done, key=lambda p: int(p.name[len(PREFIX):]))


def find_checkpoint(output_dir: str | Path, resume: str | bool) -> Path:
    """``True``: the latest checkpoint of ``output_dir``; a path: that checkpoint."""
    if resume is True or resume == "latest":
        found = list_checkpoints(output_dir)
        if not found:
            raise TrainConfigError(f"nothing to resume: no checkpoint in {Path(output_dir) / 'checkpoints'}")
        return found[-1]
    path = Path(str(resume))
    if not (path / "state.json").is_file():
        raise TrainConfigError(f"not a onepass checkpoint (no state.json): {resume}")
    return path


def read_state(path: Path) -> dict[str, Any]:
    """``state.json`` of a checkpoint; one :class:`TrainConfigError` line when it is cut or not an object."""
    file = path / "state.json"
    try:
        state = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TrainConfigError(f"checkpoint {path} is damaged: state.json cannot be read ({e})") from None
    if not isinstance(state, dict) or not isinstance(state.get("step"), int) or isinstance(state["step"], bool) \
            or not isinstance(state.get("config"), dict) or not _records(state.get("history", []), "loss") \
            or not _records(state.get("evals", []), "eval_loss"):
        raise TrainConfigError(f"checkpoint {path} is damaged: state.json is not a checkpoint state")
    step, history, total = state["step"], state.get("history"), state.get("total_steps")
    if step < 0 or (isinstance(history, list) and (len(history) != step or any(
            r["step"] != i for i, r in enumerate(history, 1)))) or (isinstance(total, int) and step > total):
        raise TrainConfigError(f"checkpoint {path} is damaged: state.json says step {step}, but it holds "
                               f"{len(history) if isinstance(history, list) else 'no'} steps of history"
                               + (f" of a run of {total} steps" if isinstance(total, int) else "")
                               + "; resume from another checkpoint")
    return state


def _records(values: Any, key: str) -> bool:
    """A list of step records (``{"step": int, key: number, ...}``), as the loop writes them."""
    return isinstance(values, list) and all(
        isinstance(r, dict) and isinstance(r.get("step"), int) and isinstance(r.get(key), (int, float))
        for r in values)


def check_resumed_run(state: dict[str, Any], path: Path, *, world: int, anyway: bool,
                      say: Callable[[str], None]) -> None:
    """What :func:`check_compatible` cannot see in the config: the number of processes. A step takes
    ``batch x grad_accum x world`` units, so on another world size every later step takes other
    conversations: some twice, some never."""
    saved_world = state.get("world_size")
    if isinstance(saved_world, int) and saved_world != world:
        what = (f"world_size was {saved_world}, now {world} (a step takes per_device_train_batch_size x "
                "gradient_accumulation_steps x processes conversations: on another number of processes the steps "
                "after the checkpoint would train some conversations twice and skip others)")
        if not anyway:
            raise TrainConfigError(f"cannot resume from {path} with different settings: {what}; resume on "
                                   f"{saved_world} process(es) (--resume-anyway to continue regardless)")
        say(f"warning: --resume-anyway: resuming {path} although {what}")


def check_resume_step(state: dict[str, Any], path: Path, *, total: int) -> None:
    """A checkpoint past this run's last step (``max_steps`` lowered) is refused: the run would "finish" with
    the checkpoint's weights and its step count, having trained nothing."""
    if state["step"] > total:
        raise TrainConfigError(f"checkpoint {path} is at step {state['step']}, past this run's {total} steps: raise "
                               "max_steps (or num_train_epochs) to train on from it")


# settings the optimizer's param groups and the scheduler's base rates save with their state: on resume they
# come back from the checkpoint, whatever the config now says
RESTORED_WITH_STATE = ("learning_rate", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon")


def check_compatible(saved: dict[str, Any], config: TrainConfig, path: Path, *, anyway: bool = False,
                     say: Callable[[str], None] | None = None) -> None:
    """Refuse to resume from ``path`` with other :data:`RESUME_KEYS` settings (paths compared resolved);
    ``anyway`` (``--resume-anyway``): say what differs and go on."""
    now = config.to_dict()
    saved = {DEPRECATED_KEYS.get(k, k): v for k, v in saved.items()}  # a run saved before the HF key names
    diffs = [f"{k} was {saved[k]!r}, now {now[k]!r}" for k in RESUME_KEYS
             if k in saved and _norm(k, saved[k]) != _norm(k, now[k])]
    if diffs and anyway:
        kept = [k for k in RESTORED_WITH_STATE if k in saved and _norm(k, saved[k]) != _norm(k, now[k])]
        (say or logging.getLogger("onepass").warning)(
            f"warning: --resume-anyway: resuming {path} with different settings: " + "; ".join(diffs)
            + (f". The optimizer and scheduler state restored from it carry their own {', '.join(kept)}, so "
               "those keep the checkpoint's values; start a new run to use the new ones" if kept else ""))
    elif diffs:
        raise TrainConfigError(f"cannot resume from {path} with different settings: " + "; ".join(diffs)
                               + " (--resume-anyway to continue regardless)")


def _norm(key: str, value: Any) -> Any:
    if isinstance(value, str) and key in PATH_KEYS and Path(value).exists():
        return str(Path(value).resolve())  # ./data.jsonl and /abs/data.jsonl are one file
    return list(value) if isinstance(value, tuple) else value


def _rng_state() -> dict[str, Any]:
    name, keys, pos, has_gauss, cached = np.random.get_state()  # a numpy array would need an unsafe unpickler
    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "numpy": [name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached]}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _load(path: Path) -> Any:
    """A ``.pt`` file of tensors and plain containers; anything else is refused, never executed."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise TrainConfigError(f"{path} holds objects other than tensors and plain values (weights_only "
                               f"load refused it; an untrusted or older checkpoint?): {str(e).splitlines()[0]}"
                               ) from None
    except (RuntimeError, EOFError, OSError, ValueError) as e:  # cut short, or not a torch file
        raise TrainConfigError(f"checkpoint file {path} is damaged or incomplete: "
                               f"{(str(e).splitlines() or [type(e).__name__])[0]}") from None


def check_new_run(output_dir: str | Path, *, overwrite: bool) -> list[Path]:
    """Before a run that does not resume: ``output_dir`` must not hold another run (its checkpoints would
    mix with this one's and ``--resume`` could continue the wrong run) unless ``overwrite``.

    Returns what the new run replaces (its ``checkpoints/`` is removed by the caller, on one process).
    """
    out = Path(output_dir)
    used = [p for p in (out / "checkpoints", out / "metrics.json", out / "metrics.jsonl", out / "train_config.yaml")
            if p.is_file() or (p.is_dir() and any(p.iterdir()))]
    if used and not overwrite:
        raise TrainConfigError(f"{out} holds another run ({', '.join(p.name for p in used)}): pass --resume to "
                               "continue it, --overwrite to start a new run there, or choose another --output-dir")
    return used


def prune_checkpoints(output_dir: str | Path, keep: int, run_id: str | None) -> list[Path]:
    """Remove this run's checkpoints but the latest ``keep``; another run's are never touched."""
    mine = [p for p in list_checkpoints(output_dir) if _run_id(p) == run_id]
    drop = mine[:-keep] if keep > 0 else mine
    for old in drop:  # renamed first: a kill while its files go leaves a hidden leftover, never a half checkpoint
        aside = old.with_name(f".{old.name}{PRUNING}")
        os.replace(old, aside)
        shutil.rmtree(aside, ignore_errors=True)
    return drop


PRUNING, WRITING = ".pruning", ".tmp"  # .step-N.pruning: being removed; .step-N.tmp: being written
_LEFTOVER = re.compile(rf"\.(?P<name>{PREFIX}\d+)(?P<kind>\.pruning|\.tmp|\.old-\d+)")


def clean_leftovers(output_dir: str | Path) -> list[str]:
    """Before a run writes checkpoints (the output folder is locked: no other run of this machine writes
    it): remove what an interrupted save or pruning left (``.step-N.tmp``, ``.step-N.pruning``, an
    interrupted replace); name a ``step-N`` folder without ``state.json`` (not a checkpoint: left in place).
    Returns one line per thing done or found."""
    root = Path(output_dir) / "checkpoints"
    if not root.is_dir():
        return []
    lines = []
    for p in sorted(root.iterdir()):
        found = _LEFTOVER.fullmatch(p.name)
        if found is None:
            continue
        if found["kind"] in (PRUNING, WRITING):
            shutil.rmtree(p, ignore_errors=True)
            lines.append(f"removed {p} (left by an interrupted checkpoint "
                         f"{'removal' if found['kind'] == PRUNING else 'save'})")
        else:  # .step-N.old-PID: a replace of step-N interrupted (onepass.files.publish_dir)
            lines.extend(recover_dir(root / found["name"]))
    for p in sorted(root.iterdir()):
        if p.is_dir() and p.name.startswith(PREFIX) and p.name[len(PREFIX):].isdigit() and \
                not (p / "state.json").is_file():
            lines.append(f"note: {p} has no state.json (a save or a removal by an older onepass was "
                         "interrupted): it is not a checkpoint and is left in place; remove it if it is not yours")
    return lines


def _run_id(path: Path) -> str | None:
    """The run id of a checkpoint; None when its state.json is damaged (never pruned: not known to be ours)."""
    try:
        return read_state(path).get("run_id")
    except TrainConfigError:
        logging.getLogger("onepass").warning("note: %s has a damaged state.json; left in place", path)
        return None


def is_sharded(accelerator: Any) -> bool:
    return str(accelerator.distributed_type).split(".")[-1] in ("FSDP", "DEEPSPEED")


def save_checkpoint(accelerator: Any, model: Any, optimizer: Any, scheduler: Any, *, output_dir: str | Path,
                    step: int, state: dict[str, Any], keep: int | None) -> Path:
    """Write the checkpoint of ``step`` on every process (collective); returns its directory. Weights that
    are not finite are never written (:class:`NonFiniteWeightsError`)."""
    check_finite_weights(accelerator, model, step=step)
    final = checkpoint_dir(output_dir, step)
    tmp = temp_sibling(final, per_process=False)  # every rank writes into it
    try:
        return _save(accelerator, model, optimizer, scheduler, output_dir=output_dir, step=step, state=state,
                     keep=keep, final=final, tmp=tmp)
    except Exception as e:  # a full disk, a quota: the previous checkpoint stays the latest
        reason = write_failure(e)
        if reason is None:
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        earlier = [p for p in list_checkpoints(output_dir) if p != final]
        kept = (f"the previous checkpoint ({earlier[-1].name}) is kept: free space and --resume" if earlier else
                "there is no earlier checkpoint to resume from: free space and run again")
        raise CheckpointWriteError(f"cannot write checkpoint {final} ({reason}); {kept}") from None


def _torch_save(obj: Any, path: Path) -> None:
    """``torch.save`` through a Python file object, so a failed write carries its ``OSError``."""
    with open(path, "wb") as f:
        torch.save(obj, f)


def _save(accelerator: Any, model: Any, optimizer: Any, scheduler: Any, *, output_dir: str | Path, step: int,
          state: dict[str, Any], keep: int | None, final: Path, tmp: Path) -> Path:
    from safetensors.torch import save_file

    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    if is_sharded(accelerator):
        accelerator.save_state(str(tmp / "accelerate"))
    elif accelerator.is_main_process:
        weights = {n: t.contiguous() for n, t in trainable_state(accelerator.unwrap_model(model)).items()}
        save_file(weights, str(tmp / "trainable.safetensors"))
        _torch_save(optimizer.state_dict(), tmp / "optimizer.pt")
    if accelerator.is_main_process:
        _torch_save(scheduler.state_dict(), tmp / "scheduler.pt")
    _torch_save(_rng_state(), tmp / f"rng-rank{accelerator.process_index}.pt")
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (tmp / "state.json").write_text(json.dumps({**state, "step": step}, indent=1) + "\n", encoding="utf-8")
        publish_dir(tmp, final, replace=True)
        if keep is not None:
            prune_checkpoints(output_dir, keep, state.get("run_id"))
    accelerator.wait_for_everyone()
    return final


def check_tensors(saved: dict[str, torch.Tensor], like: dict[str, torch.Tensor], file: Path) -> None:
    """Every saved tensor has the shape of the one it restores and only finite values: a broadcastable
    shape would be ``copy_``-ed into every row, a NaN would resume a run that can only produce NaN."""
    for name, t in saved.items():
        if tuple(t.shape) != tuple(like[name].shape):
            raise TrainConfigError(f"checkpoint file {file}: {name} has shape {tuple(t.shape)}, the model's is "
                                   f"{tuple(like[name].shape)}; it is not a checkpoint of this model")
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise TrainConfigError(f"checkpoint file {file}: {name} holds NaN or infinite values; resume from an "
                                   "earlier checkpoint")


def load_checkpoint(accelerator: Any, model: Any, optimizer: Any, scheduler: Any, path: Path) -> dict[str, Any]:
    """Restore everything :func:`save_checkpoint` wrote; returns the saved ``state.json``."""
    from safetensors.torch import load_file

    if is_sharded(accelerator):
        accelerator.load_state(str(path / "accelerate"))
    else:
        try:
            saved = load_file(str(path / "trainable.safetensors"))
        except Exception as e:  # noqa: BLE001 (safetensors raises its own error type for a cut file)
            raise TrainConfigError(f"checkpoint file {path / 'trainable.safetensors'} is damaged or incomplete: "
                                   f"{(str(e).splitlines() or [type(e).__name__])[0]}") from None
        params = dict(accelerator.unwrap_model(model).named_parameters())
        names = {n for n, p in params.items() if p.requires_grad}
        if names != set(saved):
            missing, extra = sorted(names - set(saved)), sorted(set(saved) - names)
            raise TrainConfigError(f"checkpoint {path} does not fit this model: missing {missing[:3]}, "
                                   f"unexpected {extra[:3]}")
        check_tensors({n: saved[n] for n in names}, {n: params[n] for n in names}, path / "trainable.safetensors")
        optimizer_state = _load(path / "optimizer.pt")
        with torch.no_grad():
            for n in names:
                params[n].copy_(saved[n])
        try:
            optimizer.load_state_dict(optimizer_state)
        except (ValueError, KeyError, TypeError, IndexError) as e:
            raise TrainConfigError(f"checkpoint file {path / 'optimizer.pt'} does not fit this run's optimizer: "
                                   f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
        by_param = {id(p): n for n, p in params.items()}
        check_tensors({f"{by_param.get(id(p), '?')}.{k}": v for p, s in optimizer.state.items() for k, v in s.items()
                       if isinstance(v, torch.Tensor) and v.ndim > 0},
                      {f"{by_param.get(id(p), '?')}.{k}": p for p, s in optimizer.state.items() for k, v in s.items()
                       if isinstance(v, torch.Tensor) and v.ndim > 0}, path / "optimizer.pt")
    scheduler.load_state_dict(_load(path / "scheduler.pt"))
    rng = path / f"rng-rank{accelerator.process_index}.pt"
    if rng.is_file():
        _set_rng_state(_load(rng))
    elif accelerator.is_main_process:
        logging.getLogger("onepass").warning("note: %s not in %s (another number of processes?): dropout will "
                                             "differ", rng.name, path)
    return read_state(path)
