"""Streaming export of a checkpoint's model tensors to Hugging Face safetensors shards.

[Note: streaming export]
~~~~~~~~~~~~~~~~~~~~~~~~
Memory stays near ONE tensor, whatever the model size:

- The shard plan comes from DCP metadata alone (names, shapes, dtypes): greedy in name
  order, a new shard when the next tensor would pass ``max_shard_size`` (a tensor larger
  than that gets a shard of its own, as ``transformers`` does).
- Each shard file is written incrementally: the safetensors header (JSON with every
  tensor's dtype, shape and byte range, known from the plan) first, then each tensor's
  bytes as soon as it is read. safetensors' own ``save_file`` needs the whole shard in
  memory; the format (8-byte little-endian header length, JSON header padded with spaces
  to 8 bytes, raw little-endian data) does not.
- Each tensor is read alone into a zeroed full tensor, each stored box straight from its
  file into its place (see [Note: reading records in one pass] in ``_read.py``; DCP's own
  reader, which ``torch.load``s every box whole before copying it, is the fallback), then
  cast and written 8 MB at a time. The peak is the full tensor plus a few MB, whatever the
  shard size or the number of ranks that saved (``tools/bench/bench_export.py``).
- A tied tensor (see [Note: tied tensors] in ``_state.py``) is written once, under the name
  it is stored under (the first in ``named_parameters`` order: ``model.embed_tokens.weight``,
  not ``lm_head.weight``), as transformers' ``save_pretrained`` and safetensors' ``save_model``
  write a tied model; ``from_pretrained`` of a config with ``tie_word_embeddings`` ties
  ``lm_head.weight`` to it again (transformers 5.24: no missing key, the same logits). The
  alias is written instead, read from the stored entry, only where the name map drops the
  stored name and names the alias.

Files are written under temporary names and renamed when complete; the index last.

[Note: export checks]
~~~~~~~~~~~~~~~~~~~~~
Before anything is read or written:

- the output folder must be new or empty; ``overwrite=True`` allows a non-empty one and
  replaces only what an export writes (``model-NNNNN-of-NNNNN.safetensors`` and the index;
  stale shards of a previous export are removed after the new index is in place, the old
  index before the first new shard), never other files. ``model.safetensors`` is refused
  even then: ``from_pretrained`` prefers it to the index, and it is not an export's file.
- the checkpoint is verified as ``load`` verifies it ([Note: checkpoint integrity] in
  ``_integrity.py``): no symbolic links or special files, every recorded file present with
  its size, nothing extra, and (``verify=True``, the default) every xxh3_128 checksum, in
  this one process. Cost: docs/checkpoints.md, Export.
"""

from __future__ import annotations

import io
import json
import math
import os
import re
import struct
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Union

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.checkpoint.storage import StorageReader

from shardbridge.checkpoint._inspect import natural_key
from shardbridge.checkpoint.derived import metadata_of
from shardbridge.checkpoint.state._state import MODEL_KEY
from shardbridge.checkpoint.storage._backend import Stored
from shardbridge.checkpoint.storage._destination import check_destination, write_file
from shardbridge.checkpoint.storage._integrity import check_files, damage_message, log_unverified
from shardbridge.checkpoint.storage._location import Location, locate, open_checkpoint
from shardbridge.checkpoint.storage._manifest import FILES_SINCE_VERSION, Manifest
from shardbridge.checkpoint.storage._read import EXPORT_IN_PLACE_MIN_BYTES, read_box_into
from shardbridge.checkpoint.storage._reader import TrustedReader
from shardbridge.checkpoint.storage._trust import check_no_links

__all__ = ["NameMap", "export_safetensors", "parse_size", "read_tensor", "write_beside"]

NameMap = Union[Mapping[str, str | None], Callable[[str], str | None]]
"""Checkpoint FQN -> output name; None drops the tensor. A mapping keeps unlisted names."""

INDEX_NAME = "model.safetensors.index.json"
_OWN_FILE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors(\.tmp)?|" + re.escape(INDEX_NAME) + r"(\.tmp)?")
"""Names an export writes (and their temporaries): all that ``overwrite=True`` removes."""
_SINGLE_FILE = "model.safetensors"
_WRITE_BYTES = 8 << 20
"""Bytes of a tensor cast and written at a time."""

