"""Reading checkpoint files without running code from them (``.metadata``, bytes items, RNG files).

[Note: untrusted checkpoints]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A checkpoint may come from anywhere (a shared filesystem, a download), so no file of it may
run code in the reader. torch DCP's own reader does not promise that: it reads ``.metadata``
with plain ``pickle.load`` and every non-tensor ("bytes") item with
``torch.load(weights_only=False)`` (``DefaultLoadPlanner.load_bytes``), so a crafted file runs
any Python on load, inspect and export. shardbridge reads every file of a checkpoint under a
rule that admits data only::

    file                      written as                  read with
    .metadata                 pickle of DCP dataclasses   MetadataUnpickler: an allowlist of
                                                          the DCP classes and torch constants
                                                          below, then a structural check
    __R_N.distcp, tensors     torch.save of a tensor      torch.load(weights_only=True) (DCP)
    __R_N.distcp, bytes       torch.save of a value       torch.load(weights_only=True) (here)
    rng/rank-*.pt             torch.save of uint8 tensors torch.load(weights_only=True)
    shardbridge.json          JSON                        json

Anything else is refused with :class:`UntrustedCheckpointError` (a ``ValueError``) naming the
file (and key) and saying nothing from it ran. The allowlist of ``.metadata`` is what DCP
2.13's metadata holds (``torch/distributed/checkpoint/metadata.py`` and ``filesystem.py``,
checked against a real checkpoint with FSDP2 x TP DTensors, fused components, optimizer state
and bytes items): ``Metadata``, ``StorageMeta``, ``TensorStorageMetadata``,
``BytesStorageMetadata``, ``ChunkStorageMetadata``, ``TensorProperties`` (and its private
``_MEM_FORMAT_ENCODING`` enum), ``MetadataIndex``, ``_StorageInfo`` (where each item lives),
``torch.Size``, the torch dtype / layout / memory-format constants (a layout is pickled as a
call of ``torch.serialization._get_layout(name)``; here that name maps to a table lookup), and
``pathlib`` paths (``StorageMeta.checkpoint_id``; pure paths here, no filesystem access). The
only callables an admitted pickle can reach are those constructors, which store their
arguments. The unpickler is Python's own, with one more rule: ``BUILD`` (set an object's
state) only applies to instances of the admitted dataclasses, never to a class, so a pickle
cannot rewrite an admitted class for the rest of the process.

After unpickling, the structure is checked as DCP itself would write it: every tensor's
chunks lie inside it and cover it exactly, each element once ([Note: exact chunk coverage];
DCP's own save-time rule only adds up volumes), every chunk of
every tensor and every bytes item has exactly one storage record (and every record a chunk or
item), every item lives in a ``.distcp`` file of this directory (no ``/``, no ``..``) inside
the file's size, items of one file do not overlap, no stream transforms (shardbridge writes
none), and each tensor chunk's record is at least as long as its raw bytes. So the bytes a
reader allocates for a declared shape are bounded by the bytes on disk. Readers also refuse
symbolic links and special files in the directory (:func:`check_no_links`; ``load``'s
integrity check in ``_integrity.py``).

Still possible with a hostile checkpoint (see docs/checkpoints.md, "Threat model"): wrong
values (see Integrity: checksums and ``shardbridge ckpt verify``), large allocations up to the
size of its files, slow reads of very large metadata, and classes the PROCESS registered with
``torch.serialization.add_safe_globals`` (weights_only admits them; TE registers its FP8
tensor classes), whose constructors run.

Cost: Python's pure-Python unpickler is ~2.5x slower than the C one (30 MB of metadata,
190k chunks: 10 s instead of 4 s); the checks add a linear pass.
"""

from __future__ import annotations

import io
import logging
import math
import os
import pickle
import re
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import ReadItem

from shardbridge._compat import DCP_MEM_FORMAT_ENCODING, DCPStorageInfo, PyUnpickler, dcp_set_element
from shardbridge.checkpoint.storage._backend import Stored
from shardbridge.checkpoint.storage._coverage import coverage_fault
from shardbridge.checkpoint.storage._destination import _link_or_special
from shardbridge.checkpoint.storage._files import DATA_FILE_PATTERN

# -- private upstream names: reached through shardbridge._compat ([Note: upstream internals]) --
_set_element = dcp_set_element
_StorageInfo = DCPStorageInfo
_MEM_FORMAT_ENCODING = DCP_MEM_FORMAT_ENCODING
_PyUnpickler = PyUnpickler
_LAYOUT_PICKLE_NAME = ("torch.serialization", "_get_layout")  # how torch pickles a torch.layout
_DCP_METADATA_NAME = ".metadata"  # filesystem._metadata_fn
# ----------------------------------------------------------------------------------------------

