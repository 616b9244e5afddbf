"""tests/warm.py starts a test's commands from a preloaded interpreter: each one must be what ``python ARGV`` is.

Every check runs the same command warm and cold (a fresh interpreter, as subprocess starts it) and compares what a
test can see: output, exit status, argv, working directory, environment, ``sys.path[0]``, ``__main__``, the temp
folder, a traceback, death by a signal; and torchrun's ranks started warm (tests/ranks.py) against torch's
launcher.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import warm
from ranks import ACCELERATE, TORCHRUN, _accelerate_ranks, fsdp_refused, rank_env, run_ranks

CONFIGS = Path(__file__).parents[1] / "configs"

SEEN = """
import json, os, sys, tempfile
print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0], "main": __name__,
                  "file": globals().get("__file__"), "mine": os.environ.get("WARM_TEST"),
                  "tmp": tempfile.gettempdir(), "spec": getattr(__spec__, "name", None)}))
print("to stderr", file=sys.stderr)
sys.exit(int(sys.argv[-1]))
"""


@pytest.fixture
def forms(tmp_path):
    """The three ways a test starts python: -c code, a script, -m module (each exits with its last argument)."""
    (tmp_path / "seen_script.py").write_text(SEEN)
    (tmp_path / "tmp").mkdir()
    env = {**os.environ, "WARM_TEST": "yes", "TMPDIR": str(tmp_path / "tmp"),
           "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    return env, {"-c": [sys.executable, "-c", SEEN, "a b", "0"],
                 "script": [sys.executable, str(tmp_path / "seen_script.py"), "x", "3"],
                 "-m": [sys.executable, "-m", "seen_script", "--flag", "7"]}


@pytest.mark.parametrize("form", ["-c", "script", "-m"])
def test_a_warm_command_sees_what_a_fresh_interpreter_sees(forms, tmp_path, form):
    env, commands = forms
    cmd = commands[form]
    proc = warm.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert isinstance(proc, warm.Popen)  # started warm, not handed to subprocess
    out, err = proc.communicate(timeout=120)
    cold = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert (proc.returncode, out, err) == (cold.returncode, cold.stdout, cold.stderr)
    seen = json.loads(out)
    assert seen["mine"] == "yes" and seen["tmp"] == str(tmp_path / "tmp") and seen["main"] == "__main__"
    assert proc.returncode == int(cmd[-1]) and proc.cpu is not None and proc.cpu > 0


def test_a_traceback_an_exit_and_a_death_by_signal_are_a_fresh_interpreters():
    """Uncaught exceptions (KeyboardInterrupt: death by SIGINT), SIGKILL, sys.exit with a message, None or a
    number past 255, a non-daemon thread and an atexit function: the same output and status warm and cold."""
    for code in ("def f():\n    raise ValueError('boom')\nf()", "import os, signal\nos.kill(os.getpid(), signal.SIGINT)",
                 "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)", "import sys\nsys.exit('a message')",
                 "import sys\nsys.exit(None)", "import sys\nsys.exit(300)",
                 "import atexit, threading, time\natexit.register(print, 'at exit')\n"
                 "threading.Thread(target=lambda: (time.sleep(0.5), print('thread'))).start()\nprint('main')"):
        cmd = [sys.executable, "-c", code]
        hot = warm.run(cmd, capture_output=True, text=True, timeout=120)
        cold = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert (hot.returncode, hot.stdout, hot.stderr) == (cold.returncode, cold.stdout, cold.stderr)


def test_a_signal_reaches_a_running_command_and_its_status_comes_back():
    proc = warm.Popen([sys.executable, "-c", "import time\nprint('up', flush=True)\ntime.sleep(60)"],
                      stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "up\n" and proc.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.1)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == -signal.SIGTERM
    proc.stdout.close()


def test_what_the_preloaded_libraries_read_at_import_starts_cold(monkeypatch):
    """A command that changes an environment variable read at import (given, or inherited from a test that set it;
    or asks for COLD_ENV) gets a fresh interpreter: subprocess's Popen, not the server's fork."""
    code = ["-c", "import os; print(os.environ['HF_HOME'])"]
    hot = warm.Popen([sys.executable, *code], env={**os.environ, "HF_HOME": "/elsewhere"}, stdout=subprocess.PIPE,
                     text=True)
    assert type(hot) is subprocess.Popen and hot.communicate(timeout=60)[0] == "/elsewhere\n"
    cold = warm.Popen([sys.executable, *code], env={**os.environ, warm.COLD_ENV: "1", "HF_HOME": "/x"},
                      stdout=subprocess.DEVNULL)
    assert type(cold) is subprocess.Popen and cold.wait(timeout=60) == 0
    assert type(warm.Popen(["echo", "not python"], stdout=subprocess.DEVNULL)) is subprocess.Popen
    monkeypatch.setenv("HF_HUB_CACHE", "/inherited")
    inherited = warm.Popen([sys.executable, "-c", "import os; print(os.environ['HF_HUB_CACHE'])"],
                           stdout=subprocess.PIPE, text=True)
    assert type(inherited) is subprocess.Popen and inherited.communicate(timeout=60)[0] == "/inherited\n"


RANK = r"""
import json, os, sys
keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE",
        "ROLE_NAME", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS")
