"""Load a Hugging Face ``from_pretrained`` folder into an already-parallelized model, shard-on-read.

Public: :func:`load_pretrained`, :func:`read_index`, :class:`PretrainedReport`,
:class:`StackedSource`. Torch and ``safetensors`` only; no process group is used (every rank
reads its own slices).

[Note: shard-on-read]
~~~~~~~~~~~~~~~~~~~~~
Each parameter of the parallelized model (a DTensor under FSDP2 x TP, or a plain tensor) is
filled with exactly the global index ranges its local tensor holds, read from the safetensors
files with ``safe_open(...).get_slice(key)[box]``::

    checkpoint tensor [V, H] on disk        rank (dp_shard=1, tp=0) of a dp2 x tp2 mesh
    +---------+---------+                   colwise weight (_StridedShard(0, sf=2), Shard(0)):
    | tp0,dp0 |         |  rows [0, V/4)    holds rows [V/4, V/2) -> reads only those rows
    | tp0,dp1 |         |  rows [V/4, V/2)
    | tp1,dp0 |  ...    |
    +---------+---------+

What a rank holds comes from the layout algebra (``shardbridge.layout``: FSDP2's own chunking
for the placements ``fully_shard`` builds, the DTensor reading otherwise), so uneven and strided
layouts (a packed ``[gate; up]`` weight under ``_StridedShard``) read right; a local tensor the
algebra cannot explain is refused. Fused parameters registered with
:func:`shardbridge.fused.register_fused` (``qkv``, ``gate_up``) are assembled from their components
(``q_proj``, ``k_proj``, ...): each contiguous piece of the local tensor is split in item
coordinates (:func:`shardbridge.fused.split_local`) and each component piece read from the
component's checkpoint tensor. Tied parameters (one tensor under several names) are filled
once, from whichever of their names the checkpoint has.

[Note: experts stored one by one]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
MoE models hold their experts as one 3-D tensor per projection, dim 0 the expert index
(transformers' ``experts.gate_up_proj`` ``[E, 2I, D]``), while hub folders store one tensor per
expert and projection (``experts.{e}.gate_proj.weight`` ``[I, D]``, ``experts.{e}.up_proj.weight``)
and transformers stacks and concatenates them while loading. A :class:`StackedSource` describes
that: ``keys[e]`` are expert e's tensors in the order they are concatenated along ``dim`` of the
model tensor. A rank reads, for each expert its local tensor holds (dim 0 of its boxes: under
expert parallelism only its own experts), the rows of each component its box covers::

    model gate_up_proj [E=4, 2I, D], ep=2 x efsdp=2 (FSDP on dim 1), rank (efsdp 1, ep 0):
        experts 0-1, rows [I, 2I) = up_proj of experts 0 and 1 -> reads experts.{0,1}.up_proj.weight only

Peak host memory per rank: the model's local shards plus one slice being copied. Each key is
read under its own ``safe_open`` (a memory map of the file, closed after the key), so the pages
of a file a rank touched do not stay resident for the whole load.

Everything is checked before anything is read, identically on every rank (headers only):
missing and unexpected keys, shapes and dtypes; each error names the key and the fix. Nothing
read executes code: the index is JSON, safetensors headers are JSON, data is raw bytes.

Why not DCP's ``HuggingFaceStorageReader``: see docs/hf.md "Pretrained weights".

[Note: file selection]
~~~~~~~~~~~~~~~~~~~~~~
One folder, one model: shardbridge reads the files ``from_pretrained`` reads, in transformers'
order (5.24, ``modeling_utils._get_resolved_checkpoint_files``, local folder)::

    config.json "transformers_weights": NAME     -> NAME (a .safetensors or an index)
    model.safetensors                            -> that one file; an index beside it is ignored
    model.safetensors.index.json                 -> the shards it names (all must exist)

So a folder holding both files loads ``model.safetensors`` everywhere, and an index left over
beside it, naming deleted shards, is not read (``from_pretrained`` loads that folder too).
Before, shardbridge read the index first: two different models from one folder, no warning.
``*.bin`` pickles are never read (they would run code). :func:`weights_file` is the one
place that decides; :func:`read_index`, :func:`load_pretrained`, the hf adapter and
``shardbridge ckpt convert`` all go through it.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from shardbridge._compat import local_tensor, state_dict_fqns
from shardbridge._fused import FusedSpec, fused_params, split_local
from shardbridge._json import MAX_BYTES, loads
from shardbridge.checkpoint.state._components import component_fqn, fused_tp_size
from shardbridge.checkpoint.state._repair import _multi_box_pieces, describe

__all__ = [
    "INDEX_NAME",
    "SINGLE_FILE_NAME",
    "PretrainedReport",
    "StackedSource",
    "load_pretrained",
    "read_index",
    "read_json",
    "weights_file",
]

INDEX_NAME = "model.safetensors.index.json"
"""The index ``save_pretrained`` writes beside sharded safetensors files."""
SINGLE_FILE_NAME = "model.safetensors"
"""The one file ``save_pretrained`` writes when the model fits one shard."""

# safetensors dtype names (the format's header spelling) -> torch dtypes.
_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
for _name, _attr in (("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64")):
    if hasattr(torch, _attr):
        _DTYPES[_name] = getattr(torch, _attr)

_MAX_LISTED = 8


@dataclass(frozen=True)
class _Entry:
    """One tensor of the checkpoint: its file, shape and dtype (from the header)."""

    file: Path
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class StackedSource:
    """A model tensor ``[E, ...]`` stored in the checkpoint as one tensor per expert (and component).

    See [Note: experts stored one by one].

    Example:
        >>> gate_up = StackedSource(
        ...     keys=tuple((f"mlp.experts.{e}.gate_proj.weight", f"mlp.experts.{e}.up_proj.weight") for e in range(4)),
        ...     dim=1,
        ... )
        >>> gate_up.keys[2]
        ('mlp.experts.2.gate_proj.weight', 'mlp.experts.2.up_proj.weight')
    """

    keys: tuple[tuple[str, ...], ...]
    """``keys[e]``: expert e's checkpoint keys, in the order their tensors are concatenated along
    :attr:`dim` (one key when nothing is concatenated). Each has the model tensor's shape without
    dim 0, with its own size along ``dim``."""
    dim: int = 1
    """The model tensor's dim the components are concatenated along (>= 1)."""

    def __post_init__(self) -> None:
        """Validate the key lists and the dim."""
        if not self.keys or any(not k for k in self.keys) or len({len(k) for k in self.keys}) != 1:
            raise ValueError(
                f"StackedSource.keys must list the same number (>= 1) of keys for every expert; got {self.keys!r:.200}"
            )
        if isinstance(self.dim, bool) or not isinstance(self.dim, int) or self.dim < 1:
            raise ValueError(f"StackedSource.dim={self.dim!r} must be an int >= 1 (dim 0 indexes the experts)")