__all__ = [
    "MetadataUnpickler",
    "UntrustedCheckpointError",
    "check_no_links",
    "load_bytes_weights_only",
    "raise_untrusted",
    "read_metadata",
]

logger = logging.getLogger("shardbridge.checkpoint")

_REFUSED = "this checkpoint is not trusted; nothing from it was executed"


class UntrustedCheckpointError(ValueError):
    """A checkpoint file holds something other than the data shardbridge / DCP write.

    See [Note: untrusted checkpoints]. Nothing from the file was executed.
    """


_TORCH_CONSTANTS: dict[str, Any] = {
    name: value
    for name, value in vars(torch).items()
    if isinstance(value, (torch.dtype, torch.layout, torch.memory_format))
}
_LAYOUTS = {str(v): v for v in _TORCH_CONSTANTS.values() if isinstance(v, torch.layout)}


def _layout_by_name(name: Any) -> torch.layout:
    """Stands in for ``torch.serialization._get_layout``: a table lookup, nothing else."""
    if not isinstance(name, str) or name not in _LAYOUTS:
        raise pickle.UnpicklingError(f"unknown torch layout {name!r}")
    return _LAYOUTS[name]


_DCP_CLASSES: tuple[type, ...] = (
    Metadata,
    StorageMeta,
    TensorStorageMetadata,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    TensorProperties,
    MetadataIndex,
    _StorageInfo,
)

_ADMITTED: dict[tuple[str, str], Any] = {
    **{(cls.__module__, cls.__qualname__): cls for cls in _DCP_CLASSES},
    (_MEM_FORMAT_ENCODING.__module__, _MEM_FORMAT_ENCODING.__qualname__): _MEM_FORMAT_ENCODING,
    ("torch", "Size"): torch.Size,
    **{("torch", name): value for name, value in _TORCH_CONSTANTS.items()},
    _LAYOUT_PICKLE_NAME: _layout_by_name,
    # StorageMeta.checkpoint_id: the saving run's path, as whichever path class it used.
    ("pathlib", "PosixPath"): PurePosixPath,
    ("pathlib", "PurePosixPath"): PurePosixPath,
    ("pathlib", "WindowsPath"): PureWindowsPath,
    ("pathlib", "PureWindowsPath"): PureWindowsPath,
}
"""(module, name) a ``.metadata`` pickle may reference -> the object it gets instead."""


MAX_DEPTH = 32
"""Nesting of any object a ``.metadata`` pickle builds (DCP's own: 7)."""
MAX_TUPLE = 1024
"""Elements of a tuple, those of the tuples inside it included (DCP's own: a ``torch.Size`` and
its arguments, a flatten path, a ``TensorProperties`` state: a few dozen at most)."""
_NESTS = frozenset({tuple, torch.Size, list, dict, PurePosixPath, PureWindowsPath, *_DCP_CLASSES})
"""The types (exactly) of what an admitted pickle builds that holds other objects."""
_MARK = -1
_BUILDING = {  # opcode -> (objects it takes from the stack, _MARK: those since the mark; whether they go INTO the one below)
    pickle.TUPLE1: (1, False), pickle.TUPLE2: (2, False), pickle.TUPLE3: (3, False), pickle.TUPLE: (_MARK, False),
    pickle.LIST: (_MARK, False), pickle.DICT: (_MARK, False),
    pickle.REDUCE: (2, False), pickle.NEWOBJ: (2, False), pickle.NEWOBJ_EX: (3, False),
    pickle.APPEND: (1, True), pickle.APPENDS: (_MARK, True), pickle.SETITEM: (2, True), pickle.SETITEMS: (_MARK, True),
    pickle.BUILD: (1, True),
}  # fmt: skip
_CALLS = (pickle.REDUCE[0], pickle.NEWOBJ[0], pickle.NEWOBJ_EX[0])  # the arguments' contents become the object's
_BUILD_OP, _REDUCE_OP = pickle.BUILD[0], pickle.REDUCE[0]
_EMPTY = ()
_INDEX_FIELDS = frozenset({"fqn", "offset", "index"})
_NEVER = {  # opcodes DCP metadata never uses, and why they are refused
    pickle.EXT1: "a pickle extension code (copyreg's cache hands out objects without find_class)",
    pickle.EXT2: "a pickle extension code (copyreg's cache hands out objects without find_class)",
    pickle.EXT4: "a pickle extension code (copyreg's cache hands out objects without find_class)",
    pickle.DUP: "DUP (one object twice on the stack)",
    pickle.OBJ: "protocol 0/1 object calls", pickle.INST: "protocol 0/1 object calls",
    pickle.EMPTY_SET: "a set", pickle.ADDITEMS: "a set", pickle.FROZENSET: "a frozenset",
}  # fmt: skip


