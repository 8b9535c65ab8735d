"""Where a writer may put its files: never through a link, never over a file without ``overwrite``.

[Note: writer destinations]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
Every writer of shardbridge (``ckpt export``, ``ckpt convert``, the hf adapter's
``export_pretrained``, the demo) checks its destination before it writes anything::

    destination                      overwrite=False        overwrite=True
    DST missing or an empty folder   written                written
    DST/<name> a regular file        refused by name        replaced (a new file, renamed over it)
    DST/<name> a link / special file refused by name        refused by name
    DST itself a link                refused by name        refused by name

A link is refused even with ``overwrite``: writing through it changes a file outside the
destination (what the user asked to replace is the link's name, not its target), and replacing
it silently drops what the user linked there. Files are written under a temporary name
created anew (``O_EXCL | O_NOFOLLOW``: a link planted under that name is never followed),
fsynced, then renamed over ``DST/<name>``; a rename replaces a name, never writes through one.
Only local folders can hold links; object stores are checked for existing objects only.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from pathlib import Path

__all__ = ["check_destination", "write_file"]


def _link_or_special(
    path: str, missing: tuple[type[OSError], ...] = (FileNotFoundError, NotADirectoryError)
) -> str | None:
    """What ``path`` is when it is a symbolic link or a special file; None for a regular file, a
    directory, or no file (``lstat`` raised one of ``missing``)."""
    try:
        mode = os.lstat(path).st_mode
    except missing:
        return None
    if stat.S_ISLNK(mode):
        return f"a symbolic link (to {os.readlink(path)!r})"
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        return "not a regular file"
    return None


def check_destination(
    out_dir: str | os.PathLike[str],
    names: Iterable[str],
    *,
    overwrite: bool,
    flag: str | None = "--overwrite (overwrite=True)",
) -> None:
    """Refuse, before anything is written, a destination a writer must not write into.

    See [Note: writer destinations]: ``out_dir`` a symbolic link, one of ``names`` (files
    the writer writes directly in ``out_dir``) a link or special file, or an existing file
    among ``names`` without ``overwrite``.

    Args:
        out_dir: the destination folder (it may not exist yet).
        names: the file names the writer will write into ``out_dir``.
        overwrite: the user allowed replacing existing files.
        flag: how the user says ``overwrite``, for the message (None: the writer always overwrites).

    Raises:
        ValueError: naming the path, what it is, and the fix; nothing was written.

    Example:
        >>> check_destination("/no/such/folder", ["config.json"], overwrite=False)
    """
    out = os.fspath(out_dir)
    if "://" in out:
        return
    if (what := _link_or_special(out)) is not None:
        raise ValueError(
            f"destination {out!r} is {what}; shardbridge never writes through a link and nothing was written: "
            "pass the real folder instead"
        )
    if not os.path.isdir(out):
        if os.path.lexists(out):
            raise ValueError(f"destination {out!r} is a file, not a folder; nothing was written: choose another path")
        return
    for name in names:
        path = os.path.join(out, name)
        if (what := _link_or_special(path)) is not None:
            even = f" (not even with {flag})" if flag else ""
            raise ValueError(
                f"{path!r} is {what}; shardbridge never writes through a link and nothing was written{even}: "
                "remove it, or choose another folder"
            )
        if os.path.lexists(path) and not overwrite:
            raise ValueError(
                f"{path!r} already exists; nothing was written: pass {flag} to replace it, or choose a new folder"
            )


def write_file(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` as ``path``: a new temporary file (never through a link), fsync, rename over ``path``.

    See [Note: writer destinations]. A leftover temporary file of an interrupted write is
    removed first.
    """
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)  # a leftover (or a planted link): never opened
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
