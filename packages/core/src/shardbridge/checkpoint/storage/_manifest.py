"""``shardbridge.json``: what a checkpoint directory holds besides DCP's files.

[Note: checkpoint format]
~~~~~~~~~~~~~~~~~~~~~~~~~
::

    <root>/step-00000100/            one committed checkpoint (see _local.py, _fsspec.py)
        .metadata                    DCP metadata (pickled torch DCP dataclasses only)
        __0_0.distcp, __1_0.distcp   DCP data: plain tensors, primitives (torch.save)
        rng/rank-00000.pt ...        per-rank RNG states: {"cpu": uint8 tensor,
                                     "cuda": uint8 tensor (only when CUDA is available)}
        shardbridge.json             this manifest; written last, atomically

DCP keys are ``model.<fqn>`` for model tensors and ``optim.<key>`` for the optimizer in
torch's flattened form (``optim.state.<fqn>.exp_avg``); the hyperparameters
(``param_groups.<fqn>.lr`` ...) are one entry, ``optim.param_groups``, a list of (key, value)
pairs since format 2 (format 1 stored each alone; both load, see [Note: packed param groups]
in ``_state.py``).
FQNs are the model's own (no FSDP / compile prefixes). A fused parameter is stored as its
components under component FQNs (see [Note: component names] in ``_components.py``), in
component-global coordinates, for its optimizer states too. Every tensor is a plain tensor:
``dcp_to_torch_save`` + ``torch.load(weights_only=True)`` reads a checkpoint without
shardbridge installed.

The manifest (JSON object, ASCII) has::

    format            "shardbridge.checkpoint"
    format_version    3 (readers refuse newer versions; 2 = no "files", 1 = also param_groups
                      unpacked; both still load, unverified)
    step              int or null
    world_size        ranks that wrote the checkpoint
    torch_version, shardbridge_version, created (UTC ISO 8601)
    has_optimizer     whether optim.* keys exist
    layout            {"parallel_dims": {dp_replicate, dp_shard, cp, tp} or null,
                       "mesh_axes": {axis name: size} seen on the DTensors,
                       "tensors": {state-dict key: {"mesh": {axis: size}, "placements": [str],
                                                   "stored_as": "dtensor" | "repaired" |
                                                   "components" | "plain" | "boxes"}},
                       "optim_state_absent": [stored names of parameters the optimizer held
                                              no state for (no gradient yet); absent before
                                              this record existed or without optimizer],
                       "derived": how every ``.metadata`` record is derived from the layout
                                  (saves of the derived protocol; read by loads, ignored by
                                  older readers: [Note: derived loads] in ``derived/_records.py``)}
    fused             {fused fqn: {"dim", "tp_size", "components": [{"name", "size", "fqn"}]}}
    rng               {"world_size", "files": "rng/rank-{rank:05d}.pt"}
    extra             the user's JSON dict
    files             (format 3) every file of the directory except this manifest, by relative
                      POSIX name: {".metadata": {"size": bytes, "xxh3_128": 32 hex digits},
                      "__0_0.distcp": {...}, "rng/rank-00000.pt": {...}}
                      (see [Note: checkpoint integrity] in ``_integrity.py``)
    manifest_xxh3_128 (format 3) xxh3_128 of the manifest itself: the canonical JSON
                      (sorted keys, no spaces) of every other key; a manifest edited or
                      damaged after the save is refused
"""

from __future__ import annotations

import datetime
import json
import os
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import xxhash

from shardbridge._json import MAX_DEPTH
from shardbridge._json import loads as bounded_json
from shardbridge.checkpoint.storage._destination import _link_or_special, write_file

if TYPE_CHECKING:
    from shardbridge.checkpoint.storage._backend import Backend

__all__ = [
    "DERIVED_KEY",
    "FORMAT_NAME",
    "CHECKSUM_KEY",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "Manifest",
    "OPTIM_STATE_ABSENT",
    "RNG_PATTERN",
    "check_json_extra",
    "read_manifest",
    "rng_file",
    "write_manifest",
]