def _flat_index(fqn: Any = None, offset: Any = None, index: Any = None) -> bool:
    """Whether these are a ``MetadataIndex``'s fields as DCP writes them (nothing nested to hash)."""
    return (
        type(fqn) is str
        and (offset is None or type(offset) is torch.Size or (type(offset) is tuple and all(type(v) is int for v in offset)))
        and type(index) in (int, type(None))
    )


_ARGUMENTS = {
    MetadataIndex: _flat_index,
    _MEM_FORMAT_ENCODING: lambda value=None, *rest: type(value) in (int, str) and not rest,
}
"""Admitted callables whose arguments are hashed or formatted into an error: what they may be given."""


def _show(value: Any) -> str:
    """``value`` from an untrusted file, shown without walking it (no repr of a structure)."""
    if type(value) is str:
        return repr(value[:80]) + ("..." if len(value) > 80 else "")
    if type(value) is int:
        return repr(value) if abs(value) < 1 << 64 else f"a {value.bit_length()}-bit int"
    if value is None or type(value) in (bool, float) or isinstance(value, (torch.dtype, torch.layout)):
        return repr(value)
    if type(value) in (tuple, torch.Size) and len(value) <= 16 and all(type(v) is int and abs(v) < 1 << 64 for v in value):
        return repr(tuple(value))
    return f"a {type(value).__name__}"


class _Memo(dict):
    """The unpickler's memo, keeping what a reused slot held alive (so that no id is reused while it loads).

    A slot number is below the stream's length (pickle numbers slots from 0, one per ``PUT``):
    C's unpickler, DCP's reader, allocates every slot up to the number it is given, so a flipped
    byte in a slot number would make it ask for tens of GB."""

    def __init__(self, slots: int) -> None:
        super().__init__()
        self.slots = slots
        self.replaced: list[Any] = []

    def __setitem__(self, key: Any, value: Any) -> None:
        if not 0 <= key < self.slots:
            raise pickle.UnpicklingError(f"memo slot {key} beyond the stream's {self.slots} bytes")
        if key in self:
            self.replaced.append(self[key])
        super().__setitem__(key, value)


def _hook(original: Callable[[Any], None], method: Callable[..., None], *args: Any) -> Callable[[Any], None]:
    """An unpickler opcode handler: ``method(self, original, *args)``."""
    return lambda self: method(self, original, *args)


