"""Hostile checkpoints for the tests of [Note: untrusted checkpoints] (core and adapters).

Not public. Each payload unpickles as ``os.mkdir(marker)`` when anything unpickles it without
restriction, so a test proves that nothing ran by checking that ``marker`` does not exist.
"""

from __future__ import annotations

import io
import json
import os
import pickle
from pathlib import Path

import torch

__all__ = ["Payload", "plant_item", "reseal", "torch_save"]


class Payload:
    """Unpickles as ``os.mkdir(marker)``: the proof that code from a checkpoint ran."""

    def __init__(self, marker: str | os.PathLike[str]) -> None:
        self.marker = str(marker)

    def __reduce__(self):  # noqa: ANN204
        return (os.mkdir, (self.marker,))


def torch_save(obj: object) -> bytes:
    """``torch.save`` of ``obj`` as bytes (how DCP stores a bytes item or a tensor record)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def reseal(path: str | os.PathLike[str]) -> None:
    """Record the current sizes and checksums of every file in the manifest, as an attacker would.

    The manifest's checksums detect damage, not hostility (anyone can recompute them), so a
    crafted checkpoint passes the integrity checks and reaches the readers.
    """
    from shardbridge.checkpoint.storage import _manifest

    path = Path(path)
    manifest = path / _manifest.MANIFEST_NAME
    data = json.loads(manifest.read_text())
    if "files" not in data:
        return
    from shardbridge.checkpoint.storage._integrity import file_checksum

    for name in data["files"]:
        size, digest = file_checksum(path / name)
        data["files"][name] = {"size": size, _manifest.CHECKSUM_KEY: digest}
    data[_manifest.SELF_CHECKSUM_KEY] = _manifest._self_checksum(data)
    manifest.write_text(json.dumps(data, indent=2, sort_keys=True))


def plant_item(path: str | os.PathLike[str], key: str, data: bytes) -> None:
    """Point the DCP item ``key`` of checkpoint ``path`` at ``data`` (appended to its data file)."""
    path = Path(path)
    md = pickle.loads((path / ".metadata").read_bytes())  # the test's own, trusted file
    (index,) = [i for i in md.storage_data if i.fqn == key]
    info = md.storage_data[index]
    file = path / info.relative_path
    offset = file.stat().st_size
    with open(file, "ab") as f:
        f.write(data)
    md.storage_data[index] = type(info)(info.relative_path, offset, len(data))
    (path / ".metadata").write_bytes(pickle.dumps(md))
    reseal(path)