MANIFEST_NAME = "shardbridge.json"
FORMAT_NAME = "shardbridge.checkpoint"
FORMAT_VERSION = 3
FILES_SINCE_VERSION = 3
"""First format version whose manifest records every file's size and checksum."""
CHECKSUM_KEY = "xxh3_128"
"""The checksum recorded per file (xxhash's XXH3, 128 bits, lowercase hex)."""
SELF_CHECKSUM_KEY = "manifest_xxh3_128"
_HEX_128 = re.compile(r"^[0-9a-f]{32}$")
GENERATION_PATTERN = re.compile(r"^g-[0-9a-f]{16}$")
"""An object store's per-save prefix (see ``Manifest.generation``)."""
_FILE_NAME = re.compile(r"^(?:[A-Za-z0-9_.-]+/)*[A-Za-z0-9_.-]+$")
DCP_METADATA_NAME = ".metadata"
OPTIM_STATE_ABSENT = "optim_state_absent"
"""``layout`` key: stored names of the parameters saved without optimizer state (no gradient yet)."""
DERIVED_KEY = "derived"
"""``layout`` key: how every ``.metadata`` record is derived again ([Note: derived loads] in ``derived/_records.py``)."""
RNG_PATTERN = "rng/rank-{rank:05d}.pt"
"""Per-rank RNG file, relative to the checkpoint directory."""