@dataclass
class PretrainedReport:
    """What :func:`load_pretrained` did on this rank."""

    num_tensors: int = 0
    """Model tensors filled (tied names count once)."""
    bytes_read: int = 0
    """Bytes of checkpoint data this rank read (its slices only: ~ model bytes / shards)."""
    checkpoint_bytes: int = 0
    """Bytes of every checkpoint tensor this load used (what a full read would read)."""
    ignored_missing: list[str] = field(default_factory=list)
    """Model names absent from the checkpoint that ``ignore_missing`` allowed (left as they were)."""
    ignored_unexpected: list[str] = field(default_factory=list)
    """Checkpoint keys no model tensor used that ``ignore_unexpected`` allowed."""


# --------------------------------------------------------------------------- the folder


def _safe_name(folder: Path, name: object) -> Path:
    if (
        not isinstance(name, str)
        or not name
        or name != os.path.basename(name)
        or name in (".", "..")
        or "\\" in name
        or not name.endswith(".safetensors")
    ):
        raise ValueError(
            f"{folder / INDEX_NAME}: weight_map names file {name!r}; it must be a plain '*.safetensors' file name "
            "inside the folder (no directories); fix or regenerate the index with save_pretrained"
        )
    path = folder / name
    if not path.is_file():
        raise ValueError(
            f"{folder / INDEX_NAME} names {name!r}, which is not a file in {folder}; the folder is incomplete"
        )
    return path


