"""A pytest plugin that writes each test's CPU seconds, to find the tests that make a run slow.

Why: the machines that run the suite are shared, so wall time says more about the neighbours than the test. CPU
time (user + sys of the pytest process and of the child processes it waited for: ranks, commands, workers) is
what a test costs on a 2-core CI machine, where the suite's CPU / 2 is about its wall time under ``-n 2``.

    CPUPROF_OUT=/tmp/cpu .venv/bin/python -m pytest -p cpuprof -p no:xdist tests/render

appends one JSON line per test (setup + call + teardown) to ``/tmp/cpu.<pid>``:
``{"id": nodeid, "self": s, "children": s, "wall": s}``. tests/conftest.py's SLOW lists the tests of 1.5 s or
more that ``make test-quick`` leaves out.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time

import pytest


def _cpu() -> tuple[float, float]:
    """This process's CPU seconds, and its children's: those it waited for, and the commands tests/warm.py's
    server started for it (the server's children, not this process's)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    warm = sys.modules.get("warm")
    started = warm.CPU_SECONDS[0] if warm is not None else 0.0
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime + started


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    own0, children0 = _cpu()
    wall0 = time.perf_counter()
    yield
    own1, children1 = _cpu()
    if out := os.environ.get("CPUPROF_OUT"):
        with open(f"{out}.{os.getpid()}", "a", encoding="utf-8") as f:
            f.write(json.dumps({"id": item.nodeid, "self": own1 - own0, "children": children1 - children0,
                                "wall": time.perf_counter() - wall0}) + "\n")
