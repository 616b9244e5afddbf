"""What a run leaves for a person: metrics.json + metrics.jsonl, the loss curve PNG, trackers, the progress bar.

Why this module exists: a run must be inspectable while it runs and after it
crashes, at a cost per step that does not grow with the run. Two files:

    metrics.jsonl   the log: one JSON line per step (and per eval), appended and flushed at every
                    logging step and before every checkpoint: a killed run keeps its curve
    metrics.json    the summary: the run's settings, status ("running", "finishing", "stopped at
                    step N ...", "finished") and latest step, rewritten atomically (small, bounded);
                    once the run ends (finished or stopped) it also holds the whole ``history`` and
                    ``evals``, as it always has

:func:`read_metrics` reads both (a run still going, or killed, has its history in the log only;
a cut last line is skipped). Rewriting one file with the whole history at every logged step cost
253 ms a write at 10k steps and 2.5 s at 100k (issue 37); an appended line costs the same at step
10 and step 100,000. The PNG is drawn at every checkpoint and at the end. ``report_to`` trackers
(tensorboard, wandb, mlflow, trackio, ...) are accelerate's (:func:`make_trackers`): the run's
``Accelerator`` is made with them and :class:`Reporter` logs ``train/loss``,
``train/grad_norm``, ``train/lr``, ``train/tokens_per_s`` and ``eval/loss``
through it. Their offline modes (``WANDB_MODE=offline``, a local mlflow
``file:`` store) need no network. matplotlib and the trackers are imported only
when used.

    >>> r = Reporter("runs/x", main=True, progress=False, total=10)                # doctest: +SKIP
    >>> r.log_step({"step": 1, "loss": 2.3, "lr": 1e-4}); r.close()               # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from onepass.files import atomic_write_text

METRICS, LOG = "metrics.json", "metrics.jsonl"

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


def read_metrics(output_dir: str | Path) -> dict[str, Any]:
    """A run's metrics.json with its ``history`` and ``evals``, from ``metrics.jsonl`` where metrics.json does
    not hold them yet (a run still going, or killed); a cut last line (a kill while it was written) is skipped."""
    out = Path(output_dir)
    metrics = json.loads((out / METRICS).read_text(encoding="utf-8"))
    if "history" in metrics or not (out / LOG).is_file():
        return metrics
    history, evals = [], []
    lines = (out / LOG).read_text(encoding="utf-8").splitlines()
    for i, line in enumerate(lines):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines) - 1:  # cut by a kill while it was written
                continue
            raise ValueError(f"{out / LOG}: line {i + 1} is not JSON") from None
        (evals if "eval_loss" in record else history).append(record)
    return {**metrics, "history": history, "evals": evals}


class Reporter:
    """Progress bar, tensorboard scalars, metrics.json/.jsonl and loss.png for the main process (no-ops elsewhere)."""

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
        self._pending: list[dict[str, Any]] = []  # logged, not yet in metrics.jsonl
        self._unwritten: set[str] = set()  # reports a full disk refused (warned once each)
        if not main:
            return
        self._start_log()
        if progress:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True)
        if accelerator is not None and accelerator.log_with:
            accelerator.init_trackers(PROJECT, config=_scalars(self.header.get("config", {})),
                                      init_kwargs=_tracker_kwargs(self.out, run_name or self.out.name))
            self.tracking = accelerator

    @property
    def metrics_path(self) -> Path:
        return self.out / METRICS

    @property
    def log_path(self) -> Path:
        return self.out / LOG

    @property
    def plot_path(self) -> Path:
        return self.out / "loss.png"

    def log_step(self, record: dict[str, Any], *, write: bool) -> None:
        self.history.append(record)
        if not self.main:
            return
        self._pending.append(record)
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
            self.write_summary()

    def log_eval(self, step: int, loss: float) -> None:
        self.evals.append({"step": step, "eval_loss": loss})
        if not self.main:
            return
        self._pending.append(self.evals[-1])
        message = f"step {step}: eval loss {loss:.4f}"
        if self.bar is not None:
            self.bar.write(message)
        else:
            self.log(message)
        if self.tracking is not None:
            self.tracking.log({"eval/loss": loss}, step=step)
        self.write_summary()

    def _start_log(self) -> None:
        """The log of this run: the resumed history (a killed run's lines past its checkpoint dropped), once."""
        self.out.mkdir(parents=True, exist_ok=True)
        lines = sorted([*self.history, *self.evals], key=lambda r: (r["step"], "eval_loss" in r))
        with self._unless_full(LOG):
            atomic_write_text(self.log_path, "".join(json.dumps(r) + "\n" for r in lines))

    def flush(self) -> None:
        """Append the records logged since the last flush to ``metrics.jsonl`` (one line each)."""
        if not self.main or not self._pending:
            return
        with self._unless_full("metrics.jsonl"):
            with open(self.log_path, "a", encoding="utf-8") as f:
                f.write("".join(json.dumps(r) + "\n" for r in self._pending))
            self._pending.clear()

    @contextlib.contextmanager
    def _unless_full(self, what: str) -> Any:
        """A report that cannot be written (a full disk) is one warning line, not the end of the run: the
        checkpoints say whether the run can go on (they fail, in one line, on the same disk)."""
        try:
            yield
        except OSError as e:
            if what not in self._unwritten:
                self._unwritten.add(what)
                log.warning("warning: cannot write %s in %s (%s); the run goes on", what, self.out, e.strerror or e)

    def summary(self, **extra: Any) -> dict[str, Any]:
        """The bounded part of metrics.json: settings, status, the latest step and where the log is."""
        status = {"status": "running", **extra}
        return {**self.header, **status, "steps_done": len(self.history),
                "last_step": self.history[-1] if self.history else None, "log": LOG}

    def payload(self, **extra: Any) -> dict[str, Any]:
        return {**self.summary(**extra), "history": self.history, "evals": self.evals}

    def write_summary(self, **extra: Any) -> None:
        """Flush the log, then rewrite the small metrics.json (no history: its size does not grow)."""
        if self.main:
            self.flush()
            with self._unless_full(METRICS):
                atomic_write_text(self.metrics_path, json.dumps(self.summary(**extra), indent=1) + "\n")

    def write(self, **extra: Any) -> None:
        """The run's end (finished or stopped): the log flushed, metrics.json with the whole history once."""
        if self.main:
            self.flush()
            with self._unless_full(METRICS):
                atomic_write_text(self.metrics_path, json.dumps(self.payload(**extra), indent=1) + "\n")

    def plot(self) -> Path | None:
        if not self.main or not self.history:
            return None
        with self._unless_full(self.plot_path.name):
            return plot_losses(self.history, self.evals, self.plot_path,
                               title=f"{self.header.get('schedule', '')} training loss".strip())
        return None

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self.tracking is not None:  # not accelerator.end_training(): that also ends the process group
            for tracker in self.tracking.trackers:
                tracker.finish()
            self.tracking = None
