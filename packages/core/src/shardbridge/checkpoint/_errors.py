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
same gathered failures, so no collective is needed). ``save`` drives DCP's writer itself
([Note: save rounds] in ``_save.py``): the rank whose write failed translates its own error
with :func:`save_failure`, and the write round raises it on every rank.

- save: ``OSError`` (``errno`` kept when known) "saving checkpoint DIR failed on rank R
  writing FILE: No space left on device ..." and the fix;
- load: ``PermissionError`` for unreadable files, else ``ValueError`` naming the damaged file
  (a data file shorter than ``.metadata`` says, a missing one, garbage) and suggesting
  ``shardbridge ckpt verify``.
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

__all__ = ["dcp_errors", "describe_checkpoint_exception", "save_failure"]

# The zip writer's message when a write came up short (the OSError itself is lost in C++).
_SHORT_WRITE = "unexpected pos"
# Below this much free space a short write is taken for a full filesystem.
_NEARLY_FULL_BYTES = 1 << 20
_ZIP_MAGIC = b"PK\x03\x04"


@contextmanager
def dcp_errors(
    action: Literal["save", "load"],
    checkpoint_dir: str | os.PathLike[str],
    *,
    data_dir: str | os.PathLike[str] | None = None,
) -> Iterator[None]:
    """Re-raise a ``CheckpointException`` from the body as one clear error. See [Note: DCP errors].

    Args:
        action: "save" or "load".
        checkpoint_dir: the checkpoint the user named.
        data_dir: where DCP writes or reads the files (save's temporary directory); None =
            ``checkpoint_dir``.
    """
    try:
        yield
    except CheckpointException as exc:
        data = Path(checkpoint_dir if data_dir is None else data_dir)
        raise describe_checkpoint_exception(exc, action, Path(checkpoint_dir), data_dir=data) from None


def describe_checkpoint_exception(
    exc: CheckpointException, action: Literal["save", "load"], checkpoint_dir: Path, *, data_dir: Path | None = None
) -> Exception:
    """The one exception that stands for ``exc`` (see [Note: DCP errors])."""
    data_dir = checkpoint_dir if data_dir is None else data_dir
    failures = sorted(exc.failures.items())
    if not failures:
        return RuntimeError(f"{action} of checkpoint {str(checkpoint_dir)!r} failed: {exc}")
    rank, (cause, _) = failures[0]
    others = f" (and on {len(failures) - 1} other rank(s))" if len(failures) > 1 else ""
    where = f"{action} of checkpoint {str(checkpoint_dir)!r} failed on rank {rank}{others}"
    if action == "save":
        return _save_error(where, rank, cause, data_dir)
    return _load_error(where, cause, data_dir)


def save_failure(cause: BaseException, rank: int, checkpoint_dir: Path, data_dir: Path) -> Exception:
    """The one clear exception for ``cause``, raised on ``rank`` while it wrote its files of a save."""
    return _save_error(f"save of checkpoint {str(checkpoint_dir)!r} failed on rank {rank}", rank, cause, data_dir)


def _first_line(cause: BaseException) -> str:
    text = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {text[0] if text else ''}".rstrip(": ")


def _save_error(where: str, rank: int, cause: BaseException, data_dir: Path) -> Exception:
    files = f"its data files {str(data_dir / f'__{rank}_*.distcp')!r}"
    code = getattr(cause, "errno", None) if isinstance(cause, OSError) else None
    if code is None and _SHORT_WRITE in str(cause):
        # torch.save's zip writer lost the OSError: ask the filesystem why the write came up short.
        code = errno.ENOSPC if _free_bytes(data_dir) < _NEARLY_FULL_BYTES else errno.EIO
        reason = os.strerror(code) if code == errno.ENOSPC else "a write came up short (disk quota or file size limit?)"
    elif code is not None:
        reason = os.strerror(code)
    else:
        return RuntimeError(f"{where} writing {files}: {_first_line(cause)}")
    filename = getattr(cause, "filename", None)
    target = repr(str(filename)) if filename else files
    fix = (
        "free space on that filesystem or save elsewhere"
        if code in (errno.ENOSPC, errno.EDQUOT)
        else "check that every rank may write there"
    )
    error = OSError(f"{where} writing {target}: {reason}; {fix}. Nothing was committed")
    error.errno = code
    return error


def _load_error(where: str, cause: BaseException, checkpoint_dir: Path) -> Exception:
    verify = f"run `shardbridge ckpt verify {checkpoint_dir}` to find every damaged file"
    if isinstance(cause, PermissionError):
        name = cause.filename or checkpoint_dir
        error = PermissionError(f"{where}: permission denied reading {str(name)!r}; make it readable by this user")
        error.errno = errno.EACCES
        return error
    damaged = _damaged_files(checkpoint_dir)
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


def _damaged_files(checkpoint_dir: Path) -> list[str]:
    """Data files that are missing, shorter than ``.metadata`` says, or garbage (best effort)."""
    try:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        from shardbridge.checkpoint._trust import read_metadata

        # Never plain pickle: see [Note: untrusted checkpoints] in _trust.py.
        metadata = read_metadata(checkpoint_dir, data_files=False)
        needed: dict[str, int] = {}
        tensor_offsets: dict[str, list[int]] = {}
        for index, info in (metadata.storage_data or {}).items():
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
            if isinstance(metadata.state_dict_metadata.get(index.fqn), TensorStorageMetadata):
                tensor_offsets.setdefault(info.relative_path, []).append(info.offset)
    except Exception:  # noqa: BLE001 (a diagnostic only; the caller reports the original cause)
        return []
    found = []
    for name, size in sorted(needed.items()):
        file = checkpoint_dir / name
        if not file.is_file():
            found.append(f"data file {str(file)!r} is missing")
        elif file.stat().st_size < size:
            found.append(f"data file {str(file)!r} is truncated ({file.stat().st_size} of {size} bytes)")
        elif not _items_start_as_zip(file, tensor_offsets.get(name, [])):
            found.append(f"data file {str(file)!r} holds garbage where .metadata places a tensor")
    return found


def _items_start_as_zip(file: Path, offsets: list[int]) -> bool:
    """Each tensor item of a ``.distcp`` file is one ``torch.save`` zip archive."""
    try:
        with open(file, "rb") as f:
            for offset in offsets:
                f.seek(offset)
                if f.read(4) != _ZIP_MAGIC:
                    return False
    except OSError:
        return True  # unreadable: the caller reports the original cause
    return True
