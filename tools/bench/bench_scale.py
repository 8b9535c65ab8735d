"""Scale model of the checkpoint path: 8 to 16,384 simulated ranks, Llama-3 8B / 70B / 405B.

One process plays rank 0 of a job of N ranks (torch's fake process group: ``init_process_group
("fake")``), and every collective the checkpoint code calls is intercepted (:class:`SimGroup`):
it is counted, its bytes are computed as torch moves them (object collectives pickle, then pad
every rank's payload to the largest), and rank 0 receives what the other ranks would send. The
other ranks' payloads (their local plans, their write results) are generated from the layout
algebra (``shardbridge.layout.fsdp_tp_chunk``: the box FSDP2 x TP stores on each rank), no
tensors. Rank 0 then runs the REAL code of each contender on them:

- shardbridge save: ``write_and_commit`` with the default protocol (``DerivedSave``:
  plan round, write round, ``.metadata``, manifest, commit on local disk), after the save's
  argument round (``_dist.one_round``, as ``save`` calls it);
- plain DCP save: ``dcp.save`` with ``DefaultSavePlanner`` over the same local plans;
- shardbridge load (same layout, and into another world size), from a cold process: the
  manifest read, every storage record derived from it (``derived.derive_load``), the load's two
  rounds (``_dist.one_round`` agreeing that every rank derived, then ``on_all_ranks``) and rank
  0's own load plan over the saved boxes its boxes overlap (``dcp.load`` with ``no_dist=True``:
  no planning collectives);
- plain DCP load: ``dcp.load`` (plan gather + scatter, read all-gather) over the same plans.

Measured on rank 0: planning time (the contender's calls, without building the other ranks'
payloads), peak Python memory (tracemalloc; the gathered payloads count: rank 0 holds them),
collective rounds (calls), bytes received by rank 0 and by one other rank, ``.metadata`` and
manifest size. The other ranks' payloads are built one by one as rank 0 receives them, so a
configuration costs O(world x items) here as it does on a real rank 0; configurations above
``--budget`` items are not run for plain DCP: its time and memory are projected linearly in world
x items from the largest run of the same model (marked ``~``); shardbridge's save and load always run. Rounds and bytes per rank are
exact for every configuration (the sizes of ``sizes_of`` payloads are pickled samples).

    python tools/bench/bench_scale.py                 # the table of docs/benchmarks.md, "Scale"
    python tools/bench/bench_scale.py --models 8B --worlds 8,64 --budget 2e5
    nox -s scale

Assumptions, printed with the table: every parameter in bf16 with fp32 Adam state (exp_avg,
exp_avg_sq, step); q/k/v/gate/up/output/embedding column-parallel (Shard(0)), o_proj/down
row-parallel (Shard(1)), norms replicated over tp; FSDP2 shards dim 0 of the TP-local piece
over dp_shard; HSDP replicates over dp_replicate (DCP writes each box once).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import gc
import os
import pickle
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from shardbridge._compat import DCPStorageInfo, fake_store, flatten_state_dict
from shardbridge._mesh import ParallelDims
from shardbridge.checkpoint import _dist, _load, _save
from shardbridge.checkpoint._verify import hash_share
from shardbridge.checkpoint.derived import DerivedSave, derive_load
from shardbridge.checkpoint.derived._layouts import placement_spread
from shardbridge.checkpoint.derived._records import derive
from shardbridge.checkpoint.derived._save import _coordinate
from shardbridge.checkpoint.derived._spread import Grid, Spread
from shardbridge.checkpoint.state._chunks import LoadPlanner, LocalChunks, Origin
from shardbridge.checkpoint.state._repair import _verdict
from shardbridge.checkpoint.storage import _integrity
from shardbridge.checkpoint.storage._catalog import newest
from shardbridge.checkpoint.storage._files import data_file_name, record_length, split_items
from shardbridge.checkpoint.storage._location import locate, open_checkpoint
from shardbridge.checkpoint.storage._manifest import CHECKSUM_KEY, DCP_METADATA_NAME, MANIFEST_NAME, Manifest, rng_file
from shardbridge.checkpoint.storage._writer import RECORDS_KEY, RankFiles, Writer
from shardbridge.layout import chunk_box, fsdp_placements, fsdp_tp_chunk, parse_placements
from torch import nn
from torch.distributed.checkpoint import default_planner
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.futures import Future

WORLDS = (8, 64, 512, 4096, 16384)
NCCL = "shardbridge NCCL"
"""The contender: shardbridge in a job whose default group has no CPU backend (``init_process_group("nccl")``)."""


@dataclass(frozen=True, kw_only=True)
class LlamaShape:
    """A Llama-3 decoder's shape (the published ``config.json`` of each size)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    tp: int
    """TP degree used at world >= tp (inside one 8-GPU node)."""
    max_shard: int
    """Largest dp_shard; the rest of the world is dp_replicate (HSDP)."""


SHAPES = {
    "8B": LlamaShape(hidden=4096, layers=32, heads=32, kv_heads=8, ffn=14336, vocab=128256, tp=1, max_shard=64),
    "70B": LlamaShape(hidden=8192, layers=80, heads=64, kv_heads=8, ffn=28672, vocab=128256, tp=8, max_shard=64),
    "405B": LlamaShape(hidden=16384, layers=126, heads=128, kv_heads=8, ffn=53248, vocab=128256, tp=8, max_shard=128),
}


