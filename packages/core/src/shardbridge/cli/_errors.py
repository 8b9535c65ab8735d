"""One line for every error a ``shardbridge`` command can meet: what is wrong, and the fix.

[Note: CLI errors]
~~~~~~~~~~~~~~~~~~
A command never ends in a traceback (``--debug`` shows one). :func:`describe` turns any
exception into one line, by class:

- bad input (``ValueError``, ``NotImplementedError``): the library's own message, which
  names the flag or file and the fix; a missing extra (``ImportError``): its install hint;
- files (``OSError``): missing path, permission denied, not a directory, no space left;
  "the path and what to do";
- a damaged checkpoint (anything else raised while ``ckpt`` reads one: unpickling errors,
  EOF, torch's zip reader): the checkpoint, the cause, and ``shardbridge ckpt verify``;
- DCP's ``CheckpointException`` (see [Note: DCP errors] in ``checkpoint/_errors.py``);
- a failed demo worker: its rank and last line;
- anything else: its type and first line, and ``--debug``.

The command line prints ``shardbridge <command>: error: <line>`` and exits 2.
"""

from __future__ import annotations

import argparse
import errno

__all__ = ["describe", "one_line"]

_MAX_CHARS = 600


def one_line(text: str) -> str:
    """``text`` as one line: its non-empty lines joined, capped at a readable length."""
    line = " ".join(part.strip() for part in str(text).splitlines() if part.strip())
    return line if len(line) <= _MAX_CHARS else line[: _MAX_CHARS - 3] + "..."


def describe(err: BaseException, args: argparse.Namespace | None = None) -> str:
    """One line naming what went wrong and the fix (see [Note: CLI errors])."""
    from torch.distributed.checkpoint.api import CheckpointException

    checkpoint = _checkpoint_arg(args)
    if isinstance(err, ImportError):  # a missing extra (its install hint), never a damaged checkpoint
        return one_line(str(err))
    if isinstance(err, (ValueError, NotImplementedError)):
        message = one_line(str(err))
        verifying = getattr(args, "ckpt_command", None) == "verify"
        if checkpoint is not None and not verifying and "damaged" in message and "verify" not in message:
            message += f"; `shardbridge ckpt verify {checkpoint}` lists every damaged file"
        return message
    if isinstance(err, CheckpointException):
        from shardbridge.checkpoint.storage._errors import describe_checkpoint_exception

        action = "save" if getattr(args, "command", None) == "demo" else "load"
        return describe(describe_checkpoint_exception(err, action, checkpoint or "."), args)
    if isinstance(err, OSError):
        return one_line(_describe_os_error(err))
    if type(err).__name__ == "DistributedTestFailure":  # a demo worker failed (shardbridge.testing)
        return one_line(_describe_worker_failure(str(err)))
    cause = f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0]}".rstrip(": ")
    if checkpoint is not None:
        return one_line(
            f"cannot read checkpoint {checkpoint!r} ({cause}); it may be damaged: run "
            f"`shardbridge ckpt verify {checkpoint}` to find the damaged file (--debug shows the traceback)"
        )
    return one_line(f"{cause} (unexpected; rerun with --debug for the traceback and report it)")


def _checkpoint_arg(args: argparse.Namespace | None) -> str | None:
    if args is None or getattr(args, "command", None) != "ckpt":
        return None
    return getattr(args, "path", None)


def _describe_os_error(err: OSError) -> str:
    if err.filename is None and err.strerror is None:
        return str(err)  # our own OSErrors (e.g. a failed save) carry their whole message
    name = repr(str(err.filename)) if err.filename is not None else "a file"
    if isinstance(err, PermissionError):
        return f"permission denied: {name}; make it readable (or writable) by this user, or choose another path"
    if isinstance(err, FileNotFoundError):
        return f"no such file or directory: {name}; check the path"
    if isinstance(err, NotADirectoryError):
        return f"{name}: a path component is a file, not a directory; choose another path"
    if isinstance(err, IsADirectoryError):
        return f"{name} is a directory where a file was expected; choose another path"
    if isinstance(err, FileExistsError):
        return f"{name} already exists; remove it or choose another path"
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"no space left writing {name}; free space on that filesystem or write elsewhere"
    if err.errno == errno.EROFS:
        return f"{name} is on a read-only filesystem; write elsewhere"
    return f"{err.strerror or type(err).__name__}: {name}"


def _describe_worker_failure(text: str) -> str:
    """The summary and the first failed rank's exception line of a ``DistributedTestFailure``."""
    lines = text.strip().splitlines() or ["a worker process failed"]
    head, rank, last = lines[0], None, ""
    for line in lines[1:]:
        if line.startswith("--- rank "):
            if rank is not None:
                break
            rank = line.strip("- ")
        elif line.strip() and not line.startswith((" ", "Traceback")):
            last = line.strip()
    detail = f"; {rank}: {last}" if rank and last else ""
    return f"{head}{detail} (rerun with --debug for every rank's traceback)"