class MetadataUnpickler(_PyUnpickler):
    """Unpickles DCP metadata admitting only the globals in :data:`_ADMITTED`, bounded in structure.

    See [Note: untrusted checkpoints]. Every refusal raises :class:`UntrustedCheckpointError`
    naming ``where`` before anything the pickle names is called. Every object's nesting depth
    (:data:`MAX_DEPTH`) and every tuple's size (:data:`MAX_TUPLE`) are counted as the stack
    builds them, so nothing recursive in C (a hash, a comparison, a repr) ever meets an
    unbounded structure: [Note: bounded structure].
    """

    dispatch = dict(_PyUnpickler.dispatch)

    def __init__(self, file: Any, *, where: str) -> None:
        super().__init__(file)
        self._where = where
        self.dropped_strides = False  # torch >= 2.15's TensorProperties.strides, on a torch without the field
        self._nested: dict[int, tuple[int, int]] = {}  # id -> (depth, tuple size): on the stack, holding nests
        self._kept: dict[int, tuple[int, int]] = {}  # the same, every memoized object (the memo keeps it alive)
        self._closed: set[int] = set()  # memoized objects another one took: never changed again
        self.memo = _Memo(len(file.getbuffer()) if isinstance(file, io.BytesIO) else 1 << 62)

    def find_class(self, module: str, name: str) -> Any:
        try:
            return _ADMITTED[(module, name)]
        except (KeyError, TypeError):
            raise UntrustedCheckpointError(
                f"{self._where} references pickle global '{_show(module)[1:-1]}.{_show(name)[1:-1]}', which DCP "
                f"metadata never holds: {_REFUSED}"
            ) from None

    def persistent_load(self, pid: Any) -> Any:
        raise UntrustedCheckpointError(
            f"{self._where} holds a pickle persistent id, which DCP metadata never holds: {_REFUSED}"
        )

    def _refuse(self, what: str) -> UntrustedCheckpointError:
        return UntrustedCheckpointError(f"{self._where} {what}, which DCP metadata never does: {_REFUSED}")

    def _build(self, original: Callable[[Any], None], op: int, count: int, into: bool) -> None:
        """Run ``op``, counting the depth and tuple size of what it builds, never recursing.

        Objects holding nothing nested cost no bookkeeping; ``_nested`` keeps the others while
        they are on the stack, ``_kept`` every memoized one. A memoized object is closed once
        something took it (``_closed``): it may be referenced again, never changed, so no depth
        counted for a holder goes stale."""
        stack = self.stack
        taken = stack if count == _MARK else stack[len(stack) - count :]
        nested = [x for x in taken if type(x) in _NESTS and x is not _EMPTY]
        if op == _BUILD_OP:
            self._check_build(stack[-2] if len(stack) >= 2 else None, stack[-1] if stack else None)
        elif op == _REDUCE_OP and len(stack) >= 2 and (stack[-2] is MetadataIndex or stack[-2] is _MEM_FORMAT_ENCODING):
            if not (type(stack[-1]) is tuple and _ARGUMENTS[stack[-2]](*stack[-1])):  # they hash / format them
                raise self._refuse(f"calls {stack[-2].__name__} with {_show(stack[-1])}")
        original(self)
        top = self.stack[-1]
        key = id(top)
        if into and key in self._closed:
            raise self._refuse("changes an object after another took it")
        if not nested:
            return
        kept, inner = self._kept, []
        for x in nested:  # taken: off the stack
            k = id(x)
            hit = self._nested.pop(k, None)
            if k in kept:
                self._closed.add(k)
                hit = hit or kept[k]
            inner.append(hit or (1, len(x) if type(x) is tuple else 0))
        if type(top) is torch.Size:  # ints only
            return
        depth, size = max(inner)[0] + (op not in _CALLS), 0
        if type(top) is tuple:
            size = len(top) + sum(n for _, n in inner)
        if into:
            depth = max(depth, (self._nested.get(key) or kept.get(key) or (1, 0))[0])
        if depth > MAX_DEPTH or size > MAX_TUPLE:
            what = f"nests objects {depth} deep (at most {MAX_DEPTH})" if depth > MAX_DEPTH else (
                f"builds a tuple of {size} elements (at most {MAX_TUPLE})")  # fmt: skip
            raise UntrustedCheckpointError(f"{self._where} {what}, beyond what DCP metadata holds: {_REFUSED}")
        self._nested[key] = (depth, size)
        if key in kept:
            kept[key] = (depth, size)

    def _memo_put(self, original: Callable[[Any], None]) -> None:
        original(self)
        top = self.stack[-1]
        if type(top) in _NESTS:  # kept alive by the memo: its id stays its own
            self._kept[id(top)] = self._nested.get(id(top)) or (1, len(top) if isinstance(top, tuple) else 0)

    def _never(self, why: str) -> None:
        raise self._refuse(f"uses {why}")

    def _check_build(self, target: Any, state: Any) -> None:
        if isinstance(target, type) or not isinstance(target, _DCP_CLASSES):
            raise self._refuse(f"sets the state of a {type(target).__name__} object ({_show(target)})")
        if type(target) is MetadataIndex:  # the one hashable class: its hash walks its fields
            ok = type(state) is dict and state.keys() <= _INDEX_FIELDS and _flat_index(**state)
        elif type(target) is TensorProperties:  # its __setstate__ formats what it does not know into an error
            kinds = (torch.dtype, torch.layout, bool, _MEM_FORMAT_ENCODING, bool)
            ok = (
                type(state) is tuple
                and len(state) in (5, 6)  # 6: torch >= 2.15 adds `strides` (None, or a tuple of ints)
                and all(isinstance(v, k) for v, k in zip(state, kinds))
                and (len(state) == 5 or state[5] is None or (type(state[5]) is tuple and all(type(v) is int for v in state[5])))
            )
            if ok and len(state) == 6 and "strides" not in TensorProperties.__dataclass_fields__:
                # torch >= 2.15's sixth field: the local strides of the first rank that wrote the
                # tensor, read by nothing but its ShardedTensor; this torch's class has no place for it
                self.stack[-1] = state[:5]
                self.dropped_strides |= state[5] is not None
        else:
            ok = True
        if not ok:
            raise self._refuse(f"gives a {type(target).__name__} the state {_show(state)}")

    for _op, (_count, _into) in _BUILDING.items():
        dispatch[_op[0]] = _hook(_PyUnpickler.dispatch[_op[0]], _build, _op[0], _count, _into)
    for _op in (pickle.PUT, pickle.BINPUT, pickle.LONG_BINPUT, pickle.MEMOIZE):
        dispatch[_op[0]] = _hook(_PyUnpickler.dispatch[_op[0]], _memo_put)
    for _op, _why in _NEVER.items():
        dispatch[_op[0]] = lambda self, why=_why: self._never(why)
    del _op, _count, _into, _why


