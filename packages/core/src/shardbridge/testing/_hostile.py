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

__all__ = ["Payload", "overlap_chunks", "plant_item", "reseal", "torch_save"]


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


def reseal(path: str | os.PathLike[str], *, keep_derived: bool = False) -> None:
    """Record the current sizes and checksums of every file in the manifest, as an attacker would.

    The manifest's checksums detect damage, not hostility (anyone can recompute them), so a
    crafted checkpoint passes the integrity checks and reaches the readers. ``keep_derived``:
    keep ``layout.derived`` (by default it is dropped, as an attacker who crafted ``.metadata``
    would, so that a load reads ``.metadata`` instead of deriving its records: [Note: derived loads]).
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
    if not keep_derived:
        data.get("layout", {}).pop(_manifest.DERIVED_KEY, None)
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


def overlap_chunks(path: str | os.PathLike[str], key: str) -> None:
    """Split tensor ``key`` (one chunk, n rows) of checkpoint ``path`` into rows [0, n//2+1) and [n//2, n-1).

    Each new chunk gets its own record holding the tensor's true rows. The volumes add up to the
    tensor's (DCP's own save-time rule), but row n//2 is held twice and row n-1 by no chunk: the
    case [Note: exact chunk coverage] refuses. Works on any DCP directory (resealed if it has a
    shardbridge manifest).
    """
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    path = Path(path)
    md = pickle.loads((path / ".metadata").read_bytes())  # the test's own, trusted file
    entry = md.state_dict_metadata[key]
    (index,) = [i for i in md.storage_data if i.fqn == key]
    info = md.storage_data.pop(index)
    file = path / info.relative_path
    with open(file, "rb") as f:
        f.seek(info.offset)
        full = torch.load(io.BytesIO(f.read(info.length)), weights_only=True)
    n, rest = entry.size[0], tuple(entry.size[1:])
    entry.chunks = []
    for i, (lo, hi) in enumerate(((0, n // 2 + 1), (n // 2, n - 1))):
        offsets = torch.Size((lo,) + (0,) * len(rest))
        entry.chunks.append(ChunkStorageMetadata(offsets=offsets, sizes=torch.Size((hi - lo, *rest))))
        data = torch_save(full[lo:hi].clone())
        offset = file.stat().st_size
        with open(file, "ab") as f:
            f.write(data)
        md.storage_data[MetadataIndex(key, offsets, i)] = type(info)(info.relative_path, offset, len(data))
    (path / ".metadata").write_bytes(pickle.dumps(md))
    from shardbridge.checkpoint.storage import _manifest

    if (path / _manifest.MANIFEST_NAME).is_file():
        reseal(path)