def _read_headers(files: Iterable[Path]) -> dict[Path, dict[str, _Entry]]:
    from safetensors import safe_open

    out: dict[Path, dict[str, _Entry]] = {}
    for path in files:
        entries: dict[str, _Entry] = {}
        try:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    sl = f.get_slice(key)
                    dtype_name = sl.get_dtype()
                    if dtype_name not in _DTYPES:
                        raise ValueError(
                            f"{path}: tensor {key!r} has safetensors dtype {dtype_name!r}, which this torch "
                            f"cannot hold; supported: {sorted(_DTYPES)}"
                        )
                    entries[key] = _Entry(path, tuple(int(s) for s in sl.get_shape()), _DTYPES[dtype_name])
        except ValueError:
            raise
        except Exception as exc:  # safetensors raises its own SafetensorError on a bad header
            raise ValueError(f"{path}: not a readable safetensors file ({type(exc).__name__}: {exc})") from exc
        out[path] = entries
    return out


def read_json(path: str | os.PathLike[str]) -> Any:
    """A JSON file of a ``from_pretrained`` folder (``config.json``, an index), bounded, then parsed.

    Its size and nesting are measured before anything recursive parses it ([Note: bounded
    structure] in ``shardbridge/_json.py``).

    Raises:
        OSError: the file cannot be read.
        ValueError: it is larger than 256 MiB, nests deeper than 64 levels, or is not JSON
            (``json.JSONDecodeError``); the message names the file.

    Example:
        >>> read_json("Llama-3.2-1B/config.json")["model_type"]  # doctest: +SKIP
        'llama'
    """
    path = Path(path)
    size = path.stat().st_size
    if size > MAX_BYTES:
        raise ValueError(f"{path} is {size} bytes, more than the {MAX_BYTES} this reader takes; not reading it")
    return loads(path.read_bytes(), str(path))


def weights_file(path: str | os.PathLike[str]) -> Path | None:
    """The weights file ``from_pretrained`` reads in a local folder: a ``.safetensors`` file or an index.

    transformers' order (5.24, ``modeling_utils._get_resolved_checkpoint_files``; see [Note:
    file selection]): the file config.json's ``transformers_weights`` names, else
    ``model.safetensors``, else ``model.safetensors.index.json``. None when there is none.

    Raises:
        ValueError: config.json names a weights file that is not a plain ``*.safetensors`` /
            ``*.safetensors.index.json`` name inside the folder, or that file is missing.

    Example:
        >>> weights_file("/no/such/folder") is None
        True
    """
    folder = Path(path)
    explicit = _explicit_weights_name(folder)
    if explicit is not None:
        chosen = folder / explicit
        if not chosen.is_file():
            raise ValueError(
                f"{folder / 'config.json'} names transformers_weights {explicit!r}, which is not a file in {folder}; "
                "the folder is incomplete (from_pretrained cannot load it either)"
            )
        return chosen
    for name in (SINGLE_FILE_NAME, INDEX_NAME):
        if (folder / name).is_file():
            return folder / name
    return None


def _explicit_weights_name(folder: Path) -> str | None:
    """config.json's ``transformers_weights`` (what from_pretrained loads instead of the default names)."""
    try:
        config = read_json(folder / "config.json")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None  # no readable config: the default names (the model's config comes from elsewhere)
    name = config.get("transformers_weights") if isinstance(config, dict) else None
    if name is None:
        return None
    if (
        not isinstance(name, str)
        or name != os.path.basename(name)
        or not (name.endswith(".safetensors") or name.endswith(".safetensors.index.json"))
    ):
        raise ValueError(
            f"{folder / 'config.json'}: transformers_weights={name!r} must be a plain '*.safetensors' or "
            "'*.safetensors.index.json' file name inside the folder; fix config.json"
        )
    return name