def rng_file(rank: int) -> str:
    """Path of ``rank``'s RNG file relative to the checkpoint directory."""
    return RNG_PATTERN.format(rank=rank)


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """The parsed ``shardbridge.json`` of one checkpoint. See [Note: checkpoint format]."""

    step: int | None
    """Training step given to ``save``; None when none was given."""
    world_size: int
    """Number of ranks that wrote the checkpoint."""
    has_optimizer: bool
    """Whether optimizer state (``optim.*`` keys) was saved."""
    layout: dict[str, Any] = field(default_factory=dict)
    """Parallel layout of the saving run (see the module note)."""
    fused: dict[str, Any] = field(default_factory=dict)
    """Fused parameters stored as components: fused fqn -> dim, tp_size, components."""
    extra: dict[str, Any] = field(default_factory=dict)
    """User extras (JSON)."""
    rng: dict[str, Any] = field(default_factory=dict)
    """Where the per-rank RNG files are."""
    torch_version: str = ""
    """torch version of the saving run."""
    shardbridge_version: str = ""
    """shardbridge version of the saving run."""
    created: str = ""
    """UTC time of the save, ISO 8601."""
    files: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Every file but the manifest: relative name -> {"size", "xxh3_128"} (format 3; {} before)."""
    format_version: int = FORMAT_VERSION
    """Format version (3; 1 and 2 are still read, without file verification)."""
    generation: str | None = None
    """Object stores: the prefix below the checkpoint that holds its files (``g-<16 hex>``, one per
    save; see [Note: object-store commit] in ``_fsspec.py``). None (absent from the JSON): the files
    sit beside the manifest, as on local disk."""

    def to_json(self) -> str:
        """The manifest as JSON text (ASCII, sorted keys, indented), with its own checksum (format 3)."""
        # A shallow copy: the fields are JSON values already (asdict's deep copy of every file
        # record cost ~1 s for 32,000 files; docs/benchmarks.md, Scale).
        data = {"format": FORMAT_NAME, **{f.name: getattr(self, f.name) for f in fields(self)}}
        if self.generation is None:
            del data["generation"]
        data[SELF_CHECKSUM_KEY] = _self_checksum(data)
        return _pretty(data)

    @classmethod
    def from_json(cls, text: str, where: str) -> Manifest:
        """Parse and validate; ValueError naming ``where`` and what is wrong."""
        try:
            data = bounded_json(text, where)  # [Note: bounded structure]
        except json.JSONDecodeError as exc:
            raise ValueError(
                f"{where} is not valid JSON ({exc}); the save that wrote it did not finish. "
                "Use shardbridge.checkpoint.latest(root) to find the newest complete checkpoint"
            ) from None
        if not isinstance(data, dict) or data.get("format") != FORMAT_NAME:
            raise ValueError(f'{where} is not a shardbridge checkpoint manifest (no "format": {FORMAT_NAME!r})')
        version = data.get("format_version")
        if not isinstance(version, int) or version < 1:
            raise ValueError(f"{where} has an invalid format_version {version!r}")
        if version > FORMAT_VERSION:
            raise ValueError(
                f"{where} has format_version {version}, newer than this shardbridge reads "
                f"({FORMAT_VERSION}); upgrade shardbridge"
            )
        kinds = {
            "step": (int, type(None)),
            "world_size": int,
            "has_optimizer": bool,
            "layout": dict,
            "fused": dict,
            "extra": dict,
            "rng": dict,
            "torch_version": str,
            "shardbridge_version": str,
            "created": str,
        }
        for key, kind in kinds.items():
            if key not in data or not isinstance(data[key], kind):
                raise ValueError(f"{where} is missing {key!r} or it has the wrong type; the manifest is damaged")
        files: dict[str, dict[str, Any]] = {}
        if version >= FILES_SINCE_VERSION:  # older formats record no files: loaded unverified
            _check_self_checksum(data, where)
            files = check_files_record(data.get("files"), where)
        _check_values(data, where)
        generation = data.get("generation")
        if generation is not None and (not isinstance(generation, str) or not GENERATION_PATTERN.match(generation)):
            raise ValueError(
                f"{where}: generation={generation!r} must be 'g-' and 16 hex digits; the manifest is damaged"
            )
        return cls(**{k: data[k] for k in (*kinds, "format_version")}, files=files, generation=generation)


def _compact(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(", ", ": "), ensure_ascii=True, allow_nan=False)


_ENTRY_PER_LINE_UP_TO = 4096
"""A top-level mapping with more entries (the file records of a save by thousands of ranks) is one line."""


def _pretty(data: dict[str, Any]) -> str:
    """JSON with sorted keys, one top-level key per line and one entry per line of each top-level
    mapping (a file's record, a tensor's layout), deeper values on their entry's line.

    ``json.dumps(indent=...)`` runs Python's pure-Python encoder: ~1 s for the 32,000 file
    records of a 16,384-rank save; this encodes with the C encoder (0.4 s one entry per line, so a
    mapping of more than ``_ENTRY_PER_LINE_UP_TO`` entries is written on one line).
    """
    lines = []
    for key in sorted(data):
        value = data[key]
        if isinstance(value, dict) and value and len(value) <= _ENTRY_PER_LINE_UP_TO:
            inner = [f"  {_compact(k)}: {_compact(value[k])}" for k in sorted(value)]
            lines.append(f" {_compact(key)}: {{\n" + ",\n".join(inner) + "\n }")
        else:
            lines.append(f" {_compact(key)}: {_compact(value)}")
    return "{\n" + ",\n".join(lines) + "\n}\n"


def _self_checksum(data: dict[str, Any]) -> str:
    """xxh3_128 of the canonical JSON of ``data`` without its own checksum key."""
    rest = {k: v for k, v in data.items() if k != SELF_CHECKSUM_KEY}
    text = json.dumps(rest, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return xxhash.xxh3_128_hexdigest(text.encode("ascii"))


def _check_self_checksum(data: dict[str, Any], where: str) -> None:
    recorded = data.get(SELF_CHECKSUM_KEY)
    if not isinstance(recorded, str) or not _HEX_128.match(recorded):
        raise ValueError(f"{where} has no valid {SELF_CHECKSUM_KEY!r} (32 hex digits); the manifest is damaged")
    if _self_checksum(data) != recorded:
        raise ValueError(
            f"{where} does not match its own checksum ({SELF_CHECKSUM_KEY}): it was damaged or edited after "
            "the save, so none of its records can be trusted; use another checkpoint (latest(root) skips it)"
        )


def check_files_record(files: Any, where: str) -> dict[str, dict[str, Any]]:
    """Validate the ``files`` record of a format-3 manifest; ValueError naming the bad entry.

    Names are relative POSIX paths inside the checkpoint (letters, digits, ``_.-``, ``/``
    between parts; no ``..``, ``.``, empty or absolute parts, not the manifest itself);
    each record is exactly ``{"size": int >= 0, "xxh3_128": 32 lowercase hex digits}``.
    """
    if not isinstance(files, dict):
        raise ValueError(f"{where} has no 'files' record (an object); the manifest is damaged")
    for name, record in files.items():
        parts = name.split("/") if isinstance(name, str) else []
        if not isinstance(name, str) or not _FILE_NAME.match(name) or any(p in (".", "..") for p in parts):
            raise ValueError(
                f"{where}: 'files' names {name!r}, which is not a plain relative file name inside the checkpoint "
                "(letters, digits, '_.-', '/' between parts; no '..', no absolute path); the manifest is damaged "
                "or crafted"
            )
        if name == MANIFEST_NAME:
            raise ValueError(f"{where}: 'files' must not record the manifest itself; the manifest is damaged")
        if not isinstance(record, dict) or set(record) != {"size", CHECKSUM_KEY}:
            raise ValueError(
                f"{where}: 'files'[{name!r}] must be {{'size': int, {CHECKSUM_KEY!r}: hex str}}, got {record!r}"
            )
        size, checksum = record["size"], record[CHECKSUM_KEY]
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ValueError(f"{where}: 'files'[{name!r}]['size'] = {size!r} must be an int >= 0")
        if not isinstance(checksum, str) or not _HEX_128.match(checksum):
            raise ValueError(
                f"{where}: 'files'[{name!r}][{CHECKSUM_KEY!r}] = {checksum!r} must be 32 lowercase hex digits"
            )
    return files


def _check_values(data: dict[str, Any], where: str) -> None:
    """ValueError naming the first manifest field whose value or sub-structure readers cannot use."""

    def bad(field: str, value: Any, expected: str) -> ValueError:
        return ValueError(f"{where}: {field}={value!r} must be {expected}; the manifest is damaged")

    def count(value: Any, minimum: int) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= minimum

    def mapping(field: str, value: Any, check_value: Any, expected: str) -> None:
        if not isinstance(value, dict):
            raise bad(field, value, "an object")
        for key, item in value.items():
            if not check_value(item):
                raise bad(f"{field}[{key!r}]", item, expected)

    if isinstance(data["format_version"], bool):
        raise bad("format_version", data["format_version"], "an int >= 1")
    if data["step"] is not None and not count(data["step"], 0):
        raise bad("step", data["step"], "an int >= 0 or null")
    if not count(data["world_size"], 1):
        raise bad("world_size", data["world_size"], "an int >= 1")
    layout = data["layout"]
    dims = layout.get("parallel_dims")
    if dims is not None:
        mapping("layout.parallel_dims", dims, lambda v: isinstance(v, int) and not isinstance(v, bool), "an int")
    mapping("layout.mesh_axes", layout.get("mesh_axes", {}), lambda v: count(v, 1), "an int >= 1")

    def tensor_record(record: Any) -> bool:
        return (
            isinstance(record, dict)
            and isinstance(record.get("mesh", {}), dict)
            and isinstance(record.get("placements", []), list)
            and isinstance(record.get("stored_as", ""), str)
        )

    absent = layout.get(OPTIM_STATE_ABSENT, [])
    if not isinstance(absent, list) or not all(isinstance(n, str) for n in absent):
        raise bad(f"layout.{OPTIM_STATE_ABSENT}", absent, "a list of parameter names (str)")
    mapping(
        "layout.tensors",
        layout.get("tensors", {}),
        tensor_record,
        'an object {"mesh": {...}, "placements": [...], "stored_as": str}',
    )

    def component(c: Any) -> bool:
        return (
            isinstance(c, dict)
            and isinstance(c.get("name"), str)
            and isinstance(c.get("fqn"), str)
            and count(c.get("size"), 0)
        )

    def fused_record(record: Any) -> bool:
        return (
            isinstance(record, dict)
            and count(record.get("dim"), 0)
            and count(record.get("tp_size"), 1)
            and isinstance(record.get("components"), list)
            and all(component(c) for c in record["components"])
        )

    mapping(
        "fused",
        data["fused"],
        fused_record,
        'an object {"dim": int, "tp_size": int >= 1, "components": [{"name", "size", "fqn"}]}',
    )
    rng = data["rng"]
    if "world_size" in rng and not count(rng["world_size"], 1):
        raise bad("rng.world_size", rng["world_size"], "an int >= 1")
    if "files" in rng and not isinstance(rng["files"], str):
        raise bad("rng.files", rng["files"], "a str")


def utc_now() -> str:
    """Current UTC time, ISO 8601 with seconds."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


