"""Atomic writes: a file or directory appears complete under its name, or not at all.

Why this module exists: metrics, checkpoints, prepared datasets, the cached
tokenizer and converted records are read by something that may run while they
are written (a plot, a resumed run, a second process) or after a crash. Each
is written beside its target under a hidden temporary name (``.NAME.tmp-PID``,
so on the same filesystem) and renamed into place when complete. A rename
within one filesystem is atomic: a reader sees the old version or the new
one, never half of one. A write that fails removes its temporary.

    >>> import tempfile
    >>> out = Path(tempfile.mkdtemp()) / "metrics.json"
    >>> atomic_write_text(out, "{}") == out, out.read_text()
    (True, '{}')
    >>> with atomic_dir(out.with_name("dataset")) as tmp:
    ...     _ = (tmp / "stats.json").write_text("{}")
    ...     tmp.name.startswith(".dataset.tmp-")
    True
    >>> sorted(p.name for p in out.parent.iterdir())
    ['dataset', 'metrics.json']
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any


def temp_sibling(path: str | Path, *, per_process: bool = True) -> Path:
    """The hidden temporary name beside ``path``: ``.NAME.tmp-PID``, or ``.NAME.tmp`` when several
    processes write into one temporary (the ranks of a checkpoint)."""
    path = Path(path)
    return path.with_name(f".{path.name}.tmp-{os.getpid()}" if per_process else f".{path.name}.tmp")


@contextmanager
def atomic_file(path: str | Path, mode: str = "w", *, encoding: str = "utf-8") -> Iterator[IO[Any]]:
    """A file open for writing that replaces ``path`` when the block ends without error."""
    path = Path(path)
    tmp = temp_sibling(path)
    try:
        with open(tmp, mode, encoding=None if "b" in mode else encoding) as f:
            yield f
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | Path, text: str, *, encoding: str = "utf-8") -> Path:
    """Write ``text`` to ``path`` atomically (temporary file, then rename)."""
    with atomic_file(path, "w", encoding=encoding) as f:
        f.write(text)
    return Path(path)


def publish_dir(tmp: str | Path, target: str | Path, *, replace: bool = True) -> bool:
    """Rename the complete directory ``tmp`` to ``target``; returns whether it was published.

    An existing ``target`` is removed first (``replace``), or kept and ``tmp`` dropped
    (another process published the same content first: a cache).
    """
    tmp, target = Path(tmp), Path(target)
    if target.exists():
        if not replace:
            shutil.rmtree(tmp, ignore_errors=True)
            return False
        shutil.rmtree(target)
    try:
        os.replace(tmp, target)
    except OSError:
        if replace or not target.exists():
            raise
        shutil.rmtree(tmp, ignore_errors=True)  # another process published between the check and here
        return False
    return True


@contextmanager
def atomic_dir(path: str | Path, *, replace: bool = True) -> Iterator[Path]:
    """An empty temporary directory beside ``path`` to write into, published as ``path``
    (:func:`publish_dir`) when the block ends without error and removed otherwise."""
    path = Path(path)
    tmp = temp_sibling(path)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    publish_dir(tmp, path, replace=replace)