def read_index(path: str | os.PathLike[str]) -> dict[str, tuple[Path, tuple[int, ...], torch.dtype]]:
    """Every tensor of a ``from_pretrained`` folder: ``{key: (file, shape, dtype)}``, headers only.

    Reads the files ``from_pretrained`` reads, in its order (see [Note: file selection]):
    ``model.safetensors`` (one file) if present, else ``model.safetensors.index.json`` (sharded).
    The index must name plain file names inside the folder, and every key it lists must be in
    the file it names.

    Raises:
        ValueError: no index or single file, a malformed index, a file outside the folder, or a
            key the index and the file headers disagree on.

    Example:
        >>> read_index("Llama-3.2-1B")["model.norm.weight"]  # doctest: +SKIP
        (PosixPath('Llama-3.2-1B/model.safetensors'), (2048,), torch.bfloat16)
    """
    folder = Path(path)
    chosen = weights_file(folder)
    if chosen is not None and not chosen.name.endswith(".index.json"):
        return {k: (e.file, e.shape, e.dtype) for k, e in _read_headers([chosen])[chosen].items()}
    if chosen is not None:
        index_path = chosen
        try:
            index = read_json(index_path)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{index_path}: not valid JSON ({exc}); regenerate it with save_pretrained") from exc
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(k, str) for k in weight_map):
            raise ValueError(
                f"{index_path}: no 'weight_map' object of key -> file name; regenerate it with save_pretrained"
            )
        files = {name: _safe_name(folder, name) for name in sorted(set(weight_map.values()), key=str)}
        headers = _read_headers(files.values())
        out = {}
        for key, name in weight_map.items():
            entry = headers[files[name]].get(key)
            if entry is None:
                raise ValueError(
                    f"{index_path} maps {key!r} to {name!r}, but that file has no such tensor; the index and "
                    "the files disagree (regenerate the folder with save_pretrained)"
                )
            out[key] = (entry.file, entry.shape, entry.dtype)
        return out
    if not Path(folder).exists():
        raise FileNotFoundError(f"{folder} does not exist; pass the folder written by save_pretrained")
    if not Path(folder).is_dir():
        raise ValueError(f"{folder} is a file, not a folder; pass the folder written by save_pretrained")
    raise ValueError(
        f"{folder} has neither {INDEX_NAME} nor {SINGLE_FILE_NAME}; pass a folder written by save_pretrained "
        "(safetensors; *.bin pickles are not read, convert them with transformers first)"
    )


# --------------------------------------------------------------------------- the model


@dataclass
class _Target:
    """One model tensor to fill (tied names grouped), and where its data comes from."""

    names: list[str]
    tensor: torch.Tensor
    spec: FusedSpec | None = None
    stacked: StackedSource | None = None
    sources: dict[str, str] = field(default_factory=dict)
    """Non-fused: {"": key}. Fused: {component: key}. Stacked: {"expert/component": key}."""
    component_sizes: tuple[int, ...] = ()
    """Stacked: each component's size along ``stacked.dim``."""


def _clean(model: nn.Module, fqn: str) -> str:
    # Wrappers (activation checkpointing, torch.compile, DDP) are not part of the checkpoint names:
    # torch's state-dict key of the tensor.
    keys = state_dict_fqns(model, fqn)
    return keys.pop() if len(keys) == 1 else fqn