_EXTRA_DEPTH = MAX_DEPTH - 1  # the manifest holds ``extra`` one level down


def check_json_extra(extra: Any, where: str = "extra", *, level: int = 1) -> None:
    """Raise ValueError naming the first key of ``extra`` that JSON cannot hold exactly.

    Allowed: dict with str keys, list, tuple (stored as a list), str, int, finite float,
    bool, None; dicts and lists nested at most 63 deep (``level``: how deep ``extra`` sits, 1 for
    the user's dict), as readers of a manifest take 64 levels ([Note: bounded structure] in ``_json.py``).

    Example:
        >>> check_json_extra({"lr": 0.1, "tags": ["a"]})
        >>> check_json_extra({"bad": {1, 2}})
        Traceback (most recent call last):
        ...
        ValueError: extra['bad'] is a set, which JSON cannot store; pass only dict/list/str/int/float/bool/None (e.g. convert tensors with .tolist())
    """
    fix = "pass only dict/list/str/int/float/bool/None (e.g. convert tensors with .tolist())"
    if isinstance(extra, (dict, list, tuple)) and level > _EXTRA_DEPTH:  # [Note: bounded structure]
        raise ValueError(
            f"{where} nests dicts and lists more than {_EXTRA_DEPTH} deep, more than a manifest's reader takes "
            f"({MAX_DEPTH} levels with the manifest's own); flatten it"
        )
    if isinstance(extra, dict):
        for key, value in extra.items():
            if not isinstance(key, str):
                raise ValueError(f"{where} has a key {key!r} of type {type(key).__name__}; JSON keys must be str")
            check_json_extra(value, f"{where}[{key!r}]", level=level + 1)
    elif isinstance(extra, (list, tuple)):
        for i, value in enumerate(extra):
            check_json_extra(value, f"{where}[{i}]", level=level + 1)
    elif isinstance(extra, float):
        if extra != extra or extra in (float("inf"), float("-inf")):
            raise ValueError(f"{where} is {extra}, which strict JSON cannot store; {fix}")
    elif extra is not None and not isinstance(extra, (str, int, bool)):
        raise ValueError(f"{where} is a {type(extra).__name__}, which JSON cannot store; {fix}")


