"""Atomic checkpoint directories: write to a hidden temporary name, then rename; recover after crashes.

[Note: atomic commit]
~~~~~~~~~~~~~~~~~~~~~
::

    <root>/.step-00000100.lock-<id>    0. rank 0 creates it and holds an exclusive flock on it
                                          (it also names host and pid) until the save is over
    <root>/.step-00000100.tmp-<id>/    1. rank 0 creates it; every rank writes DCP files and
                                          its RNG file into it (DCP fsyncs each file)
                                       2. every rank hashes the files it wrote; rank 0 gets the
                                          records with DCP's write results ([Note: checkpoint
                                          integrity], [Note: the storage writer] in _writer.py)
                                       3. rank 0 fsyncs rng/ (the names of the RNG files),
                                          writes shardbridge.json (tmp file, fsync,
                                          rename) and fsyncs the directory: the COMMIT POINT,
                                          the directory is a complete checkpoint from here on
                                       4. overwrite only: the existing final directory is
    <root>/.step-00000100.old-<id>/       renamed aside (same <id>)
    <root>/step-00000100/              5. the tmp directory is renamed to the final name
                                          (atomic on POSIX), <root> fsynced
                                       6. the .old copy is deleted; the lock released, deleted
                                       7. rank 0 tells every rank the outcome (DCP's broadcast
                                          of its finish: steps 3-6 run inside it)

A process may die (kill -9, OOM, node loss) at any point, on any rank. Whatever is left,
recovery restores a visible complete checkpoint and deletes nothing that may be the only
complete copy. Recovery looks at the hidden ``.<name>.tmp-<id>`` / ``.<name>.old-<id>``
directories of ``<root>`` whose owner is gone (see "Two jobs" below):

- R1 (restore): if ``<root>/<name>`` is missing, the first COMPLETE hidden copy is renamed
  back to ``<name>``: an ``.old-`` copy (the last committed version; newest first), else a
  ``.tmp-`` copy that passed its commit point (newest first). Complete = the manifest parses
  and verifies its own checksum, every recorded file exists with its recorded size, nothing
  extra. The crash between steps 4 and 5 thus brings the previous version back; a crash
  between 3 and 5 of a first save promotes the new one (it is complete and verified).
- R2 (delete): a hidden copy is deleted only when it has no valid manifest (the save never
  reached its commit point: it cannot be loaded) or when ``<name>`` is complete AND its
  checksums verify (so the hidden copy is not the only one). A hidden copy with a manifest
  but damaged files is kept, with a warning, when ``<name>`` is missing or damaged.
- R3: lock files whose owner is gone and whose directories are gone are deleted.

Who runs it: rank 0 at the start of every save (R1-R3, every name in the parent); a save
that raises (rank 0, its own name, after releasing its lock: so a failure after step 4
puts the previous version back); :func:`latest` (R1 only: renames, never deletes; where the
rename fails, e.g. on a read-only filesystem, the hidden copy itself is returned).

Crash points and what the next ``latest``/``save`` sees (``test_faults.py`` enumerates them)::

    before 3          tmp without manifest     R2 deletes it; the previous checkpoint stays
    after 3, before 4 tmp complete, final old  R2 deletes tmp once final verifies
                      (first save: R1 promotes tmp)
    after 4, before 5 old + tmp, no final      R1 restores old; R2 deletes tmp
    after 5           final new, old left      R2 deletes old once final verifies
    during 6          old partly deleted       R2 deletes it (no valid manifest)

Two jobs in one root: a hidden directory is left alone while its owner lives: its lock file
``.<name>.lock-<id>`` is flocked by another process (or by this one). Where flock does not
work (no ``fcntl``, an NFS mount without locking), the lock file's ``host pid`` decides: a
dead pid on this host is gone, another host is assumed alive (left alone). A hidden
directory without a lock file (a shardbridge before 0.1 wrote none) is assumed alive when
modified after this process imported ``shardbridge.checkpoint``. Renames never replace a
non-empty directory, so two jobs saving the SAME name with ``overwrite=True`` at once make
one of them fail with an error; the final directory stays complete.

Multi-node: every rank writes into the same directory and rank 0 renames it, so the path
must be on a filesystem all nodes share (NFS, Lustre, GPFS ...), with POSIX rename semantics.
A path that is not (a node-local disk) is refused by name before anything is committed: see
[Note: one directory for every rank] in ``_writer.py``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import socket
import stat
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from shardbridge.checkpoint.storage._backend import SHARED_DIRECTORY_FIX, Backend, Entry, Kind, Stored, Target
from shardbridge.checkpoint.storage._integrity import check_files
from shardbridge.checkpoint.storage._manifest import MANIFEST_NAME, Manifest, fsync_dir, read_manifest

try:
    import fcntl
except ImportError:  # pragma: no cover (Windows): liveness by pid only
    fcntl = None  # type: ignore[assignment]

__all__ = ["LOCAL", "LocalBackend", "abandon", "commit", "new_tmp_dir", "recover"]

logger = logging.getLogger("shardbridge.checkpoint")

_RUN_START = time.time()
"""Hidden directories without a lock file modified after this may be live (see the note)."""
_HIDDEN = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|old|lock)-(?P<id>[0-9a-f]{12})$")
_HELD: dict[str, tuple[int, Path]] = {}
"""Locks this process holds: id -> (fd, lock file)."""


def _is_empty_dir(path: Path) -> bool:
    return path.is_dir() and not any(path.iterdir())


# --- locks: who owns a hidden directory -------------------------------------------------


def _lock_path(parent: Path, name: str, ident: str) -> Path:
    return parent / f".{name}.lock-{ident}"


def _acquire(parent: Path, name: str) -> str:
    """Create and flock a fresh lock file for ``name``; its id."""
    for _ in range(16):
        ident = uuid.uuid4().hex[:12]
        path = _lock_path(parent, name, ident)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            if fcntl is not None:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX)  # blocks only while a checker probes it
                except OSError:
                    pass  # no locking on this filesystem: host and pid decide
            os.write(fd, f"{socket.gethostname()} {os.getpid()}\n".encode())
            if os.fstat(fd).st_ino == os.stat(path).st_ino:  # not deleted by a checker meanwhile
                _HELD[ident] = (fd, path)
                return ident
        except FileNotFoundError:
            pass
        except BaseException:  # e.g. no space for the host and pid: leave no lock file behind
            path.unlink(missing_ok=True)
            os.close(fd)
            raise
        os.close(fd)
    raise RuntimeError(f"could not create a lock file in {str(parent)!r}")


def _release(ident: str) -> None:
    held = _HELD.pop(ident, None)
    if held is None:
        return
    fd, path = held
    prefix = path.name[: -len(f"lock-{ident}")]
    if not any((path.parent / f"{prefix}{kind}-{ident}").exists() for kind in ("tmp", "old")):
        try:
            path.unlink()  # before close: nobody can open it unlocked
        except OSError:
            pass
    # else: keep the (now unheld) lock file, so that recovery knows its directory is dead
    os.close(fd)


def _owner_alive_by_pid(fd: int) -> bool:
    try:
        host, pid = os.read(fd, 512).decode().split()
        if host != socket.gethostname():
            return True  # another node: cannot tell, leave it alone
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (OSError, ValueError):
        return True
    return True


def _is_live(parent: Path, name: str, ident: str, directory: Path | None) -> bool:
    """Whether a save that may still write ``directory`` (or hold the lock) owns ``ident``."""
    if ident in _HELD:
        return True
    lock = _lock_path(parent, name, ident)
    try:
        try:
            fd = os.open(lock, os.O_RDWR)  # NFS emulates flock with write locks: needs write mode
        except (PermissionError, OSError) as exc:
            if isinstance(exc, FileNotFoundError):
                raise
            fd = os.open(lock, os.O_RDONLY)  # read-only filesystem: a local flock still works
    except FileNotFoundError:
        if directory is None:
            return False
        try:  # no lock file: written without locks; the old rule
            return directory.stat().st_mtime >= _RUN_START
        except OSError:
            return False
    except OSError:
        return True  # cannot open it: cannot tell
    try:
        if fcntl is None:
            return _owner_alive_by_pid(fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        except OSError:
            return _owner_alive_by_pid(fd)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


# --- recovery ----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Hidden:
    name: str
    kind: str  # "tmp" | "old" | "lock"
    ident: str
    path: Path


def _hidden(parent: Path) -> dict[str, list[_Hidden]]:
    found: dict[str, list[_Hidden]] = {}
    try:
        children = list(parent.iterdir())
    except OSError:
        return found
    for child in children:
        m = _HIDDEN.match(child.name)
        if m is not None:
            found.setdefault(m["name"], []).append(_Hidden(m["name"], m["kind"], m["id"], child))
    return found


def _complete(path: Path) -> Manifest | None:
    """The manifest of ``path`` if it is a complete checkpoint (sizes checked, not checksums)."""
    try:
        manifest = read_manifest(LOCAL, str(path))
    except (ValueError, OSError):
        return None
    if check_files(_stored(path), manifest, checksums=False):
        return None
    return manifest


def _has_manifest(path: Path) -> bool:
    try:
        read_manifest(LOCAL, str(path))
    except (ValueError, OSError):
        return False
    return True


def _verified(path: Path) -> bool:
    """``path`` is a complete checkpoint whose checksums verify."""
    manifest = _complete(path)
    return manifest is not None and not check_files(_stored(path), manifest, checksums=True, listing=False)


def _stored(path: Path) -> Stored:
    return Stored(LOCAL, str(path), str(path))


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _restore(parent: Path, name: str, dead: list[_Hidden]) -> Path | None:
    """R1: rename the first complete hidden copy to ``name``; the copy if the rename failed."""
    olds = sorted((h.path for h in dead if h.kind == "old"), key=_mtime, reverse=True)
    tmps = sorted((h.path for h in dead if h.kind == "tmp"), key=_mtime, reverse=True)
    for copy in (*olds, *tmps):
        if _complete(copy) is None:
            continue
        final = parent / name
        try:
            os.rename(copy, final)
        except FileNotFoundError:
            return None  # another process restored it first
        except OSError as exc:
            if final.exists():
                return None  # another process restored one first
            logger.warning(
                "shardbridge.checkpoint: %s is missing and %s is a complete copy of it, but it cannot be "
                "renamed back (%s); rename it by hand",
                final,
                copy,
                exc,
            )
            return copy
        fsync_dir(parent)
        logger.warning("shardbridge.checkpoint: restored %s from %s, left by an interrupted save", final, copy.name)
        return None
    return None


def _delete_garbage(parent: Path, name: str, dead: list[_Hidden]) -> None:
    """R2 and R3 for ``name``."""
    final = parent / name
    final_verified: bool | None = None
    for h in dead:
        if h.kind == "lock":
            continue
        if _has_manifest(h.path):  # passed its commit point: maybe the only copy
            if final_verified is None:
                final_verified = _verified(final)
            if not final_verified:
                logger.warning(
                    "shardbridge.checkpoint: keeping %s: it holds a saved checkpoint and %s is missing or "
                    "damaged; check both with `shardbridge ckpt verify` and delete one by hand",
                    h.path,
                    final,
                )
                continue
        logger.warning("shardbridge.checkpoint: deleting %s, left by an interrupted save", h.path)
        shutil.rmtree(h.path, ignore_errors=True)
    left = {h.ident for h in _hidden(parent).get(name, []) if h.kind != "lock"}
    for h in dead:
        if h.kind == "lock" and h.ident not in left:
            try:
                h.path.unlink()
            except OSError:
                pass


def recover(parent: Path, *, delete: bool, only: str | None = None, ours: str | None = None) -> list[Path]:
    """Apply [Note: atomic commit]'s recovery rules to the hidden entries of ``parent``.

    Args:
        delete: also R2 and R3 (False: R1 only, renames).
        only: one final name instead of every name.
        ours: the id of this process's failed save: its entries are not live.

    Returns:
        Complete hidden copies that R1 chose but could not rename (read-only filesystem).
    """
    stuck: list[Path] = []
    for name, entries in sorted(_hidden(parent).items()):
        if only is not None and name != only:
            continue
        dead = [
            h
            for h in entries
            if h.ident == ours or not _is_live(parent, name, h.ident, None if h.kind == "lock" else h.path)
        ]
        if not dead:
            continue
        if not (parent / name).exists():
            copy = _restore(parent, name, [h for h in dead if h.kind != "lock"])
            if copy is not None:
                stuck.append(copy)
        if delete:
            _delete_garbage(parent, name, dead)
    return stuck


# --- the save side -----------------------------------------------------------------------


def new_tmp_dir(final: Path, *, overwrite: bool) -> Path:
    """Rank 0: recover ``final``'s parent, check ``final``, create, lock and return the temporary dir.

    Raises:
        ValueError: ``final`` exists and ``overwrite`` is False, or it is not a checkpoint
            directory that may be replaced.
    """
    parent = final.parent
    if final.exists() and not final.is_dir():
        raise ValueError(f"{str(final)!r} exists and is a file; pass a directory path")
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        blocker = next((p for p in (parent, *parent.parents) if p.exists() and not p.is_dir()), parent)
        raise ValueError(
            f"cannot save to {str(final)!r}: {str(blocker)!r} is a file, not a directory; choose a path whose "
            "parent directories are directories (or can be created)"
        ) from None
    except PermissionError as err:
        raise PermissionError(
            f"cannot create the checkpoint's parent directory {str(parent)!r}: {err.strerror}; choose a writable "
            "location"
        ) from None
    recover(parent, delete=True)
    if final.exists():
        if not overwrite and not _is_empty_dir(final):
            raise ValueError(
                f"checkpoint directory {str(final)!r} already exists; pass overwrite=True to replace it, "
                "or save to a new path (e.g. step_dir(root, step))"
            )
        if not _is_empty_dir(final) and not (final / MANIFEST_NAME).exists():
            raise ValueError(
                f"refusing to overwrite {str(final)!r}: it is not a shardbridge checkpoint (no {MANIFEST_NAME}); "
                "delete it yourself or choose another path"
            )
    ident = _acquire(parent, final.name)
    tmp = parent / f".{final.name}.tmp-{ident}"
    try:
        tmp.mkdir()
    except BaseException:
        _release(ident)
        raise
    return tmp


def _ident(tmp: Path) -> str:
    return tmp.name[-12:]


def commit(tmp: Path, final: Path, manifest: Manifest, *, overwrite: bool) -> None:
    """Rank 0: write the manifest (the commit point), then rename ``tmp`` to ``final`` durably.

    See [Note: atomic commit]. Every rank must have finished writing into ``tmp``.
    """
    from shardbridge.checkpoint.storage._manifest import write_manifest

    for sub in sorted(e.path for e in os.scandir(tmp) if e.is_dir(follow_symlinks=False)):
        fsync_dir(Path(sub))  # the names in rng/ (each file fsynced by its writer; its name too, now)
    write_manifest(tmp, manifest)  # its rename made durable: the directory fsynced
    old = None
    if final.exists():
        if _is_empty_dir(final):
            final.rmdir()
        elif not overwrite:  # new_tmp_dir checked it: another job created it since
            raise FileExistsError(
                f"checkpoint directory {str(final)!r} was created by another process while this save was "
                "running; not replacing it (two jobs are saving to the same path: give each its own root)"
            )
        else:
            old = final.parent / f".{final.name}.old-{_ident(tmp)}"
            os.rename(final, old)
    try:
        os.rename(tmp, final)
    except BaseException:
        if old is not None:
            try:  # the previous version back; else abandon()'s recovery does it
                os.rename(old, final)
            except OSError:
                pass
        raise
    fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    _release(_ident(tmp))


def abandon(tmp: Path, final: Path) -> None:
    """Rank 0, after a save failed: release the lock, then recover ``final``'s name. Never raises.

    Deletes ``tmp`` unless it is the only complete copy (see [Note: atomic commit], R1-R3).
    """
    try:
        recover(final.parent, delete=True, only=final.name, ours=_ident(tmp))
    except Exception as exc:  # noqa: BLE001 (the save's own error is the one to raise)
        logger.warning("shardbridge.checkpoint: cleaning up %s after a failed save failed too: %s", tmp, exc)
    finally:
        _release(_ident(tmp))


# --- the backend -------------------------------------------------------------------------


class LocalBackend(Backend):
    """Checkpoints on a local or shared POSIX filesystem: [Note: atomic commit].

    Paths are plain paths (``file://`` URIs are turned into them by ``_location.py``).
    """

    def uri(self, path: str) -> str:
        """The path itself."""
        return path

    def kind(self, path: str) -> Kind:
        """"dir", "file" or "missing" (a link to a directory counts as one, as ``Path.is_dir``)."""
        if os.path.isdir(path):
            return "dir"
        return "file" if os.path.lexists(path) else "missing"

    def read_bytes(self, path: str) -> bytes:
        """The file's bytes."""
        with open(path, "rb") as f:
            return f.read()

    def read_into(self, path: str, offset: int, out: memoryview) -> int:
        """``pread`` into ``out``."""
        fd = os.open(path, os.O_RDONLY)
        try:
            done = 0
            while done < len(out):
                n = os.preadv(fd, [out[done:]], offset + done)
                if not n:
                    break
                done += n
            return done
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def stream(self, path: str, start: int, end: int) -> Iterator[BinaryIO]:
        """The file, unbuffered, at ``start`` (it seeks too: skipped bytes need not be read)."""
        with open(path, "rb", buffering=0) as f:
            f.seek(start)
            yield f

    def listing(self, path: str) -> dict[str, Entry]:
        """One directory walk; symbolic links (also to directories) are listed, never followed."""
        found: dict[str, Entry] = {}
        pending = [("", path)]  # (prefix in the listing, directory); strings, not Paths: 65,536-rank checkpoints
        while pending:
            prefix, where = pending.pop()
            try:
                entries = list(os.scandir(where))
            except OSError:  # as os.walk: a directory that cannot be read is not listed
                continue
            for e in entries:
                if e.is_dir(follow_symlinks=False):
                    pending.append((f"{prefix}{e.name}/", e.path))
                    continue
                try:
                    st = e.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                found[prefix + e.name] = Entry(st.st_size, stat.S_ISREG(st.st_mode), st.st_mtime)
        return found

    def stat(self, path: str) -> Entry | None:
        """``lstat``: a link is an entry that is not regular."""
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return None
        return Entry(st.st_size, stat.S_ISREG(st.st_mode), st.st_mtime)

    def children(self, path: str) -> list[str]:
        """Subdirectories (hidden ones too)."""
        try:
            return sorted(e.name for e in os.scandir(path) if e.is_dir())
        except OSError:
            return []

    @contextlib.contextmanager
    def writing(self, path: str) -> Iterator[BinaryIO]:
        """A new file ``path`` (an old one, or a link, is removed, never written through); fsynced at the end."""
        Path(path).unlink(missing_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())

    def remove(self, path: str) -> None:
        """``unlink`` (missing is fine)."""
        Path(path).unlink(missing_ok=True)

    def mkdirs(self, path: str) -> None:
        """One directory level (never the temporary directory itself: see :meth:`check_target`)."""
        Path(path).mkdir(exist_ok=True)

    def check_target(self, target: Target) -> None:
        """An error if this process does not see the temporary directory rank 0 created.

        A rank never creates it: if rank 0 has already given the save up and deleted it (a dead
        peer, a destroyed process group), another rank would re-create it without a lock file,
        and recovery could not tell it from another job's save in progress: it would stay forever.
        See [Note: one directory for every rank] in ``_writer.py``.

        Raises:
            ValueError: its parent is missing too: this machine does not see rank 0's directory.
            FileNotFoundError: only the directory is missing: that, or rank 0 gave the save up.
        """
        if os.path.isdir(target.data):
            return
        here = f"on host {socket.gethostname()!r}"
        parent = os.path.dirname(target.data) or "."
        if not os.path.isdir(parent):
            raise ValueError(
                f"rank 0 created the save's temporary directory {target.data!r}, but {parent!r} does not exist "
                f"{here} (it is {os.path.abspath(parent)!r} here): the machines do not see the same directory (a "
                f"node-local disk, or a relative path under different working directories?). Nothing was "
                f"committed; {SHARED_DIRECTORY_FIX}"
            )
        raise FileNotFoundError(
            f"the save's temporary directory {target.data!r} does not exist {here} (it is "
            f"{os.path.abspath(target.data)!r} here): rank 0 gave the save up (see its error), or this machine "
            f"does not see the directory rank 0 created it in (a node-local disk?); if so, {SHARED_DIRECTORY_FIX}"
        )

    def begin(self, final: str, *, overwrite: bool) -> Target:
        """:func:`new_tmp_dir`."""
        tmp = new_tmp_dir(Path(final), overwrite=overwrite)
        return Target(final=final, data=str(tmp), ident=_ident(tmp), overwrite=overwrite)

    def commit(self, target: Target, manifest: Manifest) -> None:
        """:func:`commit`: the manifest, then the rename."""
        commit(Path(target.data), Path(target.final), manifest, overwrite=target.overwrite)

    def abandon(self, target: Target) -> None:
        """:func:`abandon`."""
        abandon(Path(target.data), Path(target.final))

    def candidates(self, root: str) -> list[str]:
        """Visible subdirectories with a manifest, and complete hidden copies R1 could not rename back."""
        top = Path(root)
        if not top.is_dir():
            return []
        stuck = recover(top, delete=False)
        found = [
            str(child)
            for child in top.iterdir()
            if not child.name.startswith(".") and child.is_dir() and (child / MANIFEST_NAME).exists()
        ]
        return found + [str(p) for p in stuck if (p / MANIFEST_NAME).exists()]

    def display_name(self, path: str) -> str:
        """The checkpoint name ``latest`` orders by: a stuck hidden copy's final name."""
        name = os.path.basename(path)
        hidden = _HIDDEN.match(name)
        return hidden["name"] if hidden is not None else name

    def identity(self, path: str) -> tuple[int, int] | None:
        """(device, inode) of the directory ``path`` names now (a commit renames a new one into place)."""
        try:
            st = os.stat(path)
        except OSError:
            return None
        return st.st_dev, st.st_ino


LOCAL = LocalBackend()
"""The one local backend (stateless)."""
