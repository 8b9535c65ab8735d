"""Which checkpoints a root holds: ``step_dir``, ``latest``, and the candidates ``load_latest`` walks."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from shardbridge.checkpoint.storage._integrity import check_files, describe_problem
from shardbridge.checkpoint.storage._location import Location, check_uri, locate, open_checkpoint

__all__ = ["about_the_store", "latest", "newest", "step_dir"]

logger = logging.getLogger("shardbridge.checkpoint")

_STEP_DIR = "step-{step:08d}"


def step_dir(root: str | os.PathLike[str], step: int) -> Path | str:
    """The conventional checkpoint directory for ``step``: ``<root>/step-00000100``.

    A URI root gives a URI (``s3://bucket/ckpt/step-00000100``), a path a ``Path``.

    Example:
        >>> str(step_dir("/ckpt", 100)), step_dir("s3://bucket/ckpt", 7)
        ('/ckpt/step-00000100', 's3://bucket/ckpt/step-00000007')
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step={step!r} must be an int >= 0")
    name = _STEP_DIR.format(step=step)
    if check_uri(os.fspath(root), what="root") is not None:  # a typo refused, not made a local folder
        return os.fspath(root).rstrip("/") + "/" + name
    return Path(root) / name


def newest(root: str | os.PathLike[str] | Location, *, skip: frozenset[str] = frozenset()) -> Path | str | None:
    """:func:`latest`, passing over the checkpoints in ``skip`` (as :func:`latest` names them)."""
    where = locate(root, what="root")
    found = []
    for path in where.backend.candidates(where.path):  # an error listing the root is raised
        try:
            stored, manifest = open_checkpoint(where.at(path))
        except Exception as exc:  # noqa: BLE001 (one damaged checkpoint must not hide the others)
            if about_the_store(exc):
                raise
            text = str(exc) if isinstance(exc, ValueError) else f"damaged manifest: {type(exc).__name__}: {exc!s:.200}"
            if "no shardbridge.json" not in text and "does not exist" not in text:
                logger.warning("shardbridge.checkpoint: skipping %s: %s", where.named(path), text)
            continue
        step = manifest.step if manifest.step is not None else -1
        found.append(((step, where.backend.display_name(path)), stored, manifest))
    for _, stored, manifest in sorted(found, key=lambda item: item[0], reverse=True):
        name = where.named(stored.path)
        if str(name) in skip:
            continue
        problems = check_files(stored, manifest, checksums=False)
        if problems:
            logger.warning(
                "shardbridge.checkpoint: skipping %s: %s%s",
                name,
                describe_problem(stored, problems[0]),
                f" (and {len(problems) - 1} more)" if len(problems) > 1 else "",
            )
            continue
        return name
    return None


_CONTENT_ERRORS = (ValueError, LookupError, TypeError, AttributeError, ArithmeticError, RecursionError, MemoryError)
"""What a manifest's content can make its reader raise (JSON nested 100,000 deep: RecursionError)."""


def about_the_store(error: BaseException) -> bool:
    """Whether reading one checkpoint's manifest failed because of the store, not of that checkpoint.

    [Note: one damaged checkpoint]
    ``latest`` and the verbs on a root skip a checkpoint whose manifest cannot be read (any
    error its content causes) and fall back to the previous one, but an error of the store
    itself (permission, credentials, an unreachable endpoint, a timeout: an ``OSError``, or a
    client's own exception) is raised: skipping it would load an older checkpoint, or none,
    without a word. A manifest that vanished meanwhile
    (``FileNotFoundError``) is skipped.
    """
    if isinstance(error, (FileNotFoundError, NotADirectoryError, IsADirectoryError)):
        return False
    return isinstance(error, OSError) or not isinstance(error, _CONTENT_ERRORS)


def latest(root: str | os.PathLike[str]) -> Path | str | None:
    """The newest complete checkpoint under ``root`` (a directory or a URI), or None.

    Considers the immediate subdirectories (prefixes) of ``root`` whose name does not start
    with "." and whose ``shardbridge.json`` is complete and valid; picks the highest recorded
    step (checkpoints saved with ``step=None`` count as -1), then the greatest name. Skipped with
    a warning: a manifest that cannot be read for what it holds (any error but the store's,
    [Note: one damaged checkpoint]), a recorded file that is missing or has another size, a
    file the manifest does not record. Checksums are not read here (that would read every
    byte of every candidate); ``load`` verifies them and ``load_latest`` falls back to the next
    older checkpoint. On local disk a checkpoint left hidden by a crash is restored first
    ([Note: atomic commit] in ``_local.py``); on an object store only a committed manifest makes a
    checkpoint ([Note: object-store commit] in ``_fsspec.py``).

    Example:
        >>> latest("/no/such/root") is None
        True
    """
    return newest(root)
