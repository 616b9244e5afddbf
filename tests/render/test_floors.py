"""The declared floors are what ``make test-min`` installs, and the package metadata builds without warnings.

``pyproject.toml`` promises lower bounds; ``make test-min`` proves them by installing exactly those
(``constraints-min.txt``, and ``TORCH_MIN`` in the Makefile for torch). A floor raised or lowered on one
side only would claim releases nobody ran (issue 33: torch>=2.13 while the GPU images run 2.11 made pip
replace their torch with a multi-GB build).
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).parents[2]


def _floors() -> dict[str, str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    specs = list(project["dependencies"]) + [r for extra in project["optional-dependencies"].values() for r in extra]
    floors: dict[str, str] = {}
    for spec in specs:
        req = Requirement(spec)
        for s in req.specifier:
            if s.operator == ">=":
                floors.setdefault(req.name.lower(), s.version)
    return floors


def _makefile(name: str) -> str:
    found = re.search(rf"^{name} \?= (.+)$", (ROOT / "Makefile").read_text(), re.M)
    assert found, f"Makefile has no {name}"
    return found.group(1).strip()


def test_every_pinned_minimum_is_the_floor_pyproject_declares():
    floors = _floors()
    pins = dict(line.split("==") for line in (ROOT / "constraints-min.txt").read_text().splitlines()
                if line and not line.startswith("#"))
    assert pins
    for name, version in pins.items():
        assert name.lower() in floors and Version(floors[name.lower()]) == Version(version), (name, version, floors)


def test_the_torch_floor_is_the_torch_test_min_installs():
    name, version = _makefile("TORCH_MIN").split("==")
    assert name == "torch" and Version(version) == Version(_floors()["torch"]) == Version("2.11")


def test_the_license_is_an_spdx_expression_setuptools_builds_without_a_warning():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert data["project"]["license"] == "Apache-2.0"  # a table is deprecated (setuptools stops in 2027)
    setuptools = Requirement(data["build-system"]["requires"][0])
    assert setuptools.name == "setuptools" and setuptools.specifier.contains("77.0.0")
    assert not setuptools.specifier.contains("76.9")  # 77: the first that reads an SPDX license