def read_metadata(
    checkpoint: Stored | str | os.PathLike[str],
    *,
    data_files: bool = True,
    select: Callable[[Metadata], Iterable[str]] | None = None,
) -> Metadata:
    """The DCP metadata of a checkpoint, read without running code from it.

    Chunk offsets and sizes pickled as tuples of ints (Megatron-FSDP's own DCP writer, e.g.
    Megatron-LM's ``fsdp_dtensor`` checkpoints, writes them so; torch's writes ``torch.Size``)
    are read as ``torch.Size``, so such checkpoints pass the structure check DCP's own pass.

    Args:
        checkpoint: the stored checkpoint (or a local checkpoint directory).
        data_files: also check that every item lies inside its data file (what bounds the
            memory a reader allocates by the bytes on disk); False for readers of the
            metadata alone (inspect), which then describe a checkpoint with damaged data files.
        select: for a reader of some entries only (a foreign checkpoint whose other entries
            may be damaged): given the unpickled metadata, returns the keys to keep (it may
            raise its own error); the others are dropped with their storage records before
            the structure check, which then covers exactly the kept entries. None = all.

    Raises:
        UntrustedCheckpointError: the file references anything but DCP metadata classes,
            or its structure is not what DCP writes (see [Note: untrusted checkpoints]).
        ValueError: the file is missing or not a pickle.

    Example:
        >>> md = read_metadata("ckpt/step-00000010")  # doctest: +SKIP
        >>> sorted(md.state_dict_metadata)[:1]  # doctest: +SKIP
        ['model.layers.0.attention.o_proj.weight']
    """
    stored = _stored(checkpoint)
    where = repr(stored.show(_DCP_METADATA_NAME))
    try:
        data = stored.backend.read_bytes(stored.file(_DCP_METADATA_NAME))
    except (FileNotFoundError, IsADirectoryError):
        raise ValueError(f"{where} does not exist; the checkpoint is damaged") from None
    try:
        unpickler = MetadataUnpickler(io.BytesIO(data), where=where)
        metadata = unpickler.load()
    except UntrustedCheckpointError:
        raise
    except Exception as err:  # noqa: BLE001 (a pickle stream that is not DCP metadata: report, never run)
        raise ValueError(
            f"{where} is not DCP metadata ({type(err).__name__}: {err}); the checkpoint is damaged or was not "
            "written by shardbridge / DCP"
        ) from None
    if unpickler.dropped_strides:
        logger.info(
            "%s was written by torch >= 2.15: its tensors' local strides (read only by ShardedTensor) are dropped, "
            "torch %s has no field for them",
            where,
            torch.__version__,
        )
    if type(metadata) is Metadata and isinstance(metadata.state_dict_metadata, dict):
        _sizes_as_torch_size(metadata)
        if select is not None:
            _keep_only(metadata, set(select(metadata)))
    try:
        _check_metadata(metadata, stored if data_files else None, where)
    except (AttributeError, TypeError, KeyError) as exc:  # an admitted object built without its fields
        raise _refuse(where, f"holds an object without the fields DCP gives it ({type(exc).__name__}: {exc})") from None
    return metadata


def _sizes_as_torch_size(md: Metadata) -> None:
    """Chunk offsets / sizes written as tuples of ints -> ``torch.Size`` (anything else is left to the check)."""
    for entry in md.state_dict_metadata.values():
        if type(entry) is not TensorStorageMetadata or not isinstance(entry.chunks, list):
            continue
        for chunk in entry.chunks:
            if type(chunk) is not ChunkStorageMetadata:
                continue
            for name in ("offsets", "sizes"):
                value = getattr(chunk, name)
                if type(value) is tuple and all(type(v) is int for v in value):
                    setattr(chunk, name, torch.Size(value))