@dataclass(frozen=True, kw_only=True)
class Layout:
    """dp_replicate x dp_shard x tp, mesh order (dp_replicate, dp_shard, tp), row-major ranks."""

    dp_replicate: int
    dp_shard: int
    tp: int

    @property
    def world(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp

    def coordinate(self, rank: int) -> tuple[int, int, int]:
        return rank // (self.dp_shard * self.tp), (rank // self.tp) % self.dp_shard, rank % self.tp

    def __str__(self) -> str:
        return f"{self.dp_replicate}x{self.dp_shard}x{self.tp}"


def layout_for(shape: LlamaShape, world: int) -> Layout:
    """The layout the table uses: tp inside a node, FSDP up to ``max_shard``, HSDP replicas beyond."""
    tp = min(shape.tp, world)
    shard = min(world // tp, shape.max_shard)
    return Layout(dp_replicate=world // (tp * shard), dp_shard=shard, tp=tp)


def tensors(shape: LlamaShape) -> list[tuple[str, tuple[int, ...], int | None]]:
    """``(fqn, global shape, tp dim)`` of every parameter, under shardbridge's stored names."""
    hd = shape.hidden // shape.heads
    h, f = shape.hidden, shape.ffn
    out: list[tuple[str, tuple[int, ...], int | None]] = [("tok_embeddings.weight", (shape.vocab, h), 0)]
    for i in range(shape.layers):
        p = f"layers.{i}."
        out += [
            (p + "attention_norm.weight", (h,), None),
            (p + "attention.q_proj.weight", (shape.heads * hd, h), 0),
            (p + "attention.k_proj.weight", (shape.kv_heads * hd, h), 0),
            (p + "attention.v_proj.weight", (shape.kv_heads * hd, h), 0),
            (p + "attention.o_proj.weight", (h, shape.heads * hd), 1),
            (p + "ffn_norm.weight", (h,), None),
            (p + "feed_forward.gate_proj.weight", (f, h), 0),
            (p + "feed_forward.up_proj.weight", (f, h), 0),
            (p + "feed_forward.down.weight", (h, f), 1),
        ]
    return out + [("norm.weight", (h,), None), ("output.weight", (shape.vocab, h), 0)]


def build_module(shape: LlamaShape) -> nn.Module:
    """A real module with these parameters (for a real save of a small shape: the oracle)."""

    def linear(rows: int, cols: int) -> nn.Linear:
        return nn.Linear(cols, rows, bias=False)

    def tree(spec: dict[str, Any]) -> nn.Module:
        module = nn.Module()
        for key, value in spec.items():
            module.add_module(key, tree(value) if isinstance(value, dict) else value)
        return module

    hd, h = shape.hidden // shape.heads, shape.hidden
    layer = lambda: tree({  # noqa: E731
        "attention_norm": nn.RMSNorm(h), "ffn_norm": nn.RMSNorm(h),
        "attention": {"q_proj": linear(shape.heads * hd, h), "k_proj": linear(shape.kv_heads * hd, h),
                      "v_proj": linear(shape.kv_heads * hd, h), "o_proj": linear(h, shape.heads * hd)},
        "feed_forward": {"gate_proj": linear(shape.ffn, h), "up_proj": linear(shape.ffn, h), "down": linear(h, shape.ffn)},
    })  # fmt: skip
    model = tree({"tok_embeddings": nn.Embedding(shape.vocab, h), "norm": nn.RMSNorm(h), "output": linear(shape.vocab, h)})
    model.layers = nn.ModuleList(layer() for _ in range(shape.layers))
    return model


def parallelize(model: nn.Module, layout: Layout) -> nn.Module:
    """TP (column: q/k/v/gate/up/output/embedding rows, row: o_proj/down), then FSDP2 per layer and root."""
    pm = ParallelDims(dp_replicate=layout.dp_replicate, dp_shard=layout.dp_shard, tp=layout.tp).build_mesh("cpu")
    if layout.tp > 1:
        plan: dict[str, Any] = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate()), "output": ColwiseParallel()}
        for i in range(len(model.layers)):
            for name in ("attention.q_proj", "attention.k_proj", "attention.v_proj", "feed_forward.gate_proj",
                         "feed_forward.up_proj"):  # fmt: skip
                plan[f"layers.{i}.{name}"] = ColwiseParallel()
            for name in ("attention.o_proj", "feed_forward.down"):
                plan[f"layers.{i}.{name}"] = RowwiseParallel()
        parallelize_module(model, pm["tp"], plan)
    for block in model.layers:
        fully_shard(block, mesh=pm.fsdp_mesh)
    fully_shard(model, mesh=pm.fsdp_mesh)
    return model


# ------------------------------------------------------------------ one rank's plans, generated

_STATE = TensorProperties(dtype=torch.float32)
_OPTIM_TENSORS = ("exp_avg", "exp_avg_sq")
_PARAM_GROUPS = "optim.param_groups"


@dataclass
class Model:
    """One model under one layout: every rank's boxes, its local plans and write results, generated."""

    params: list[tuple[str, tuple[int, ...], int | None]]
    layout: Layout
    optimizer: bool = True
    param_dtype: torch.dtype = torch.bfloat16
    _boxes: dict[tuple[int, int], list[Any]] = field(default_factory=dict)
    _spreads: dict[Any, Spread] = field(default_factory=dict)

    def boxes(self, rank: int) -> list[tuple[str, torch.Size, torch.Size, torch.Size] | None]:
        """Per parameter: (fqn, global size, offsets, sizes) of this rank's box (None: empty)."""
        _, shard, tp = self.layout.coordinate(rank)
        key = (shard, tp)
        if key not in self._boxes:  # replicas hold the same boxes: computed once per (shard, tp)
            out = []
            for fqn, shape, tp_dim in self.params:
                chunk = fsdp_tp_chunk(
                    shape, tp_dim=tp_dim, tp_size=self.layout.tp, tp_rank=tp,
                    dp_size=self.layout.dp_shard, dp_rank=shard,
                )  # fmt: skip
                box = chunk_box(shape, chunk)
                assert box is not None, (fqn, chunk)
                sizes, offsets = box
                out.append(None if 0 in sizes else (fqn, torch.Size(shape), torch.Size(offsets), torch.Size(sizes)))
            self._boxes[key] = out
        return self._boxes[key]

    def items(self, rank: int) -> list[WriteItem]:
        """The local save plan's items, as ``LocalChunks.__create_write_items__`` and DCP make them."""
        items: list[WriteItem] = []
        for box in self.boxes(rank):
            if box is None:
                continue
            fqn, size, offsets, sizes = box
            keys = [(f"model.{fqn}", TensorProperties(dtype=self.param_dtype))]
            if self.optimizer:
                keys += [(f"optim.state.{fqn}.{name}", _STATE) for name in _OPTIM_TENSORS]
            for key, props in keys:
                chunk = ChunkStorageMetadata(offsets=offsets, sizes=sizes)
                items.append(
                    WriteItem(
                        index=MetadataIndex(key, offsets),
                        type=WriteItemType.SHARD,
                        tensor_data=TensorWriteData(chunk=chunk, properties=props, size=size),
                    )
                )
        if self.optimizer:
            empty = torch.Size([])
            for fqn, _, _ in self.params:  # step: a 0-dim tensor every rank holds (DCP keeps one)
                items.append(
                    WriteItem(
                        index=MetadataIndex(f"optim.state.{fqn}.step", empty),
                        type=WriteItemType.TENSOR,
                        tensor_data=TensorWriteData(
                            chunk=ChunkStorageMetadata(offsets=empty, sizes=empty), properties=_STATE, size=empty
                        ),
                    )
                )
            items.append(WriteItem(index=MetadataIndex(_PARAM_GROUPS), type=WriteItemType.BYTE_IO))
        return items

    def local_plan(self, rank: int) -> SavePlan:
        """The items, and DCP's planner data: each flattened key's path in the nested state dict."""
        items = self.items(rank)
        return SavePlan(items, planner_data={item.index.fqn: self._path(item.index.fqn) for item in items})

    @staticmethod
    def _path(key: str) -> tuple[str, ...]:
        top, _, rest = key.partition(".")
        if top == "model" or rest == "param_groups":
            return (top, rest)
        fqn, _, name = rest[len("state.") :].rpartition(".")
        return (top, "state", fqn, name)

    def write_results(self, rank: int, plan: SavePlan) -> list[WriteResult]:
        """What a rank's writer returns for its part of the global plan: one file, records last."""
        name, offset, out = f"__{rank}_0.distcp", 0, []
        for item in plan.items:
            length = 1024 if item.tensor_data is None else 1024 + item.tensor_data.chunk.sizes.numel() * 4
            out.append(WriteResult(index=item.index, size_in_bytes=length, storage_data=DCPStorageInfo(name, offset, length)))
            offset += length
        records = {name: {"size": offset, CHECKSUM_KEY: "0" * 32}, rng_file(rank): {"size": 9000, CHECKSUM_KEY: "0" * 32}}
        files = RankFiles(rank, f"node{rank // 8:05d}", records)
        out.append(WriteResult(index=MetadataIndex(RECORDS_KEY), size_in_bytes=0, storage_data=files))
        return out

    def spread(self, shape: tuple[int, ...], tp_dim: int | None, properties: TensorProperties) -> Spread:
        """The spread the save derives for one parameter's (or state's) DTensor under FSDP2 x TP."""
        r, s, t = self.layout.dp_replicate, self.layout.dp_shard, self.layout.tp
        ranks = torch.arange(self.layout.world).view(r, s, t)
        if tp_dim is not None and t > 1:  # TP, then fully_shard: (dp_replicate?, dp_shard, tp)
            mesh = ranks if r > 1 else ranks[0]
            placements = fsdp_placements(tp_dim=tp_dim, tp_size=t, dp_replicate=r > 1)
        else:  # fully_shard alone, on the dp mesh of this tp rank (the other tp ranks hold copies)
            mesh = ranks[..., 0] if r > 1 else ranks[0, :, 0]
            placements = (Replicate(), Shard(0)) if r > 1 else (Shard(0),)
        grid = Grid.tiled(tuple(mesh.shape), mesh, self.layout.world)
        verdict = _verdict(shape, tuple(mesh.shape), placements, None)
        rule = "true" if verdict.bad else "dcp"  # what check_dtensor decides: repaired or DCP's own boxes
        return placement_spread(shape, grid, placements, rule, multi=verdict.non_contiguous, properties=properties)

    def origin(self, shape: tuple[int, ...], tp_dim: int | None, dtype: torch.dtype) -> Origin:
        """The :class:`Origin` the state side gives the entry whose spread :meth:`spread` is."""
        spread = self._spreads[(shape, tp_dim, dtype)]
        args = spread.recipe[1]
        placements = tuple(parse_placements(", ".join(args["placements"]))) if args["placements"] else ()
        mesh = SimpleNamespace(shape=spread.grid.shape[1:], mesh=spread.grid.ranks.view(spread.grid.shape)[0])
        return Origin(shape, dtype, mesh, placements, args["rule"], args["multi"])

    def state(self, rank: int) -> dict[str, Any]:
        """Rank ``rank``'s state as the save hands it to DCP: meta tensors with their spreads, in
        torch's order (model, then per parameter step / exp_avg / exp_avg_sq, then the packed param groups)."""
        model: dict[str, Any] = {}
        optim: dict[str, Any] = {}
        props = {d: TensorProperties(dtype=d) for d in (self.param_dtype, torch.float32)}
        for fqn, shape, tp_dim in self.params:
            for dtype, out, key in [(self.param_dtype, model, fqn)] + (
                [(None, optim, f"state.{fqn}.step"), (torch.float32, optim, f"state.{fqn}.exp_avg"),
                 (torch.float32, optim, f"state.{fqn}.exp_avg_sq")] if self.optimizer else []
            ):  # fmt: skip
                if dtype is None:
                    out[key] = torch.empty((), device="meta")  # AdamW's step: a plain 0-d tensor on every rank
                    continue
                spread = self._spreads.get((shape, tp_dim, dtype))
                if spread is None:
                    spread = self._spreads[(shape, tp_dim, dtype)] = self.spread(shape, tp_dim, props[dtype])
                coordinate = _coordinate(spread, rank)
                assert coordinate is not None
                boxes = [(o, z) for o, z in spread.boxes_at(coordinate) if 0 not in z]
                pieces = [(o, torch.empty(z, dtype=dtype, device="meta")) for o, z in boxes]
                out[key] = LocalChunks(shape, pieces, origin=self.origin(shape, tp_dim, dtype))
        if self.optimizer:
            hyper = {"lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "amsgrad": False,
                     "foreach": None, "maximize": False, "capturable": False, "differentiable": False, "fused": None}  # fmt: skip
            optim["param_groups"] = [(f"param_groups.{fqn}.{k}", v) for fqn, _, _ in self.params for k, v in hyper.items()]
        return {"model": model, "optim": optim} if self.optimizer else {"model": model}

    def load_state(self, rank: int) -> dict[str, Any]:
        """This rank's state dict for a load: LocalChunks over meta tensors (no memory)."""
        model: dict[str, Any] = {}
        state: dict[str, Any] = {}
        for box in self.boxes(rank):
            if box is None:
                continue
            fqn, size, offsets, sizes = box
            model[fqn] = LocalChunks(size, [(offsets, torch.empty(sizes, dtype=self.param_dtype, device="meta"))])
            if self.optimizer:
                state[fqn] = {
                    name: LocalChunks(size, [(offsets, torch.empty(sizes, dtype=torch.float32, device="meta"))])
                    for name in _OPTIM_TENSORS
                }
        out: dict[str, Any] = {"model": model}
        if self.optimizer:
            for fqn, _, _ in self.params:
                state.setdefault(fqn, {})["step"] = torch.empty((), device="meta")
            out["optim"] = {"state": state}
        return out


# --------------------------------------------------------------------- the simulated collectives


# Bytes received per collective as torch moves them, (rank 0, any other rank), for a payload of
# ``width`` bytes (object collectives: the largest rank's pickle; every rank's is padded to it).
_RECEIVED: dict[str, Callable[[int, int], tuple[int, int]]] = {
    "all_gather": lambda w, n: (w * n, w * n),
    "all_gather_object": lambda w, n: (8 * n + w * n, 8 * n + w * n),  # sizes, then padded pickles
    "gather_object": lambda w, n: (8 * n + w * n, 8 * n),  # sizes all-gathered, pickles to dst
    "gather": lambda w, n: (w * n, 0),  # one fixed-size buffer per rank, to dst only
    "scatter_object_list": lambda w, n: (8 + w, 8 + w),  # the largest size, then one padded pickle
    "broadcast_object_list": lambda w, n: (8 + w, 8 + w),
    "broadcast": lambda w, n: (w, w),
    "all_reduce": lambda w, n: (w, w),
    "barrier": lambda w, n: (0, 0),
}


@dataclass
class Counts:
    """Collectives rank 0 took part in: (name, payload kind, width); bytes received for ``world``."""

    world: int
    calls: list[tuple[str, str, int]] = field(default_factory=list)

    @property
    def rounds(self) -> int:
        return len(self.calls)

    @property
    def rank0_bytes(self) -> int:
        return sum(_RECEIVED[name](width, self.world)[0] for name, _, width in self.calls)

    @property
    def other_bytes(self) -> int:
        return sum(_RECEIVED[name](width, self.world)[1] for name, _, width in self.calls)

    def at(self, world: int, widths: dict[str, int]) -> Counts:
        """The same collectives at ``world`` with the payload kinds' widths there (projection)."""
        return Counts(world, [(name, kind, widths.get(kind, width)) for name, kind, width in self.calls])


def _kind(obj: Any) -> str:
    """What a payload carries: the kinds whose size grows with the model or the world."""
    inner = obj[1] if isinstance(obj, tuple) and len(obj) == 2 else obj
    if isinstance(inner, SavePlan):
        return "save plan"
    if isinstance(inner, LoadPlan):
        return "load plan"
    if isinstance(inner, list) and inner and isinstance(inner[0], WriteResult):
        return "write results"
    if isinstance(obj, list) and obj and isinstance(obj[0], Metadata):
        return "metadata"
    if isinstance(obj, tuple) and len(obj) == 3 and isinstance(obj[1], tuple) and isinstance(obj[1][1], Metadata):
        return "metadata"
    return "small"


class SideGroup:
    """A group ``dist.new_group`` made in the simulation (the checkpoint's gloo side group of an
    NCCL-only job, [Note: the checkpoint group] in ``checkpoint/_dist.py``): every rank, gloo."""


class SimGroup:
    """Rank 0's view of an N-rank job: torch.distributed's collectives, intercepted.

    ``peer(rank, obj)`` returns what ``rank`` contributes where rank 0 contributes ``obj``
    (default: the same). ``sizes_of(obj)``: the pickled sizes torch pads object payloads to.
    Time spent in ``peer`` is generation, not rank 0's work: it is summed in ``generation_s``.

    ``backend``: what the default group answers: "gloo" (it takes CPU tensors), or "nccl": it
    takes none, as ``init_process_group("nccl")``'s (it answers "cuda:nccl", the same to the
    checkpoint; torch's logging would ask a CPU build for NCCL's version on "nccl"): the
    checkpoint then makes a gloo side group, :class:`SideGroup`, counted in ``groups_made``.
    """

    _NAMES = ("all_gather", "all_gather_object", "gather_object", "gather", "scatter_object_list", "broadcast",
              "broadcast_object_list", "all_reduce", "barrier", "get_backend", "new_group", "get_global_rank")  # fmt: skip

    def __init__(self, world: int, backend: str = "gloo") -> None:
        self.world = world
        self.backend = backend
        self.groups_made = 0
        self.counts = Counts(world)
        self.peer: Callable[[int, Any], Any] = lambda rank, obj: obj
        self.peer_buffer: Callable[[int, torch.Tensor], torch.Tensor] = lambda rank, buf: buf
        self.max_payload: Callable[[Any, bytes], int] = lambda obj, mine: len(mine)
        self.generation_s = 0.0
        self.seconds = 0.0
        self.peak = 0
        self.derived: bool | None = None

    @contextlib.contextmanager
    def active(self) -> Iterator[SimGroup]:
        saved = {name: getattr(dist, name) for name in self._NAMES}
        for name in self._NAMES:
            setattr(dist, name, getattr(self, name))
        try:
            yield self
        finally:
            for name, fn in saved.items():
                setattr(dist, name, fn)

    def _count(self, name: str, kind: str, width: int) -> None:
        self.counts.calls.append((name, kind, width))

    def _peers(self, obj: Any) -> list[Any]:
        start = time.perf_counter()
        out = [obj] + [self.peer(r, obj) for r in range(1, self.world)]
        self.generation_s += time.perf_counter() - start
        return out

    def get_backend(self, group: Any = None) -> str:  # noqa: D102
        return "gloo" if isinstance(group, SideGroup) else "cuda:nccl" if self.backend == "nccl" else self.backend

    def new_group(self, *args: Any, **kw: Any) -> SideGroup:  # noqa: D102
        assert kw.get("backend") == "gloo" and not args and kw.get("ranks") is None, (args, kw)
        self.groups_made += 1
        return SideGroup()

    def get_global_rank(self, group: Any, group_rank: int) -> int:  # noqa: D102
        assert isinstance(group, SideGroup)  # every rank, in order
        return group_rank

    # torch's object collectives: sizes first (one int64 per rank), then padded pickles.
    def all_gather_object(self, out: list[Any] | None = None, obj: Any = None, group: Any = None, **kw: Any) -> None:  # noqa: D102
        out, obj = kw.get("object_list", out), kw.get("obj", obj)  # torch's keyword names
        mine = pickle.dumps(obj)
        self._count("all_gather_object", _kind(obj), self.max_payload(obj, mine))
        out[:] = self._peers(obj)

    def gather_object(self, obj: Any, out: list[Any] | None = None, dst: int = 0, group: Any = None, **kw: Any) -> None:  # noqa: D102
        mine = pickle.dumps(obj)
        self._count("gather_object", _kind(obj), self.max_payload(obj, mine))
        out = kw.get("object_gather_list", out)  # torch's keyword name (DCP passes it by name)
        assert out is not None
        out[:] = self._peers(obj)

    def scatter_object_list(  # noqa: D102
        self, out: list[Any] | None = None, objs: list[Any] | None = None, src: int = 0, group: Any = None, **kw: Any
    ) -> None:
        out = kw.get("scatter_object_output_list", out)  # torch's keyword names (DCP passes them by name)
        objs = kw.get("scatter_object_input_list", objs)
        assert out is not None and objs is not None
        width = max(len(pickle.dumps(o)) for o in (objs[:2] + objs[-1:]))
        first = objs[0][1] if isinstance(objs[0], tuple) and objs[0][0] == "ok" else objs[0]
        with_metadata = isinstance(first, tuple) and any(isinstance(x, Metadata) for x in first)
        self._count("scatter_object_list", "plan+metadata" if with_metadata else _kind(first), width)
        out[0] = objs[0]

    def gather(self, tensor: torch.Tensor, gather_list: list[torch.Tensor] | None = None, dst: int = 0,  # noqa: D102
               group: Any = None, **kw: Any) -> None:  # fmt: skip
        self._count("gather", "small", tensor.numel() * tensor.element_size())
        if gather_list is not None:
            start = time.perf_counter()
            gather_list[0].copy_(tensor)
            for r in range(1, self.world):
                gather_list[r].copy_(self.peer_buffer(r, tensor))
            self.generation_s += time.perf_counter() - start

    def broadcast_object_list(self, objs: list[Any] | None = None, src: int = 0, group: Any = None, **kw: Any) -> None:  # noqa: D102
        objs = kw.get("object_list", objs)  # torch's keyword name
        self._count("broadcast_object_list", _kind(objs), len(pickle.dumps(objs)))

    def all_gather(self, out: list[torch.Tensor], tensor: torch.Tensor, group: Any = None, **kw: Any) -> None:  # noqa: D102
        self._count("all_gather", "small", tensor.numel() * tensor.element_size())
        for t in out:
            t.copy_(tensor)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, group: Any = None, **kw: Any) -> None:  # noqa: D102
        self._count("broadcast", "small", tensor.numel() * tensor.element_size())

    def all_reduce(self, tensor: torch.Tensor, *args: Any, **kw: Any) -> None:  # noqa: D102
        self._count("all_reduce", "small", tensor.numel() * tensor.element_size())

    def barrier(self, *args: Any, **kw: Any) -> None:  # noqa: D102
        self._count("barrier", "small", 0)


