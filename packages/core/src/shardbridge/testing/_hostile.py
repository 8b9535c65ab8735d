"""Hostile checkpoints for the tests of [Note: untrusted checkpoints] (core and adapters).

Not public. Each payload unpickles as ``os.mkdir(marker)`` when anything unpickles it without
restriction, so a test proves that nothing ran by checking that ``marker`` does not exist.
"""

from __future__ import annotations

import io
import json
import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

__all__ = ["Payload", "forge_derived", "overlap_chunks", "plant_item", "reseal", "torch_save"]


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


def forge_derived(path: str | os.PathLike[str], edit: Callable[[dict[str, Any]], None]) -> None:
    """Edit checkpoint ``path``'s ``layout.derived`` as an attacker with shardbridge installed would.

    ``edit`` changes the record in place; its ``digest`` is then computed again as a save computes it
    (over the spreads the edited record rebuilds, where they rebuild) and the manifest resealed, so
    that only what the record says differs ([Note: derived loads] in ``checkpoint/derived/_records.py``).
    """
    from shardbridge.checkpoint.derived._recipes import decode_grid, decode_properties, rebuild
    from shardbridge.checkpoint.derived._spread import spreads_digest
    from shardbridge.checkpoint.storage import _manifest

    manifest = Path(path) / _manifest.MANIFEST_NAME
    data = json.loads(manifest.read_text())
    record = data["layout"][_manifest.DERIVED_KEY]
    edit(record)
    try:
        grids = [decode_grid(g, data["world_size"]) for g in record["grids"]]
        spreads = [(fqn, rebuild(record["recipes"][r], grids[g], keep_empty=keep, properties=decode_properties(props)))
                   for fqn, g, r, keep, props, _ in record["entries"]]  # fmt: skip
        record["digest"] = spreads_digest(spreads)
        if "records" in record:  # layout.derived version 1 also held a digest of the derived records
            _redigest_records(record, spreads)
    except Exception:  # noqa: BLE001 (a record no rule rebuilds keeps its digest: a load refuses it anyway)
        pass
    manifest.write_text(json.dumps(data))
    reseal(path, keep_derived=True)


def _redigest_records(record: dict[str, Any], spreads: list[Any]) -> None:
    """Version 1's records digest (shardbridge before layout.derived version 2), as its save computed it."""
    from shardbridge.checkpoint.derived import _records
    from shardbridge.checkpoint.derived._spread import spread_table, writers

    entries = []
    for ordinal, ((fqn, spread), row) in enumerate(zip(spreads, record["entries"])):
        table = spread_table(spread)
        size = None if row[5] is None else torch.Size(row[5])
        entries.append(_records.Entry(fqn, spread, table, writers(table, ordinal, bytes_item=spread.properties is None),
                                      spread.properties, size))  # fmt: skip
    derivation = _records.derive(entries, only=None, bytes_lengths=record["bytes"], threads=record["threads"],
                                 min_file_bytes=record["min_file_bytes"])  # fmt: skip
    record["records"] = _records.records_digest(entries, derivation)  # type: ignore[attr-defined]


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
