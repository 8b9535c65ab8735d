"""Bytes a process reads from a checkpoint backend, counted at its read functions (tests and benchmarks)."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from typing import Any

__all__ = ["counted_reads"]


class _Counted:
    """A stream whose every byte read is counted under ``name``."""

    def __init__(self, raw: Any, name: str, count: Counter[str]) -> None:
        self._raw, self._name, self._count = raw, name, count

    def readinto(self, out: Any) -> int:
        n = self._raw.readinto(out)
        self._count[self._name] += n or 0
        return n

    def read(self, size: int = -1) -> bytes:
        data = self._raw.read(size)
        self._count[self._name] += len(data)
        return data

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._raw, attr)


@contextlib.contextmanager
def counted_reads(backend: type) -> Iterator[Counter[str]]:
    """Every byte this process reads through ``backend`` (a ``Backend`` class) inside the block, per file.

    Counted at its ``stream``, ``read_into`` and ``read_bytes``, under the path's last part; the
    methods are restored after the block.

    Example:
        >>> from shardbridge.checkpoint.storage._local import LocalBackend
        >>> with counted_reads(LocalBackend) as reads:
        ...     pass
        >>> sum(reads.values())
        0
    """
    count: Counter[str] = Counter()
    real = {name: getattr(backend, name) for name in ("stream", "read_into", "read_bytes")}

    @contextlib.contextmanager
    def stream(self: Any, path: str, start: int, end: int) -> Iterator[Any]:
        with real["stream"](self, path, start, end) as raw:
            yield _Counted(raw, path.rsplit("/", 1)[-1], count)

    def read_into(self: Any, path: str, offset: int, out: memoryview) -> int:
        n = real["read_into"](self, path, offset, out)
        count[path.rsplit("/", 1)[-1]] += n
        return n

    def read_bytes(self: Any, path: str) -> bytes:
        data = real["read_bytes"](self, path)
        count[path.rsplit("/", 1)[-1]] += len(data)
        return data

    backend.stream, backend.read_into, backend.read_bytes = stream, read_into, read_bytes  # type: ignore[attr-defined]
    try:
        yield count
    finally:
        for name, fn in real.items():
            setattr(backend, name, fn)
