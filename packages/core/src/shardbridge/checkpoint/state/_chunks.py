"""Local-chunk objects: tell DCP exactly which global boxes this rank holds.

DCP asks every state-dict value three questions through the ``_Checkpointable`` protocol
(``torch/distributed/_checkpointable.py``; DTensor answers them in ``tensor/_api.py``)::

    __create_write_items__(fqn, obj)  save: one WriteItem per box (global offsets + sizes)
    __create_chunk_list__()           load: the boxes this rank wants filled
    __get_tensor_shard__(index)       save and load: the local tensor behind one box

A DTensor answers from ``compute_local_shape_and_global_offset``, which is wrong for some
FSDP2 x TP layouts (see [Note: DCP layout repair] in ``_repair.py``). :class:`LocalChunks`
answers from boxes the caller computed (the truth, from the layout algebra), and its tensors
are views into the live local tensors, so a DCP load writes into parameters and optimizer
states in place. The same object carries fused components: one box per component piece.

DCP's default planners only look up ``torch.Tensor`` values, and ``DefaultLoadPlanner``
replaces values of unknown types with None while it initialises meta tensors, so
:class:`SavePlanner` and :class:`LoadPlanner` below teach them about :class:`LocalChunks`.
Nothing of this class is written to disk: the checkpoint holds plain tensors and DCP's own
metadata only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    STATE_DICT_TYPE,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from shardbridge._compat import flatten_sharded_tensors, flatten_state_dict
from shardbridge.checkpoint.storage._trust import WeightsOnlyBytes

__all__ = ["LoadPlanner", "LocalChunks", "Origin", "SavePlanner"]


@dataclass(frozen=True)
class Origin:
    """The layout every rank's boxes of one :class:`LocalChunks` entry follow from.

    What a save protocol may derive every rank's boxes from without asking the ranks (the
    derived protocol, ``checkpoint/derived``); the state side only says what the boxes ARE:

    - ``mesh`` None: a tensor of ``shape`` every rank of the job holds whole;
    - else the boxes of a DTensor of ``shape`` with ``placements`` on ``mesh``, read by ``rule``
      ("dcp": DCP's own description; "true" / "local": ``_repair.RULES``), one box per range of
      a several-range chunk when ``multi``;
    - ``fused``: ``(spec, tp_size, name)``: this entry is component ``name`` of that tensor, split
      as ``shardbridge.fused.split_local`` splits it.

    Empty boxes are never listed (:class:`LocalChunks` drops them).
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    mesh: Any = None
    placements: tuple[Any, ...] = ()
    rule: str = "dcp"
    multi: bool = False
    fused: tuple[Any, int, str] | None = None


class LocalChunks:
    """The boxes of one global tensor that this rank holds, each with a view of its data.

    Args:
        global_size: shape of the whole (global) tensor.
        pieces: ``(global_offsets, tensor)`` per box; ``tensor.shape`` is the box's size.
            Empty boxes are dropped (DCP would deduplicate an empty box against a full box
            that starts at the same offset on another rank). A tensor with zero elements
            keeps one empty box at the origin so that DCP still records its key.
        origin: the layout every rank's boxes follow from (:class:`Origin`), when the caller
            knows it; None = only this rank's boxes are known (a framework's own boxes).

    Example:
        >>> local = torch.arange(6.0).reshape(3, 2)
        >>> chunks = LocalChunks((9, 2), [((5, 0), local)])
        >>> [tuple(c.offsets) for c in chunks.__create_chunk_list__()]
        [(5, 0)]
    """

    def __init__(
        self,
        global_size: Sequence[int],
        pieces: Sequence[tuple[Sequence[int], torch.Tensor]],
        *,
        origin: Origin | None = None,
    ) -> None:
        self._size = torch.Size(global_size)
        self.origin = origin
        kept: list[tuple[torch.Size, torch.Tensor]] = []
        for offsets, tensor in pieces:
            offsets = torch.Size(offsets)
            assert len(offsets) == len(self._size) == tensor.dim(), (offsets, self._size, tensor.shape)
            assert all(o + s <= g for o, s, g in zip(offsets, tensor.shape, self._size)), (offsets, tensor.shape)
            if tensor.numel() > 0:
                kept.append((offsets, tensor))
        if not kept and self._size.numel() == 0 and pieces:
            kept.append((torch.Size([0] * len(self._size)), pieces[0][1]))
            self.origin = None  # the origin box of an empty tensor: not what the layout lists
        self._pieces = kept

    # -- tensor-like surface DCP's planners use ---------------------------------------------

    def size(self) -> torch.Size:
        """Global size (DCP compares it with the saved size on load)."""
        return self._size

    @property
    def shape(self) -> torch.Size:
        """Global shape."""
        return self._size

    @property
    def pieces(self) -> list[tuple[torch.Size, torch.Tensor]]:
        """``(global_offsets, view)`` per non-empty box."""
        return list(self._pieces)

    def __repr__(self) -> str:
        boxes = ", ".join(f"{tuple(o)}+{tuple(t.shape)}" for o, t in self._pieces)
        return f"LocalChunks(size={tuple(self._size)}, boxes=[{boxes}])"

    # -- the _Checkpointable protocol -------------------------------------------------------

    def __create_write_items__(self, fqn: str, object: Any) -> list[WriteItem]:  # noqa: A002 (DCP's name)
        return [
            WriteItem(
                index=MetadataIndex(fqn, offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=offsets, sizes=tensor.shape),
                    properties=TensorProperties.create_from_tensor(tensor),
                    size=self._size,
                ),
            )
            for offsets, tensor in self._pieces
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=offsets, sizes=tensor.shape) for offsets, tensor in self._pieces]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        # DCP's hint: index.index is the position in our chunk list (load) or in the
        # global plan (save); check it, then fall back to matching offsets.
        if index.index is not None and index.index < len(self._pieces):
            offsets, tensor = self._pieces[index.index]
            if offsets == index.offset:
                return tensor
        for offsets, tensor in self._pieces:
            if offsets == index.offset:
                return tensor
        raise ValueError(f"{index.fqn}: this rank holds no box at offsets {index.offset}; it holds {self!r}")