@contextlib.contextmanager
def fake_world(world: int) -> Iterator[None]:
    """This process is rank 0 of ``world`` (torch's fake process group: no peers)."""
    dist.init_process_group("fake", store=fake_store(), rank=0, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _plan_payloads(model: Model, sim: SimGroup) -> None:
    """Peers send their own local plans and write results (built from the layout algebra)."""
    samples = sorted({1, sim.world // 2, sim.world - 1} - {0})

    def peer(rank: int, obj: Any) -> Any:
        wrapped = isinstance(obj, tuple) and len(obj) == 2 and obj[0] is None
        inner = obj[1] if wrapped else obj
        if isinstance(inner, SavePlan) and inner.usable:  # (DCP's plan caching: an unchanged plan is sent empty)
            inner = model.local_plan(rank)
        elif isinstance(inner, list) and inner and isinstance(inner[0], WriteResult):
            inner = model.write_results(rank, model.local_plan(rank))
        elif isinstance(inner, LoadPlan):
            inner = LoadPlan(_load_items(model, rank, sim.metadata))  # type: ignore[attr-defined]
        else:
            return obj
        return (None, inner) if wrapped else inner

    def max_payload(obj: Any, mine: bytes) -> int:
        # torch pads to the largest rank's pickle: a few ranks' sizes stand for all (same structure)
        start = time.perf_counter()
        n = max([len(mine)] + [len(pickle.dumps(peer(r, obj))) for r in samples])
        sim.generation_s += time.perf_counter() - start
        return n

    sim.peer, sim.max_payload = peer, max_payload


def _load_items(model: Model, rank: int, metadata: Metadata) -> list[Any]:
    planner = LoadPlanner()
    planner.set_up_planner(model.load_state(rank), metadata, rank == 0)
    return planner.create_local_plan().items


# ------------------------------------------------------------------------------- the contenders


@dataclass
class Result:
    """One contender on one configuration."""

    seconds: float
    peak_bytes: int
    counts: Counts
    metadata_bytes: int = 0
    manifest_bytes: int = 0
    projected: bool = False
    derived: bool | None = None
    """shardbridge's save: whether it ran the derived protocol (never the gathered fallback)."""
    hashed_bytes: int = 0
    """shardbridge's load: the bytes of rank 0's share of the checksums (``verify=True``)."""


_LIBC = ctypes.CDLL("libc.so.6")


def _rss_kib(field: str) -> int:
    match = re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text())
    return int(match.group(1)) if match else 0


@contextlib.contextmanager
def measured(sim: SimGroup) -> Iterator[None]:
    """Rank 0's time (without building the other ranks' payloads) and peak memory, onto ``sim``.

    Peak memory is the growth of the process's peak resident set during the block (Linux:
    ``/proc/self/clear_refs`` resets the peak first), so torch tensors count as well as Python
    objects; the other ranks' payloads, built as rank 0 receives them, count too (rank 0 holds them).
    """
    gc.collect()
    _LIBC.malloc_trim(0)  # freed memory back to the system, so the resident set counts live memory only
    base = _rss_kib("VmRSS")
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass  # no reset: the peak is then at least the process's peak so far
    start = time.perf_counter()
    try:
        yield
    finally:
        sim.seconds = time.perf_counter() - start - sim.generation_s
        sim.peak = max(0, _rss_kib("VmHWM") - base) * 1024


class _SimWriter(Writer):
    """shardbridge's writer, laying rank 0's files out by the file rule: each lands as a sparse
    file of its size (no bytes written), so that ``check_seen`` and the commit list them."""

    def write_data(self, plan: SavePlan, planner: Any) -> Future[list[WriteResult]]:
        out, files = [], {}
        for n, bucket in enumerate(split_items(plan.items, self.threads, self.min_file_bytes)):
            name, offset = data_file_name(self.rank, n), 0
            for item in bucket:
                if item.type == WriteItemType.BYTE_IO:
                    length = planner.resolve_data(item).getbuffer().nbytes  # the real pickled bytes
                else:
                    data = item.tensor_data
                    length = record_length(tuple(data.chunk.sizes), data.properties.dtype)
                out.append(WriteResult(index=item.index, size_in_bytes=length, storage_data=DCPStorageInfo(name, offset, length)))
                offset += length
            files[name] = {"size": offset, CHECKSUM_KEY: "0" * 32}
        files[rng_file(self.rank)] = {"size": 9000, CHECKSUM_KEY: "0" * 32}
        land(self.target.data, files)
        out.append(WriteResult(index=MetadataIndex(RECORDS_KEY), size_in_bytes=0,
                               storage_data=RankFiles(self.rank, "node00000", files)))  # fmt: skip
        done: Future[list[WriteResult]] = Future()
        done.set_result(out)
        return done


def land(directory: str, files: dict[str, dict[str, Any]]) -> None:
    """``files`` as a rank leaves them: each a sparse file of its recorded size (a tmpfs stores no
    bytes of it), so that rank 0's listings and ``Writer.check_seen`` run on every rank's files."""
    made: set[str] = set()
    for name, record in files.items():
        path = os.path.join(directory, name)
        parent = os.path.dirname(path)
        if parent not in made:
            os.makedirs(parent, exist_ok=True)
            made.add(parent)
        with open(path, "wb") as f:
            f.truncate(record["size"])


def _peer_files(model: Model, protocol: Any) -> dict[int, dict[str, dict[str, Any]]]:
    """Every other rank's files and their records, sized by the file rule.

    Computed once, outside the timed region, with the same derivation rank 0 runs (each rank
    checks its own records against it: [Note: the derived protocol])."""
    local = protocol.local(model.state(0))
    assert local.entries is not None, "the simulated state must be derivable"
    derivation = derive(local.entries, only=None, bytes_lengths={}, threads=1, min_file_bytes=1 << 62)
    files: dict[int, dict[str, dict[str, Any]]] = {r: {} for r in range(1, model.layout.world)}
    for (w, f), size in derivation.sizes.items():
        if w != 0:
            files[w][data_file_name(w, f)] = {"size": size, CHECKSUM_KEY: "0" * 32}
    for rank, mine in files.items():
        mine[rng_file(rank)] = {"size": 9000, CHECKSUM_KEY: "0" * 32}
    return files


def _peer_records(files: dict[int, dict[str, dict[str, Any]]], sim: SimGroup) -> None:
    """What every other rank sends in the write round: its files' records (in the fixed-size
    buffer, or as an object where the round falls back to torch's object collectives)."""

    def value(rank: int, obj: Any) -> Any:
        if isinstance(obj, tuple) and len(obj) == 2 and isinstance(obj[1], tuple) and isinstance(obj[1][0], RankFiles):
            return obj[0], (RankFiles(rank, f"node{rank // 8:05d}", files[rank]), *obj[1][1:])
        return obj

    sim.peer = value
    sim.peer_buffer = lambda rank, buf: _dist._pack(value(rank, (None, (RankFiles(0, "", {}), True, None))), buf.numel() - 8)


def cold() -> None:
    """Forget every table the checkpoint code caches between calls (spreads, grids, record lengths):
    what a job's first save or a resume's load computes from scratch."""
    from shardbridge.checkpoint.derived import _records, _spread
    from shardbridge.checkpoint.derived import _save as _dsave
    from shardbridge.checkpoint.state import _repair
    from shardbridge.checkpoint.storage import _files

    for cache in (_spread._TABLES, _spread._TILED, _spread._EVERYWHERE, _dsave._COORDS):
        cache.clear()  # the records' columns and lengths live on the tables
    for fn in (_repair._verdict, _records.positions, _files.record_length):
        fn.cache_clear()


def shardbridge_save(model: Model, root: Path, *, warm: bool = False, backend: str = "gloo") -> Result:
    """Rank 0 of ``save``: its argument round, then ``write_and_commit`` with the production protocol.

    ``warm``: an earlier save of the same state ran in this job (untimed), so the protocol's
    tables are cached, as in training after the first save. ``backend``: the default group's
    (:class:`SimGroup`). Every other rank's files are on disk (sparse) before rank 0 starts:
    its listing and ``check_seen`` run on them.
    """
    protocol = DerivedSave()
    files = _peer_files(model, DerivedSave())
    if warm:
        _save_once(model, root / "first", protocol, SimGroup(model.layout.world, backend), files)
    else:
        cold()  # computing the peers' records filled the caches the save would fill
    sim = SimGroup(model.layout.world, backend)
    final = _save_once(model, root / "sb", protocol, sim, files)
    return Result(sim.seconds, sim.peak, sim.counts, (final / DCP_METADATA_NAME).stat().st_size,
                  (final / MANIFEST_NAME).stat().st_size, derived=sim.derived)  # fmt: skip


def _save_once(model: Model, path: Path, protocol: Any, sim: SimGroup, files: dict[int, dict[str, Any]]) -> Path:
    _peer_records(files, sim)
    where = locate(path)
    target = where.backend.begin(where.path, overwrite=False)
    land(target.data, {name: record for mine in files.values() for name, record in mine.items()})
    manifest = Manifest(
        step=1, world_size=model.layout.world, has_optimizer=model.optimizer, extra={},
        layout={"tensors": {f: {"mesh": {"dp_shard": model.layout.dp_shard, "tp": model.layout.tp},
                                "placements": [], "stored_as": "dtensor"} for f, _, _ in model.params}},
    )  # fmt: skip
    state = model.state(0)
    with sim.active(), measured(sim):
        local = protocol.local(state)
        # The save's argument round, as ``save`` calls it (rank 0's target, plans unchanged, digests agree)
        _, same, agreed = _dist.one_round(lambda: target, same=("save", {"path": str(path)}), share=lambda mine: mine,
                                          agree=lambda mine: protocol.digest(local))  # fmt: skip
        sim.derived = agreed and protocol.digest(local) != 0
        job = _save.SaveJob(where=where, target=target, dcp_state=state, rng=b"\0" * 64, manifest=manifest,
                            protocol=protocol, local=local, derived=sim.derived)  # fmt: skip
        with patched(_save, "Writer", _SimWriter):
            _save.write_and_commit(job)
    return Path(where.path)


@contextlib.contextmanager
def patched(module: Any, name: str, value: Any) -> Iterator[None]:
    """``module.name`` is ``value`` inside the block."""
    original = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, original)


class _SimPlanner(DefaultSavePlanner):
    """``DefaultSavePlanner`` whose local plan is the generated one: the rest is DCP's own (the
    global plan; with ``caching``, ``enable_plan_caching=True``'s caches and empty plans)."""

    def __init__(self, plan: SavePlan, *, caching: bool = False) -> None:
        super().__init__(enable_plan_caching=caching)
        self._local = plan

    def set_up_planner(self, *args: Any, **kwargs: Any) -> None:  # noqa: D102
        super().set_up_planner(*args, **kwargs)
        self.mappings = self._local.planner_data  # the generated state's paths, as flattening it gives

    def create_local_plan(self) -> SavePlan:  # noqa: D102
        with patched(default_planner, "create_default_local_save_plan", lambda *_: self._local):
            return super().create_local_plan()


def _forget_plans() -> None:
    """Empty DCP's process-wide plan caches (class attributes of ``SavePlanner``)."""
    for name, cache in vars(SavePlanner).items():
        if name.startswith("_cached_") and isinstance(cache, dict):
            cache.clear()


class _DCPWriter(StorageWriter):
    """A storage writer that writes ``.metadata`` only (to measure it); data results are generated."""

    def __init__(self, model: Model, path: Path) -> None:
        super().__init__()
        self.model, self.path = model, path

    def reset(self, checkpoint_id: Any = None) -> None: ...
    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None: ...
    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: Any) -> Future[list[WriteResult]]:
        done: Future[list[WriteResult]] = Future()
        done.set_result(self.model.write_results(0, plan)[:-1])
        return done

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        metadata.storage_data = {r.index: r.storage_data for part in results for r in part}
        self.path.write_bytes(pickle.dumps(metadata))

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False


