"""Paths and URIs: which backend a checkpoint path names, and how results name it back.

Every public verb takes a checkpoint location as a path (``str`` or ``os.PathLike``) or a URI:

    /ckpt/step-00000100, Path(...)        local disk (the local backend)
    file:///ckpt/step-00000100            the same, as a URI (local backend; results stay URIs)
    s3://bucket/ckpt/step-00000100        an object store through fsspec (the ``s3``
    gs://..., az://..., abfs://...        extra: s3fs; or gcsfs / adlfs)

A result names what it found in the form it was given: a ``Path`` for a plain path, a ``str``
URI for a URI. The object store is configured as any fsspec client is (credentials and endpoint
from the environment, e.g. ``AWS_ENDPOINT_URL``, or ``fsspec.config.conf["s3"]`` / ``FSSPEC_S3_*``:
timeouts, retries); shardbridge adds one setting of its own, ``use_listings_cache=False``
(another process's commit must be seen at once).
"""

from __future__ import annotations

import os
import re
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardbridge._extras import install_hint
from shardbridge.checkpoint.storage._backend import Backend, Stored
from shardbridge.checkpoint.storage._local import LOCAL
from shardbridge.checkpoint.storage._manifest import Manifest, read_manifest

__all__ = ["Location", "is_uri", "locate", "open_checkpoint"]

_URI = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*)://(?P<rest>.*)$")
_INSTALL = {
    "s3": install_hint("s3"),
    "s3a": install_hint("s3"),
    "gs": "pip install gcsfs",
    "gcs": "pip install gcsfs",
    "az": "pip install adlfs",
    "abfs": "pip install adlfs",
    "abfss": "pip install adlfs",
}
"""The fsspec implementation each object-store scheme needs."""
_BACKENDS: dict[Any, Backend] = {}
"""One backend per fsspec filesystem (equal when fsspec would hand out the same instance: its token)."""


def is_uri(value: Any) -> bool:
    """Whether ``value`` is a string of the form ``scheme://...``.

    Example:
        >>> is_uri("s3://bucket/ckpt"), is_uri("/ckpt"), is_uri("file:///ckpt")
        (True, False, True)
    """
    return isinstance(value, str) and _URI.match(value) is not None


@dataclass(frozen=True)
class Location:
    """A checkpoint path resolved: its backend, the backend's path, and the user's form of it."""

    backend: Backend
    path: str
    """The backend's path: a local path, or ``bucket/key`` on an object store."""
    scheme: str | None
    """``None`` for a plain path, else the URI scheme ("file", "s3", ...)."""

    @property
    def user(self) -> Path | str:
        """How results name this location: a ``Path`` for a plain path, else the URI."""
        return self.named(self.path)

    def named(self, path: str) -> Path | str:
        """The user's form of another backend ``path`` (a plain path, or a URI of this scheme)."""
        if self.scheme is None:
            return Path(path)
        if self.scheme == "file":
            return "file://" + urllib.parse.quote(path)
        return self.backend.uri(path)

    def child(self, *names: str) -> Location:
        """The location ``self/name/...``."""
        return Location(self.backend, self.backend.join(self.path, *names), self.scheme)

    def at(self, path: str) -> Location:
        """The location of another backend ``path`` (same backend and form)."""
        return Location(self.backend, path, self.scheme)

    def __str__(self) -> str:
        return str(self.user)


def locate(value: str | os.PathLike[str] | Location, *, what: str = "path") -> Location:
    """Resolve a path or URI (see the module docstring).

    Raises:
        ValueError: not a str, os.PathLike or URI; an unknown URI scheme.
        ImportError: the scheme's fsspec implementation is not installed (the install hint).
    """
    if isinstance(value, Location):
        return value
    if isinstance(value, os.PathLike) and not isinstance(value, str):
        value = os.fspath(value)
    if not isinstance(value, str):
        raise ValueError(
            f"{what}={value!r} must be a path (str or os.PathLike) or a URI such as 's3://bucket/ckpt'"
        )
    match = _URI.match(value)
    if match is None:
        return Location(LOCAL, value, None)
    scheme = match["scheme"].lower()
    if scheme == "file":
        path = urllib.parse.unquote(urllib.parse.urlparse(value).path)
        return Location(LOCAL, path, "file")
    return Location(*_fsspec(value, scheme), scheme)


def _fsspec(uri: str, scheme: str) -> tuple[Backend, str]:
    import fsspec

    from shardbridge.checkpoint.storage._fsspec import FsspecBackend

    hint = _INSTALL.get(scheme, "install the fsspec implementation for it")
    try:
        fs, path = fsspec.core.url_to_fs(uri, use_listings_cache=False)
    except ImportError as exc:
        raise ImportError(f"checkpoint path {uri!r} needs fsspec's {scheme!r} filesystem: {hint} ({exc})") from None
    except ValueError as exc:
        raise ValueError(
            f"checkpoint path {uri!r}: fsspec knows no filesystem for {scheme!r}:// ({exc}); use a local path, "
            "file://, s3://, gs:// or az://"
        ) from None
    backend = _BACKENDS.get(fs)
    if backend is None or getattr(backend, "fs", None) is not fs:
        backend = _BACKENDS[fs] = FsspecBackend(fs, scheme)
    return backend, path.rstrip("/")


def open_checkpoint(where: Location, *, need_metadata: bool = True) -> tuple[Stored, Manifest]:
    """The checkpoint at ``where`` and its validated manifest (ValueError naming what is wrong)."""
    manifest = read_manifest(where.backend, where.path, need_metadata=need_metadata)
    return Stored(where.backend, where.path, where.backend.data_path(where.path, manifest.generation)), manifest
