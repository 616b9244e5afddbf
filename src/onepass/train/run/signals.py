"""How a run stops on a signal: SIGTERM as Ctrl-C, and a stop that lands inside a parameter update held until it ends.

Why this module exists: a run stopped by Ctrl-C or by a scheduler's SIGTERM (SLURM, Kubernetes, systemd)
must leave a checkpoint to resume from, and a checkpoint holds whole steps only. :func:`sigterm_as_interrupt`
makes SIGTERM a :class:`Terminated` (a KeyboardInterrupt) while training; :func:`stops_held` keeps either
signal from landing inside an update (:class:`onepass.train.run.step.Stepper` runs the update in it) and
:func:`deliver` raises it once the step counts (:mod:`onepass.train.run.loop`).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any


class Terminated(KeyboardInterrupt):
    """SIGTERM (what SLURM, Kubernetes and systemd send before they kill): handled like Ctrl-C."""


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM raises :class:`Terminated` in the main thread while training, so a scheduler's stop writes a
    checkpoint and status "stopped" like Ctrl-C does; the previous handler is restored after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, _frame: Any) -> None:
        raise Terminated(f"signal {signal.Signals(signum).name}")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def stops_held() -> Iterator[list[int]]:
    """Ctrl-C or SIGTERM arriving inside the block are held, not handled: the list yielded collects them, for
    :func:`deliver` to hand to the handlers in place once the step they interrupted is counted.

    The parameter update (clip, optimizer and scheduler step) must run whole: a stop that landed inside it
    used to leave no checkpoint at all (half-updated weights cannot be saved), and with a large optimizer
    state the update is a good part of each step. Main thread only (where signals are handled)."""
    caught: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield caught
        return
    before = {s: signal.signal(s, lambda signum, _frame: caught.append(signum)) for s in STOP_SIGNALS}
    try:
        yield caught
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


def deliver(held: list[int]) -> None:
    """The first held stop signal, now, to the handler in place (KeyboardInterrupt, Terminated); the list empties."""
    if held:
        signum = held[0]
        held.clear()
        signal.raise_signal(signum)


__all__ = ["STOP_SIGNALS", "Terminated", "deliver", "sigterm_as_interrupt", "stops_held"]