_ST_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
}
_UNITS = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_size(size: int | str) -> int:
    """Bytes of ``size``: an int, or "2GB" (10**9) / "2GiB" (2**30) / "500MB" / "64KiB".

    Example:
        >>> parse_size("2GB"), parse_size("1.5KiB"), parse_size(100)
        (2000000000, 1536, 100)
    """
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)?\s*", str(size).upper())
        if match is None or (match.group(2) or "B") not in _UNITS:
            raise ValueError(
                f"max_shard_size={size!r} is not a size; use an int of bytes or e.g. '2GB', '500MB', '1GiB'"
            )
        value = int(float(match.group(1)) * _UNITS[match.group(2) or "B"])
    if value <= 0:
        raise ValueError(f"max_shard_size={size!r} must be > 0 bytes")
    return value


class _OneTensorPlanner(LoadPlanner):
    """Routes every read of one key into ``target`` (a full, empty tensor)."""

    def __init__(self, target: torch.Tensor) -> None:
        self.target = target

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:  # noqa: ANN001
        raise AssertionError("not used: the plan is built by read_tensor")

    def create_local_plan(self) -> LoadPlan:
        raise AssertionError("not used")

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        raise AssertionError(f"{read_item.dest_index.fqn} is not a tensor")

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        out = self.target
        for dim, (offset, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            out = out.narrow(dim, offset, length)
        return out

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass


def read_tensor(reader: StorageReader, metadata: Metadata, key: str, arena: torch.Tensor | None = None) -> torch.Tensor:
    """The full tensor ``key`` of a DCP checkpoint, read alone (no process group).

    ``reader`` must have been set up with ``reader.set_up_storage_reader(metadata, True)``.
    Each stored box is read straight into the result (see [Note: reading records in one pass]
    in ``_read.py``); if one cannot be, the whole tensor is read by DCP's reader instead.
    ``arena``: a uint8 buffer at least as large as the tensor, which the result then views
    (one allocation reused for every tensor of an export); None allocates.
    """
    md = metadata.state_dict_metadata[key]
    assert isinstance(md, TensorStorageMetadata), key
    dtype = md.properties.dtype
    # zeros, not empty: a hostile .metadata with overlapping chunks must not leak process memory.
    if arena is None:
        target = torch.zeros(md.size, dtype=dtype)
    else:
        nbytes = md.size.numel() * dtype.itemsize
        target = arena[:nbytes].view(dtype).view(md.size).zero_()
    for chunk in md.chunks:
        view = target
        for dim, (offset, size) in enumerate(zip(chunk.offsets, chunk.sizes)):
            view = view.narrow(dim, offset, size)
        if not _read_box(reader, key, chunk, view):
            # DCP's reader for this box: it torch.loads the record whole, then copies it in.
            plan = LoadPlan(create_read_items_for_chunk_list(key, md, [chunk]))
            reader.read_data(plan, _OneTensorPlanner(view)).wait()
    return target


def _read_box(reader: StorageReader, key: str, chunk: ChunkStorageMetadata, view: torch.Tensor) -> bool:
    info = reader.storage_data.get(MetadataIndex(key, chunk.offsets))  # type: ignore[attr-defined]
    if info is None or info.length < EXPORT_IN_PLACE_MIN_BYTES or getattr(info, "transform_descriptors", None):
        return False
    stored = getattr(reader, "stored", None)  # a TrustedReader; DCP's own FileSystemReader reads local files
    source = (stored.backend, stored.file(info.relative_path)) if stored else os.path.join(reader.path, info.relative_path)  # type: ignore[attr-defined]
    return read_box_into(source, info.offset, info.length, view)


def _resolve_name(name_map: NameMap | None, fqn: str) -> str | None:
    if name_map is None:
        return fqn
    if isinstance(name_map, Mapping):
        return name_map.get(fqn, fqn)
    return name_map(fqn)


def _out_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    if dtype is None:
        return None
    value = dtype if isinstance(dtype, torch.dtype) else getattr(torch, str(dtype), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"dtype={dtype!r} is not a torch dtype; use e.g. torch.bfloat16 or 'bfloat16'")
    if not value.is_floating_point or value not in _ST_DTYPES:
        # Only floating tensors are cast: an integer dtype would silently change nothing (or
        # everything, were it applied).
        valid = ", ".join(sorted(str(d).removeprefix("torch.") for d in _ST_DTYPES if d.is_floating_point))
        raise ValueError(f"dtype={dtype!r} is not a floating dtype safetensors stores; use one of {valid}")
    return value


def _header(entries: list[tuple[str, torch.dtype, tuple[int, ...], int]]) -> bytes:
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, dtype, shape, nbytes in entries:
        header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=True).encode("ascii")
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def export_safetensors(
    checkpoint_path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    max_shard_size: int | str = "2GB",
    name_map: NameMap | None = None,
    dtype: torch.dtype | str | None = None,
    progress: bool = True,
    verify: bool = True,
    overwrite: bool = False,
) -> Path | str:
    """Write a checkpoint's model tensors as Hugging Face safetensors shards + index.

    Streams: about one tensor in memory at a time (see [Note: streaming export]). Fused
    parameters are already stored as their components. Writes
    ``model-0000x-of-0000y.safetensors`` (always sharded names, also for one shard) and
    ``model.safetensors.index.json`` (``{"metadata": {"total_size": bytes}, "weight_map":
    {name: file}}``). Run in one process; no process group is used.

    Args:
        checkpoint_path: a checkpoint directory written by :func:`save`, or its URI.
        out_dir: output directory: new or empty (created), see ``overwrite``; a URI writes to an
            object store (each shard appears whole when its upload completes; the index last).
        max_shard_size: bytes per shard file, or "2GB" / "500MB" / "1GiB".
        name_map: checkpoint FQN -> output name (e.g. add ``model.`` for transformers);
            a mapping keeps unlisted names, a function or mapping returning None drops one.
        dtype: cast floating-point tensors to this dtype (e.g. torch.bfloat16); None keeps.
        progress: show a tqdm bar (only when stderr is a terminal).
        verify: before anything is read, compare every file's xxh3_128 checksum with the
            manifest, as :func:`load` does (reads every byte once more). False checks
            links, existence, sizes and extra files only (always done).
        overwrite: allow a non-empty ``out_dir``: replace the files an export writes there
            (``model-*-of-*.safetensors`` and the index), keep every other file. False
            (default) refuses a non-empty folder before anything is read or written.

    Returns:
        The path of the index file (its URI for a URI ``out_dir``).

    Raises:
        ValueError: not a shardbridge checkpoint, a damaged one (a file missing, truncated,
            corrupted, foreign, extra or a link; the first is named), an empty ``out_dir``
            string, a non-empty ``out_dir`` without ``overwrite``, two tensors mapped to one
            name, a dtype safetensors cannot store, or a bad ``max_shard_size``.

    Example:
        >>> export_safetensors("/ckpt/step-00000100", "/hf/model", dtype="bfloat16",
        ...                    name_map=lambda fqn: "model." + fqn)  # doctest: +SKIP
    """
    from tqdm.auto import tqdm

    for name, value in (("verify", verify), ("overwrite", overwrite)):
        if not isinstance(value, bool):
            raise ValueError(f"{name}={value!r} must be True or False")
    target = _check_out_dir(out_dir, overwrite=overwrite)
    where = locate(checkpoint_path, what="checkpoint_path")
    limit = parse_size(max_shard_size)
    cast = _out_dtype(dtype)
    check_no_links(Stored(where.backend, where.path, where.path))  # never read through a link: [Note: export checks]
    stored, manifest = open_checkpoint(where)
    _verify(stored, manifest, checksums=verify)
    # no code runs ([Note: untrusted checkpoints] in _trust.py); records derived where they render .metadata
    reader = TrustedReader(stored, metadata_of(stored, manifest))
    metadata = reader.read_metadata()
    reader.set_up_storage_reader(metadata, True)

    prefix = f"{MODEL_KEY}."
    entries = []  # (dcp key, out name, out dtype, shape, nbytes)
    taken: dict[str, str] = {}
    keys = [
        k
        for k, md in metadata.state_dict_metadata.items()
        if k.startswith(prefix) and isinstance(md, TensorStorageMetadata)
    ]
    # Tied aliases, read from the entry they are stored under: [Note: tied tensors] in _state.py.
    tied = {
        f"{prefix}{alias}": f"{prefix}{record.get('tied_to')}"
        for alias, record in manifest.layout.get("tensors", {}).items()
        if record.get("stored_as") == "tied" and f"{prefix}{record.get('tied_to')}" in keys
    }
    # Once, under the stored name, or under the first alias the name map keeps: [Note: streaming export].
    written = {k for k in keys if _resolve_name(name_map, k[len(prefix) :]) is not None}
    once = {}
    for alias, source in sorted(tied.items(), key=lambda item: natural_key(item[0])):
        if alias not in metadata.state_dict_metadata and source not in written:
            if _resolve_name(name_map, alias[len(prefix) :]) is not None:
                once[alias] = source
                written.add(source)
    tied = once
    for key in sorted([*keys, *tied], key=natural_key):
        source = tied.get(key, key)
        md = metadata.state_dict_metadata[source]
        fqn = key[len(prefix) :]
        name = _resolve_name(name_map, fqn)
        if name is None:
            continue
        if name in taken:
            raise ValueError(f"name_map maps both {taken[name]!r} and {fqn!r} to {name!r}; output names must be unique")
        taken[name] = fqn
        out = md.properties.dtype
        if cast is not None and out.is_floating_point:
            out = cast
        if out not in _ST_DTYPES:
            raise ValueError(f"{fqn!r} has dtype {out}, which safetensors cannot store; pass dtype=torch.float32")
        numel = 1
        for s in md.size:
            numel *= s
        entries.append((source, name, out, tuple(md.size), numel * out.itemsize))

    shards: list[list[tuple[str, str, torch.dtype, tuple[int, ...], int]]] = []
    size = 0
    for entry in entries:
        if not shards or (size + entry[4] > limit and shards[-1]):
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += entry[4]
    if not shards:
        shards.append([])

    if not target.backend.remote:
        Path(target.path).mkdir(parents=True, exist_ok=True)
    previous = _remove_previous_index(target)
    total = sum(e[4] for e in entries)
    weight_map: dict[str, str] = {}
    bar = tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc="export",
        disable=not (progress and sys.stderr.isatty()),
    )
    # One buffer for every tensor read: no allocator churn, the peak stays one tensor.
    largest = max(
        (metadata.state_dict_metadata[e[0]].properties.dtype.itemsize * math.prod(e[3]) for e in entries), default=0
    )
    arena = torch.empty(largest, dtype=torch.uint8)
    try:
        for i, shard in enumerate(shards, start=1):
            file_name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            _write_shard(target.child(file_name), shard, reader, metadata, bar, arena)
            weight_map.update({name: file_name for _, name, *_ in shard})
    finally:
        bar.close()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    index_path = write_beside(target, INDEX_NAME, (json.dumps(index, indent=2) + "\n").encode("ascii"))
    for stale in previous - set(weight_map.values()):  # shards of a previous export (overwrite=True)
        _remove(target.child(stale))
    return index_path