def _keep_only(md: Metadata, keep: set[str]) -> None:
    """Drop every entry but ``keep`` from ``md``, with the storage records of the dropped ones."""
    md.state_dict_metadata = {k: v for k, v in md.state_dict_metadata.items() if k in keep}
    if isinstance(md.storage_data, dict):
        md.storage_data = {i: r for i, r in md.storage_data.items() if getattr(i, "fqn", None) in keep}


def _stored(checkpoint: Stored | str | os.PathLike[str]) -> Stored:
    """A checkpoint given as a local directory (files beside the manifest) or a URI, as a :class:`Stored`."""
    if isinstance(checkpoint, Stored):
        return checkpoint
    from shardbridge.checkpoint.storage._location import is_uri, locate, open_checkpoint

    if is_uri(checkpoint):
        where = locate(checkpoint)
        try:
            return open_checkpoint(where, need_metadata=False)[0]
        except ValueError:
            return Stored(where.backend, where.path, where.path)
    from shardbridge.checkpoint.storage._local import LOCAL

    path = os.fspath(checkpoint)
    return Stored(LOCAL, path, path)


def _refuse(where: str, what: str) -> UntrustedCheckpointError:
    return UntrustedCheckpointError(f"{where} {what}, which DCP never writes: {_REFUSED}")


def _is_size(value: Any) -> bool:
    return isinstance(value, torch.Size) and all(type(v) is int and v >= 0 for v in value)


def _check_metadata(md: Any, files: Stored | str | os.PathLike[str] | None, where: str) -> None:
    """The structure DCP writes; see [Note: untrusted checkpoints].

    ``files``: the checkpoint whose data files must hold every item (None: not checked).
    """
    if type(md) is not Metadata:
        raise _refuse(where, f"holds a {type(md).__name__} instead of DCP Metadata")
    if not isinstance(md.state_dict_metadata, dict):
        raise _refuse(where, "has no state_dict_metadata dict")
    checked: set[tuple[int, Any, Any]] = set()  # entries sharing one chunk list (one layout) are checked once
    for key, entry in md.state_dict_metadata.items():
        if not isinstance(key, str):
            raise _refuse(where, f"has a non-string key {key!r}")
        if type(entry) is BytesStorageMetadata:
            continue
        if type(entry) is not TensorStorageMetadata:
            raise _refuse(where, f"describes {key!r} as a {type(entry).__name__}")
        same = (id(entry.chunks), entry.size, type(entry.properties))
        if isinstance(entry.chunks, list) and same in checked and _is_size(entry.size):
            props = entry.properties
            if type(props) is TensorProperties and isinstance(props.dtype, torch.dtype):
                continue
        _check_tensor_entry(key, entry, where)
        if isinstance(entry.chunks, list):
            checked.add(same)
    if md.planner_data is not None:
        if not isinstance(md.planner_data, dict) or not all(
            isinstance(k, str) and isinstance(v, (tuple, list)) and all(isinstance(p, (str, int)) for p in v)
            for k, v in md.planner_data.items()
        ):
            raise _refuse(where, "holds planner data that is not {key: path of names}")
    if md.storage_meta is not None and type(md.storage_meta) is not StorageMeta:
        raise _refuse(where, f"holds storage_meta of type {type(md.storage_meta).__name__}")
    if md.version is not None and not isinstance(md.version, str):
        raise _refuse(where, f"holds version {md.version!r}")
    _check_storage(md, None if files is None else _stored(files), where)


def _check_tensor_entry(key: str, entry: TensorStorageMetadata, where: str) -> None:
    props = entry.properties
    if type(props) is not TensorProperties or not isinstance(props.dtype, torch.dtype):
        raise _refuse(where, f"gives {key!r} properties that are not a TensorProperties with a dtype")
    if not _is_size(entry.size) or not isinstance(entry.chunks, list):
        raise _refuse(where, f"gives {key!r} a size {entry.size!r} that is not a torch.Size of ints >= 0")
    volume = 0
    for chunk in entry.chunks:
        if type(chunk) is not ChunkStorageMetadata or not (_is_size(chunk.offsets) and _is_size(chunk.sizes)):
            raise _refuse(where, f"gives {key!r} a chunk that is not offsets + sizes")
        if not (len(chunk.offsets) == len(chunk.sizes) == len(entry.size)) or any(
            o + s > g for o, s, g in zip(chunk.offsets, chunk.sizes, entry.size)
        ):
            raise _refuse(
                where,
                f"places a chunk of {key!r} at {tuple(chunk.offsets)} + {tuple(chunk.sizes)} outside its size "
                f"{tuple(entry.size)}",
            )
        volume += math.prod(chunk.sizes)
    if volume != math.prod(entry.size):
        raise _refuse(
            where,
            f"gives {key!r} chunks of {volume} elements for a size {tuple(entry.size)} of {math.prod(entry.size)}",
        )
    # Equal volumes do not rule out an overlap with a matching gap; see [Note: exact chunk coverage].
    fault = coverage_fault(entry.size, [(tuple(c.offsets), tuple(c.sizes)) for c in entry.chunks])
    if fault is not None:
        raise _refuse(where, f"gives {key!r} (size {tuple(entry.size)}) chunks that {fault}")


