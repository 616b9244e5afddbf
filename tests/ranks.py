"""Run a multi-process launch (torchrun, accelerate launch) from a test: one try, and a failure you can read.

Why this module exists: the two-rank tests used to retry a run that aborted or hung in
teardown, and ``subprocess.run(timeout=...)`` killed only the launcher, so the ranks of a
timed-out try lived on beside the next try (torch elastic starts each rank in a session of
its own: found still alive minutes later). Here, on a timeout, the launcher and every
process under it get SIGABRT first, which, with ``PYTHONFAULTHANDLER=1``, makes each print
every thread's Python stack, then SIGKILL. The stacks are in the assertion message.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence


def free_port() -> int:
    """A port nothing listens on now: accelerate launch's default (29500) is shared by every launch, so two
    tests launching at once (``pytest -n``) would meet there."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env() -> dict[str, str]:
    """The environment a launch's ranks run in: one thread each, offline, no tokenizer threads."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def run_ranks(cmd: Sequence[str], env: Mapping[str, str], *, timeout: float) -> subprocess.CompletedProcess:
    """Run ``cmd`` to the end; raise AssertionError with its output (and stacks) if it times out. An ``accelerate
    launch`` gets a free main process port (torchrun ``--standalone`` picks its own)."""
    env = {**env, "PYTHONFAULTHANDLER": "1", "OMP_NUM_THREADS": "1"}
    cmd = list(cmd)
    if "accelerate.commands.launch" in cmd:
        at = cmd.index("accelerate.commands.launch") + 1
        cmd[at:at] = ["--main_process_port", str(free_port())]
    proc = subprocess.Popen(list(cmd), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _signal_group(proc.pid, signal.SIGABRT)  # faulthandler: every rank prints its threads' stacks
        time.sleep(10)
        _signal_group(proc.pid, signal.SIGKILL)  # then every writer of the pipes is gone: read them to the end
        out, err = proc.communicate()
        raise AssertionError(f"{cmd[:4]}... did not finish in {timeout:.0f} s; stacks of every process:\n"
                             f"{err[-8000:]}\n{out[-2000:]}") from None
    finally:
        _signal_group(proc.pid, signal.SIGKILL)  # nothing of this launch outlives it
    return subprocess.CompletedProcess(list(cmd), proc.returncode, out, err)


def _signal_group(pid: int, sig: int) -> None:
    """``sig`` to the launch and every process under it: its process group, and each descendant on its own
    (torch elastic starts each rank in a session of its own, out of the launcher's group)."""
    import psutil

    try:
        procs = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        procs = []
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
    for p in procs:
        try:
            p.send_signal(sig)
        except psutil.NoSuchProcess:
            pass


def fsdp_refused(proc: subprocess.CompletedProcess) -> bool:
    """On an accelerate older than onepass's FSDP-on-CPU floor (``make test-min``), an FSDP launch must stop
    before any training; True when it did (the caller's comparison is then moot), False on an accelerate that
    runs it. It stops in onepass's one line, or, for a config with a ``parallelism_config`` section (the
    shipped sequence-parallel one) on an accelerate that predates the section (1.4, make test-min), earlier, in
    ``accelerate launch`` itself: its config reader names the key and says to upgrade accelerate."""
    from onepass.train.distributed import FSDP_ACCELERATE, accelerate_predates_fsdp

    if not accelerate_predates_fsdp():
        return False
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ""
    ours = f"FSDP on CPU ranks needs accelerate>={FSDP_ACCELERATE}" in proc.stderr
    launcher = last.startswith("ValueError: ") and "unknown keys (['parallelism_config'])" in last \
        and "upgrading your `accelerate` version" in last
    assert ours or launcher, proc.stderr[-4000:]
    return True
