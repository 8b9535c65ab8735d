"""DCP's failures, turned into one clear error naming the file, the rank and the cause.

[Note: DCP errors]
~~~~~~~~~~~~~~~~~~
``dcp.save`` / ``dcp.load`` gather every rank's exception and raise the same
``CheckpointException`` on every rank. It derives from ``BaseException`` (it escapes
``except Exception``), its text is one remote traceback per rank, and the real cause is often
hidden: a full disk during ``torch.save`` of a ``.distcp`` file reads "unexpected pos 704 vs
598" (the zip writer's short write), a truncated data file "failed finding central
directory". :func:`dcp_errors` wraps every ``dcp.load`` call of the core (and any
``dcp.save``) and re-raises one exception, the same on every rank (each rank translates the
same gathered failures, so no collective is needed). A save's writer translates the error of
the file it was writing with :func:`save_failure` (naming the file or object); the save
protocol raises it on every rank ([Note: save protocols] in ``_protocol.py``).

- save: ``OSError`` (``errno`` kept when known) "saving checkpoint DIR failed on rank R
  writing FILE: No space left on device ..." and the fix;
- load: ``PermissionError`` for unreadable files, else ``ValueError`` naming the damaged file
  (a data file shorter than ``.metadata`` says, a missing one, garbage) and suggesting
  ``shardbridge ckpt verify``;
- either: an :class:`ObjectStoreError` (the store failed, not a file: credentials, the endpoint,
  the bucket, a server that does not answer) keeps its cause and fix; "damaged" is said only
  of damage.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Literal

from torch.distributed.checkpoint.api import CheckpointException

from shardbridge.checkpoint.storage._backend import Stored
from shardbridge.checkpoint.storage._store import ObjectStoreError

__all__ = ["dcp_errors", "describe_checkpoint_exception", "save_failure"]

# The zip writer's message when a write came up short (the OSError itself is lost in C++).
_SHORT_WRITE = "unexpected pos"
# Below this much free space a short write is taken for a full filesystem.
_NEARLY_FULL_BYTES = 1 << 20
_ZIP_MAGIC = b"PK\x03\x04"


@contextmanager
def dcp_errors(
    action: Literal["save", "load"],
    checkpoint: Stored | str | os.PathLike[str],
    *,
    data_dir: str | os.PathLike[str] | None = None,
) -> Iterator[None]:
    """Re-raise a ``CheckpointException`` from the body as one clear error. See [Note: DCP errors].

    Args:
        action: "save" or "load".
        checkpoint: the checkpoint the user named (a :class:`Stored` for a load).
        data_dir: where DCP writes the files (a local save's temporary directory); None =
            the checkpoint's.
    """
    try:
        yield
    except CheckpointException as exc:
        raise describe_checkpoint_exception(exc, action, checkpoint, data_dir=data_dir) from None


def describe_checkpoint_exception(
    exc: CheckpointException,
    action: Literal["save", "load"],
    checkpoint: Stored | str | os.PathLike[str],
    *,
    data_dir: str | os.PathLike[str] | None = None,
) -> Exception:
    """The one exception that stands for ``exc`` (see [Note: DCP errors])."""
    stored = checkpoint if isinstance(checkpoint, Stored) else None
    shown = str(checkpoint) if stored is not None else str(os.fspath(checkpoint))
    failures = sorted(exc.failures.items())
    if not failures:
        return RuntimeError(f"{action} of checkpoint {shown!r} failed: {exc}")
    rank, (cause, _) = failures[0]
    others = f" (and on {len(failures) - 1} other rank(s))" if len(failures) > 1 else ""
    where = f"{action} of checkpoint {shown!r} failed on rank {rank}{others}"
    if action == "save":
        local = None if stored is not None and stored.backend.remote else Path(data_dir or shown)
        return _save_error(where, rank, cause, local, None)
    if stored is None:
        from shardbridge.checkpoint.storage._trust import _stored

        stored = _stored(checkpoint)
    return _load_error(where, cause, stored)


def save_failure(cause: BaseException, rank: int, checkpoint: str, path: str, *, local: bool = True) -> Exception:
    """The one clear exception for ``cause``, raised on ``rank`` while it wrote ``path`` (a file of a save).

    ``local``: ``path`` is on a local filesystem (a short write is then checked for a full disk).
    """
    where = f"save of checkpoint {checkpoint!r} failed on rank {rank}"
    return _save_error(where, rank, cause, Path(path).parent if local else None, path)


def _first_line(cause: BaseException) -> str:
    text = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {text[0] if text else ''}".rstrip(": ")


def _save_error(where: str, rank: int, cause: BaseException, data_dir: Path | None, file: str | None) -> Exception:
    """``data_dir``: the local directory written into (None on an object store); ``file``: the file written."""
    files = repr(file) if file is not None else f"its data files {str((data_dir or Path('.')) / f'__{rank}_*.distcp')!r}"
    if isinstance(cause, ObjectStoreError):  # the store failed: its cause and fix, not a filesystem's
        return cause.again(f"{where} writing {files}: ", " Nothing was committed")
    code = getattr(cause, "errno", None) if isinstance(cause, OSError) else None
    if code is None and _SHORT_WRITE in str(cause):
        # torch.save's zip writer lost the OSError: ask the filesystem why the write came up short.
        full = data_dir is not None and _free_bytes(data_dir) < _NEARLY_FULL_BYTES
        code = errno.ENOSPC if full else errno.EIO
        reason = os.strerror(code) if code == errno.ENOSPC else "a write came up short (disk quota or file size limit?)"
    elif code is not None:
        reason = os.strerror(code)
        if code == errno.EIO and getattr(cause, "strerror", None):  # a client's own cause (botocore's, ...)
            reason = str(cause.strerror).strip().splitlines()[0]
    else:
        return RuntimeError(f"{where} writing {files}: {_first_line(cause)}")
    filename = getattr(cause, "filename", None)
    target = repr(str(filename)) if filename and data_dir is not None else files
    fix = (
        "free space on that filesystem or save elsewhere"
        if code in (errno.ENOSPC, errno.EDQUOT)
        else "check that every rank may write there"
    )
    error = OSError(f"{where} writing {target}: {reason}; {fix}. Nothing was committed")
    error.errno = code
    return error


def _load_error(where: str, cause: BaseException, stored: Stored) -> Exception:
    verify = f"run `shardbridge ckpt verify {stored}` to find every damaged file"
    if isinstance(cause, ObjectStoreError):  # the store failed, not a file: nothing to verify
        return cause.again(f"{where}: ")
    if isinstance(cause, PermissionError):
        name = cause.filename or str(stored)
        error = PermissionError(f"{where}: permission denied reading {str(name)!r}; make it readable by this user")
        error.errno = errno.EACCES
        return error
    damaged = _damaged_files(stored)
    if damaged:
        return ValueError(f"{where}: {'; '.join(damaged)}; the checkpoint is damaged: {verify}")
    if isinstance(cause, FileNotFoundError):
        return ValueError(f"{where}: {str(cause.filename or '')!r} is missing; the checkpoint is damaged: {verify}")
    return ValueError(f"{where}: {_first_line(cause)}; the checkpoint may be damaged: {verify}")


def _free_bytes(path: Path) -> int:
    for candidate in (path, *path.parents):
        try:
            return shutil.disk_usage(candidate).free
        except OSError:
            continue
    return 1 << 62


def _damaged_files(stored: Stored) -> list[str]:
    """Data files that are missing, shorter than ``.metadata`` says, or garbage (best effort)."""
    try:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        from shardbridge.checkpoint.storage._trust import read_metadata

        # Never plain pickle: see [Note: untrusted checkpoints] in _trust.py.
        metadata = read_metadata(stored, data_files=False)
        needed: dict[str, int] = {}
        tensor_offsets: dict[str, list[int]] = {}
        for index, info in (metadata.storage_data or {}).items():
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
            if isinstance(metadata.state_dict_metadata.get(index.fqn), TensorStorageMetadata):
                tensor_offsets.setdefault(info.relative_path, []).append(info.offset)
        sizes = {n: e.size for n, e in stored.backend.listing(stored.data).items() if e.regular}
    except Exception:  # noqa: BLE001 (a diagnostic only; the caller reports the original cause)
        return []
    found = []
    for name, size in sorted(needed.items()):
        shown = stored.show(name)
        if name not in sizes:
            found.append(f"data file {shown!r} is missing")
        elif sizes[name] < size:
            found.append(f"data file {shown!r} is truncated ({sizes[name]} of {size} bytes)")
        elif not _items_start_as_zip(stored, name, tensor_offsets.get(name, [])):
            found.append(f"data file {shown!r} holds garbage where .metadata places a tensor")
    return found


def _items_start_as_zip(stored: Stored, name: str, offsets: list[int]) -> bool:
    """Each tensor item of a ``.distcp`` file is one ``torch.save`` zip archive."""
    magic = bytearray(4)
    try:
        for offset in offsets:
            got = stored.backend.read_into(stored.file(name), offset, memoryview(magic))
            if got != 4 or bytes(magic) != _ZIP_MAGIC:
                return False
    except OSError:
        return True  # unreadable: the caller reports the original cause
    return True