def _check_storage(md: Metadata, stored: Stored | None, where: str) -> None:
    storage = md.storage_data
    if not isinstance(storage, dict):
        raise _refuse(where, "has no storage_data dict (where each item lives)")
    spans: dict[str, list[tuple[int, int]]] = {}
    chunks: dict[str, dict[torch.Size, ChunkStorageMetadata]] = {}
    for index, info in storage.items():
        if (
            type(index) is not MetadataIndex
            or type(info) is not _StorageInfo
            or not (vars(index).keys() <= _INDEX_FIELDS and _flat_index(**vars(index)))
        ):
            raise _refuse(where, f"holds a storage entry {index!r:.80} -> {info!r:.80}")
        entry = md.state_dict_metadata.get(index.fqn)
        if entry is None:
            raise _refuse(where, f"stores an item {index.fqn!r} that it does not describe")
        name = info.relative_path
        if not isinstance(name, str) or not DATA_FILE_PATTERN.fullmatch(name) or name.startswith(".."):
            raise _refuse(where, f"places {index.fqn!r} in {name!r}, which is not a .distcp file of this directory")
        if type(info.offset) is not int or type(info.length) is not int or info.offset < 0 or info.length < 0:
            raise _refuse(where, f"places {index.fqn!r} at offset {info.offset!r}, length {info.length!r}")
        if info.transform_descriptors:
            raise _refuse(where, f"asks for stream transforms {info.transform_descriptors!r} for {index.fqn!r}")
        if isinstance(entry, TensorStorageMetadata):
            if index.fqn not in chunks:
                chunks[index.fqn] = {c.offsets: c for c in entry.chunks}
            chunk = chunks[index.fqn].get(index.offset) if isinstance(index.offset, torch.Size) else None
            if chunk is None:
                raise _refuse(where, f"stores a chunk of {index.fqn!r} at {index.offset!r} that it does not describe")
            raw = math.prod(chunk.sizes) * entry.properties.dtype.itemsize
            if info.length < raw:
                raise _refuse(
                    where,
                    f"stores {raw} bytes of {index.fqn!r} at {tuple(chunk.offsets)} in a {info.length}-byte record",
                )
        elif index.offset is not None:
            raise _refuse(where, f"stores the bytes item {index.fqn!r} at {index.offset!r}, as a tensor chunk")
        spans.setdefault(name, []).append((info.offset, info.length))
    _check_every_chunk_stored(md, where)
    sizes: dict[str, int] | None = None
    for name, items in spans.items():
        items.sort()
        end = 0
        for offset, length in items:
            if offset < end:
                raise _refuse(where, f"places overlapping items in {name!r} (at byte {offset})")
            end = offset + length
        if stored is None:
            continue
        if sizes is None:
            sizes = {n: e.size for n, e in stored.backend.listing(stored.data).items() if e.regular}
        shown = stored.show(name)
        if name not in sizes:
            raise ValueError(f"data file {shown!r} is missing; the checkpoint is damaged")
        if end > sizes[name]:
            raise ValueError(
                f"data file {shown!r} is truncated ({sizes[name]} of {end} bytes); the checkpoint is damaged"
            )


def _check_every_chunk_stored(md: Metadata, where: str) -> None:
    """Every chunk of every tensor (and every bytes item) has exactly one storage record.

    With the checks above (each record lies inside its file and is at least as long as its
    chunk's raw bytes), this bounds the bytes a reader allocates for a declared shape by the
    bytes on disk: a chunk without a record would let a few-KiB checkpoint declare GiBs.
    """
    stored = {(index.fqn, index.offset) for index in md.storage_data}
    for key, entry in md.state_dict_metadata.items():
        if type(entry) is BytesStorageMetadata:
            if (key, None) not in stored:
                raise _refuse(where, f"describes {key!r} but stores no record of it")
            continue
        seen: set[torch.Size] = set()
        for chunk in entry.chunks:
            at = tuple(chunk.offsets)
            if chunk.offsets in seen:
                raise _refuse(where, f"describes a chunk of {key!r} at {at} twice")
            seen.add(chunk.offsets)
            if (key, chunk.offsets) not in stored:
                raise _refuse(where, f"describes a chunk of {key!r} at {at} but stores no record of it")


