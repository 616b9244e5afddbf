"""Atomic writes: a file or directory appears complete under its name, or not at all.

Why this module exists: metrics, checkpoints, prepared datasets, the cached
tokenizer and converted records are read by something that may run while they
are written (a plot, a resumed run, a second process) or after a crash. Each
is written beside its target under a hidden temporary name (``.NAME.tmp-PID``,
so on the same filesystem) and renamed into place when complete. A rename
within one filesystem is atomic: a reader sees the old version or the new
one, never half of one. A write that fails removes its temporary.

Replacing a directory takes two renames, and a crash (``kill -9``) can fall
between them. The states, and what the next write of the same name does:

    1. NAME (old)           .NAME.tmp-PID (new, being written)   -> the temporary of a dead PID is removed
    2. .NAME.old-PID (old)  .NAME.tmp-PID (new, complete)        -> old renamed back to NAME, temporary removed
    3. NAME (new)           .NAME.old-PID (old)                  -> the old copy is removed

So the old directory stays complete until the new one is in place, and
:func:`recover_dir` (run by :func:`atomic_dir` before it writes) puts things
back in order. Only leftovers of processes that are no longer running are
touched. A folder that an output will replace must be a previous output
(:func:`check_output_dir`: it holds ``.onepass-output``) or be replaced on
purpose (``--overwrite``): unrelated files are never deleted by default.

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

import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from onepass.errors import OnePassError, UsageError

MARKER = ".onepass-output"  # in every directory onepass writes as a whole (prepared rows): safe to replace


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


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _leftovers(target: Path, kind: str) -> list[tuple[Path, int]]:
    """``.NAME.{kind}-PID`` siblings of ``target`` whose process is not running, with the PID."""
    prefix = f".{target.name}.{kind}-"
    if not target.parent.is_dir():
        return []
    found = []
    for p in target.parent.iterdir():
        pid = p.name[len(prefix):]
        if p.name.startswith(prefix) and pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            found.append((p, int(pid)))
    return found


def recover_dir(target: str | Path) -> list[str]:
    """Undo an interrupted :func:`publish_dir` of ``target`` (see the states above); what was done.

    A missing ``target`` with an old copy beside it gets the old copy back; then the temporaries and
    old copies of dead processes are removed.
    """
    target = Path(target)
    done = []
    olds = sorted(_leftovers(target, "old"), key=lambda x: x[0].stat().st_mtime)
    if olds and not os.path.lexists(target):
        path, _ = olds.pop()
        os.replace(path, target)
        done.append(f"restored {target} from {path.name} (an earlier replace was interrupted)")
    for path, _ in olds + _leftovers(target, "tmp"):
        _remove(path)
        done.append(f"removed {path.name} (left by a process that is no longer running)")
    return done


def publish_dir(tmp: str | Path, target: str | Path, *, replace: bool = True) -> bool:
    """Rename the complete directory ``tmp`` to ``target``; returns whether it was published.

    An existing ``target`` is renamed aside to ``.NAME.old-PID``, ``tmp`` renamed into
    place, then the old one removed (``replace``; a crash in between is undone by
    :func:`recover_dir`); or it is kept and ``tmp`` dropped (another process published
    the same content first: a cache).
    """
    tmp, target = Path(tmp), Path(target)
    old = None
    if os.path.lexists(target):
        if not replace:
            shutil.rmtree(tmp, ignore_errors=True)
            return False
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        _remove(old)
        os.replace(target, old)
    try:
        os.replace(tmp, target)
    except OSError:
        if old is not None:
            os.replace(old, target)  # put the old one back
        if replace or not target.exists():
            raise
        shutil.rmtree(tmp, ignore_errors=True)  # another process published between the check and here
        return False
    if old is not None:
        _remove(old)
    return True


_DATASET_FILE = re.compile(r"(data-\d+-of-\d+\.arrow|cache-.*\.arrow|dataset_info\.json|state\.json|stats\.json)")


def is_output_dir(path: str | Path) -> bool:
    """Whether ``path`` holds only what onepass wrote there, so replacing it loses nothing else.

    The marker lists the files the output was written with (a manifest); anything else in the folder
    (a training run's ``checkpoints/``, ``final/``, ``metrics.json``, a user's notes) makes it not ours.
    A marker without a list (older releases) or a prepared dataset from before markers: only the files a
    prepared dataset holds.
    """
    path = Path(path)
    names = {p.name for p in path.iterdir()} - {MARKER} if path.is_dir() else set()
    try:
        info = json.loads((path / MARKER).read_text(encoding="utf-8")) if (path / MARKER).is_file() else None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        info = {}
    files = info.get("files") if isinstance(info, dict) else None
    if isinstance(files, list):
        return names <= set(map(str, files))
    if info is None and not ((path / "stats.json").is_file() and (path / "dataset_info.json").is_file()):
        return False
    return all(_DATASET_FILE.fullmatch(n) for n in names)


def write_marker(folder: str | Path, kind: str) -> None:
    """Mark ``folder`` (being written, complete but for this) as a onepass output that a later run may
    replace, with the names of the files in it: the manifest :func:`is_output_dir` compares against."""
    files = sorted(p.name for p in Path(folder).iterdir() if p.name != MARKER)
    (Path(folder) / MARKER).write_text(json.dumps({"kind": kind, "files": files}) + "\n", encoding="utf-8")


def check_output_dir(path: str | Path, *, overwrite: bool = False, flag: str = "--out") -> Path:
    """Before any work: ``path`` can be written, and replacing it loses nothing the user wanted.

    Refused: a file; a non-empty folder that is not a previous output (unless ``overwrite``);
    a parent folder that cannot be created or written. Leftovers of an interrupted earlier
    replace are recovered first (:func:`recover_dir`).
    """
    path = Path(path)
    for line in recover_dir(path):
        print(f"note: {line}")
    if path.exists() and not path.is_dir():
        raise UsageError(f"{flag} {path} is a file, not a folder: choose another {flag}")
    if path.is_dir() and any(path.iterdir()) and not is_output_dir(path) and not overwrite:
        raise UsageError(f"{flag} {path} is a folder with files onepass did not write there (a training run, "
                         f"another output, your files); it would be replaced: choose an empty or new folder, or "
                         f"pass --overwrite")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise UsageError(f"{flag} {path}: cannot write in {path.parent} ({e.strerror or e})") from None
    return path


def check_writable(path: str | Path, *, flag: str = "--output-dir") -> Path:
    """``path`` is a folder a file can be written in, or can be made one: one :class:`UsageError` line
    before any work otherwise (a read-only file system or folder, a file in the way). Nothing is created:
    the probe is written in ``path`` or in its nearest existing parent, and removed."""
    path = Path(path)
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    try:
        if not existing.is_dir():
            raise NotADirectoryError(20, "a file is in the way", str(existing))
        fd, probe = tempfile.mkstemp(dir=existing, prefix=".onepass-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise UsageError(f"{flag} {path}: cannot write there ({e.strerror or e}); choose another {flag}") from None
    return path


@contextmanager
def atomic_dir(path: str | Path, *, replace: bool = True) -> Iterator[Path]:
    """An empty temporary directory beside ``path`` to write into, published as ``path``
    (:func:`publish_dir`) when the block ends without error and removed otherwise."""
    path = Path(path)
    recover_dir(path)
    tmp = temp_sibling(path)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    publish_dir(tmp, path, replace=replace)


class WriteError(OnePassError):
    """A write the machine refused (a full disk, a file-size limit, a quota: :func:`write_failure`), said in one
    line naming what could not be written and what was kept; the temporary is removed."""


def write_failure(error: BaseException) -> str | None:
    """Why writing a file failed, in a few words, when ``error`` is a failed write; else None.

    A full disk reaches us three ways: an ``OSError`` (ENOSPC) from Python's own writes; a
    ``RuntimeError`` from ``torch.save`` ("[enforce fail at inline_container.cc] unexpected pos",
    with the ``OSError`` of the file object it wrote through as its context); a ``SafetensorError``
    whose message holds the I/O error ("No space left on device (os error 28)"). pyarrow's ``OSError`` says
    "Error writing bytes to file. Detail: [errno 27] File too large": the system's words for that number are
    returned.
    """
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, OSError):
            number = re.search(r"\[errno (\d+)\]", str(seen.strerror or seen), re.IGNORECASE)
            return os.strerror(int(number.group(1))) if number else seen.strerror or str(seen)
        seen = seen.__cause__ or seen.__context__
    if type(error).__name__ == "SafetensorError" and ("I/O error" in str(error) or "os error" in str(error)):
        return str(error).split("I/O error: ")[-1].splitlines()[0]
    return None


def cache_dir() -> Path:
    """onepass's cache folder: ``$ONEPASS_CACHE``, else ``$XDG_CACHE_HOME/onepass`` (``~/.cache/onepass``)."""
    root = os.environ.get("ONEPASS_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "onepass")
    return Path(root)


class OutputLocked(UsageError):
    """Another running onepass command writes the same output folder."""


def lock_path(path: str | Path) -> Path:
    """The lock file of the output folder ``path``: in onepass's cache folder (``locks/``), named by a digest
    of its real absolute path (two spellings of one folder share it; nothing is left beside the user's
    outputs, nothing in ``TMPDIR``)."""
    import hashlib

    real = os.path.realpath(os.path.abspath(path))
    digest = hashlib.sha256(real.encode("utf-8", "surrogateescape")).hexdigest()[:24]
    return cache_dir() / "locks" / f"{digest}.lock"


@contextmanager
def output_lock(path: str | Path, *, command: str) -> Iterator[Path | None]:
    """Hold the lock of the output folder ``path`` for the block (:func:`lock_path`, an exclusive ``flock``).
    A second command on the same output on this machine fails at once with :class:`OutputLocked` naming
    the first one's PID; the lock goes with its process (``kill -9`` included), so nothing stale ever holds
    it. No-op where ``fcntl`` is missing (Windows)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover
        yield None
        return
    lock = lock_path(path)
    try:
        lock.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:  # a read-only home: run unlocked rather than not at all
        print(f"note: no output lock for {path} ({e.strerror or e})")
        yield None
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 300, 0).decode("utf-8", "replace").strip() or "another process"
            raise OutputLocked(f"{path} is being written by {holder}; wait for it to finish or choose another "
                               "output") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"onepass {command} (PID {os.getpid()})\n".encode(), 0)
        yield lock
    finally:
        os.close(fd)  # releases the lock