class SavePlanner(DefaultSavePlanner):
    """``DefaultSavePlanner`` that resolves :class:`LocalChunks` values.

    Plan caching is the save protocol's business ([Note: save protocols] in ``_protocol.py``):
    ``dcp.save`` runs it with ``enable_plan_caching=True`` under a key per job (DCP keeps its
    plans per key for the whole process).
    """

    def lookup_object(self, index: MetadataIndex) -> Any:
        obj = self.state_dict.get(index.fqn)
        if isinstance(obj, LocalChunks):
            return obj.__get_tensor_shard__(index)
        return super().lookup_object(index)


class LoadPlanner(WeightsOnlyBytes, DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that resolves :class:`LocalChunks` values in place.

    Differs from the default in two more ways: it does not materialise meta tensors
    (``_init_state_dict``), which would replace :class:`LocalChunks` by None; shardbridge
    only loads into materialised models. And bytes items (packed param groups, non-tensor
    ``_extra_state``) load with ``torch.load(weights_only=True)``, not DCP's
    ``weights_only=False``: see [Note: untrusted checkpoints] in ``_trust.py``.
    """

    def set_up_planner(
        self, state_dict: STATE_DICT_TYPE, metadata: Metadata | None = None, is_coordinator: bool = False
    ) -> None:
        # DefaultLoadPlanner.set_up_planner without _init_state_dict.
        self.original_state_dict = state_dict
        if self.flatten_sharded_tensors:
            state_dict = flatten_sharded_tensors(state_dict)
        if self.flatten_state_dict:
            state_dict, self.mappings = flatten_state_dict(state_dict)
        self.state_dict = state_dict
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict.get(index.fqn)
        if isinstance(obj, LocalChunks):
            return obj.__get_tensor_shard__(index)
        return super().lookup_tensor(index)
