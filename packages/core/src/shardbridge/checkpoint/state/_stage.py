"""Stage a portable state dict to host memory: the snapshot an asynchronous save writes.

See [Note: async save] in ``_async.py``. The input is what :func:`build_portable_state`
returns (layouts repaired, fused parameters split, FP8 made plain), so the snapshot holds
exactly the boxes a synchronous save would write. Every tensor becomes a host copy:

- a ``DTensor`` becomes :class:`LocalChunks` of the boxes DCP itself would write for it (its
  own ``__create_write_items__``), so the writer thread never touches the device mesh;
- :class:`LocalChunks` (repaired layouts, fused components) keep their boxes, copied;
- a plain tensor is copied; any other value (hyperparameters, bytes items) is deep-copied.

Copies go into buffers kept from the previous save when shapes and dtypes match (no page
faults on the training thread's critical path after the first save); on CUDA they are pinned
and copied with ``non_blocking`` then synchronised once.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from shardbridge.checkpoint.state._chunks import LocalChunks
from shardbridge.checkpoint.state._repair import dtensor_origin

__all__ = ["Stager"]


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
        self._used: set[tuple[Any, ...]] = set()
        self._async_cuda = False

    @property
    def nbytes(self) -> int:
        """Bytes of host memory the buffers hold."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def stage(self, state: dict[str, Any]) -> dict[str, Any]:
        """A host-memory copy of ``state`` (nested dicts of tensors, DTensors, LocalChunks, values)."""
        self._used = set()
        self._async_cuda = False
        out = self._value((), state)
        if self._async_cuda:
            torch.cuda.synchronize()
        for key in [k for k in self._buffers if k not in self._used]:
            del self._buffers[key]  # a tensor that is gone or changed shape
        return out

    def _value(self, where: tuple[Any, ...], value: Any) -> Any:
        if isinstance(value, dict):
            return {k: self._value((*where, k), v) for k, v in value.items()}
        if isinstance(value, DTensor):
            # The boxes DCP would write for this DTensor (one, or several for a local tensor
            # that is itself checkpointable); Partial placements raise here as in DCP.
            name = ".".join(str(w) for w in where)
            items = value.__create_write_items__(name, value)
            pieces = []
            for i, item in enumerate(items):
                assert item.tensor_data is not None, name
                local = value.__get_tensor_shard__(item.index)
                pieces.append((item.tensor_data.chunk.offsets, self._copy((*where, i), local)))
            origin = dtensor_origin(value, "dcp")  # DCP's boxes, the empty ones dropped (as LocalChunks does)
            return LocalChunks(value.shape, pieces, origin=origin)
        if isinstance(value, LocalChunks):
            pieces = [(offsets, self._copy((*where, i), t)) for i, (offsets, t) in enumerate(value.pieces)]
            return LocalChunks(value.shape, pieces, origin=value.origin)  # the same boxes on every rank
        if isinstance(value, torch.Tensor):
            return self._copy((*where, "t"), value)
        return copy.deepcopy(value)

    def _copy(self, key: tuple[Any, ...], t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        buf = self._buffers.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            pin = t.device.type == "cuda"
            buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
            self._buffers[key] = buf
        self._used.add(key)
        if t.device.type == "cuda":
            buf.copy_(t, non_blocking=True)
            self._async_cuda = True
        else:
            buf.copy_(t)
        return buf