def dcp_save(model: Model, root: Path, *, cached: bool = False) -> Result:
    """Rank 0 of plain ``dcp.save`` (DefaultSavePlanner) over the same local plans.

    ``cached``: ``DefaultSavePlanner(enable_plan_caching=True)``, the job's second save: the first
    (untimed) filled DCP's plan cache, so every rank sends an empty plan and rank 0 reuses the
    cached global plan; the write results are still gathered."""
    path = root / "dcp.metadata"
    _forget_plans()
    if cached:
        first = SimGroup(model.layout.world)
        _plan_payloads(model, first)
        with first.active():
            dcp.save({}, storage_writer=_DCPWriter(model, path), planner=_SimPlanner(model.local_plan(0), caching=True))
    sim = SimGroup(model.layout.world)
    _plan_payloads(model, sim)
    try:
        with sim.active(), measured(sim):
            planner = _SimPlanner(model.local_plan(0), caching=cached)
            dcp.save({}, storage_writer=_DCPWriter(model, path), planner=planner)
    finally:
        _forget_plans()  # world x items of plans: gone before the next contender
    return Result(sim.seconds, sim.peak, sim.counts, path.stat().st_size)


class _Reader(StorageReader):
    """Reads nothing: ``.metadata`` given (shardbridge: rank 0's, broadcast) or unpickled from
    its bytes at every ``read_metadata`` (DCP: every rank reads the file)."""

    def __init__(self, metadata: Metadata | None = None, data: bytes | None = None) -> None:
        super().__init__()
        self.metadata, self.data = metadata, data

    def reset(self, checkpoint_id: Any = None) -> None: ...
    def read_metadata(self) -> Metadata:  # no ``rank=``: DCP would take it for rank-local metadata
        return self.metadata if self.metadata is not None else pickle.loads(self.data)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None: ...
    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: Any) -> Future[None]:
        done: Future[None] = Future()
        done.set_result(None)
        return done

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False