def read_manifest(backend: Backend, path: str, *, need_metadata: bool = True) -> Manifest:
    """Read and validate the manifest of the checkpoint at ``path`` (a backend path).

    Args:
        need_metadata: also require DCP's ``.metadata`` (every reader needs it; ``verify``
            reports its absence as one more problem instead).

    Raises:
        ValueError: the checkpoint does not exist, is not a shardbridge checkpoint, or its
            manifest is truncated / invalid / from a newer format. The message says what to do.
    """
    shown = backend.uri(path)
    manifest_path = backend.join(path, MANIFEST_NAME)
    if not backend.remote:
        _refuse_linked_manifest(manifest_path, shown)
    try:
        text = backend.read_bytes(manifest_path).decode("utf-8", errors="replace")
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        kind = backend.kind(path)
        if kind == "missing":
            raise ValueError(
                f"checkpoint path {shown!r} does not exist; pass a directory written by "
                "shardbridge.checkpoint.save (latest(root) returns the newest one)"
            ) from None
        if kind == "file":
            raise ValueError(f"checkpoint path {shown!r} is a file; pass the checkpoint directory") from None
        hint = (
            "it looks like a plain DCP checkpoint: read it with torch.distributed.checkpoint.load"
            if backend.kind(backend.join(path, DCP_METADATA_NAME)) == "file"
            else "pass a directory written by shardbridge.checkpoint.save"
        )
        raise ValueError(f"{shown!r} is not a shardbridge checkpoint (no {MANIFEST_NAME}); {hint}") from None
    manifest = Manifest.from_json(text, backend.uri(manifest_path))
    data = backend.data_path(path, manifest.generation)
    if need_metadata and backend.kind(backend.join(data, DCP_METADATA_NAME)) != "file":
        raise ValueError(f"{shown!r} has {MANIFEST_NAME} but no DCP {DCP_METADATA_NAME}; the checkpoint is damaged")
    return manifest


def _refuse_linked_manifest(manifest_path: str, shown: str) -> None:
    """Never read the manifest through a symbolic link, nor open a FIFO (it would block).

    The same line as ``check_no_links`` (inspect, export) draws for every file: shardbridge
    writes a regular ``shardbridge.json``; a link may point at another checkpoint's manifest
    (whose records then vouch for these files) or anywhere else.
    """
    if (what := _link_or_special(manifest_path)) is None:
        return  # a regular file; or none, reported below with what the path is instead
    raise ValueError(
        f"checkpoint {shown!r} is damaged: {MANIFEST_NAME} is {what}, which shardbridge never writes; not reading "
        "through it: replace it with the real file"
    )


def fsync_dir(path: Path) -> None:
    """fsync a directory so that renames inside it are durable (POSIX; no-op elsewhere)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_manifest(checkpoint_dir: Path, manifest: Manifest) -> None:
    """Write ``shardbridge.json`` atomically and durably into ``checkpoint_dir``."""
    write_file(checkpoint_dir / MANIFEST_NAME, manifest.to_json().encode("ascii"))
    fsync_dir(checkpoint_dir)
