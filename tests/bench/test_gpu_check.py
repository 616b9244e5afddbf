"""``make gpu-check`` refuses cleanly without CUDA, and picks the shapes a GPU can hold."""

from __future__ import annotations

import os
import subprocess
import sys

from onepass.bench.gpu_check import REFUSAL, default_shapes


def test_gpu_check_refuses_in_one_line_without_cuda(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # no CUDA even on a GPU machine
    run = subprocess.run([sys.executable, "-m", "onepass.bench.gpu_check"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 1
    assert run.stderr.splitlines() == [REFUSAL] and run.stdout == ""
    assert not (tmp_path / "benchmarks").exists()  # nothing written, nothing installed


def test_default_shapes_add_4b_only_where_it_fits():
    assert default_shapes(40.0) == ["qwen3-0.6b"]
    assert default_shapes(80.0) == ["qwen3-0.6b", "qwen3-4b"]