def write_beside(out: Location | str | os.PathLike[str], name: str, data: bytes) -> Path | str:
    """Write ``data`` as ``out/name``: a local file via a temporary name + fsync + rename, an object in one PUT.

    Returns the file's path (its URI for a URI ``out``).
    """
    out = locate(out, what="out_dir")
    if out.backend.remote:
        out.backend.write_bytes(out.child(name).path, data)
    else:
        write_file(Path(out.path, name), data)
    return out.child(name).user


def _remove(where: Location) -> None:
    if where.backend.remote:
        where.backend.remove(where.path)
    else:
        Path(where.path).unlink(missing_ok=True)


def _verify(stored: Stored, manifest: Manifest, *, checksums: bool) -> None:
    """ValueError naming the first damaged file, as ``load`` does. See [Note: export checks]."""
    if manifest.format_version < FILES_SINCE_VERSION:
        log_unverified(stored, manifest.format_version)
        return
    problems = check_files(stored, manifest, checksums=checksums, listing=True)
    if problems:
        raise ValueError(damage_message(stored, problems, doing="exporting"))


def _check_out_dir(out_dir: str | os.PathLike[str], *, overwrite: bool) -> Location:
    """The output folder, or ValueError before anything is read or written. See [Note: export checks]."""
    if not isinstance(out_dir, (str, os.PathLike)) or not str(os.fspath(out_dir)).strip():
        # Path("") is the current directory: never a silent default for where files go.
        raise ValueError(f"out_dir={out_dir!r} is empty; pass the folder to write the safetensors into")
    out = locate(out_dir, what="out_dir")
    if not out.backend.remote:
        check_destination(out.path, [], overwrite=overwrite)  # out_dir itself a link: [Note: writer destinations]
    if out.backend.kind(out.path) != "dir":
        return out
    names = _top_names(out)
    if not out.backend.remote:  # a link among the files an export replaces: refused, even with overwrite
        check_destination(out.path, [n for n in names if _OWN_FILE.fullmatch(n)], overwrite=True)
    if names and not overwrite:
        shown = ", ".join(names[:5]) + (f", ... ({len(names) - 5} more)" if len(names) > 5 else "")
        raise ValueError(
            f"out_dir {str(out)!r} is not empty ({shown}); nothing was written. Pass a new or empty folder, "
            f"or overwrite=True (CLI: --overwrite) to replace the files an export writes there "
            f"(model-*-of-*.safetensors, {INDEX_NAME}) and keep the others"
        )
    if _SINGLE_FILE in names:
        raise ValueError(
            f"out_dir {str(out)!r} holds {_SINGLE_FILE}, which from_pretrained would load instead of the exported "
            f"{INDEX_NAME}; it is not a file an export writes, so it is not deleted: move it away first"
        )
    return out