def shardbridge_load(model: Model, checkpoint: Path, *, backend: str = "gloo", latest: bool = False) -> Result:
    """Rank 0 of ``load(checkpoint)`` with ``verify=True`` (the default), ``_load``'s rounds: round 1
    is ``_load._open`` itself (the arguments; the manifest, which every rank reads; rank 0's
    listing of the checkpoint and its check of every file's size; every storage record derived
    from the manifest and, on rank 0, ``.metadata`` rendered from them and compared byte for byte,
    [Note: derived loads]), agreeing on the derivation (no rank unpickles ``.metadata``); this
    rank's share of the checksums (``_verify.hash_share``); each rank plans alone
    (``dcp.load(no_dist=True)``); round 2 agrees that every rank read.

    Not hashed: a rank hashes its share of the checkpoint's bytes at the disk's speed, the same
    per byte at any world size; ``Result.hashed_bytes`` counts rank 0's share. ``latest``:
    ``load_latest(checkpoint's parent)``: rank 0 finds the newest intact checkpoint first (a
    listing of the root, every candidate's manifest read, the newest one's files listed and
    sized) and broadcasts it."""
    cold()  # a resume: nothing the save computed is cached in this process
    stored, manifest = open_checkpoint(locate(checkpoint))  # untimed: the records the stand-in hash answers
    recorded = {stored.file(name): record[CHECKSUM_KEY] for name, record in manifest.files.items()}
    hashed = [0]

    def checksum(backend: Any, path: str, size: int | None = None) -> tuple[int, str]:
        assert size is not None
        hashed[0] += size
        return size, recorded[path]

    sim = SimGroup(model.layout.world, backend)
    with sim.active(), patched(_integrity, "checksum", checksum), measured(sim):
        if latest:
            checkpoint = _dist.broadcast_from_rank0(newest(checkpoint.parent) if _dist.rank() == 0 else None)
        where = locate(checkpoint)
        kwargs = {"model": nn.Module(), "optimizer": None, "strict": True, "rng": True, "provider": None,
                  "verify": True, "skip_damaged": latest}  # fmt: skip
        (_, _, opened, expected), intact, agreed = _dist.one_round(
            _load._open, (where,), kwargs, same=("shardbridge.checkpoint.load", {"path": str(checkpoint)}),
            all_of=lambda opened: not opened[2][0], agree=lambda opened: opened[3],
        )  # fmt: skip
        if not (intact and agreed and expected):
            raise RuntimeError(f"{checkpoint}: the load found {opened[0]} or could not derive its records")
        # rank 0 rendered .metadata from the derivation and compared it in round 1; the others derive now
        records = opened[1] if _dist.rank() == 0 else derive_load(manifest.layout, manifest.world_size, manifest.files)
        # this rank's share of the checksums, hashed in the pass that reads the files (not here)
        hashed[0] = sum(r["size"] for r in hash_share(manifest.files, _dist.rank(), _dist.world_size()).values())
        state = model.load_state(0)
        reader = _Reader(records.metadata(local=flatten_state_dict(state)[0]))  # as _load's _read_state
        _dist.on_all_ranks(lambda: dcp.load(state, storage_reader=reader, planner=LoadPlanner(), no_dist=True))
    return Result(sim.seconds, sim.peak, sim.counts, hashed_bytes=hashed[0])


