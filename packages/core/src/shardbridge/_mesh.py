"""Parallel dimensions and the one DeviceMesh every shardbridge component shares.

[Note: mesh axes]

The world is one 4-D mesh, outermost first::

    (dp_replicate, dp_shard, cp, tp)

Every axis exists even when its degree is 1, so code never branches on "is there a tp
axis". Flattened axes name the groups users need::

    dp          = dp_replicate x dp_shard        data loading: ranks that see different batches
    dp_shard_cp = dp_shard x cp                  FSDP sharding
    dp_cp       = dp_replicate x dp_shard x cp   loss / gradient reduction
    weight      = dp_shard x cp x tp             every rank holding a different piece of a weight:
                                                 the amax group of per-tensor FP8 scaling
                                                 (excludes dp_replicate: replicas hold equal pieces)

Example, world 8 = dp_replicate 2 x dp_shard 2 x tp 2 (cp 1)::

    rank:          0  1  2  3  4  5  6  7
    dp_replicate:  0  0  0  0  1  1  1  1
    dp_shard:      0  0  1  1  0  0  1  1
    tp:            0  1  0  1  0  1  0  1
    weight group of rank 0: {0, 1, 2, 3}     dp group of rank 0: {0, 2, 4, 6}

[Note: expert axes]
~~~~~~~~~~~~~~~~~~~
Experts are an axis, but not a fifth factor of the world: ``ep`` re-partitions the ranks of
``weight`` (dp_shard x cp x tp, the ranks that already hold different pieces of a weight
within one replica), as torchtitan's ``ParallelDims`` does (its "sparse" mesh, 2026). The same
ranks, unflattened the other way, innermost last::

    dense region (attention, norms, embeddings, shared experts, the router):
        (dp_replicate, dp_shard, cp, tp)      FSDP over dp_shard_cp, TP over tp
    expert region (the routed experts):
        (dp_replicate, efsdp, ep)             experts Shard(0) over ep, FSDP over efsdp
        efsdp = dp_shard * cp * tp / ep       the ranks holding the SAME experts

``ep`` must divide ``dp_shard * cp * tp``. World 8 = dp_shard 4 x tp 2, ep 4 (cp 1)::

    rank:       0  1  2  3  4  5  6  7
    dp_shard:   0  0  1  1  2  2  3  3
    tp:         0  1  0  1  0  1  0  1
    weight:     0  1  2  3  4  5  6  7
    ep:         0  1  2  3  0  1  2  3        = weight % ep    (ep groups {0..3}, {4..7})
    efsdp:      0  0  0  0  1  1  1  1        = weight // ep   (efsdp groups {0,4}, {1,5}, ...)

    16 experts: rank 0 and rank 4 hold experts 0-3 (each half of their rows, efsdp),
                rank 1 and rank 5 experts 4-7, ...

``ep`` is innermost, so an ep group takes the tp ranks first, then cp, then dp_shard. Inside
the expert region every rank of a replica holds DIFFERENT tokens: the tp ranks, which see the
same tokens in the dense region, each take 1/tp of them for the experts (``shardbridge._ep``);
dp_shard and cp ranks hold different tokens already. So the token dispatch over ``ep`` never
sends a token twice, and a gradient of an expert summed over ``dp_replicate x efsdp x ep``
counts every token once: FSDP divides it by ``dp_cp`` (the data-parallel size, not efsdp).
``ep=1`` is the same picture with ``efsdp = weight``: every rank holds every expert's 1/weight,
tokens still split over tp. Nothing branches on "is ep enabled".
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["MESH_AXES", "FLATTENED_AXES", "ParallelDims", "ParallelMesh"]

#: The axes of the full mesh, outermost first.
MESH_AXES: tuple[str, ...] = ("dp_replicate", "dp_shard", "cp", "tp")

#: Flattened axes and the mesh axes they combine.
FLATTENED_AXES: dict[str, tuple[str, ...]] = {
    "dp": ("dp_replicate", "dp_shard"),
    "dp_shard_cp": ("dp_shard", "cp"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),
    "weight": ("dp_shard", "cp", "tp"),
}

#: The expert region's axes, outermost first: ``weight`` unflattened as ``(efsdp, ep)``
#: (see [Note: expert axes]). ``ep`` = ParallelDims.ep, ``efsdp`` = dp_shard * cp * tp / ep.
EXPERT_AXES: tuple[str, ...] = ("efsdp", "ep")


@dataclass(frozen=True, kw_only=True)
class ParallelDims:
    """Degrees of the parallel axes; their product is the world size.

    Example:
        >>> dims = ParallelDims(dp_shard=-1, tp=2).resolve(world_size=8)
        >>> dims.dp_shard
        4
    """

    dp_replicate: int = 1
    """Replicas of the sharded model (the outer axis of HSDP). 1 = no replication."""

    dp_shard: int = -1
    """Ranks one FSDP shard group spans. -1 = whatever the other axes leave of the world."""

    cp: int = 1
    """Context-parallel degree (sequence split). 1 = off. Folded into FSDP sharding."""

    tp: int = 1
    """Tensor-parallel degree. 1 = off."""

    ep: int = 1
    """Expert-parallel degree: routed experts are split ``ep`` ways over the ranks of
    ``dp_shard x cp x tp`` (it must divide their product; it adds no ranks), and each expert's
    weights are FSDP-sharded over the other ``efsdp = dp_shard * cp * tp / ep`` of them. 1 =
    every rank holds a 1/efsdp piece of every expert. Dense weights do not depend on it. See
    [Note: expert axes]."""

    def __post_init__(self) -> None:
        for name in (*MESH_AXES, "ep"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an int, got {value!r}")
            if name == "dp_shard" and value == -1:
                continue
            if value < 1:
                hint = " (only dp_shard may be -1, meaning 'the rest')" if value == -1 else ""
                raise ValueError(f"{name}({value}) must be >= 1{hint}; set {name}=1 to turn it off")

    @property
    def is_resolved(self) -> bool:
        """True when no degree is -1."""
        return self.dp_shard != -1

    def resolve(self, world_size: int) -> ParallelDims:
        """Fill ``dp_shard=-1`` and check that the degrees multiply to ``world_size``.

        Args:
            world_size: number of ranks.

        Returns:
            A resolved copy (no -1).

        Raises:
            ValueError: the degrees do not fit the world size; the message says what to set.

        Example:
            >>> ParallelDims(dp_replicate=2, tp=2).resolve(8).dp_shard
            2
        """
        if world_size < 1:
            raise ValueError(f"world_size({world_size}) must be >= 1")
        others = self.dp_replicate * self.cp * self.tp
        if self.dp_shard == -1:
            if world_size % others != 0:
                raise ValueError(
                    f"dp_replicate({self.dp_replicate}) * cp({self.cp}) * tp({self.tp}) = {others} "
                    f"does not divide world_size({world_size}), so no dp_shard fits; {self._refit(world_size)}"
                )
            resolved = dataclasses.replace(self, dp_shard=world_size // others)
        else:
            product = others * self.dp_shard
            if product != world_size:
                fix = (
                    f"set dp_shard={world_size // others} (or dp_shard=-1 to infer it)"
                    if world_size % others == 0
                    else f"no dp_shard fits: {self._refit(world_size)}"
                )
                raise ValueError(
                    f"dp_replicate({self.dp_replicate}) * dp_shard({self.dp_shard}) * cp({self.cp}) "
                    f"* tp({self.tp}) = {product} != world_size({world_size}); {fix}"
                )
            resolved = self
        expert_ranks = resolved.dp_shard * resolved.cp * resolved.tp
        if expert_ranks % resolved.ep:
            divisors = [d for d in range(1, expert_ranks + 1) if expert_ranks % d == 0]
            raise ValueError(
                f"ep({resolved.ep}) does not divide dp_shard({resolved.dp_shard}) * cp({resolved.cp}) * "
                f"tp({resolved.tp}) = {expert_ranks}, the ranks experts are spread over (ep adds no ranks); "
                f"set ep to one of {divisors}"
            )
        return resolved

    def degrees_that_fit(self, axis: str, world_size: int) -> list[int]:
        """The degrees of ``axis`` (dp_replicate, cp or tp) that fit ``world_size``, the other two kept.

        dp_shard takes what is left (as with ``dp_shard=-1``); [] when the other two alone do not
        divide the world.

        Example:
            >>> ParallelDims(tp=3).degrees_that_fit("tp", 4)
            [1, 2, 4]
        """
        if axis not in ("dp_replicate", "cp", "tp"):
            raise ValueError(f"degrees_that_fit: axis={axis!r}; choose dp_replicate, cp or tp (dp_shard takes the rest)")
        rest = math.prod(getattr(self, a) for a in ("dp_replicate", "cp", "tp") if a != axis)
        if world_size % rest:
            return []
        room = world_size // rest
        return [d for d in range(1, room + 1) if room % d == 0]

    def _refit(self, world_size: int) -> str:
        """What fits instead: each axis > 1 with its degrees that fit, or a world size (see resolve)."""
        others = self.dp_replicate * self.cp * self.tp
        fixes = [
            f"{axis} to one of {fit}"
            for axis in ("tp", "cp", "dp_replicate")
            if getattr(self, axis) > 1 and (fit := self.degrees_that_fit(axis, world_size))
        ]
        first = f"set {' or '.join(fixes)}" if fixes else f"choose degrees whose product divides {world_size}"
        return f"{first}, or use a world size divisible by {others}"

    def degree(self, axis: str) -> int:
        """Degree of a mesh axis or of a flattened axis (product of its parts)."""
        self._require_resolved()
        if axis in MESH_AXES:
            return getattr(self, axis)
        if axis in FLATTENED_AXES:
            return math.prod(getattr(self, a) for a in FLATTENED_AXES[axis])
        if axis == "ep":
            return self.ep
        if axis == "efsdp":
            return self.degree("weight") // self.ep
        raise ValueError(f"unknown axis {axis!r}; known axes: {', '.join(_ALL_AXES)}")

    @property
    def world_size(self) -> int:
        """Product of all degrees."""
        self._require_resolved()
        return self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def fsdp_enabled(self) -> bool:
        """Whether parameters are sharded or replicated over a data-parallel axis."""
        return self.degree("dp_cp") > 1

    @property
    def hsdp_enabled(self) -> bool:
        """Whether FSDP runs as HSDP (replicas of a sharded model)."""
        return self.dp_replicate > 1

    @property
    def tp_enabled(self) -> bool:
        """Whether tensor parallelism is on."""
        return self.tp > 1

    def mesh_shape(self) -> tuple[int, ...]:
        """The full mesh shape in :data:`MESH_AXES` order."""
        self._require_resolved()
        return tuple(getattr(self, a) for a in MESH_AXES)

    def build_mesh(self, device_type: str = "cpu") -> ParallelMesh:
        """Build the full DeviceMesh and all named sub-meshes.

        Needs an initialised default process group; ``dp_shard=-1`` is resolved against its
        world size.

        Args:
            device_type: "cpu" (gloo) or "cuda" (nccl); any device type a registered process-group
                backend supports (``torch.distributed.Backend``: "xpu", "mps", "hpu", ...).

        Raises:
            ValueError: ``device_type`` is not one (``"gpu"``, ``"cuda:0"``), before any mesh is built.
            TypeError: ``device_type`` is not a str (a ``torch.device``: pass its ``.type``).

        Example:
            >>> pm = ParallelDims(dp_shard=2, tp=2).build_mesh("cpu")  # doctest: +SKIP
            >>> pm["weight"].size(), pm["dp"].size()  # doctest: +SKIP
            (4, 2)
        """
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        from shardbridge._compat import concatenate_meshes, flatten_mesh, unflatten_mesh

        _check_device_type(device_type)
        if not dist.is_initialized():
            raise RuntimeError(
                "ParallelDims.build_mesh needs an initialised process group; "
                "call shardbridge.init_distributed() (torchrun's or SLURM's variables) or "
                "torch.distributed.init_process_group first"
            )
        dims = self.resolve(dist.get_world_size())
        mesh = init_device_mesh(device_type, dims.mesh_shape(), mesh_dim_names=MESH_AXES)
        axes = {axis: mesh[axis] for axis in MESH_AXES}
        # Keep the flattened meshes ourselves: slicing a flattened dim from the root mesh
        # is deprecated in torch >= 2.11.
        for name, parts in FLATTENED_AXES.items():
            axes[name] = flatten_mesh(mesh[parts], name)
        # The expert region: weight unflattened as (efsdp, ep), joined with dp_replicate without
        # new process groups (all are sub-meshes of one root, as FSDP2's own concatenation needs).
        # See [Note: expert axes].
        expert = unflatten_mesh(axes["weight"], 0, (dims.degree("efsdp"), dims.ep), EXPERT_AXES)
        for name in EXPERT_AXES:
            axes[name] = expert[name]
        expert_mesh = concatenate_meshes([mesh["dp_replicate"], axes["efsdp"], axes["ep"]])
        return ParallelMesh(dims=dims, mesh=mesh, axes=axes, expert_mesh=expert_mesh)

    def _require_resolved(self) -> None:
        if not self.is_resolved:
            raise ValueError("dp_shard is -1; call resolve(world_size) first")

    def __str__(self) -> str:
        return ", ".join(f"{a}={getattr(self, a)}" for a in (*MESH_AXES, "ep"))


_ALL_AXES: tuple[str, ...] = MESH_AXES + tuple(FLATTENED_AXES) + EXPERT_AXES


def _mesh_device_types() -> list[str]:
    """Device types a DeviceMesh can be built on here: those of every registered process-group backend."""
    import torch.distributed as dist

    types = set(dist.Backend.default_device_backend_map)
    for devices in dist.Backend.backend_capability.values():
        types.update(devices)
    return sorted(types)


def _check_device_type(device_type: object) -> None:
    """ValueError unless ``device_type`` is a bare device type some process-group backend supports.

    ``init_device_mesh`` itself takes any string: ``"gpu"`` built a mesh and trained on CPU.
    """
    from shardbridge._checks import did_you_mean

    known = _mesh_device_types()
    if not isinstance(device_type, str):
        raise TypeError(
            f"ParallelDims.build_mesh(device_type=...): expected a str such as 'cpu' or 'cuda', got a "
            f"{type(device_type).__name__}" + ("; pass its .type" if hasattr(device_type, "type") else "")
        )
    if device_type in known:
        return
    hint = did_you_mean(device_type, known)
    if device_type.split(":")[0] in known:
        hint = f"; pass {device_type.split(':')[0]!r} (each rank uses its current device; set it with torch.cuda.set_device)"
    elif device_type == "gpu":
        hint = "; did you mean 'cuda'?"
    raise ValueError(
        f"ParallelDims.build_mesh(device_type={device_type!r}): not a device type a process-group backend supports; "
        f"use 'cpu' (gloo) or 'cuda' (nccl); supported here: {known}{hint}"
    )


@dataclass(frozen=True)
class ParallelMesh:
    """The full 4-D DeviceMesh plus named access to every axis.

    ``pm["tp"]``, ``pm.tp``, ``pm["dp_shard_cp"]``, ``pm["weight"]``, ``pm["ep"]`` ... return
    1-D meshes (size 1 for degree-1 axes). ``pm.fsdp_mesh`` is the mesh ``fully_shard`` takes,
    ``pm.expert_fsdp_mesh`` the one it takes for routed experts. Built by
    :meth:`ParallelDims.build_mesh`.
    """

    dims: ParallelDims
    mesh: DeviceMesh
    axes: dict[str, DeviceMesh]
    expert_mesh: DeviceMesh
    """The expert region ``(dp_replicate, efsdp, ep)`` over the same ranks ([Note: expert axes])."""

    def __getitem__(self, axis: str) -> DeviceMesh:
        try:
            return self.axes[axis]
        except KeyError:
            raise KeyError(f"unknown axis {axis!r}; known axes: {', '.join(self.axes)}") from None

    def __getattr__(self, axis: str) -> DeviceMesh:
        if axis in _ALL_AXES:
            return self[axis]
        raise AttributeError(axis)

    @property
    def expert_fsdp_mesh(self) -> DeviceMesh:
        """``efsdp`` for FSDP of routed experts, or the 2-D ``(dp_replicate, efsdp)`` mesh for HSDP.

        Expert weights are DTensors on ``pm["ep"]`` (``Shard(0)``, the expert dim);
        ``fully_shard(experts, mesh=pm.expert_fsdp_mesh)`` shards them further over the ranks
        holding the same experts. See [Note: expert axes].
        """
        if not self.dims.hsdp_enabled:
            return self["efsdp"]
        return self.expert_mesh["dp_replicate", "efsdp"]

    @property
    def fsdp_mesh(self) -> DeviceMesh:
        """``dp_shard_cp`` for FSDP, or the 2-D ``(dp_replicate, dp_shard_cp)`` mesh for HSDP."""
        if not self.dims.hsdp_enabled:
            return self["dp_shard_cp"]
        from shardbridge._compat import unflatten_mesh

        # dp_cp = (dp_replicate, dp_shard, cp) flattened; unflattening it reuses its groups.
        return unflatten_mesh(
            self["dp_cp"],
            0, (self.dims.dp_replicate, self.dims.degree("dp_shard_cp")), ("dp_replicate", "dp_shard_cp")
        )

    def coordinate(self) -> dict[str, int]:
        """This rank's coordinate on every axis, flattened ones included."""
        return {axis: mesh.get_local_rank() for axis, mesh in self.axes.items()}