say = lambda record: os.write(1, (json.dumps(record) + "\n").encode())  # one write a line: ranks share stdout
say({k: os.environ.get(k) for k in keys}
    | {"has": sorted(k for k in ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID") if k in os.environ)}
    | {k: v for k, v in os.environ.items() if k.startswith(("ACCELERATE_", "FSDP_", "PARALLELISM_CONFIG_"))})
import torch.distributed as dist
dist.init_process_group("gloo")
t = __import__("torch").tensor([dist.get_rank() + 1.0])
dist.all_reduce(t)
say({"sum": t.item()})
dist.destroy_process_group()
sys.exit(3 if os.environ["RANK"] == sys.argv[1] else 0)
"""


@pytest.mark.multiprocess
@pytest.mark.parametrize("launch", ["torchrun", "accelerate-fsdp"])
def test_warm_ranks_get_the_launchers_environment_and_meet_over_gloo(tmp_path, launch):
    """The ranks tests/ranks.py starts warm see what torch's launcher (or accelerate's, with the shipped FSDP CPU
    config: every ACCELERATE_* and FSDP_* variable) gives its ranks, and meet over gloo; one failing rank fails
    the launch, as it does under the launcher."""
    (tmp_path / "rank.py").write_text(RANK)
    launcher = [*TORCHRUN, "2"] if launch == "torchrun" else [
        *ACCELERATE, "--config_file", str(CONFIGS / "accelerate-fsdp-cpu.yaml"), "--num_processes", "2"]
    cmd = [*launcher, str(tmp_path / "rank.py"), "none"]
    real = run_ranks(cmd, rank_env(), timeout=120, launcher=True)
    if launch != "torchrun" and real.returncode != 0 and fsdp_refused(real):  # an accelerate before its CPU FSDP
        return
    assert launch == "torchrun" or _accelerate_ranks(cmd, rank_env()) is not None  # it is started warm
    hot = run_ranks(cmd, rank_env(), timeout=120)
    assert hot.returncode == real.returncode == 0, hot.stderr[-3000:] + real.stderr[-3000:]

    def lines(proc):
        return sorted((json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")), key=str)

    assert lines(hot) == lines(real) and len(lines(hot)) == 4  # each rank's environment, and the sum 1 + 2
    if launch == "accelerate-fsdp":
        assert lines(hot)[0]["ACCELERATE_USE_FSDP"] == "true"
    failed = run_ranks([*launcher, str(tmp_path / "rank.py"), "1"], rank_env(), timeout=120)
    assert failed.returncode == 1  # one rank failed: the launch fails, as torchrun's does