def _top_names(out: Location) -> list[str]:
    """Names directly in the folder ``out`` (files and directories)."""
    if not out.backend.remote:
        return sorted(entry.name for entry in Path(out.path).iterdir())
    return sorted({name.split("/", 1)[0] for name in out.backend.listing(out.path)})


def _remove_previous_index(out: Location) -> set[str]:
    """Delete a previous export's index (before any new shard is written); the names of its shard files."""
    if out.backend.kind(out.path) != "dir":
        return set()
    listing = out.backend.listing(out.path)
    names = {name for name, entry in listing.items() if "/" not in name and entry.regular and _OWN_FILE.fullmatch(name)}
    for name in names & {INDEX_NAME, INDEX_NAME + ".tmp"}:
        _remove(out.child(name))
    return names - {INDEX_NAME, INDEX_NAME + ".tmp"}


def _write_shard(
    where: Location,
    shard: list[tuple[str, str, torch.dtype, tuple[int, ...], int]],
    reader: TrustedReader,
    metadata: Metadata,
    bar: object,
    arena: torch.Tensor,
) -> None:
    """One shard file, streamed: locally under a temporary name, fsynced, renamed; an object store's
    upload makes the object appear whole when it completes."""
    backend = where.backend
    path = where.path if backend.remote else where.path + ".tmp"
    with backend.writing(path) as f:
        f.write(_header([(name, dtype, shape, nbytes) for _, name, dtype, shape, nbytes in shard]))
        for key, name, dtype, _, nbytes in shard:
            tensor = read_tensor(reader, metadata, key, arena).reshape(-1)
            assert tensor.numel() * dtype.itemsize == nbytes, name
            # Cast and written a slice at a time: no second full copy of the tensor.
            step = max(1, _WRITE_BYTES // max(1, tensor.element_size()))
            for start in range(0, tensor.numel(), step):
                f.write(tensor[start : start + step].to(dtype).view(torch.uint8).numpy().data)
            del tensor  # no view of it may outlive this line: the next tensor reuses the memory
            bar.update(nbytes)  # type: ignore[attr-defined]
    if not backend.remote:
        os.replace(path, where.path)
