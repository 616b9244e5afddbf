"""The one lazy step: a name of ours written ``"module:attribute"``, imported when it is first used.

Why this module exists: imports of our own modules go at module level (docs/design.md, "Imports"),
so importing a module imports everything it needs, once, and an import cycle shows at once. Only
two places must not pay for torch before they are used, and both name what they reach instead of
importing it:

- the command registry (:mod:`onepass.cli`): ``onepass --help`` and ``onepass CMD --help`` import
  each command's parser (no torch) and name its runner, imported when the command runs;
- a package's public names that live in torch modules (``from onepass.train import train``), so that
  importing a torch-free module of the package (``onepass.train.config``) does not import torch.

Heavy or optional third-party packages (torch, transformers, datasets, peft, ...) are imported
inside the torch-free functions that use them, with a plain ``import``; nothing of ours is.

    >>> resolve("onepass.errors:UsageError").__name__
    'UsageError'
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def resolve(spec: str) -> Any:
    """The attribute ``spec`` (``"package.module:attribute"``) names, importing its module."""
    module, sep, attribute = spec.partition(":")
    assert sep and module.startswith("onepass") and attribute, f"not a 'onepass.module:attribute' name: {spec!r}"
    return getattr(importlib.import_module(module), attribute)


def package_getattr(package: str, names: Mapping[str, str]) -> Callable[[str], Any]:
    """A package's ``__getattr__`` (PEP 562) for public ``names``: name -> ``"module:attribute"``."""

    def __getattr__(name: str) -> Any:
        if name in names:
            return resolve(names[name])
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
