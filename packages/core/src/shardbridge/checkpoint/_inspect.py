"""``inspect``: what a checkpoint holds, from its manifest and DCP metadata (no data read)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from shardbridge.checkpoint.derived import metadata_of
from shardbridge.checkpoint.storage._backend import Stored
from shardbridge.checkpoint.storage._location import locate, open_checkpoint
from shardbridge.checkpoint.storage._manifest import DERIVED_KEY
from shardbridge.checkpoint.storage._trust import check_no_links

__all__ = ["CheckpointInfo", "TensorInfo", "format_bytes", "inspect"]


def format_bytes(num: int) -> str:
    """Human-readable size with binary units.

    Example:
        >>> format_bytes(1536), format_bytes(3 * 2**30)
        ('1.5 KiB', '3.0 GiB')
    """
    value = float(num)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError


@dataclass(frozen=True, kw_only=True)
class TensorInfo:
    """One tensor of a checkpoint."""

    name: str
    """DCP key: ``model.<fqn>`` or ``optim.state.<fqn>.<state>``."""
    shape: tuple[int, ...]
    """Global shape."""
    dtype: str
    """torch dtype name, e.g. "float32"."""
    nbytes: int
    """Size of the global tensor in bytes."""
    num_chunks: int
    """Boxes it is stored in (one per distinct rank shard)."""


@dataclass(frozen=True, kw_only=True)
class CheckpointInfo:
    """Summary of a checkpoint; ``str(info)`` is the table the CLI prints."""

    path: Path | str
    """The checkpoint directory (a ``str`` URI for a checkpoint given as one)."""
    step: int | None
    """Training step."""
    world_size: int
    """Ranks that saved it."""
    has_optimizer: bool
    """Whether optimizer state is stored."""
    layout: dict[str, Any]
    """Parallel layout of the saving run (manifest ``layout``)."""
    fused: dict[str, Any]
    """Fused parameters stored as components (manifest ``fused``)."""
    extra: dict[str, Any]
    """User extras."""
    torch_version: str
    """torch version of the saving run."""
    created: str
    """UTC time of the save."""
    format_version: int
    """shardbridge checkpoint format version."""
    tensors: tuple[TensorInfo, ...] = field(default_factory=tuple)
    """Every tensor, model first, in name order."""
    num_other_entries: int = 0
    """Non-tensor entries (optimizer hyperparameters)."""

    @property
    def total_bytes(self) -> int:
        """Bytes of all tensors."""
        return sum(t.nbytes for t in self.tensors)

    @property
    def model_bytes(self) -> int:
        """Bytes of the model tensors."""
        return sum(t.nbytes for t in self.tensors if t.name.startswith("model."))

    def __str__(self) -> str:
        axes = ", ".join(f"{k}={v}" for k, v in self.layout.get("mesh_axes", {}).items()) or "no DTensors"
        num_model = sum(t.name.startswith("model.") for t in self.tensors)
        lines = [
            f"checkpoint {self.path}",
            f"  step {self.step}, saved by {self.world_size} rank(s) ({axes}), torch {self.torch_version}, "
            f"{self.created}, format {self.format_version}",
        ]
        dims = self.layout.get("parallel_dims")
        if dims:
            lines.append("  parallel dims: " + ", ".join(f"{k}={v}" for k, v in dims.items()))
        lines.append(
            f"  model: {num_model} tensors, {format_bytes(self.model_bytes)}; optimizer: "
            + (
                f"{len(self.tensors) - num_model} tensors, {format_bytes(self.total_bytes - self.model_bytes)}"
                if self.has_optimizer
                else "not saved"
            )
            + f"; total {format_bytes(self.total_bytes)}"
        )
        for fqn, record in self.fused.items():
            names = ", ".join(c["fqn"] for c in record["components"])
            lines.append(f"  fused {fqn} (tp {record['tp_size']}) stored as {names}")
        repaired = [k for k, r in self.layout.get("tensors", {}).items() if r.get("stored_as") == "repaired"]
        if repaired:
            lines.append(f"  layouts repaired for DCP: {', '.join(repaired)}")
        if DERIVED_KEY in self.layout:  # see [Note: derived loads] in derived/_records.py
            lines.append("  storage records: derivable by every loading rank (layout.derived), else read from .metadata")
        else:
            lines.append("  storage records: read from .metadata by rank 0 at load (no layout.derived)")
        if self.extra:
            lines.append(f"  extra keys: {', '.join(sorted(self.extra))}")
        rows = [(t.name, str(t.shape), t.dtype, format_bytes(t.nbytes), str(t.num_chunks)) for t in self.tensors]
        header = ("name", "shape", "dtype", "size", "chunks")
        widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
        lines.append("")
        for row in (header, *rows):
            lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
        return "\n".join(lines)


def inspect(path: str | os.PathLike[str]) -> CheckpointInfo:
    """Describe a checkpoint (a directory or its URI) without reading its tensors.

    Raises:
        ValueError: missing path, not a shardbridge checkpoint, a damaged manifest, or a
            symbolic link (or special file) in the directory: never read through (see
            [Note: untrusted checkpoints] in ``_trust.py``). Damaged data files are not
            looked at (``verify`` does that).

    Example:
        >>> print(inspect("/shared/ckpt/step-00000100"))  # doctest: +SKIP
        checkpoint /shared/ckpt/step-00000100
          step 100, saved by 4 rank(s) (dp_shard_cp=2, tp=2), torch 2.13.0+cpu, ...
    """
    where = locate(path)
    check_no_links(Stored(where.backend, where.path, where.path))  # before anything is read through one
    stored, manifest = open_checkpoint(where)
    metadata = metadata_of(stored, manifest, data_files=False)  # [Note: derived loads]; [Note: untrusted checkpoints]
    tensors = []
    others = 0
    for key, md in metadata.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            others += 1
            continue
        dtype = md.properties.dtype
        nbytes = math.prod(md.size) * dtype.itemsize
        tensors.append(
            TensorInfo(
                name=key,
                shape=tuple(md.size),
                dtype=str(dtype).removeprefix("torch."),
                nbytes=nbytes,
                num_chunks=len(md.chunks),
            )
        )
    tensors.sort(key=lambda t: (not t.name.startswith("model."), natural_key(t.name)))
    return CheckpointInfo(
        path=where.user,
        step=manifest.step,
        world_size=manifest.world_size,
        has_optimizer=manifest.has_optimizer,
        layout=manifest.layout,
        fused=manifest.fused,
        extra=manifest.extra,
        torch_version=manifest.torch_version,
        created=manifest.created,
        format_version=manifest.format_version,
        tensors=tuple(tensors),
        num_other_entries=others,
    )


def natural_key(name: str) -> tuple[Any, ...]:
    """Sort key that orders ``layers.2`` before ``layers.10``."""
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in name.split("."))
