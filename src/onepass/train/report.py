"""What a run leaves for a person: metrics.json, the loss curve PNG, tensorboard, the progress bar.

Why this module exists: a run must be inspectable while it runs and after it
crashes. ``metrics.json`` is rewritten atomically (:func:`onepass.files.atomic_write_text`) at
every logging step, so a killed run still has its curve; the PNG is drawn at
every checkpoint and at the end. matplotlib and tensorboard are imported only
when used.

    >>> r = Reporter("runs/x", main=True, report_to=(), progress=False, total=10)   # doctest: +SKIP
    >>> r.log_step({"step": 1, "loss": 2.3, "lr": 1e-4}); r.close()               # doctest: +SKIP
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from onepass.files import atomic_write_text


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

    def __init__(self, output_dir: str | Path, *, main: bool, report_to: Sequence[str], progress: bool,
                 total: int, initial: int = 0, header: Mapping[str, Any] | None = None,
                 history: list[dict[str, Any]] | None = None, evals: list[dict[str, Any]] | None = None,
                 log: Any = print) -> None:
        self.out = Path(output_dir)
        self.main = main
        self.header = dict(header or {})
        self.history: list[dict[str, Any]] = list(history or [])
        self.evals: list[dict[str, Any]] = list(evals or [])
        self.log = log
        self.bar = None
        self.writer = None
        if not main:
            return
        if progress:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True)
        if "tensorboard" in report_to:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(self.out / "tensorboard"), purge_step=initial + 1 if initial else None)

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
        if self.writer is not None:
            for key in ("loss", "grad_norm", "lr", "tokens_per_s"):
                self.writer.add_scalar(f"train/{key}", record[key], record["step"])
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
        if self.writer is not None:
            self.writer.add_scalar("eval/loss", loss, step)
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
        if self.writer is not None:
            self.writer.close()
            self.writer = None
