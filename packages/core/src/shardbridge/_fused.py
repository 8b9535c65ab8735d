r"""Fused parameters (SwiGLU ``[gate; up]``, QKV, N-way) in global item coordinates.

A fused parameter concatenates several logical components along one dim. Under column
tensor parallelism every TP rank holds the TP shard of EACH component, so the global tensor
of the fused DTensor parameter is TP-interleaved. This module maps between that layout, the
plain ``[gate; up]`` layout (tp=1) and the components, for full tensors, TP-local tensors and
arbitrary contiguous local shards (FSDP shards, plain-tensor optimizer states).

Public: :class:`FusedSpec`, :class:`FusedSegment`, :class:`ComponentPiece`,
:func:`split_fused`, :func:`merge_fused`, :func:`split_local`, :func:`tp_local_fused`,
:func:`shard_fused`, :func:`register_fused`, :func:`fused_params`,
:data:`FUSED_SPECS_ATTR`. Everything else here is private.

[Note: item coordinates]
~~~~~~~~~~~~~~~~~~~~~~~~
Take SwiGLU fc1 with gate = g0..g3, up = u0..u3 (one row each), tp=2, dp=2. TP rank j
holds ``[gate_j; up_j]``; FSDP (dp) then chunks each TP-local piece::

    plain (tp=1) layout     [g0 g1 g2 g3 | u0 u1 u2 u3]
    item coordinates        [g0 g1 u0 u1 | g2 g3 u2 u3]     <- DTensor global, Shard(0) on tp
                             \ tp=0 ---/   \ tp=1 ---/
    FSDP shards (rank)      [g0 g1][u0 u1] [g2 g3][u2 u3]
                            (dp0,tp0)(dp1,tp0)(dp0,tp1)(dp1,tp1)

"Item coordinates" are indices into the DTensor-global tensor (second row). A rank's local
shard is a contiguous range of item coordinates; to split it into components we intersect
that range with the component segments *of the same coordinate system*:
``gate: [0,2) [4,6)``, ``up: [2,4) [6,8)`` (see :meth:`FusedSpec.segments`).

Megatron-LM (``split_swiglu_linear_fc1`` / ``split_gdn_fused``) computes the component
slices from ``data.numel() // tp``: ``w = [0, n/2)``, ``v = [n/2, n)`` with
``n = data.numel() // tp`` (flattened, within one TP-local piece) and intersects them with
the rank's FSDP slice of that piece. For a DTensor ``data.numel()`` is the global numel, so
``n`` is the TP-local numel and the slices are right. For a plain-tensor optimizer state
(FusedAdam's ``exp_avg``) ``data.numel()`` is the LOCAL shard numel, so on rank (dp0, tp0)
above, holding 2 rows of H elements: ``n = 2H/2 = H``, ``w = [0, H/2)``, ``v = [H/2, H)``::

    local shard of (dp0,tp0)   [g0 g1]          FSDP slice [0, 2H) of the TP piece
    upstream w / v             [g0[:H/2]] [g0[H/2:]]   -> "up" receives gate values
    right    w / v             [g0 g1]    []
    (dp1,tp0) holds [u0 u1] at [2H, 4H): upstream w and v are empty -> up rows lost

Wrong values are written to the checkpoint silently (Megatron-LM #4423, unmerged). Here the
segments always come from the spec and the tp size, never from the size of the tensor being
split, so a DTensor, a plain local shard and an empty shard are all split the same way.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from shardbridge._checks import checked_args

__all__ = [
    "FUSED_SPECS_ATTR",
    "ComponentPiece",
    "FusedSegment",
    "FusedSpec",
    "fused_params",
    "merge_fused",
    "register_fused",
    "shard_fused",
    "split_fused",
    "split_local",
    "tp_local_fused",
]

FUSED_SPECS_ATTR = "_shardbridge_fused_specs"
"""Module attribute holding ``dict[param_name, FusedSpec]``, written by :func:`register_fused`."""


@dataclass(frozen=True, kw_only=True)
class FusedSegment:
    """One contiguous run of one component inside a fused tensor, along the fused dim.

    Items ``[item_start, item_stop)`` of the fused tensor hold rows
    ``[component_start, component_start + length)`` of component ``name``.
    """

    name: str
    """Component name."""
    item_start: int
    """First index along the fused dim, in item coordinates."""
    item_stop: int
    """One past the last index along the fused dim, in item coordinates."""
    component_start: int
    """Index along the fused dim of the component where this segment starts."""

    @property
    def length(self) -> int:
        """Number of indices along the fused dim in this segment."""
        return self.item_stop - self.item_start


@dataclass(frozen=True, kw_only=True, eq=False)
class ComponentPiece:
    """A view into a local shard that belongs to one component (see :func:`split_local`)."""

    name: str
    """Component name."""
    view: torch.Tensor
    """A view of the local shard (writing into it writes the shard)."""
    component_offset: int
    """Index along the fused dim of the component where ``view`` starts."""


@dataclass(frozen=True, kw_only=True)
class FusedSpec:
    """How a fused parameter concatenates its components along ``dim``.

    Sizes are along ``dim`` (rows for a weight ``[out, in]`` with ``dim=0``). Under TP every
    rank holds the ``1/tp`` shard of each component, concatenated in component order; see
    [Note: item coordinates] in this module.

    Example:
        >>> spec = FusedSpec.swiglu(4)
        >>> [(s.name, s.item_start, s.item_stop) for s in spec.segments(2)]
        [('gate_proj', 0, 2), ('up_proj', 2, 4), ('gate_proj', 4, 6), ('up_proj', 6, 8)]
    """

    components: tuple[tuple[str, int], ...]
    """``(name, size along dim)`` per component, in fused order. Names are unique."""
    dim: int = 0
    """Tensor dim along which the components are concatenated (and TP shards). 0 = rows."""
    head_dim: int | None = None
    """QKV only: rows per attention head. When set, ``components`` are ``(q, k, v)`` in whole
    heads and TP splits whole KV groups (``num_kv_heads % tp == 0``). None = not QKV."""

    def __post_init__(self) -> None:
        components = tuple((str(n), s) for n, s in self.components)
        object.__setattr__(self, "components", components)
        if not components:
            raise ValueError("FusedSpec.components is empty; give at least one (name, size) pair")
        names = [n for n, _ in components]
        if len(set(names)) != len(names):
            raise ValueError(f"FusedSpec.components names {names} are not unique; rename the duplicates")
        for name, size in components:
            if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
                raise ValueError(
                    f"FusedSpec.components[{name!r}] size={size!r} must be a positive int; "
                    "give the component's size along the fused dim"
                )
        if not isinstance(self.dim, int) or self.dim < 0:
            raise ValueError(f"FusedSpec.dim={self.dim!r} must be an int >= 0; use the non-negative dim index")
        if self.head_dim is not None:
            self._check_qkv()

    def _check_qkv(self) -> None:
        if self.head_dim <= 0:
            raise ValueError(f"FusedSpec.head_dim={self.head_dim} must be > 0 (or None for a non-QKV spec)")
        if len(self.components) != 3:
            raise ValueError(
                f"FusedSpec with head_dim={self.head_dim} is QKV and needs 3 components (q, k, v), "
                f"got {len(self.components)}: {self.names}; set head_dim=None for an N-way spec"
            )
        for name, size in self.components:
            if size % self.head_dim:
                raise ValueError(
                    f"FusedSpec.components[{name!r}] size={size} is not a multiple of "
                    f"head_dim={self.head_dim}; QKV sizes must be num_heads * head_dim"
                )
        (_, q), (k_name, k), (v_name, v) = self.components
        if k != v:
            raise ValueError(
                f"QKV sizes {k_name}={k} and {v_name}={v} differ; k and v must both be num_kv_heads * head_dim"
            )
        if (q // self.head_dim) % (k // self.head_dim):
            raise ValueError(
                f"num_heads={q // self.head_dim} is not a multiple of num_kv_heads="
                f"{k // self.head_dim}; grouped query attention needs num_heads % num_kv_heads == 0"
            )

    # -- presets ---------------------------------------------------------------------------

    @classmethod
    def swiglu(
        cls, intermediate_size: int, *, names: tuple[str, str] = ("gate_proj", "up_proj"), dim: int = 0
    ) -> FusedSpec:
        """SwiGLU fc1 ``[gate; up]``, each ``intermediate_size`` along ``dim``.

        Example:
            >>> FusedSpec.swiglu(8).sizes
            (8, 8)
        """
        gate, up = names
        return cls(components=((gate, intermediate_size), (up, intermediate_size)), dim=dim)

    @classmethod
    def qkv(
        cls,
        *,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        names: tuple[str, str, str] = ("q_proj", "k_proj", "v_proj"),
        dim: int = 0,
    ) -> FusedSpec:
        """Fused ``[q; k; v]`` with grouped query heads.

        TP rank j holds the q heads of its KV groups, then its k heads, then its v heads.

        Example:
            >>> FusedSpec.qkv(num_heads=8, num_kv_heads=2, head_dim=4).sizes
            (32, 8, 8)
        """
        for field_name, value in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"FusedSpec.qkv {field_name}={value!r} must be a positive int")
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}; "
                "grouped query attention needs num_heads % num_kv_heads == 0"
            )
        q, k, v = names
        return cls(
            components=((q, num_heads * head_dim), (k, num_kv_heads * head_dim), (v, num_kv_heads * head_dim)),
            dim=dim,
            head_dim=head_dim,
        )

    @classmethod
    def nway(cls, sizes: Mapping[str, int], *, dim: int = 0) -> FusedSpec:
        """N-way fused projection (GDN-style ``in_proj``), components in mapping order.

        Example:
            >>> FusedSpec.nway({"q": 4, "k": 4, "v": 8, "beta": 2}).total
            18
        """
        return cls(components=tuple(sizes.items()), dim=dim)

    # -- derived ---------------------------------------------------------------------------

    @property
    def names(self) -> tuple[str, ...]:
        """Component names in fused order."""
        return tuple(n for n, _ in self.components)

    @property
    def sizes(self) -> tuple[int, ...]:
        """Component sizes along ``dim``, in fused order."""
        return tuple(s for _, s in self.components)

    @property
    def total(self) -> int:
        """Size of the fused (DTensor-global) tensor along ``dim``."""
        return sum(self.sizes)

    def component_shape(self, name: str, fused_shape: Sequence[int]) -> torch.Size:
        """Global shape of component ``name`` given the global shape of the fused tensor.

        Example:
            >>> FusedSpec.swiglu(8).component_shape("up_proj", (16, 3))
            torch.Size([8, 3])
        """
        sizes = dict(self.components)
        if name not in sizes:
            raise ValueError(f"component {name!r} is not in FusedSpec names {self.names}")
        shape = list(fused_shape)
        _check_fused_len(self, shape, "fused_shape")
        shape[self.dim] = sizes[name]
        return torch.Size(shape)

    def check_tp(self, tp_size: int) -> None:
        """Raise if the components cannot be TP-sharded ``tp_size`` ways.

        Raises:
            ValueError: a component size (QKV: ``num_kv_heads``) is not divisible by tp_size.
            NotImplementedError: QKV with ``tp_size > num_kv_heads`` (KV-head replication).
        """
        if not isinstance(tp_size, int) or tp_size < 1:
            raise ValueError(f"tp_size={tp_size!r} must be an int >= 1")
        if self.head_dim is not None:
            num_kv_heads = self.sizes[1] // self.head_dim
            if tp_size > num_kv_heads:
                raise NotImplementedError(
                    f"tp_size={tp_size} > num_kv_heads={num_kv_heads}: replicating KV heads across "
                    f"TP ranks is not supported; use a tp_size that divides num_kv_heads={num_kv_heads}"
                )
            if num_kv_heads % tp_size:
                raise ValueError(
                    f"num_kv_heads={num_kv_heads} is not divisible by tp_size={tp_size}; "
                    f"use a tp_size that divides num_kv_heads={num_kv_heads}"
                )
            return
        for name, size in self.components:
            if size % tp_size:
                raise ValueError(
                    f"fused component {name!r} has size {size} along dim {self.dim}, not divisible by "
                    f"tp_size={tp_size}; every component size {dict(self.components)} must be a "
                    "multiple of tp_size (choose tp_size dividing all of them)"
                )

    def local_size(self, tp_size: int) -> int:
        """Size along ``dim`` of one TP-local fused piece."""
        self.check_tp(tp_size)
        return self.total // tp_size

    def segments(self, tp_size: int) -> tuple[FusedSegment, ...]:
        """Component segments of the fused DTensor-global tensor at ``tp_size``, in item order.

        Example:
            >>> [(s.name, s.item_start, s.component_start) for s in FusedSpec.swiglu(2).segments(2)]
            [('gate_proj', 0, 0), ('up_proj', 1, 0), ('gate_proj', 2, 1), ('up_proj', 3, 1)]
        """
        self.check_tp(tp_size)
        out = []
        item = 0
        for tp_rank in range(tp_size):
            for name, size in self.components:
                shard = size // tp_size
                out.append(
                    FusedSegment(name=name, item_start=item, item_stop=item + shard, component_start=tp_rank * shard)
                )
                item += shard
        assert item == self.total
        return tuple(out)


def _check_fused_len(spec: FusedSpec, shape: Sequence[int], what: str) -> None:
    if len(shape) <= spec.dim:
        raise ValueError(f"{what} {tuple(shape)} has no dim {spec.dim} (FusedSpec.dim); pass the fused tensor")
    if shape[spec.dim] != spec.total:
        raise ValueError(
            f"{what} {tuple(shape)} has size {shape[spec.dim]} along dim {spec.dim}, but the FusedSpec "
            f"components {dict(spec.components)} sum to {spec.total}; pass the full fused tensor"
        )


def split_fused(tensor: torch.Tensor, spec: FusedSpec, tp_size: int) -> dict[str, torch.Tensor]:
    """Split a full fused tensor in item coordinates (TP-interleaved at ``tp_size``).

    With ``tp_size=1`` this is the plain ``[gate; up]`` split. Returns new tensors when a
    component has several segments, views when it has one.

    Example:
        >>> spec = FusedSpec.swiglu(2)
        >>> parts = split_fused(torch.tensor([0, 10, 1, 11]), spec, tp_size=2)
        >>> parts["gate_proj"].tolist(), parts["up_proj"].tolist()
        ([0, 1], [10, 11])
    """
    _check_fused_len(spec, tensor.shape, "fused tensor shape")
    pieces: dict[str, list[torch.Tensor]] = {n: [] for n in spec.names}
    for seg in spec.segments(tp_size):
        pieces[seg.name].append(tensor.narrow(spec.dim, seg.item_start, seg.length))
    return {n: p[0] if len(p) == 1 else torch.cat(p, dim=spec.dim) for n, p in pieces.items()}


def merge_fused(components: Mapping[str, torch.Tensor], spec: FusedSpec, tp_size: int) -> torch.Tensor:
    """Inverse of :func:`split_fused`: the fused tensor in item coordinates at ``tp_size``.

    Example:
        >>> spec = FusedSpec.swiglu(2)
        >>> merge_fused({"gate_proj": torch.tensor([0, 1]), "up_proj": torch.tensor([10, 11])}, spec, 2).tolist()
        [0, 10, 1, 11]
    """
    if set(components) != set(spec.names):
        raise ValueError(
            f"merge_fused got components {sorted(components)}, but the FusedSpec names are "
            f"{list(spec.names)}; pass exactly one tensor per component"
        )
    for name, size in spec.components:
        shape = components[name].shape
        if len(shape) <= spec.dim or shape[spec.dim] != size:
            raise ValueError(
                f"component {name!r} has shape {tuple(shape)}; FusedSpec expects size {size} along dim {spec.dim}"
            )
    parts = [components[s.name].narrow(spec.dim, s.component_start, s.length) for s in spec.segments(tp_size)]
    return torch.cat(parts, dim=spec.dim)


def split_local(local: torch.Tensor, spec: FusedSpec, tp_size: int, global_offset: int) -> list[ComponentPiece]:
    """Views of a contiguous local shard of a fused tensor, one per component segment it touches.

    ``local`` holds items ``[global_offset, global_offset + local.shape[dim])`` of the fused
    tensor in item coordinates at ``tp_size`` (an FSDP shard of a TP-local piece, a
    plain-tensor optimizer state such as ``exp_avg``, or a DTensor whose local shard is such a
    range). The shard may straddle component boundaries or be empty (then ``[]``). The caller
    computes ``global_offset``; see [Note: item coordinates] for why the segments come from
    the spec and never from ``local``'s size.

    For a DTensor, its global shape must be the fused shape and the views are into its local
    tensor. Views, not copies: writing into them writes the shard (a DCP load relies on it).

    Example:
        >>> spec = FusedSpec.swiglu(4)                    # tp=2 items: [g0 g1 u0 u1 g2 g3 u2 u3]
        >>> shard = torch.tensor([11, 20, 21])            # items [1, 4): g1 u0 u1
        >>> [(p.name, p.view.tolist(), p.component_offset) for p in split_local(shard, spec, 2, 1)]
        [('gate_proj', [11], 1), ('up_proj', [20, 21], 0)]
    """
    if isinstance(local, DTensor):
        _check_fused_len(spec, local.shape, "DTensor global shape")
        with torch.no_grad():
            local = local.to_local()
    dim = spec.dim
    if local.dim() <= dim:
        raise ValueError(f"local shard shape {tuple(local.shape)} has no dim {dim} (FusedSpec.dim)")
    length = local.shape[dim]
    if global_offset < 0 or global_offset + length > spec.total:
        raise ValueError(
            f"local shard covers items [{global_offset}, {global_offset + length}) along dim {dim}, "
            f"outside the fused size {spec.total}; pass global_offset in item coordinates of the fused tensor"
        )
    stop = global_offset + length
    pieces = []
    for seg in spec.segments(tp_size):
        lo, hi = max(seg.item_start, global_offset), min(seg.item_stop, stop)
        if lo >= hi:
            continue
        pieces.append(
            ComponentPiece(
                name=seg.name,
                view=local.narrow(dim, lo - global_offset, hi - lo),
                component_offset=seg.component_start + (lo - seg.item_start),
            )
        )
    return pieces


def tp_local_fused(full: torch.Tensor, spec: FusedSpec, tp_size: int, tp_rank: int) -> torch.Tensor:
    """TP-local fused piece of ``tp_rank`` from a plain (tp=1 layout) full ``[gate; up]`` tensor.

    Returns a new contiguous tensor ``[gate_j; up_j]`` (QKV: ``[q_j; k_j; v_j]``).

    Example:
        >>> full = torch.tensor([0, 1, 10, 11])       # [gate; up]
        >>> tp_local_fused(full, FusedSpec.swiglu(2), tp_size=2, tp_rank=1).tolist()
        [1, 11]
    """
    _check_fused_len(spec, full.shape, "full tensor shape")
    spec.check_tp(tp_size)
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank={tp_rank} must be in [0, tp_size={tp_size})")
    parts = []
    offset = 0
    for size in spec.sizes:
        shard = size // tp_size
        parts.append(full.narrow(spec.dim, offset + tp_rank * shard, shard))
        offset += size
    return torch.cat(parts, dim=spec.dim)


@checked_args(full=torch.Tensor, spec=FusedSpec, tp_mesh=DeviceMesh)
def shard_fused(full: torch.Tensor, spec: FusedSpec, tp_mesh: DeviceMesh) -> DTensor:
    """Column-parallel fused DTensor (``Shard(dim)`` on ``tp_mesh``) from a plain full tensor.

    Every rank passes the same plain ``[gate; up]`` tensor; the result's global tensor is in
    item coordinates (TP-interleaved) and has an explicit global shape and contiguous stride.
    The result is detached; wrap it in ``nn.Parameter`` to use it as a parameter.

    Example:
        >>> # on each rank of a 2-rank tp mesh:
        >>> # w = nn.Parameter(shard_fused(full_fc1, FusedSpec.swiglu(8), tp_mesh))
    """
    if tp_mesh.ndim != 1:
        raise ValueError(f"tp_mesh must be 1-D, got a {tp_mesh.ndim}-D mesh {tp_mesh}; pass mesh['tp']")
    tp_size = tp_mesh.size()
    with torch.no_grad():
        local = tp_local_fused(full.detach(), spec, tp_size, tp_mesh.get_local_rank())
    global_shape = full.shape
    stride = torch.empty(global_shape, device="meta").stride()
    # local [gate_j; up_j] -> Shard(dim) on tp: global is [gate_0; up_0; gate_1; up_1; ...]
    return DTensor.from_local(local, tp_mesh, [Shard(spec.dim)], run_check=False, shape=global_shape, stride=stride)


@checked_args(module=nn.Module, spec=FusedSpec)
def register_fused(module: nn.Module, param_name: str, spec: FusedSpec) -> None:
    """Record that ``module.<param_name>`` is fused as ``spec``.

    Stored in ``module._shardbridge_fused_specs`` (:data:`FUSED_SPECS_ATTR`), a
    ``dict[param_name, FusedSpec]`` on the module, so it survives parameter replacement
    (DTensor conversion, ``fully_shard``). The parameter may be global (plain or DTensor) or
    a TP-local piece.

    Example:
        >>> mlp = nn.Linear(3, 8, bias=False)
        >>> register_fused(mlp, "weight", FusedSpec.swiglu(4))
        >>> fused_params(nn.Sequential(mlp))
        {'0.weight': FusedSpec(components=(('gate_proj', 4), ('up_proj', 4)), dim=0, head_dim=None)}
    """
    param = module._parameters.get(param_name)
    if param is None:
        raise ValueError(
            f"{type(module).__name__} has no parameter {param_name!r}; its parameters are "
            f"{list(module._parameters)} (pass the name within this module, not an FQN)"
        )
    shape = param.shape
    if len(shape) <= spec.dim or spec.total % max(shape[spec.dim], 1) or shape[spec.dim] == 0:
        raise ValueError(
            f"parameter {param_name!r} has shape {tuple(shape)}, but FusedSpec components "
            f"{dict(spec.components)} sum to {spec.total} along dim {spec.dim}; the size along dim "
            "must be the fused total (or total / tp for a TP-local piece)"
        )
    specs = dict(getattr(module, FUSED_SPECS_ATTR, {}))
    specs[param_name] = spec
    setattr(module, FUSED_SPECS_ATTR, specs)


def fused_params(model: nn.Module) -> dict[str, FusedSpec]:
    """All registered fused parameters of ``model`` by FQN (as in ``model.named_parameters()``).

    Example:
        >>> fused_params(nn.Linear(2, 2))
        {}
    """
    fqns = {name for name, _ in model.named_parameters()}
    out: dict[str, FusedSpec] = {}
    for prefix, module in model.named_modules():
        for param_name, spec in getattr(module, FUSED_SPECS_ATTR, {}).items():
            fqn = f"{prefix}.{param_name}" if prefix else param_name
            if fqn in fqns:
                out[fqn] = spec
    return out
