"""Installing onepass as a user does: a wheel into a fresh venv, then the command works.

The slow test copies the working tree's files (tracked and new, not ignored) to a
temporary folder, builds a wheel there (``python -m build --wheel``), creates a
new venv (``python -m venv``, no system site-packages), installs torch (the
pinned CPU wheel, as ``make setup`` does), then the wheel with its dependencies
from the package index, and runs ``onepass --version`` and ``onepass verify``
from outside the source tree, with a fresh tokenizer cache.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

import onepass
from onepass.cli import main, version

ROOT = Path(__file__).resolve().parents[1]
TORCH_PIN = "torch==2.13.0"  # the Makefile's pin: the local CPU wheel, not a multi-GB CUDA build


def project_version() -> str:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def test_version_is_the_projects(capsys):
    assert onepass.__version__ == project_version()  # the fallback when no distribution is installed
    assert version() in (project_version(), onepass.__version__)
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"onepass {version()}"


def test_top_level_help_lists_every_command_in_user_words(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "one forward pass per" in out and "``" not in out and "main(argv)" not in out
    for command in ("prepare", "verify", "show", "train", "data", "bench", "export", "eval"):
        assert f"\n    {command} " in out, command


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=900, **kw)
    assert result.returncode == 0, f"{' '.join(cmd)} failed ({result.returncode}):\n{result.stdout[-3000:]}\n" \
                                   f"{result.stderr[-3000:]}"
    return result


def _copy_sources(dest: Path) -> None:
    """The files a clone (plus not-yet-committed work) has: git's tracked and untracked-not-ignored files."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


@pytest.mark.e2e
@pytest.mark.slow
def test_wheel_installs_into_a_fresh_venv_and_runs(tmp_path):
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs the git checkout to know which files a clone has")
    start = time.monotonic()
    src, dist, venv, work = tmp_path / "src", tmp_path / "dist", tmp_path / "venv", tmp_path / "work"
    work.mkdir()
    _copy_sources(src)
    _run([sys.executable, "-m", "build", "--wheel", "--outdir", str(dist), str(src)])
    (wheel,) = dist.glob("onepass-*.whl")
    assert wheel.name.startswith(f"onepass-{project_version()}-")

    _run([sys.executable, "-m", "venv", str(venv)])
    assert "include-system-site-packages = false" in (venv / "pyvenv.cfg").read_text()
    # --no-compile: no bytecode for the ~14k modules of the dependencies at install (about a third of this test's
    # CPU); the few hundred modules a command imports are compiled (and cached) when it first imports them
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
           "--no-compile"]
    _run(pip + [TORCH_PIN])  # first, as a GPU user installs their CUDA torch first
    _run(pip + [f"{wheel}[qwen]"])
    built = time.monotonic() - start

    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update(ONEPASS_CACHE=str(tmp_path / "cache"), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    onepass_bin = str(venv / "bin" / "onepass")
    out = _run([onepass_bin, "--version"], cwd=work, env=env).stdout.strip()
    assert out == f"onepass {project_version()}"
    where = _run([str(venv / "bin" / "python"), "-c", "import onepass; print(onepass.__file__)"],
                 cwd=work, env=env).stdout.strip()
    assert where.startswith(str(venv)), where  # the installed copy, not the source tree
    verify = _run([onepass_bin, "verify", "--tiny", "qwen3", "--data", "builtin:mathchat", "--limit", "2"],
                  cwd=work, env=env)
    report = json.loads(verify.stdout.strip().splitlines()[-1])
    assert report["equal"] is True and report["num_conversations"] == 2
    print(f"\nwheel build + fresh venv install: {built:.0f}s; whole test {time.monotonic() - start:.0f}s")


# --------------------------------------------------------------------------------------------
# beside the RL stacks: pip resolves onepass with each stack's pins (docs/rl.md)

STACKS = ["skyrl==0.3.0", "verl==0.9.1"]  # OpenRLHF 0.11.2 resolves too (transformers 5.15.0), but its flash-attn
# sdist needs torch to report its requirements (--no-build-isolation) and the resolution takes minutes: docs/rl.md


@pytest.fixture(scope="module")
def local_wheel(tmp_path_factory):
    """onepass's wheel, built from this checkout (no network: setuptools from this venv)."""
    dist = tmp_path_factory.mktemp("wheel")
    _run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", str(dist),
          str(ROOT)])
    (wheel,) = dist.glob("onepass-*.whl")
    return wheel


@pytest.mark.e2e
@pytest.mark.registry
@pytest.mark.parametrize("stack", STACKS)
def test_onepass_resolves_beside_each_rl_stack(local_wheel, tmp_path, stack):
    """``pip install onepass <stack>`` resolves (pip's dry run, beside this venv's torch): the stack's transformers
    pin is inside onepass's range (issue 43: with transformers>=5.23 none of them resolved)."""
    report = tmp_path / "report.json"
    empty = tmp_path / "no-constraints.txt"
    empty.write_text("")
    env = dict(os.environ, PIP_CONSTRAINT=str(empty))  # a machine-wide pip cap is not what a user has
    result = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--timeout", "30",
                             "--report", str(report), str(local_wheel), stack],
                            capture_output=True, text=True, timeout=900, env=env)
    if result.returncode != 0 and any(s in result.stderr for s in ("NewConnectionError", "Could not fetch URL",
                                                                    "Temporary failure in name resolution")):
        pytest.skip(f"the package index is not reachable: {result.stderr.strip().splitlines()[-1]}")
    assert result.returncode == 0, result.stderr[-3000:]
    chosen = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in json.loads(report.read_text())["install"]}
    name, version = stack.split("==")
    assert chosen["onepass"] == project_version() and chosen[name] == version
    from packaging.version import Version

    transformers = Version(chosen.get("transformers") or __import__("transformers").__version__)
    assert Version("5.2") <= transformers < Version("6"), transformers