def check_no_links(checkpoint: Stored | str | os.PathLike[str]) -> None:
    """ValueError naming the first entry of a checkpoint that is a symbolic link or special file.

    shardbridge and DCP write regular files and directories only; a link (to a file outside
    the directory, or to another checkpoint's file) is never read through, as ``load``'s
    integrity check refuses it ("not a regular file"). A FIFO would block a reader. One
    directory walk, no data read; nothing is checked when the checkpoint is not a directory
    (the manifest reader reports that), nor on object stores (objects are never links).
    """
    stored = _stored(checkpoint)
    if stored.backend.remote or not os.path.isdir(stored.data):
        return
    top = Path(stored.data)
    for dirpath, dirnames, filenames in os.walk(top, followlinks=False):
        for name in sorted((*dirnames, *filenames)):
            entry = Path(dirpath) / name
            if (what := _link_or_special(str(entry), missing=(FileNotFoundError,))) is None:
                continue
            rel = entry.relative_to(top).as_posix()
            raise ValueError(
                f"checkpoint {str(stored)!r} is damaged: {rel}: {what}, which shardbridge never writes; not reading "
                f"through it. Copy the real file in; `shardbridge ckpt verify {stored}` lists every problem"
            )


# -- weights_only loads ------------------------------------------------------------------------


def load_bytes_weights_only(data: io.BytesIO | bytes, *, where: str) -> Any:
    """``torch.load(data, weights_only=True)``; a refused pickle -> :class:`UntrustedCheckpointError`."""
    stream = data if isinstance(data, io.BytesIO) else io.BytesIO(data)
    try:
        return torch.load(stream, weights_only=True)
    except pickle.UnpicklingError as err:
        first = str(err).strip().splitlines()
        raise UntrustedCheckpointError(
            f"{where} holds a pickle that torch.load(weights_only=True) refuses "
            f"({first[0] if first else type(err).__name__}; {_weights_only_reason(str(err))}): "
            "shardbridge writes only plain tensors and Python values there; "
            f"{_REFUSED}"
        ) from None


def _weights_only_reason(text: str) -> str:
    match = re.search(r"Unsupported global: GLOBAL ([\w.]+)", text)
    return f"pickle global '{match.group(1)}'" if match else "not plain data"


class WeightsOnlyBytes:
    """Mixin for a ``DefaultLoadPlanner``: bytes items load with ``weights_only=True``.

    See [Note: untrusted checkpoints]. :class:`TrustedReader` only hands bytes items to
    planners with this mixin (or ones that declare ``weights_only_bytes = True``).
    """

    weights_only_bytes = True
    checkpoint_dir: Stored | None = None  # set by TrustedReader.read_data, for messages

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        storage = getattr(self.metadata, "storage_data", None) or {}  # type: ignore[attr-defined]
        info = storage.get(read_item.storage_index)
        file = info.relative_path if info is not None else "a data file"
        if self.checkpoint_dir is not None and info is not None:
            file = self.checkpoint_dir.show(file)
        obj = load_bytes_weights_only(value, where=f"{file!r} (item {fqn!r})")
        if self.flatten_state_dict:  # type: ignore[attr-defined]
            _set_element(self.original_state_dict, self.mappings[fqn], obj)  # type: ignore[attr-defined]
        else:
            self.state_dict[fqn] = obj  # type: ignore[attr-defined]


@contextmanager
def raise_untrusted() -> Iterator[None]:
    """Re-raise an :class:`UntrustedCheckpointError` that DCP wrapped in a ``CheckpointException``.

    DCP gathers every rank's failure into one ``CheckpointException`` on every rank, so every
    rank finds and raises the same error (see [Note: symmetric errors] in ``_dist.py``).
    """
    try:
        yield
    except CheckpointException as exc:
        for _, (cause, _tb) in sorted(exc.failures.items()):
            if isinstance(cause, UntrustedCheckpointError):
                raise UntrustedCheckpointError(str(cause)) from None
        raise
