"""Count, on CPU, the operations that would make the host wait for the GPU on CUDA.

On CUDA a host sync is a blocking device-to-host read: ``.item()`` / ``float()`` / ``bool()`` of a tensor
(``aten._local_scalar_dense``), ``.cpu()`` / ``.tolist()`` / ``.numpy()``, and every op whose output size
depends on the data (``nonzero``, ``masked_select``, a boolean index, ``unique``, ``repeat_interleave``
without ``output_size``, ``bincount``, ``equal``). On CPU none of them waits, so a test there counts them
instead: a ``TorchDispatchMode`` sees the aten ops, and the Python-level reads that never reach the
dispatcher on CPU are counted by wrapping their ``torch.Tensor`` methods while the counter is on.
``torch.cuda.set_sync_debug_mode("error")`` is the same check on CUDA (tests/train/run/test_host_syncs.py).
"""

from __future__ import annotations

import contextlib
import traceback
from collections import Counter
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
ALWAYS = {aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default,
          aten.equal.default, aten.bincount.default, aten.unique_consecutive.default, aten.unique_dim.default,
          aten._unique.default, aten._unique2.default}
INDEXING = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default,
            aten._unsafe_index.Tensor}
READS = ("cpu", "tolist", "numpy", "item")


def _bool_index(args: tuple) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())


class SyncCounter(TorchDispatchMode):
    """``with SyncCounter() as c:`` counts in ``c.ops`` each op (or Tensor read) that would sync on CUDA;
    ``c.where`` holds the first stack of each, for a failing test to show."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.where: dict[str, str] = {}

    def _flag(self, name: str) -> None:
        self.ops[name] += 1
        self.where.setdefault(name, "".join(traceback.format_stack(limit=12)[:-2]))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in ALWAYS or (func in INDEXING and _bool_index(args)) or (
                func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None):
            self._flag(str(func))
        return func(*args, **kwargs)

    @contextlib.contextmanager
    def counting(self) -> Iterator[SyncCounter]:
        """The mode on, and the Tensor reads that do not dispatch on CPU wrapped to count themselves."""
        saved = {name: getattr(torch.Tensor, name) for name in READS}

        def counted(name):
            real = saved[name]

            def read(tensor, *args, **kwargs):
                self._flag(f"Tensor.{name}")
                return real(tensor, *args, **kwargs)
            return read

        for name in READS:
            setattr(torch.Tensor, name, counted(name))
        try:
            with self:
                yield self
        finally:
            for name, real in saved.items():
                setattr(torch.Tensor, name, real)

    def report(self) -> str:
        return "\n".join(f"{name} x{n}, first at:\n{self.where[name]}" for name, n in self.ops.items())