def _targets(model: nn.Module, fused: Mapping[str, FusedSpec]) -> list[_Target]:
    by_id: dict[int, _Target] = {}
    order: list[_Target] = []
    for prefix, module in model.named_modules(remove_duplicate=False):
        tensors = [(n, p) for n, p in module._parameters.items() if p is not None]
        tensors += [
            (n, b) for n, b in module._buffers.items() if b is not None and n not in module._non_persistent_buffers_set
        ]
        for name, t in tensors:
            fqn = _clean(model, f"{prefix}.{name}" if prefix else name)
            target = by_id.get(id(t))
            if target is None:
                target = by_id[id(t)] = _Target(names=[], tensor=t)
                order.append(target)
            if fqn not in target.names:
                target.names.append(fqn)
    clean_fused = {_clean(model, k): v for k, v in fused.items()}
    for target in order:
        specs = {clean_fused[n] for n in target.names if n in clean_fused}
        if len(specs) > 1:
            raise ValueError(f"tied parameter {target.names} has different FusedSpecs {specs}; register one")
        target.spec = specs.pop() if specs else None
    return order


def _mapper(name_map: Callable[[str], str] | Mapping[str, str] | None) -> Callable[[str], str]:
    if name_map is None:
        return lambda n: n
    if callable(name_map):
        return name_map
    mapping = dict(name_map)
    return lambda n: mapping.get(n, n)


def _listing(items: list[str]) -> str:
    head = ", ".join(repr(i) for i in items[:_MAX_LISTED])
    return head + (f", ... ({len(items)} in all)" if len(items) > _MAX_LISTED else "")


def _matches(name: str, patterns: list[re.Pattern[str]]) -> bool:
    return any(p.fullmatch(name) for p in patterns)


def _plan(
    targets: list[_Target],
    index: Mapping[str, tuple[Path, tuple[int, ...], torch.dtype]],
    mapper: Callable[[str], str],
    *,
    cast_dtype: bool,
    ignore_missing: list[re.Pattern[str]],
    ignore_unexpected: list[re.Pattern[str]],
    report: PretrainedReport,
) -> list[_Target]:
    """Resolve every target's checkpoint keys and check shapes / dtypes; raise on any mismatch."""
    missing: list[str] = []
    problems: list[str] = []
    used: set[str] = set()
    planned: list[_Target] = []
    for target in targets:
        shape = tuple(target.tensor.shape)
        if target.stacked is not None:
            stacked_problem = _plan_stacked(target, index, missing, used, cast_dtype)
            if stacked_problem:
                problems.append(stacked_problem)
            elif target.sources:
                planned.append(target)
            continue
        if target.spec is None:
            keys = [mapper(n) for n in target.names]
            key = next((k for k in keys if k in index), None)
            if key is None:
                if all(_matches(n, ignore_missing) for n in target.names):
                    report.ignored_missing.extend(target.names)
                else:
                    missing.append(keys[0] if len(keys) == 1 else f"{keys[0]} (tied: {keys[1:]})")
                continue
            wanted = {"": (key, shape)}
        else:
            spec = target.spec
            base = target.names[0]
            wanted = {c: (mapper(component_fqn(base, c)), tuple(spec.component_shape(c, shape))) for c in spec.names}
            absent = [k for k, _ in wanted.values() if k not in index]
            if absent:
                if all(_matches(n, ignore_missing) for n in target.names):
                    report.ignored_missing.extend(target.names)
                else:
                    missing.extend(f"{k} (component of fused {base!r})" for k in absent)
                continue
        for key, want_shape in wanted.values():
            _, have_shape, have_dtype = index[key]
            used.add(key)
            if have_shape != want_shape:
                problems.append(
                    f"{key!r}: checkpoint shape {have_shape}, model {target.names[0]!r} expects {want_shape} "
                    "(a different config than the checkpoint's? build the model from the folder's config.json)"
                )
            dtype = target.tensor.dtype
            if have_dtype != dtype and not (cast_dtype and have_dtype.is_floating_point and dtype.is_floating_point):
                fix = (
                    "pass cast_dtype=True to cast floating point values"
                    if have_dtype.is_floating_point and dtype.is_floating_point
                    else "integer / bool tensors are never cast; build the model with the checkpoint's dtype"
                )
                problems.append(
                    f"{key!r}: checkpoint dtype {have_dtype}, model {target.names[0]!r} is {dtype}; {fix} "
                    "or build the model in the checkpoint's dtype"
                )
        target.sources = {c: k for c, (k, _) in wanted.items()}
        planned.append(target)
    unexpected = sorted(k for k in index if k not in used and not _matches(k, ignore_unexpected))
    report.ignored_unexpected = sorted(k for k in index if k not in used and _matches(k, ignore_unexpected))
    errors = []
    if missing:
        errors.append(
            f"{len(missing)} model tensor(s) are not in the checkpoint: {_listing(missing)}; pass name_map= if "
            "the checkpoint names them differently, or ignore_missing=[regex] for tensors you initialise yourself"
        )
    if unexpected:
        errors.append(
            f"{len(unexpected)} checkpoint key(s) match no model tensor: {_listing(unexpected)}; pass name_map= "
            "if the model names them differently, or ignore_unexpected=[regex] to skip them"
        )
    if problems:
        errors.append(f"{len(problems)} mismatch(es): " + "; ".join(problems[:_MAX_LISTED]))
    if errors:
        raise ValueError("load_pretrained: " + " | ".join(errors))
    return planned