class _DCPLoadPlanner(LoadPlanner):
    """DCP's ``DefaultLoadPlanner`` planning (shardbridge's subclass only resolves LocalChunks)."""

    assert issubclass(LoadPlanner, DefaultLoadPlanner)


def dcp_load(model: Model, metadata_bytes: bytes) -> Result:
    """Rank 0 of plain ``dcp.load``: every rank reads ``.metadata``, plans; plans gathered, scattered."""
    sim = SimGroup(model.layout.world)
    _plan_payloads(model, sim)
    reader = _Reader(data=metadata_bytes)
    sim.metadata = pickle.loads(metadata_bytes)  # type: ignore[attr-defined]  # the peers' (generation)
    with sim.active(), measured(sim):
        dcp.load(model.load_state(0), storage_reader=reader, planner=_DCPLoadPlanner())
    return Result(sim.seconds, sim.peak, sim.counts)


# ---------------------------------------------------------------------------------- the table


def _fmt_bytes(n: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{int(n)} B"


HEAD = ("model", "world", "layout r x s x t", "items/rank", "op", "who", "rank-0 s", "rank-0 peak", "rounds",
        "recv rank 0", "recv other rank", ".metadata", "manifest", "rank 0 hashes")  # fmt: skip


def _row(name: str, world: int, where: str, items: int, op: str, who: str, r: Result) -> tuple[str, ...]:
    mark = "~" if r.projected else ""
    return (
        name, str(world), where, str(items), op, who,
        f"{mark}{r.seconds:.3g}", f"{mark}{_fmt_bytes(r.peak_bytes)}", str(r.counts.rounds),
        _fmt_bytes(r.counts.rank0_bytes), _fmt_bytes(r.counts.other_bytes),
        f"{mark}{_fmt_bytes(r.metadata_bytes)}" if r.metadata_bytes else "-",
        f"{mark}{_fmt_bytes(r.manifest_bytes)}" if r.manifest_bytes else "-",
        _fmt_bytes(r.hashed_bytes) if r.hashed_bytes else "-",
    )  # fmt: skip


@dataclass
class Config:
    """One (model, world): the layouts and sizes the projection scales by."""

    name: str
    world: int
    model: Model
    target: Model
    """The same model at half the world: the reshard load."""

    @property
    def items(self) -> int:
        return len(self.model.items(0))

    @property
    def cost(self) -> int:
        """Items rank 0 plans over when every rank's plan is gathered."""
        return self.world * self.items

    @property
    def chunks(self) -> int:
        """Distinct boxes (what ``.metadata`` lists): replicas write none of their own."""
        return self.cost // self.model.layout.dp_replicate

    def widths(self, metadata_bytes: int) -> dict[str, int]:
        plan = len(pickle.dumps((None, self.model.local_plan(1))))
        results = len(pickle.dumps((None, self.model.write_results(1, self.model.local_plan(1)))))
        return {"save plan": plan, "load plan": plan, "write results": results, "metadata": metadata_bytes,
                "plan+metadata": plan + metadata_bytes}  # fmt: skip


def config(name: str, world: int) -> Config:
    shape = SHAPES[name]
    model = Model(tensors(shape), layout_for(shape, world))
    target = Model(tensors(shape), layout_for(shape, max(world // 2, shape.tp)))
    return Config(name, world, model, target)


def run(cfg: Config, root: Path, *, heavy: bool = True) -> dict[tuple[str, str], Result]:
    """Every contender on one configuration, for real (rank 0 on the gathered payloads).

    ``heavy=False``: shardbridge's saves and loads only (their cost is the distinct boxes, not world x items)."""
    root.mkdir(parents=True, exist_ok=True)
    out: dict[tuple[str, str], Result] = {}
    with fake_world(cfg.world):
        out["save", "shardbridge"] = shardbridge_save(cfg.model, root)
        out["save again", "shardbridge"] = shardbridge_save(cfg.model, root / "again", warm=True)
        out["save", NCCL] = shardbridge_save(cfg.model, root / "nccl", backend="nccl")
        for key in (("save", "shardbridge"), ("save again", "shardbridge"), ("save", NCCL)):
            if not out[key].derived:
                raise RuntimeError(f"{cfg.name} at {cfg.world} ranks: the {key[0]} fell back to gathered plans")
        out["load same", "shardbridge"] = shardbridge_load(cfg.model, root / "sb")
        out["load same", NCCL] = shardbridge_load(cfg.model, root / "nccl" / "sb", backend="nccl")
        out["load latest", "shardbridge"] = shardbridge_load(cfg.model, root / "sb", latest=True)
        if heavy:
            out["save", "DCP"] = dcp_save(cfg.model, root)
            out["save again", "DCP"] = dcp_save(cfg.model, root, cached=True)
            meta = (root / "sb" / DCP_METADATA_NAME).read_bytes()
            out["load same", "DCP"] = dcp_load(cfg.model, meta)
    with fake_world(cfg.target.layout.world):
        out["load reshard", "shardbridge"] = shardbridge_load(cfg.target, root / "sb")
        if heavy:
            out["load reshard", "DCP"] = dcp_load(cfg.target, meta)
    return out


def project(cfg: Config, ref: Config, measured: dict[tuple[str, str], Result]) -> dict[tuple[str, str], Result]:
    """Not run: the same collectives with this configuration's payload sizes; time and memory
    scaled by the items rank 0 plans over (world x items; shardbridge's load: the distinct boxes),
    ``.metadata`` by the distinct boxes."""
    scale, meta_scale = cfg.cost / ref.cost, cfg.chunks / ref.chunks
    metadata = int(measured["save", "shardbridge"].metadata_bytes * meta_scale)
    widths = cfg.widths(metadata)
    out = {}
    for key, r in measured.items():
        world = cfg.target.layout.world if key[0] == "load reshard" else cfg.world
        # shardbridge's load reads .metadata and plans its own boxes: it grows with the distinct boxes
        by = meta_scale if key[1] == "shardbridge" else scale
        # DCP's cached save: every rank's plan travels empty (its measured width), the results in full
        kinds = {k: v for k, v in widths.items() if "plan" not in k} if key == ("save again", "DCP") else widths
        out[key] = Result(
            r.seconds * by, int(r.peak_bytes * by), r.counts.at(world, kinds),
            int(r.metadata_bytes * meta_scale), int(r.manifest_bytes * cfg.world / ref.world), projected=True,
        )  # fmt: skip
    return out


def table(
    models: list[str], worlds: list[int], budget: float, log: Callable[[str], None] = print, *, check: bool = False
) -> list[tuple[str, ...]]:
    """The rows: every (model, world), run when its cost fits ``budget``, else projected.

    ``check``: beside each run configuration after a model's first, what the projection from the
    previous run would have said for plain DCP (rows "DCP projected"), to check the ``~`` numbers."""
    rows: list[tuple[str, ...]] = []
    # in memory where there is a tmpfs: every contender's files (shardbridge's fsynced ``.metadata``
    # and manifest, DCP's ``.metadata``) land at memory speed, so the table times planning, not the disk
    memory = Path("/dev/shm")
    with tempfile.TemporaryDirectory(dir=memory if memory.is_dir() else None) as tmp:
        for name in models:
            ref: tuple[Config, dict[tuple[str, str], Result]] | None = None
            for world in worlds:
                cfg = config(name, world)
                if cfg.cost <= budget or ref is None:
                    results = run(cfg, Path(tmp) / f"{name}-{world}")
                    if check and ref is not None:
                        guess = project(cfg, *ref).items()
                        results.update({(op, "DCP projected"): r for (op, who), r in guess if who == "DCP"})
                    ref = (cfg, {k: r for k, r in results.items() if k[1] != "DCP projected"})
                else:  # shardbridge's saves and loads still run; the gathering contenders are projected
                    results = {**project(cfg, *ref), **run(cfg, Path(tmp) / f"{name}-{world}", heavy=False)}
                log(f"... {name} at {world} ranks: {'projected' if results['save', 'DCP'].projected else 'run'}")
                for (op, who), r in results.items():
                    layout = cfg.model.layout if op != "load reshard" else f"{cfg.model.layout}->{cfg.target.layout}"
                    rows.append(_row(name, world, str(layout), cfg.items, op, who, r))
                    log("| " + " | ".join(rows[-1]) + " |")  # as it comes: a long run's rows survive a kill
                shutil.rmtree(Path(tmp) / f"{name}-{world}")  # every rank's files: inodes in memory
    return rows


def render(rows: list[tuple[str, ...]]) -> str:
    """A markdown table."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(HEAD)]

    def line(cells: tuple[str, ...]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"

    return "\n".join([line(HEAD), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])


def main(argv: list[str] | None = None) -> int:
    """Print the scale table."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--models", default=",".join(SHAPES), help="comma list of " + ", ".join(SHAPES))
    parser.add_argument("--worlds", default=",".join(map(str, WORLDS)))
    parser.add_argument("--budget", type=float, default=1e6, help="largest world x items run (else projected)")
    parser.add_argument("--check", action="store_true", help="beside each run, plain DCP as projected from the previous run")
    args = parser.parse_args(argv)
    for name in args.models.split(","):
        shape = SHAPES[name]
        layouts = ", ".join(f"{w}: {layout_for(shape, w)}" for w in map(int, args.worlds.split(",")))
        print(f"{name}: {dataclasses.asdict(shape)}; dp_replicate x dp_shard x tp by world: {layouts}")
    rows = table(args.models.split(","), [int(w) for w in args.worlds.split(",")], args.budget,
                 log=lambda m: print(m, file=sys.stderr, flush=True), check=args.check)  # fmt: skip
    print(render(rows))
    print("~ = projected from the largest run of the same model (time, memory by world x items; .metadata by "
          "distinct boxes); rounds and bytes are the run's collectives with this configuration's payload sizes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
