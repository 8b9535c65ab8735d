"""Stage a portable state dict to host memory: the snapshot an asynchronous save writes.

See [Note: async save] in ``_async.py``. The input is what :func:`build_portable_state`
returns (layouts repaired, fused parameters split, FP8 made plain), so the snapshot holds
exactly the boxes a synchronous save would write. Every tensor becomes a host copy:

- a ``DTensor`` becomes :class:`LocalChunks` of the boxes DCP itself would write for it (its
  own ``__create_write_items__``), so the writer thread never touches the device mesh;
- :class:`LocalChunks` (repaired layouts, fused components) keep their boxes, copied;
- a plain tensor is copied; a list or tuple of immutable values (hyperparameters, FQNs) is
  copied item by item; any other value (bytes items, containers of tensors) is deep-copied.

Copies go into buffers kept from the previous save when shapes and dtypes match (no page
faults on the training thread's critical path after the first save); on CUDA they are pinned
and copied with ``non_blocking`` then synchronised once. A DTensor's boxes are kept the same
way, under its name and layout (mesh, placements, shape, stride, dtype): DCP's
``__create_write_items__`` runs once per tensor and layout, not once per save.

``later``: the storages of tensors that only the optimizer's ``step`` changes (its parameters and
state): their copies are not made by :meth:`Stager.stage` but returned as :class:`Pending`, which
the writer thread runs while training goes on ([Note: background staging] in ``_async.py``).
"""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from shardbridge._compat import local_tensor
from shardbridge.checkpoint.state._chunks import LocalChunks
from shardbridge.checkpoint.state._repair import dtensor_origin

__all__ = ["Pending", "Stager", "storages"]


def storages(tensors: Any) -> set[int]:
    """The storage addresses of ``tensors`` (a DTensor's local tensor; empty storages left out)."""
    out = set()
    for t in tensors:
        if isinstance(t, torch.Tensor):
            local = t.to_local() if isinstance(t, DTensor) else t
            ptr = local.untyped_storage().data_ptr()
            if ptr:
                out.add(ptr)
    return out


_ATOMS = (str, int, float, bool, bytes, type(None))


def _plain(value: Any) -> bool:
    """Whether ``value`` is an immutable atom or a list / tuple of such (nested)."""
    return isinstance(value, _ATOMS) or (type(value) in (list, tuple) and all(_plain(v) for v in value))


def _plain_copy(value: Any) -> Any:
    """A copy of a :func:`_plain` value: its lists new, its atoms and tuples of atoms shared (immutable)."""
    if type(value) is list:
        return [_plain_copy(v) for v in value]
    if type(value) is tuple:
        return tuple(_plain_copy(v) for v in value)
    return value


@dataclass
class Pending:
    """Copies of a snapshot left for later: (name, buffer, source, the source's version when staged)."""

    copies: list[tuple[str, torch.Tensor, torch.Tensor, int]] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)
    """Set once the copies are made (or failed): the sources may change from then on."""

    def run(self) -> None:
        """Make the copies, then set :attr:`done`; RuntimeError naming a source changed in place
        since it was staged."""
        try:
            self._copy()
        finally:
            self.copies.clear()
            self.done.set()

    def _copy(self) -> None:
        cuda = False
        for name, buf, src, version in self.copies:
            cuda = cuda or src.device.type == "cuda"
            buf.copy_(src, non_blocking=src.device.type == "cuda")
            if src._version != version:
                raise RuntimeError(
                    f"{name} was changed in place before the asynchronous save copied it (only optimizer.step(), "
                    "which waits for the copy, may change the optimizer's parameters and state while the save is "
                    "staging); call the save's staged() before changing them otherwise"
                )
        if cuda:
            torch.cuda.synchronize()


class Stager:
    """Copies state dicts to host memory, reusing its buffers from one save to the next.

    Not thread-safe: the buffers of one snapshot are reused by the next, so a snapshot must
    be written (the save finished) before :meth:`stage` runs again.

    Example:
        >>> stager = Stager()
        >>> snap = stager.stage({"model": {"w": torch.ones(2)}})
        >>> snap["model"]["w"].tolist()
        [1.0, 1.0]
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[Any, ...], torch.Tensor] = {}
        self._boxes: dict[tuple[Any, ...], tuple[list[tuple[Any, Any]], Any]] = {}
        """Per DTensor name and layout: DCP's (offsets, index) of each box, and their Origin."""
        self._used: set[tuple[Any, ...]] = set()
        self._async_cuda = False
        self._later: set[int] = set()
        self._pending = Pending()

    @property
    def nbytes(self) -> int:
        """Bytes of host memory the buffers hold."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def stage(self, state: dict[str, Any], later: set[int] | None = None) -> tuple[dict[str, Any], Pending]:
        """A host-memory copy of ``state`` (nested dicts of tensors, DTensors, LocalChunks, values),
        and the copies of the tensors whose storage is in ``later``, left to :meth:`Pending.run`."""
        self._used = set()
        self._async_cuda = False
        self._later, self._pending = set(later or ()), Pending()
        out = self._value((), state)
        if self._async_cuda:
            torch.cuda.synchronize()
        for key in [k for k in self._buffers if k not in self._used]:
            del self._buffers[key]  # a tensor that is gone or changed shape
        for key in [k for k in self._boxes if k not in self._used]:
            del self._boxes[key]
        return out, self._pending

    def _value(self, where: tuple[Any, ...], value: Any) -> Any:
        if isinstance(value, dict):
            return {k: self._value((*where, k), v) for k, v in value.items()}
        if isinstance(value, DTensor):
            # The boxes DCP would write for this DTensor (one, or several for a local tensor
            # that is itself checkpointable); Partial placements raise here as in DCP.
            key = (where, value.device_mesh, tuple(value.placements), value.shape, value.stride(), value.dtype)
            boxes = self._boxes.get(key)
            if boxes is None or hasattr(local_tensor(value), "__create_write_items__"):  # its own boxes: never kept
                name = ".".join(str(w) for w in where)
                items = value.__create_write_items__(name, value)
                assert all(item.tensor_data is not None for item in items), name
                origin = dtensor_origin(value, "dcp")  # DCP's boxes, the empty ones dropped (as LocalChunks does)
                boxes = self._boxes[key] = ([(item.tensor_data.chunk.offsets, item.index) for item in items], origin)
            self._used.add(key)
            pieces = [
                (offsets, self._copy((*where, i), value.__get_tensor_shard__(index)))
                for i, (offsets, index) in enumerate(boxes[0])
            ]
            return LocalChunks(value.shape, pieces, origin=boxes[1])
        if isinstance(value, LocalChunks):
            pieces = [(offsets, self._copy((*where, i), t)) for i, (offsets, t) in enumerate(value.pieces)]
            return LocalChunks(value.shape, pieces, origin=value.origin)  # the same boxes on every rank
        if isinstance(value, torch.Tensor):
            return self._copy((*where, "t"), value)
        if _plain(value):  # a hyperparameter, param_groups' lists of FQNs: deepcopy is ~20x slower
            return _plain_copy(value)
        return copy.deepcopy(value)

    def _copy(self, key: tuple[Any, ...], t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        buf = self._buffers.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            pin = t.device.type == "cuda"
            buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
            self._buffers[key] = buf
        self._used.add(key)
        if self._later and t.untyped_storage().data_ptr() in self._later:
            self._pending.copies.append((".".join(str(k) for k in key[:-1]), buf, t, t._version))
        elif t.device.type == "cuda":
            buf.copy_(t, non_blocking=True)
            self._async_cuda = True
        else:
            buf.copy_(t)
        return buf
