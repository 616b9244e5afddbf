"""Fault injection helpers: run onepass in a subprocess, kill it, and look for what it left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

import warm

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
       "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}


def onepass(*argv: str, env: dict | None = None, module: str = "onepass", **kw) -> subprocess.Popen:
    """``python -m onepass ARGV`` (or a lighter entry point: ``module="onepass.prepare.data_cli"``), output piped;
    started from tests/warm.py's server (torch and transformers already imported), as a command of its own."""
    return warm.Popen([sys.executable, "-m", module, *argv], env={**ENV, **(env or {})},
                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)


def dead_pid() -> int:
    """The PID of a process that has exited (for leftovers 'of a dead process')."""
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def wait_for(predicate, timeout: float, every: float = 0.05) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(every)
    return predicate()


def kill9(proc: subprocess.Popen) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)


def alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out
