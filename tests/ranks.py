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
import sys
import threading
import time
from collections.abc import Mapping, Sequence

import warm


def free_port() -> int:
    """A port nothing listens on now: accelerate launch's default (29500) is shared by every launch, so two
    tests launching at once (``pytest -n``) would meet there."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env() -> dict[str, str]:
    """The environment a launch's ranks run in: one thread each, offline, no tokenizer threads."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node"]
ACCELERATE = [sys.executable, "-m", "accelerate.commands.launch"]


def run_ranks(cmd: Sequence[str], env: Mapping[str, str], *, timeout: float,
              launcher: bool = False) -> subprocess.CompletedProcess:
    """Run ``cmd`` to the end; raise AssertionError with its output (and stacks) if it times out. An ``accelerate
    launch`` gets a free main process port (torchrun ``--standalone`` picks its own).

    ``torchrun --standalone --nproc_per_node N ARGS`` starts its N ranks from tests/warm.py's server, with the
    environment torchrun gives them (the rank variables, a rendezvous on a free port, rank 0 holding the store),
    unless ``launcher``: then torch's own launcher starts them, as a user's command does (one test per kind of
    launch keeps it; the others pay 5-7 s of imports per rank less). An ``accelerate launch`` that hands its
    ranks to torchrun (multi-process, FSDP) does the same with the environment accelerate's own code works out
    for them; its other launchers (``--cpu``'s, DeepSpeed) run as they are. A plain ``python ...`` (one
    process) is started warm too."""
    env = {**env, "PYTHONFAULTHANDLER": "1", "OMP_NUM_THREADS": "1"}
    cmd = list(cmd)
    if "accelerate.commands.launch" in cmd:
        at = cmd.index("accelerate.commands.launch") + 1
        cmd[at:at] = ["--main_process_port", str(free_port())]
    if not launcher and os.environ.get(warm.COLD_ENV) is None:
        if cmd[:len(TORCHRUN)] == TORCHRUN:
            return _warm_ranks(cmd, int(cmd[len(TORCHRUN)]), env, cmd[len(TORCHRUN) + 1:], free_port(),
                               timeout=timeout)
        if cmd[:len(ACCELERATE)] == ACCELERATE and (ranks := _accelerate_ranks(cmd, env)) is not None:
            return _warm_ranks(cmd, *ranks, timeout=timeout)
    start = subprocess.Popen if launcher or cmd[1:3] in (["-m", "torch.distributed.run"],
                                                        ["-m", "accelerate.commands.launch"]) else warm.Popen
    proc = start(list(cmd), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                 start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _until_gone(_signal_group(proc.pid, signal.SIGABRT), 10)  # faulthandler: each prints its stacks, dies
        _signal_group(proc.pid, signal.SIGKILL)  # then every writer of the pipes is gone: read them to the end
        out, err = proc.communicate()
        raise AssertionError(f"{cmd[:4]}... did not finish in {timeout:.0f} s; stacks of every process:\n"
                             f"{err[-8000:]}\n{out[-2000:]}") from None
    finally:
        _signal_group(proc.pid, signal.SIGKILL)  # nothing of this launch outlives it
    return subprocess.CompletedProcess(list(cmd), proc.returncode, out, err)


def _accelerate_ranks(cmd: list[str], env: Mapping[str, str]) -> tuple | None:
    """What ``accelerate launch`` would give torchrun (a multi-process or FSDP launch on one machine): the
    number of processes, the environment and the command, worked out by accelerate's own launcher code
    (its parser, its config file reading, :func:`accelerate.utils.prepare_multi_gpu_env`), and the port; None for
    any other launch (``--cpu``'s simple launcher, DeepSpeed, ...) or anything accelerate refuses: those run
    through accelerate itself."""
    from unittest import mock

    try:
        from accelerate.commands.launch import _validate_launch_command, launch_command_parser
        from accelerate.utils import prepare_multi_gpu_env

        args = launch_command_parser().parse_args(cmd[len(ACCELERATE):])
        with mock.patch.dict(os.environ, env, clear=True):
            args, _, _ = _validate_launch_command(args)
            if args.cpu or args.use_deepspeed or not (args.use_fsdp or args.multi_gpu) or args.num_machines != 1:
                return None
            launched = prepare_multi_gpu_env(args)
    except Exception:  # noqa: BLE001: accelerate's own launcher then says what it says
        return None
    script = [*(["-m"] if args.module else []), args.training_script, *args.training_script_args]
    return int(args.num_processes), launched, script, int(args.main_process_port)


def _warm_ranks(cmd: list[str], world: int, env: Mapping[str, str], args: list[str], port: int, *,
                timeout: float) -> subprocess.CompletedProcess:
    """torchrun's ranks without torchrun: each rank a warm command writing to the same two pipes (as torchrun's
    ranks write to its own streams); when one fails the others are stopped (torchrun's agent does the same) and
    the launch returns 1. A command warm.py cannot start warm runs under its launcher."""
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    ranks = []
    try:
        for rank in range(world):
            rank_env = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                        "LOCAL_WORLD_SIZE": str(world), "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1",
                        "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(world), "ROLE_NAME": "default",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TORCHELASTIC_RUN_ID": "none",
                        "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
                        "TORCHELASTIC_USE_AGENT_STORE": "False"}
            proc = warm.Popen([sys.executable, *args], env=rank_env, stdout=out_w, stderr=err_w,
                              start_new_session=True)
            if not isinstance(proc, warm.Popen):  # started cold: torchrun starts them all, as asked
                proc.kill()
                proc.wait()
                for each in ranks:
                    each.kill()
                    each.wait()
                os.close(out_w), os.close(err_w), os.close(out_r), os.close(err_r)
                return run_ranks(cmd, env, timeout=timeout, launcher=True)
            ranks.append(proc)
    finally:
        if ranks:
            os.close(out_w), os.close(err_w)
    streams = {out_r: [], err_r: []}
    reader = [threading.Thread(target=lambda fd=fd: streams[fd].append(os.fdopen(fd, errors="replace").read()),
                               daemon=True) for fd in streams]
    for t in reader:
        t.start()
    end = time.monotonic() + timeout
    failed = None
    try:
        while any(p.poll() is None for p in ranks):
            if time.monotonic() > end:
                aborted = []
                for p in ranks:  # each rank leads its own session, as torchrun's do
                    aborted += _signal_group(p.pid, signal.SIGABRT)  # faulthandler: each prints its stacks, dies
                _until_gone(aborted, 10)
                _stop(ranks)
                for t in reader:
                    t.join()
                raise AssertionError(f"{cmd[:7]}... did not finish in {timeout:.0f} s; stacks of every process:\n"
                                     f"{streams[err_r][0][-8000:]}\n{streams[out_r][0][-2000:]}") from None
            if failed is None and any(p.returncode not in (None, 0) for p in ranks):
                failed = time.monotonic()
            if failed is not None and time.monotonic() - failed > 5:
                _stop(ranks)  # what torchrun's agent does to the others when one rank fails
            time.sleep(0.05)
    finally:
        _stop(ranks)
    for t in reader:
        t.join()
    code = 0 if all(p.returncode == 0 for p in ranks) else 1
    return subprocess.CompletedProcess(list(cmd), code, streams[out_r][0], streams[err_r][0])


def _stop(ranks: list) -> None:
    """Every rank and every process under it killed, and the ranks waited for."""
    for p in ranks:
        if p.poll() is None:
            _signal_group(p.pid, signal.SIGKILL)
    for p in ranks:
        p.wait()


def _signal_group(pid: int, sig: int) -> list:
    """``sig`` to the launch and every process under it: its process group, and each descendant on its own
    (torch elastic starts each rank in a session of its own, out of the launcher's group). Returns them
    (psutil processes: the launch first)."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = root.children(recursive=True)
    except psutil.NoSuchProcess:
        root, procs = None, []
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
    for p in procs:
        try:
            p.send_signal(sig)
        except psutil.NoSuchProcess:
            pass
    return [root, *procs] if root is not None else procs


def _until_gone(procs: list, seconds: float) -> None:
    """Wait until every one of ``procs`` has ended (a zombie has: its stacks are written), at most ``seconds``."""
    import psutil

    def running(p) -> bool:
        try:
            return p.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    end = time.monotonic() + seconds
    while time.monotonic() < end and any(running(p) for p in procs):
        time.sleep(0.05)


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
