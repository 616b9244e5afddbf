"""Prepared rows written to disk as they are made: Arrow shards and a spool of trees for packing.

Why this module exists: ``prepare`` must not hold a dataset in memory (a 1M-conversation
corpus is tens of GiB of rows). :class:`RowWriter` appends rows to Arrow stream files in
exactly the folder layout of ``datasets.Dataset.save_to_disk`` (``data-00000-of-0000N.arrow``,
``dataset_info.json``, ``state.json``), so ``datasets.load_from_disk`` and every reader of
prepared rows read it unchanged; it holds one record batch at a time. Packing needs every
tree's length before the first row can be formed (best-fit decreasing is global), so
:class:`TreeSpool` keeps the trees in a flat binary file and only their lengths and offsets
in memory (two integers a tree; packing itself keeps a few per tree), and hands a tree back
by index with one read.

Deterministic: batch and shard boundaries depend only on the sequence of rows, so the same
rows give the same bytes (serial and ``--num-proc`` alike)::

    >>> import tempfile, numpy as np
    >>> from onepass.layout.tree import Layout
    >>> row = Layout(input_ids=np.array([5, 6]), position_ids=np.array([0, 1]), kv_end=np.array([2, 2]),
    ...              targets=np.array([6, -100]), weights=np.array([1.0, 0.0]))
    >>> folder = Path(tempfile.mkdtemp())
    >>> with RowWriter(folder) as w:
    ...     w.write(row)
    >>> sorted(p.name for p in folder.iterdir()), w.num_rows
    (['data-00000-of-00001.arrow', 'dataset_info.json', 'state.json'], 1)

No torch here: numpy and pyarrow.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np

from onepass.layout.tree import COLUMNS, ROW_DISK_DTYPES, ROW_SCHEMA, Layout

BATCH_ROWS = 1000  # rows per Arrow record batch (datasets' default writer_batch_size)
BATCH_TOKENS = 1 << 18  # ... or fewer tokens: a batch in memory stays ~16 MiB
SHARD_BYTES = 500 << 20  # a new shard after this many bytes (datasets' default max_shard_size)


def row_features() -> Any:
    """The ``datasets.Features`` of a prepared dataset (:data:`ROW_DISK_DTYPES`)."""
    import datasets

    return datasets.Features({c: datasets.List(datasets.Value(t)) for c, t in ROW_DISK_DTYPES.items()})


class RowWriter:
    """Rows appended one at a time to Arrow shards in ``folder``; :meth:`close` names the shards
    ``data-XXXXX-of-NNNNN.arrow`` and writes ``dataset_info.json`` and ``state.json``."""

    def __init__(self, folder: str | Path, *, batch_rows: int | None = None, batch_tokens: int | None = None,
                 shard_bytes: int | None = None) -> None:
        import pyarrow as pa

        self.folder = Path(folder)
        self.features = row_features()
        self.schema = self.features.arrow_schema  # carries the features as metadata, like datasets writes
        self._types = {c: pa.from_numpy_dtype(np.dtype(t)) for c, t in ROW_DISK_DTYPES.items()}
        self.batch_rows = batch_rows or BATCH_ROWS  # the module's values when called (tests lower them)
        self.batch_tokens = batch_tokens or BATCH_TOKENS
        self.shard_bytes = shard_bytes or SHARD_BYTES
        self._pending: list[Layout] = []
        self._pending_tokens = 0
        self._shards: list[Path] = []
        self._sink: Any = None
        self._writer: Any = None
        self.num_rows = 0
        self.num_tokens = 0

    def write(self, row: Layout) -> None:
        self._pending.append(row)
        self._pending_tokens += len(row)
        self.num_rows += 1
        self.num_tokens += len(row)
        if len(self._pending) >= self.batch_rows or self._pending_tokens >= self.batch_tokens:
            self._flush()

    def _batch(self, rows: list[Layout]) -> Any:
        import pyarrow as pa

        offsets = pa.array(np.concatenate([[0], np.cumsum([len(r) for r in rows])]), type=pa.int32())
        arrays = [pa.ListArray.from_arrays(offsets, pa.array(np.concatenate([getattr(r, c) for r in rows]),
                                                             type=self._types[c]))  # int64 -> int32: checked
                  for c in COLUMNS]
        return pa.RecordBatch.from_arrays(arrays, schema=self.schema)

    def _flush(self) -> None:
        import pyarrow as pa

        if not self._pending:
            return
        if self._writer is None:
            path = self.folder / f".shard-{len(self._shards):05d}.arrow"
            self._shards.append(path)
            self._sink = pa.OSFile(str(path), "wb")
            self._writer = pa.ipc.new_stream(self._sink, self.schema)
        self._writer.write_batch(self._batch(self._pending))
        self._pending, self._pending_tokens = [], 0
        if self._sink.tell() >= self.shard_bytes:
            self._close_shard()

    def _close_shard(self) -> None:
        self._writer.close()
        self._sink.close()
        self._writer = self._sink = None

    def close(self) -> None:
        """Flush, name the shards and write the dataset's metadata (an empty dataset has one empty shard)."""
        from datasets import DatasetInfo
        from datasets.utils.py_utils import asdict

        self._flush()
        if not self._shards:  # no rows: one empty shard, as save_to_disk writes
            import pyarrow as pa

            self._shards.append(self.folder / ".shard-00000.arrow")
            self._sink = pa.OSFile(str(self._shards[0]), "wb")
            self._writer = pa.ipc.new_stream(self._sink, self.schema)
        if self._writer is not None:
            self._close_shard()
        n = len(self._shards)
        names = [f"data-{i:05d}-of-{n:05d}.arrow" for i in range(n)]
        digest = hashlib.sha256()
        for shard, name in zip(self._shards, names):
            os.rename(shard, self.folder / name)  # new names in a private folder (os.replace is publish's)
            digest.update(f"{name}:{(self.folder / name).stat().st_size}:".encode())
        digest.update(f"{self.num_rows}:{self.num_tokens}".encode())
        state = {"_data_files": [{"filename": name} for name in names], "_fingerprint": digest.hexdigest()[:16],
                 "_format_columns": None, "_format_kwargs": {}, "_format_type": None,
                 "_output_all_columns": False, "_split": None}
        (self.folder / "state.json").write_text(json.dumps(state, indent=2, sort_keys=True), encoding="utf-8")
        info = asdict(DatasetInfo(features=self.features))
        info = {k: info[k] for k in sorted(info)}  # as save_to_disk: first level sorted
        (self.folder / "dataset_info.json").write_text(json.dumps(info, indent=2), encoding="utf-8")

    def abort(self) -> None:
        if self._writer is not None:
            self._close_shard()
        for shard in self._shards:
            shard.unlink(missing_ok=True)

    def __enter__(self) -> RowWriter:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> None:
        if kind is None:
            self.close()
        else:
            self.abort()


