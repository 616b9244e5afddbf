"""What a run leaves for a person: metrics.json, the loss curve PNG, trackers, the progress bar.

Why this module exists: a run must be inspectable while it runs and after it
crashes. ``metrics.json`` is rewritten atomically (:func:`onepass.files.atomic_write_text`) at
every logging step, so a killed run still has its curve; the PNG is drawn at
every checkpoint and at the end. ``report_to`` trackers (tensorboard, wandb,
mlflow, trackio, ...) are accelerate's (:func:`make_trackers`): the run's
``Accelerator`` is made with them and :class:`Reporter` logs ``train/loss``,
``train/grad_norm``, ``train/lr``, ``train/tokens_per_s`` and ``eval/loss``
through it. Their offline modes (``WANDB_MODE=offline``, a local mlflow
``file:`` store) need no network. matplotlib and the trackers are imported only
when used.

    >>> r = Reporter("runs/x", main=True, progress=False, total=10)                # doctest: +SKIP
    >>> r.log_step({"step": 1, "loss": 2.3, "lr": 1e-4}); r.close()               # doctest: +SKIP
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from onepass.files import atomic_write_text

PROJECT = "onepass"  # the trackers' project (wandb project, mlflow experiment, ...)
log = logging.getLogger("onepass")


def make_trackers(report_to: Sequence[str], output_dir: str | Path, *, initial: int = 0) -> list[Any]:
    """``log_with`` for ``accelerate.Accelerator``: tracker names, tensorboard as a tracker writing to
    ``OUTPUT_DIR/tensorboard`` (a resumed run purges the steps after ``initial``)."""
    from accelerate.tracking import TensorBoardTracker

    purge = {"purge_step": initial + 1} if initial else {}
    return [TensorBoardTracker("tensorboard", str(output_dir), **purge) if name == "tensorboard" else name
            for name in report_to]


def _tracker_kwargs(output_dir: Path, run_name: str) -> dict[str, dict[str, Any]]:
    return {"wandb": {"name": run_name, "dir": str(output_dir)}, "mlflow": {"run_name": run_name},
            "trackio": {"name": run_name}, "swanlab": {"experiment_name": run_name}}


def _scalars(values: Mapping[str, Any]) -> dict[str, Any]:
    """The hyperparameters every tracker can store (tensorboard's hparams take scalars only)."""
    return {k: v for k, v in values.items() if isinstance(v, (bool, int, float, str))}


def plot_losses(history: Sequence[Mapping[str, Any]], evals: Sequence[Mapping[str, Any]], out_path: str | Path,
                *, title: str = "training loss", curves: Mapping[str, Sequence[Mapping[str, Any]]] | None = None,
                by_time: bool = False) -> Path:
    """Loss per optimizer step (and eval loss points) as a PNG.

    ``curves``: several named runs on one axis (drawn with different dashes, so identical
    curves stay visible); ``by_time``: a second panel against cumulative training seconds.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    named = dict(curves) if curves else {"train": history}
    fig, axes = plt.subplots(1, 2 if by_time else 1, figsize=(11 if by_time else 7, 4), dpi=110, squeeze=False)
    styles = [dict(linestyle="-", linewidth=2.6, alpha=0.6), dict(linestyle="--", linewidth=1.3),
              dict(linestyle=":", linewidth=1.3)]
    for i, (name, rows) in enumerate(named.items()):
        style = styles[i % len(styles)]
        axes[0][0].plot([r["step"] for r in rows], [r["loss"] for r in rows], label=name, **style)
        if by_time:
            elapsed = np.cumsum([r["seconds"] for r in rows])
            axes[0][1].plot(elapsed, [r["loss"] for r in rows], label=f"{name} ({elapsed[-1]:.0f} s)", **style)
    if evals:
        axes[0][0].plot([e["step"] for e in evals], [e["eval_loss"] for e in evals], "o-", label="eval",
                        markersize=4)
    axes[0][0].set_xlabel("optimizer step")
    axes[0][0].set_title(title)
    if by_time:
        axes[0][1].set_xlabel("training time (s)")
        axes[0][1].set_title("the same steps against wall-clock time")
    for ax in axes[0]:
        ax.set_ylabel("loss (weighted CE / target weight)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    out = Path(out_path)
    fig.savefig(out)
    plt.close(fig)
    return out


class Reporter:
    """Progress bar, tensorboard scalars, metrics.json and loss.png for the main process (no-ops elsewhere)."""

    def __init__(self, output_dir: str | Path, *, main: bool, progress: bool, total: int, initial: int = 0,
                 header: Mapping[str, Any] | None = None, history: list[dict[str, Any]] | None = None,
                 evals: list[dict[str, Any]] | None = None, log: Any = log.info, accelerator: Any = None,
                 run_name: str | None = None) -> None:
        """``accelerator``: one made with ``log_with`` trackers (:func:`make_trackers`); they are
        started here with the run's config as hyperparameters, named ``run_name``."""
        self.out = Path(output_dir)
        self.main = main
        self.header = dict(header or {})
        self.history: list[dict[str, Any]] = list(history or [])
        self.evals: list[dict[str, Any]] = list(evals or [])
        self.log = log
        self.bar = None
        self.tracking = None  # the Accelerator whose trackers receive the scalars
        if not main:
            return
        if progress:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True)
        if accelerator is not None and accelerator.log_with:
            accelerator.init_trackers(PROJECT, config=_scalars(self.header.get("config", {})),
                                      init_kwargs=_tracker_kwargs(self.out, run_name or self.out.name))
            self.tracking = accelerator

    @property
    def metrics_path(self) -> Path:
        return self.out / "metrics.json"

    @property
    def plot_path(self) -> Path:
        return self.out / "loss.png"

    def log_step(self, record: dict[str, Any], *, write: bool) -> None:
        self.history.append(record)
        if not self.main:
            return
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{record['lr']:.2e}", refresh=False)
            self.bar.update(1)
        elif write:
            self.log(f"step {record['step']}: loss {record['loss']:.4f}  lr {record['lr']:.3g}  "
                     f"grad norm {record['grad_norm']:.3g}  {record['tokens_per_s']:,.0f} tok/s")
        if self.tracking is not None:
            self.tracking.log({f"train/{key}": record[key] for key in ("loss", "grad_norm", "lr", "tokens_per_s")},
                              step=record["step"])
        if write:
            self.write()

    def log_eval(self, step: int, loss: float) -> None:
        self.evals.append({"step": step, "eval_loss": loss})
        if not self.main:
            return
        message = f"step {step}: eval loss {loss:.4f}"
        if self.bar is not None:
            self.bar.write(message)
        else:
            self.log(message)
        if self.tracking is not None:
            self.tracking.log({"eval/loss": loss}, step=step)
        self.write()

    def payload(self, **extra: Any) -> dict[str, Any]:
        return {**self.header, **extra, "history": self.history, "evals": self.evals}

    def write(self, **extra: Any) -> None:
        if self.main:
            atomic_write_text(self.metrics_path, json.dumps(self.payload(**extra), indent=1) + "\n")

    def plot(self) -> Path | None:
        if not self.main or not self.history:
            return None
        return plot_losses(self.history, self.evals, self.plot_path,
                           title=f"{self.header.get('schedule', '')} training loss".strip())

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self.tracking is not None:  # not accelerator.end_training(): that also ends the process group
            for tracker in self.tracking.trackers:
                tracker.finish()
            self.tracking = None