def _plan_stacked(
    target: _Target,
    index: Mapping[str, tuple[Path, tuple[int, ...], torch.dtype]],
    missing: list[str],
    used: set[str],
    cast_dtype: bool,
) -> str | None:
    """Check a stacked target's keys, shapes and dtypes; fill its sources. A problem message or None."""
    stacked, name, shape = target.stacked, target.names[0], tuple(target.tensor.shape)
    assert stacked is not None
    if len(stacked.keys) != shape[0] or stacked.dim >= len(shape):
        return (
            f"{name!r}: a StackedSource of {len(stacked.keys)} experts along dim {stacked.dim} for a model tensor of "
            f"shape {shape} (dim 0 = experts); describe one key list per expert and a dim in [1, {len(shape)})"
        )
    absent = [k for keys in stacked.keys for k in keys if k not in index]
    if absent:
        missing.extend(f"{k} (expert of {name!r})" for k in absent)
        return None
    rest = list(shape[1:])
    sizes = tuple(index[k][1][stacked.dim - 1] if len(index[k][1]) == len(rest) else -1 for k in stacked.keys[0])
    for e, keys in enumerate(stacked.keys):
        for c, key in enumerate(keys):
            want = rest.copy()
            want[stacked.dim - 1] = sizes[c]
            have = tuple(index[key][1])
            if have != tuple(want) or sum(sizes) != shape[stacked.dim]:
                return (
                    f"{key!r} (expert {e} of {name!r}): checkpoint shape {have}; the model tensor {shape} needs "
                    f"{tuple(rest)} per expert with the components' sizes along dim {stacked.dim - 1} summing to "
                    f"{shape[stacked.dim]} (a different config than the checkpoint's?)"
                )
            dtype, have_dtype = target.tensor.dtype, index[key][2]
            if have_dtype != dtype and not (cast_dtype and have_dtype.is_floating_point and dtype.is_floating_point):
                return f"{key!r}: checkpoint dtype {have_dtype}, model {name!r} is {dtype}; pass cast_dtype=True"
            used.add(key)
            target.sources[f"{e}/{c}"] = key
    target.component_sizes = sizes
    return None


# --------------------------------------------------------------------------- reading


def _pieces(name: str, t: torch.Tensor) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    """(global offsets, local view) of every contiguous box this rank holds of ``t``."""
    if t.is_meta or (isinstance(t, DTensor) and local_tensor(t).is_meta):
        raise ValueError(
            f"{name!r} is on the meta device; materialise the model first (model.to_empty(device=...)), "
            "then load_pretrained fills it"
        )
    if not isinstance(t, DTensor):
        return [((0,) * t.dim(), t.detach())] if t.numel() else []
    found = _multi_box_pieces(t)  # (pieces, the rule that explains them)
    if found is None:
        raise ValueError(
            f"{describe(name, t)}: this rank's local tensor has shape {tuple(local_tensor(t).shape)}, which the "
            "layout algebra does not explain, so its global ranges are unknown; load into Shard / "
            "_StridedShard / Replicate placements (as FSDP2 x TP builds them)"
        )
    return [(offsets, view) for offsets, view in found[0] if view.numel()]