class TreeSpool:
    """Trees appended to one binary file (int32 columns then float64 weights, per tree); their
    lengths stay in memory for packing, and :meth:`read` returns tree ``i`` with the dtypes of
    :data:`onepass.layout.tree.ROW_SCHEMA`."""

    _INTS = tuple(c for c in COLUMNS if ROW_SCHEMA[c].kind != "f")

    def __init__(self, path: str | Path) -> None:
        assert COLUMNS[-1] == "weights" and len(self._INTS) == len(COLUMNS) - 1, COLUMNS
        self.path = Path(path)
        self._file = open(self.path, "w+b")
        self.lengths: list[int] = []
        self._offsets: list[int] = []
        self._end = 0

    def append(self, tree: Layout) -> None:
        parts = [np.asarray(getattr(tree, c), dtype=np.int32) for c in self._INTS]
        for c, part in zip(self._INTS, parts):
            assert np.array_equal(part, getattr(tree, c)), f"{c} does not fit int32"
        data = b"".join(p.tobytes() for p in parts) + np.asarray(tree.weights, dtype=np.float64).tobytes()
        self._file.seek(self._end)
        self._file.write(data)
        self._offsets.append(self._end)
        self.lengths.append(len(tree))
        self._end += len(data)

    def read(self, i: int) -> Layout:
        n = self.lengths[i]
        self._file.seek(self._offsets[i])
        data = self._file.read(n * (4 * len(self._INTS) + 8))
        ints = np.frombuffer(data, dtype=np.int32, count=n * len(self._INTS)).reshape(len(self._INTS), n)
        weights = np.frombuffer(data, dtype=np.float64, offset=4 * n * len(self._INTS), count=n)
        columns = {c: ints[k].astype(ROW_SCHEMA[c]) for k, c in enumerate(self._INTS)}
        return Layout(**columns, weights=weights.astype(ROW_SCHEMA["weights"]))

    def close(self) -> None:
        self._file.close()
        self.path.unlink(missing_ok=True)

    def __enter__(self) -> TreeSpool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
