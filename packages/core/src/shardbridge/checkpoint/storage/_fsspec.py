"""Checkpoints on object stores (S3, GCS, Azure; any fsspec filesystem): the backend and its commit.

[Note: object-store commit]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
An object store has no rename and no directories, but a PUT is atomic: a reader sees the whole
old object or the whole new one. So the manifest object is the commit point, and a save never
writes where a committed checkpoint's files are::

    <root>/.<name>.lock-g-<16 hex>    0. rank 0 writes it (host, pid, time): this save is alive
    <ckpt>/g-<16 hex>/__0_0.distcp    1. every rank uploads its files under a NEW generation
    <ckpt>/g-<16 hex>/rng/...            (one per save: the job/attempt id in every object name);
    <ckpt>/g-<16 hex>/.metadata          an object is durable once its upload completed;
                                         ``.metadata`` last, once every rank's files landed
                                      2. rank 0 lists the generation: every recorded object is
                                         there with its recorded size, and nothing else (another
                                         writer's object, a failed upload) -- else no commit
    <ckpt>/shardbridge.json           3. rank 0 PUTs the manifest naming the generation, last:
                                         THE COMMIT POINT. On S3 a conditional PUT: If-None-Match
                                         for a new checkpoint, If-Match (the old manifest's entity
                                         tag) for an overwrite, so a job that committed meanwhile
                                         is never silently replaced
                                      4. the generations it replaced (the previous one, and dead
                                         saves' ones recovery kept) and the lock are deleted: best
                                         effort, the save is committed (a failure is a warning)

- Nothing without a valid manifest is visible: ``latest`` reads manifests only, and a manifest
  names exactly one generation. A killed upload leaves a generation no manifest names.
- Overwrite keeps the old checkpoint loadable until step 3 (its manifest and generation are
  untouched); readers that opened it before are refused if its generation changes under them.
- Two jobs under one prefix cannot commit a mix: each writes its own generation, step 2
  refuses objects it did not record, step 3 refuses a manifest that changed since the save
  began, and ``verify`` / ``load`` check the manifest's generation only (its every object's size
  and checksum; an object in it that is not recorded is a problem).
- Other fsspec filesystems (GCS, Azure, memory) have no conditional PUT here: step 3 checks the
  manifest's generation just before writing it (a narrow race, last writer wins; still never a mix).

Leftovers: at the start of each save rank 0 lists the root (one level: the locks sit there, as
local disk's do) and settles the generations of every lock whose save is gone (a dead process on
this host, or a lock of another host older than ``LOCK_STALE_S``: it cannot be probed), and every
generation of ``<ckpt>`` itself no live lock names ([Note: object-store cleanup]). A failed save
deletes its own generation, unless its manifest PUT was sent (an answer lost may have committed
it): then it is kept for the next save to settle.

[Note: object-store cleanup]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Cleanup never deletes on one read what a committed manifest may name. A save killed right after
its manifest PUT is committed and leaves its lock; a store that is not read-after-write consistent
(multi-site Ceph RGW, a caching proxy) may answer the next read of that manifest with the previous
version or 404, and deleting "what the manifest does not name" then deleted the committed
checkpoint (issue 42). A dead save's generation is settled (``_settle``) by what no stale read
can take back::

    the generation                              settled            why
    is the one the manifest read names          kept (lock goes)   committed
    holds no .metadata (listing, then HEAD)     deleted            never reached step 3: no manifest
                                                                   can name it (.metadata is last)
    .metadata older than the named one's        deleted            a later commit replaced it
                                                                   (commits are ordered: step 3)
    .metadata older than LOCK_STALE_S           deleted            the store's stated bound
    otherwise                                   kept, with lock    it may be committed

A kept generation is deleted by the next commit of its checkpoint (step 4: once a conditional
PUT succeeded, no dead save can be named) or a save after ``LOCK_STALE_S``; it costs its storage
meanwhile. The store must show a PUT to every reader within ``LOCK_STALE_S`` (AWS S3, GCS, Azure:
at once); a reader shown an older manifest meanwhile loads the older checkpoint.

[Note: no 100-continue]
~~~~~~~~~~~~~~~~~~~~~~~
botocore sends every PutObject and UploadPart with ``Expect: 100-continue`` (it wraps any body
into a file object first). botocore's own HTTP client waits about a second for the server's
"100 Continue" and then sends the body anyway; aiohttp, which s3fs's aiobotocore uses, waits for
it with no timeout, and starts the client's read timeout only once the body is sent. So a server
that stops answering (overloaded, a dead proxy, SIGSTOP in test_s3_faults.py) hung a save forever
in its first PUT, whatever timeouts the user configured (measured: a 5-byte PUT to a stopped
moto server never returned; a GET failed after its read timeout). The backend removes the header
from the requests of the S3 clients of every filesystem it uses: a botocore ``before-call``
handler on the filesystem's session (clients created later, a refreshed one or s3fs's per-region
ones, copy it) and on its current client, registered when the backend is made and checked
before each write. The body goes at once and the read timeout bounds the wait for the answer.
The header only saves sending a body the server would refuse (a checkpoint's refused PUT,
permission or precondition, is an error either way; a region redirect re-sends the body). The
filesystem is fsspec's cached instance, so the user's own uploads through it go without the
header too.

Not covered: a body larger than the sockets' buffers (any PUT of a few MiB or more: a data file,
a multipart part of up to ``PART_BYTES``) sent to a server that stops reading it. aiohttp has no
write timeout, and a stopped server's kernel keeps acknowledging TCP's window probes, so that
upload may wait indefinitely (a dead host or a cut network ends it after TCP's retransmission
timeout, about 15 minutes on Linux).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import posixpath
import re
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, BinaryIO

from shardbridge.checkpoint.storage import _store
from shardbridge.checkpoint.storage._backend import Backend, Entry, Kind, Target
from shardbridge.checkpoint.storage._manifest import DCP_METADATA_NAME, GENERATION_PATTERN, MANIFEST_NAME, Manifest
from shardbridge.checkpoint.storage._store import ObjectStoreError, StoreConnectionError, StoreTimeoutError

__all__ = ["FAIL_FAST_S", "FsspecBackend", "LOCK_STALE_S", "PART_BYTES"]

logger = logging.getLogger("shardbridge.checkpoint")

PART_BYTES = 32 << 20
"""Multipart upload part size (S3's minimum is 5 MiB; see docs/benchmarks.md, object store)."""
LOCK_STALE_S = 24 * 3600.0
"""A lock of another host older than this is taken for a dead save's; a dead save's generation
that may be committed is deleted once older than this ([Note: object-store cleanup])."""
FAIL_FAST_S = 10.0
"""After a request got no answer (or the endpoint could not be reached), the next ones within this
long fail at once with its error ([Note: object-store client settings] in ``_store.py``)."""
_ERRNO = {PermissionError: errno.EACCES, FileNotFoundError: errno.ENOENT, FileExistsError: errno.EEXIST}
_BUILTIN_OS_ERRORS = (
    PermissionError,
    FileNotFoundError,
    FileExistsError,
    IsADirectoryError,
    NotADirectoryError,
    TimeoutError,
    ConnectionError,
    OSError,
)
_HOOK_LOCK = threading.Lock()
_LOCK = re.compile(r"^\.(?P<name>.+)\.lock-(?P<generation>g-[0-9a-f]{16})$")


class FsspecBackend(Backend):
    """An fsspec filesystem (``s3://``, ``gs://``, ``az://`` ...) as checkpoint storage.

    See [Note: object-store commit].
    """

    remote = True

    def __init__(self, fs: Any, scheme: str) -> None:
        self.fs = fs
        self.scheme = scheme
        self._sent: set[str] = set()  # generations whose manifest PUT was sent (abandon keeps them)
        self._down: tuple[float, ObjectStoreError] | None = None  # when a request last got no answer, and its error
        self._waits = _store.Waits(fs)
        if scheme in ("s3", "s3a"):
            self._connect()

    def uri(self, path: str) -> str:
        """``scheme://path``."""
        return f"{self.scheme}://{path}"

    # -- reads -----------------------------------------------------------------------------------

    def kind(self, path: str) -> Kind:
        """An object, a prefix with objects below it, or missing."""
        try:
            with self._naming(path):
                info = self.fs.info(path)
        except FileNotFoundError:
            return "missing"
        return "dir" if info.get("type") == "directory" else "file"

    def read_bytes(self, path: str) -> bytes:
        """One GET (s3fs's ``cat_file`` sends a HEAD first, for its size)."""
        if not self._s3:
            with self._naming(path):
                return self.fs.cat_file(path)
        from fsspec.asyn import sync

        body = self._get(path)
        try:
            with self._naming(path):
                return sync(self.fs.loop, body.read)
        finally:
            body.close()

    def read_into(self, path: str, offset: int, out: memoryview) -> int:
        """One ranged GET of ``len(out)`` bytes at ``offset``; 0 at or past the end, as a file reads."""
        if not len(out):
            return 0
        with self._naming(path):
            try:
                data = self.fs.cat_file(path, start=offset, end=offset + len(out))
            except OSError as exc:
                if exc.errno != errno.EINVAL or "not satisfiable" not in str(exc):  # S3's 416: past the end
                    raise
                return 0
        out[: len(data)] = data
        return len(data)

    @contextlib.contextmanager
    def stream(self, path: str, start: int, end: int) -> Iterator[Any]:
        """Bytes ``[start, end)`` as ONE GET read as it arrives (S3), else ranged GETs.

        See [Note: reading records in one pass] in ``_read.py``: a file's records cost one request,
        not one per record."""
        if end <= start or not self._s3:
            with super().stream(path, start, end) as ranged:
                yield ranged
            return
        body = self._get(path, Range=f"bytes={start}-{end - 1}")
        try:
            yield _S3Body(self, path, body)
        finally:
            body.close()

    @property
    def _s3(self) -> bool:
        """S3 through s3fs: GETs sent and read here (one request each, read as they arrive)."""
        return self.scheme in ("s3", "s3a") and hasattr(self.fs, "call_s3")

    def _get(self, path: str, **kwargs: Any) -> Any:
        """The body of one GET of ``path`` (S3)."""
        bucket, key, version = self.fs.split_path(path)
        if version:
            kwargs["VersionId"] = version
        with self._naming(path):
            return self.fs.call_s3("get_object", Bucket=bucket, Key=key, **kwargs)["Body"]

    def listing(self, path: str) -> dict[str, Entry]:
        """Every object below ``path`` (LIST, paginated)."""
        self.fs.invalidate_cache(path)
        try:
            with self._naming(path):
                found = self.fs.find(path, detail=True)
        except FileNotFoundError:
            return {}
        entries = {}
        for name, info in found.items():
            if info.get("type") == "directory" or name.rstrip("/") == path:
                continue
            entries[posixpath.relpath(name, path)] = Entry(int(info.get("size") or 0), True, _mtime(info))
        return entries

    def stat(self, path: str) -> Entry | None:
        """HEAD."""
        try:
            with self._naming(path):
                info = self.fs.info(path)
        except FileNotFoundError:
            return None
        if info.get("type") == "directory":
            return Entry(0, False)
        return Entry(int(info.get("size") or 0), True, _mtime(info))

    def children(self, path: str) -> list[str]:
        """The prefixes one level below ``path``."""
        self.fs.invalidate_cache(path)
        try:
            with self._naming(path):
                found = self.fs.ls(path, detail=True)
        except FileNotFoundError:
            return []
        return sorted(posixpath.basename(i["name"].rstrip("/")) for i in found if i.get("type") == "directory")

    # -- writes ------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def writing(self, path: str) -> Iterator[BinaryIO]:
        """An upload: parts of ``PART_BYTES`` (multipart on S3), the object appears whole at the end.

        On an error the upload is aborted: no object, and no parts left billed.
        """
        with self._naming(path):
            self._hook()
            f = self.fs.open(path, "wb", block_size=PART_BYTES)
        try:
            with self._naming(path):
                yield f
        except BaseException:
            discard = getattr(f, "discard", None)
            try:
                if discard is not None:
                    discard()
                else:
                    f.close()
                    self.fs.rm_file(path)
            except Exception:  # noqa: BLE001 (the write's own error is the one to raise)
                pass
            raise
        with self._naming(path):
            f.close()

    def write_bytes(self, path: str, data: bytes) -> None:
        """One PUT."""
        with self._naming(path):
            self._hook()
            self.fs.pipe_file(path, data)

    def remove(self, path: str) -> None:
        """DELETE (missing is fine)."""
        with contextlib.suppress(FileNotFoundError), self._naming(path):
            self.fs.rm_file(path)

    # -- the commit (rank 0) ----------------------------------------------------------------------

    def begin(self, final: str, *, overwrite: bool) -> Target:
        """Steps 0 of [Note: object-store commit]: leftovers settled, ``final`` checked, the lock written."""
        if "/" not in final.strip("/"):
            raise ValueError(
                f"checkpoint path {self.uri(final)!r} is a bucket, not a prefix in one; save below it, e.g. "
                f"{self.uri(final.strip('/'))}/step-00000001 (step_dir(root, step))"
            )
        manifest_path = self.join(final, MANIFEST_NAME)
        kept, listed, current, damaged = self._recover(final)
        info = None
        # a manifest there (the listing may be stale where the GET was not): its etag, then (below) its
        # generation, in that order as before: a commit between the two fails the IfMatch, never pairs
        # an older generation with a newer etag
        if MANIFEST_NAME in listed or current is not None or damaged:
            try:
                with self._naming(manifest_path):
                    info = self.fs.info(manifest_path)
            except FileNotFoundError:
                info = None
        shown = self.uri(final)
        if info is not None and not overwrite:
            raise ValueError(
                f"checkpoint {shown!r} already exists; pass overwrite=True to replace it, or save to a new path "
                "(e.g. step_dir(root, step))"
            )
        # (the listing is from before the leftovers were settled: they are not counted here either)
        others = sorted(n for n in listed if n != MANIFEST_NAME and not self.is_leftover(n))
        if info is None and others:
            what = "already holds objects" if not overwrite else f"is not a shardbridge checkpoint (no {MANIFEST_NAME})"
            raise ValueError(
                f"refusing to save to {shown!r}: it {what} ({', '.join(others[:3])}"
                f"{', ...' if len(others) > 3 else ''}); delete them or choose another path"
            )
        replaces = self._generation(final) if info is not None else None  # a damaged manifest raises here
        generation = f"g-{uuid.uuid4().hex[:16]}"
        self.write_bytes(self._lock(final, generation), f"{socket.gethostname()} {os.getpid()} {time.time():.0f}\n".encode())
        return Target(
            final=final,
            data=self.join(final, generation),
            ident=generation,
            overwrite=overwrite,
            expect=_etag(info) if info is not None else None,
            replaces=replaces,
            superseded=tuple(kept),
        )

    def commit(self, target: Target, manifest: Manifest) -> None:
        """Steps 2-4 of [Note: object-store commit]."""
        self._check_landed(target, manifest)
        data = dataclasses.replace(manifest, generation=target.ident).to_json().encode("ascii")
        self._put_manifest(target, data)
        self._sent.discard(target.ident)
        # Committed: what follows is cleanup, and its failure (the server stopped answering ...) must
        # not turn a durable save into an error. No dead save can be named any more: ours is.
        final, root = self.uri(target.final), self.uri(posixpath.dirname(target.final))
        steps = [
            (f"deleting the generation {g} it replaced", f"the next save of {final} deletes it",
             lambda g=g: self._drop(target.final, g, lock=g in target.superseded))  # a dead save's: its lock too
            for g in sorted({target.replaces, *target.superseded} - {None, target.ident})
        ]  # fmt: skip
        steps.append(("deleting its lock", f"the first save under {root} after this process ended deletes it",
                      lambda: self.remove(self._lock(target.final, target.ident))))  # fmt: skip
        for what, later, cleanup in steps:
            try:
                cleanup()
            except Exception as exc:  # noqa: BLE001
                logger.warning("shardbridge.checkpoint: %s is committed, but %s failed (%s); %s", final, what, exc, later)

    def abandon(self, target: Target) -> None:
        """Delete the failed save's generation and lock, unless its manifest PUT was sent. Never raises.

        A PUT sent but not answered may have committed it: kept, for the next save's recovery
        to judge ([Note: object-store commit]). Nothing of it can be named otherwise.
        """
        later = f"the next save under {self.uri(posixpath.dirname(target.final))} decides"
        if target.ident in self._sent:
            self._sent.discard(target.ident)
            logger.warning("shardbridge.checkpoint: keeping %s after a failed save: its manifest PUT got no answer, "
                           "so it may be committed; %s", self.uri(target.data), later)  # fmt: skip
            return
        try:  # after a request that got no answer, these fail at once (see _naming)
            self._drop(target.final, target.ident, lock=True)
        except Exception as exc:  # noqa: BLE001 (the save's own error is the one to raise)
            logger.warning("shardbridge.checkpoint: not cleaning up %s after a failed save (%s); %s",
                           self.uri(target.data), exc, later)  # fmt: skip

    # -- readers ----------------------------------------------------------------------------------

    def is_leftover(self, name: str) -> bool:
        """An object of some generation ([Note: object-store commit]): the committed one's or another save's."""
        return "/" in name and bool(GENERATION_PATTERN.match(name.split("/", 1)[0]))

    def candidates(self, root: str) -> list[str]:
        """Every prefix one level below ``root`` not starting with "." (its manifest is read by the caller)."""
        return [self.join(root, name) for name in self.children(root) if not name.startswith(".")]

    def identity(self, path: str) -> str | None:
        """The generation the manifest names now (a commit of an overwrite changes it)."""
        try:
            return self._generation(path)
        except Exception:  # noqa: BLE001 (unknown: the caller's own reads report the error)
            return None

    # -- helpers ----------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _naming(self, path: str) -> Iterator[None]:
        """Errors of the client name the object: an ``OSError`` with the object's URI as its filename.

        s3fs raises e.g. ``PermissionError('Forbidden')`` and lets botocore's connection errors
        through; a user needs to know which object of which checkpoint failed, and why
        ([Note: object-store errors] in ``_store.py``).
        """
        down = self._down
        if down is not None and time.monotonic() - down[0] < FAIL_FAST_S:  # never wait out the bound twice
            raise down[1].again(f"{self.uri(path)}: not sent, the store failed {time.monotonic() - down[0]:.1f} s ago: ")
        try:
            yield
        except (ObjectStoreError, ValueError, TypeError, AssertionError, MemoryError):
            raise
        except Exception as exc:  # noqa: BLE001 (botocore / aiohttp: the server cannot be reached ...)
            store = _store.store_error(exc, self.fs, self.uri(path), path.split("/", 1)[0])
            if isinstance(store, (StoreTimeoutError, StoreConnectionError)):
                self._down = (time.monotonic(), store)
            if store is not None:
                raise store from exc
            if not isinstance(exc, OSError):
                text = (str(exc).strip().splitlines() or [""])[0]
                raise OSError(errno.EIO, f"{type(exc).__name__}: {text}", self.uri(path)) from exc
            if exc.filename:
                raise
            text = (str(exc.strerror or exc).strip().splitlines() or [type(exc).__name__])[0]
            if type(exc).__module__ != "builtins":  # a client's own subclass (botocore's timeouts ...)
                text = f"{type(exc).__name__}: {text}"
            kind = next(k for k in _BUILTIN_OS_ERRORS if isinstance(exc, k))
            code = exc.errno if isinstance(exc.errno, int) else _ERRNO.get(kind, errno.EIO)
            raise kind(code, text, self.uri(path)) from exc

    def _connect(self) -> None:
        """Make the S3 client now (no request): a setting it cannot take is named here, not as damage."""
        try:
            self.fs.s3  # noqa: B018 (s3fs: creates the aiobotocore client)
        except Exception as exc:  # noqa: BLE001 (TypeError, botocore's configuration errors ...)
            raise _store.settings_error(exc) from None
        if getattr(self.fs, "retries", None) == _store.S3FS_OWN_RETRIES:
            self.fs.retries = 1  # botocore's attempts are the budget ([Note: object-store client settings] in _store.py)
        self._hook()

    def _hook(self) -> None:
        """This filesystem's S3 requests go without ``Expect: 100-continue`` ([Note: no 100-continue]) and are
        watched (``_store.Waits``): handlers on the filesystem's session (clients made later copy them) and client."""
        if self.scheme not in ("s3", "s3a"):
            return
        handlers = (
            ("before-call.s3", _drop_expect, "shardbridge-no-100-continue"),
            ("before-parameter-build.s3", self._waits.name, "shardbridge-wait-name"),
            ("before-call.s3", self._waits.begin, "shardbridge-wait"),
            ("after-call.s3", self._waits.end, "shardbridge-waited"),
            ("after-call-error.s3", self._waits.end, "shardbridge-wait-failed"),
        )
        with _HOOK_LOCK:  # botocore marks a unique_id registered before it clears its lookup cache
            try:
                client = self.fs.s3  # s3fs: the aiobotocore client (connects it if needed; no request)
            except Exception:  # noqa: BLE001 (an asynchronous fs not set up yet: its session below, or later)
                client = None
            events, session = getattr(getattr(client, "meta", None), "events", None), getattr(self.fs, "session", None)
            for event, handler, unique_id in handlers:
                if events is not None:
                    events.register_last(event, handler, unique_id=unique_id)
                if callable(getattr(session, "register", None)):  # clients made later copy its handlers
                    session.register(event, handler, unique_id=unique_id)
            if events is None and session is None:
                logger.debug("shardbridge.checkpoint: %s has no botocore client to take Expect off", type(self.fs))

    def _lock(self, final: str, generation: str) -> str:
        root, name = posixpath.split(final)
        return self.join(root, f".{name}.lock-{generation}")

    def _generation(self, final: str) -> str | None:
        """The generation the manifest of ``final`` names; None without a manifest (ValueError if damaged)."""
        path = self.join(final, MANIFEST_NAME)
        try:
            text = self.read_bytes(path).decode("utf-8", errors="replace")
        except FileNotFoundError:
            return None
        return Manifest.from_json(text, self.uri(path)).generation

    def _check_landed(self, target: Target, manifest: Manifest) -> None:
        """Every recorded object of the generation is there with its size; nothing else is."""
        found = self.listing(target.data)
        for name, record in sorted(manifest.files.items()):
            entry = found.pop(name, None)
            problem = (
                "is missing (its upload did not complete)"
                if entry is None
                else f"has {entry.size} bytes, {record['size']} recorded"
                if entry.size != record["size"]
                else None
            )
            if problem is not None:
                raise OSError(
                    errno.EIO,
                    f"{self.uri(self.join(target.data, name))} {problem}; nothing was committed and the previous "
                    "checkpoint is intact",
                )
        if found:
            name = sorted(found)[0]
            raise ValueError(
                f"{self.uri(self.join(target.data, name))} was not written by this save (another writer under "
                f"{self.uri(target.final)!r}?); nothing was committed and the previous checkpoint is intact"
            )

    def _put_manifest(self, target: Target, data: bytes) -> None:
        """Step 3: the manifest, unless another save committed ``final`` since this one began."""
        path = self.join(target.final, MANIFEST_NAME)
        raced = FileExistsError(
            errno.EEXIST,
            f"checkpoint {self.uri(target.final)!r} was committed by another process while this save was running; "
            "not replacing it (two jobs are saving to the same path: give each its own root)",
        )
        if self.scheme in ("s3", "s3a") and hasattr(self.fs, "call_s3"):
            bucket, key, _ = self.fs.split_path(path)
            condition = {"IfNoneMatch": "*"} if target.expect is None else {"IfMatch": target.expect}
            try:
                with self._naming(path):
                    self._sent.add(target.ident)  # sent from here on: an answer lost may have committed it
                    self._hook()
                    self.fs.call_s3("put_object", Bucket=bucket, Key=key, Body=data, **condition)
            except OSError as exc:
                text = str(exc).lower()
                if isinstance(exc, FileExistsError) or "pre-condition" in text or "precondition" in text:
                    self._sent.discard(target.ident)  # refused: not committed
                    raise raced from None  # s3fs: 412 PreconditionFailed -> FileExistsError
                raise
            finally:
                self.fs.invalidate_cache(target.final)
            return
        if self._generation(target.final) != target.replaces:
            raise raced
        self._sent.add(target.ident)
        self.write_bytes(path, data)

    def _delete_generation(self, final: str, generation: str) -> None:
        path = self.join(final, generation)
        self.fs.invalidate_cache(path)
        with contextlib.suppress(FileNotFoundError), self._naming(path):
            self.fs.rm(path, recursive=True)

    def _drop(self, final: str, generation: str, *, lock: bool) -> None:
        self._delete_generation(final, generation)
        if lock:
            self.remove(self._lock(final, generation))

    def _recover(self, final: str) -> tuple[list[str], dict[str, Entry], str | None, bool]:
        """Settle what dead saves left under ``final``'s root and ``final`` ([Note: object-store
        cleanup]): the generations of ``final`` kept because they may be committed, its listing (before
        the settling), the generation its manifest names (None: none, or damaged) and whether it is
        damaged (logged; nothing of ``final`` is cleaned up then).

        The three reads it starts from (the root's listing, ``final``'s manifest and listing) are
        independent, so they are sent at once: on an object store each costs a request's latency
        (20-60 ms), and a save waits for them before any rank writes."""
        root, name = posixpath.split(final)
        self.fs.invalidate_cache(root)

        def ls_root() -> list[dict[str, Any]]:
            try:
                with self._naming(root):
                    return self.fs.ls(root, detail=True)
            except FileNotFoundError:
                return []

        with ThreadPoolExecutor(3, thread_name_prefix="shardbridge-begin") as pool:
            reads = pool.submit(ls_root), pool.submit(self._generation, final), pool.submit(self.listing, final)
        found, listed = reads[0].result(), reads[2].result()
        try:
            current = reads[1].result()
        except ValueError as exc:  # a damaged manifest: which generation is live is unknown
            logger.warning("shardbridge.checkpoint: not cleaning up %s: %s", self.uri(final), exc)
            current, damaged = None, True
        else:
            damaged = False
        dead: dict[str, set[str]] = {name: set()}
        live: dict[str, set[str]] = {}
        for info in found:
            lock = _LOCK.match(posixpath.basename(info["name"])) if info.get("type") != "directory" else None
            if lock is not None:
                alive = self._alive(self.join(root, lock["name"]), lock["generation"], _mtime(info))
                (live if alive else dead).setdefault(lock["name"], set()).add(lock["generation"])
        for other, gens in sorted(dead.items()):  # another checkpoint: its dead saves' generations only
            if other != name:
                self._settle(self.join(root, other), gens, set(), listed_too=False)
        if damaged:
            return [], listed, None, True
        kept = self._settle(final, dead[name], live.get(name, set()), listed_too=True, known=(current, listed))
        return kept, listed, current, False

    def _settle(
        self, final: str, locked: set[str], live: set[str], *, listed_too: bool,
        known: tuple[str | None, dict[str, Entry]] | None = None,
    ) -> list[str]:  # fmt: skip
        """Delete the generations of ``final`` no commit can name: those of ``locked`` (dead saves: their
        locks go with them) and, ``listed_too``, every other one listed but ``live`` saves'. The kept ones
        are returned. ``known``: ``final``'s generation and listing, already read."""
        if known is not None:
            current, listed = known
        else:
            try:
                current = self._generation(final)
            except ValueError as exc:  # a damaged manifest: which generation is live is unknown
                logger.warning("shardbridge.checkpoint: not cleaning up %s: %s", self.uri(final), exc)
                return []
            listed = self.listing(final)
        named = listed.get(f"{current}/{DCP_METADATA_NAME}") if current else None
        kept = []
        listed_gens = {n.split("/", 1)[0] for n in listed if self.is_leftover(n)} if listed_too else set()
        for generation in sorted((listed_gens | locked) - live):
            if generation != current:
                sealed = self._sealed(final, generation, listed)
                if sealed is not None and not (named is not None and named.mtime > sealed.mtime) and not (
                    sealed.mtime and time.time() - sealed.mtime > LOCK_STALE_S
                ):
                    kept.append(generation)  # may be committed: one read of the manifest may be stale
                    continue
                if any(n.startswith(generation + "/") for n in listed):
                    logger.warning("shardbridge.checkpoint: deleting %s, left by an interrupted save",
                                   self.uri(self.join(final, generation)))  # fmt: skip
                self._delete_generation(final, generation)
            if generation in locked:
                self.remove(self._lock(final, generation))
        if kept:
            logger.warning(
                "shardbridge.checkpoint: keeping %s: left by a save that ended after writing it, so it may be "
                "committed (a manifest read can be stale); the next commit of %s deletes it, or a save after %.0f h",
                ", ".join(self.uri(self.join(final, g)) for g in kept), self.uri(final), LOCK_STALE_S / 3600,
            )  # fmt: skip
        return kept

    def _sealed(self, final: str, generation: str, listed: dict[str, Entry]) -> Entry | None:
        """The generation's ``.metadata`` (written once every rank's files landed: the save reached its
        commit), from the listing or, if the listing lacks it (a stale one), a HEAD; None if it has none."""
        name = f"{generation}/{DCP_METADATA_NAME}"
        return listed.get(name) or self.stat(self.join(final, name))

    def _alive(self, final: str, generation: str, mtime: float) -> bool:
        """Whether the save that wrote this lock may still be running."""
        try:
            host, pid, _ = self.read_bytes(self._lock(final, generation)).decode().split()
        except FileNotFoundError:
            return False
        except (OSError, ValueError):
            return True
        if host != socket.gethostname():
            return time.time() - mtime < LOCK_STALE_S
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return False
        except (OSError, ValueError):
            return True
        return True


class _S3Body:
    """The body of one GET, read on the filesystem's event loop: ``readinto`` fills ``out`` whole (short at the end)."""

    def __init__(self, backend: FsspecBackend, path: str, body: Any) -> None:
        self._backend, self._path, self._body = backend, path, body

    def readinto(self, out: Any) -> int:
        from fsspec.asyn import sync

        with self._backend._naming(self._path):
            return sync(self._backend.fs.loop, _fill, self._body, memoryview(out).cast("B"))


async def _fill(body: Any, view: memoryview) -> int:
    done = 0
    while done < len(view):
        n = await body.readinto(view[done:])
        if not n:
            break
        done += n
    return done


def _drop_expect(params: dict[str, Any], **_: Any) -> None:
    """botocore ``before-call`` handler: the request goes without ``Expect: 100-continue``."""
    headers = params.get("headers")
    if headers is not None:
        headers.pop("Expect", None)


def _mtime(info: dict[str, Any]) -> float:
    value = info.get("LastModified", info.get("mtime", info.get("last_modified", 0)))
    if hasattr(value, "timestamp"):
        return float(value.timestamp())
    try:
        return float(value)
    except (TypeError, ValueError):
        return 0.0


def _etag(info: dict[str, Any]) -> str | None:
    value = info.get("ETag", info.get("etag"))
    return None if value is None else str(value)