def _read(handle: object, key: str, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
    if not sizes:
        return handle.get_tensor(key)  # type: ignore[attr-defined]
    return handle.get_slice(key)[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]  # type: ignore[attr-defined]


@torch.no_grad()
def _fill(
    target: _Target, index: Mapping[str, tuple[Path, tuple[int, ...], torch.dtype]], report: PretrainedReport
) -> None:
    from safetensors import safe_open

    name, t, spec = target.names[0], target.tensor, target.spec
    # (key, component offsets, view) for every piece this rank holds.
    reads: list[tuple[str, tuple[int, ...], torch.Tensor]] = []
    for offsets, view in _pieces(name, t):
        if target.stacked is not None:
            reads.extend(_stacked_reads(target, offsets, view))
            continue
        if spec is None:
            reads.append((target.sources[""], offsets, view))
            continue
        tp_size = fused_tp_size(name, t, spec) if isinstance(t, DTensor) else 1
        for piece in split_local(view, spec, tp_size, offsets[spec.dim]):
            piece_offsets = list(offsets)
            piece_offsets[spec.dim] = piece.component_offset
            reads.append((target.sources[piece.name], tuple(piece_offsets), piece.view))
    for key in target.sources.values():
        report.checkpoint_bytes += _numel(index[key][1]) * index[key][2].itemsize
    by_key: dict[str, list[tuple[tuple[int, ...], torch.Tensor]]] = {}
    for key, offsets, view in reads:
        by_key.setdefault(key, []).append((offsets, view))
    for key, items in by_key.items():
        # One memory map per key, closed after it: the pages read do not stay resident.
        with safe_open(str(index[key][0]), framework="pt") as handle:
            for offsets, view in items:
                data = _read(handle, key, offsets, tuple(view.shape))
                if tuple(data.shape) != tuple(view.shape):  # internal invariant: the plan checked the shapes
                    raise AssertionError(f"{key}: read {tuple(data.shape)} for a piece of {tuple(view.shape)}")
                report.bytes_read += data.numel() * data.element_size()
                view.copy_(data)
                del data
    report.num_tensors += 1


def _stacked_reads(
    target: _Target, offsets: tuple[int, ...], view: torch.Tensor
) -> list[tuple[str, tuple[int, ...], torch.Tensor]]:
    """(key, source offsets, view) for each expert and component one local box covers.

    See [Note: experts stored one by one].
    """
    stacked = target.stacked
    assert stacked is not None
    dim, lo, hi = stacked.dim, offsets[stacked.dim], offsets[stacked.dim] + view.shape[stacked.dim]
    out = []
    for local_e in range(view.shape[0]):
        e = offsets[0] + local_e
        start = 0
        for c, size in enumerate(target.component_sizes):
            a, b = max(lo, start), min(hi, start + size)
            if a < b:
                src = list(offsets[1:])
                src[dim - 1] = a - start
                out.append((target.sources[f"{e}/{c}"], tuple(src), view[local_e].narrow(dim - 1, a - lo, b - a)))
            start += size
    return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _patterns(field: str, patterns: Iterable[str]) -> list[re.Pattern[str]]:
    """Compile ``field``'s regular expressions; a bare string is one pattern, not its characters."""
    if isinstance(patterns, str):
        patterns = [patterns]
    out = []
    for p in patterns:
        try:
            out.append(re.compile(p))
        except re.error as e:
            raise ValueError(f"{field}: {p!r} is not a regular expression ({e}); escape it with re.escape") from None
    return out


def _reshard(model: nn.Module) -> None:
    """Put FSDP2 modules in their sharded state, so the registered parameters are the shards."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def load_pretrained(
    model: nn.Module,
    path: str | os.PathLike[str],
    *,
    name_map: Callable[[str], str] | Mapping[str, str] | None = None,
    fused: Mapping[str, FusedSpec] | None = None,
    stacked: Mapping[str, StackedSource] | None = None,
    cast_dtype: bool = False,
    ignore_missing: Iterable[str] = (),
    ignore_unexpected: Iterable[str] = (),
) -> PretrainedReport:
    """Fill ``model``'s parameters and persistent buffers from a ``from_pretrained`` folder, shard-on-read.

    Call on every rank after the model is parallelized (TP, ``fully_shard``) and materialised.
    Each rank reads only the index ranges its local tensors hold (see [Note: shard-on-read]);
    no process group is used. Values are written in place, so optimizers built over the
    parameters keep them.

    Args:
        model: the model, parallelized or not (DTensor or plain parameters).
        path: the folder (``model.safetensors.index.json`` + shards, or ``model.safetensors``).
        name_map: model name -> checkpoint key (a callable, or a mapping where absent names map
            to themselves); None = the same names. Model names are ``named_parameters`` FQNs
            without ``_orig_mod`` / ``_checkpoint_wrapped_module``; a fused parameter's
            components are named by ``shardbridge.checkpoint``'s rule (``...qkv.weight`` ->
            ``...q_proj.weight``) before the map.
        fused: ``{model name: FusedSpec}`` of fused parameters; None = those registered with
            :func:`shardbridge.fused.register_fused`.
        stacked: ``{model name: StackedSource}`` of tensors stored one per expert (MoE experts
            in a hub folder); see [Note: experts stored one by one]. Their keys bypass ``name_map``.
        cast_dtype: cast floating-point checkpoint values to the model's dtype (e.g. a bf16
            checkpoint into fp32 master weights). False = a dtype mismatch is an error.
        ignore_missing: regexes (full match) of model names that may be absent (they keep their
            values).
        ignore_unexpected: regexes (full match) of checkpoint keys that may go unused.

    Returns:
        A :class:`PretrainedReport` (tensors filled, bytes this rank read).

    Raises:
        ValueError: a malformed folder, missing / unexpected keys, a shape or dtype mismatch
            (all named, checked before anything is written), a parameter on ``meta``, or a local
            layout the layout algebra cannot explain.

    Example:
        >>> model = LlamaForCausalLM(config)              # doctest: +SKIP
        >>> parallelize(model, pm)                         # TP + fully_shard  # doctest: +SKIP
        >>> load_pretrained(model, "Llama-3.2-1B", cast_dtype=True)  # doctest: +SKIP
    """
    index = read_index(path)
    report = PretrainedReport()
    missing_patterns = _patterns("ignore_missing", ignore_missing)
    unexpected_patterns = _patterns("ignore_unexpected", ignore_unexpected)
    # Sharded state FIRST: after a forward (before backward) FSDP2 registers the unsharded
    # parameters, whose storage reshard() frees -- targets collected then would be dangling.
    _reshard(model)
    fused_specs = fused_params(model) if fused is None else dict(fused)
    targets = _targets(model, fused_specs)
    stacked = dict(stacked or {})
    unknown = sorted(set(stacked) - {n for t in targets for n in t.names})
    if unknown:
        raise ValueError(f"load_pretrained: stacked names {unknown[:_MAX_LISTED]} are not tensors of the model")
    for target in targets:
        target.stacked = next((stacked[n] for n in target.names if n in stacked), None)
    targets = _plan(
        targets,
        index,
        _mapper(name_map),
        cast_dtype=cast_dtype,
        ignore_missing=missing_patterns,
        ignore_unexpected=unexpected_patterns,
        report=report,
    )
    for target in targets:
        _fill(target, index, report)
    return report
