"""ParallelDims / ParallelMesh: tier 1 (validation), tier 2 (fake process group, up to 64
ranks) and tier 3 (real gloo)."""

import itertools
import math

import pytest
import torch
import torch.distributed as dist
from shardbridge import EXPERT_AXES, FLATTENED_AXES, MESH_AXES, ParallelDims
from shardbridge._compat import fake_store
from shardbridge.testing import run_distributed

# ---------------------------------------------------------------- tier 1: validation


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tp": 0}, r"tp\(0\) must be >= 1; set tp=1 to turn it off"),
        ({"dp_replicate": -1}, r"dp_replicate\(-1\) must be >= 1 \(only dp_shard may be -1"),
        ({"cp": -2}, r"cp\(-2\) must be >= 1"),
        ({"dp_shard": 0}, r"dp_shard\(0\) must be >= 1"),
        ({"tp": 2.0}, r"tp must be an int, got 2.0"),
        ({"tp": True}, r"tp must be an int"),
        ({"ep": 0}, r"ep\(0\) must be >= 1; set ep=1 to turn it off"),
        ({"ep": True}, r"ep must be an int"),
    ],
)
def test_bad_degrees_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ParallelDims(**kwargs)


def test_product_must_match_world_size():
    with pytest.raises(
        ValueError,
        match=r"dp_shard\(3\) \* cp\(2\) \* tp\(2\) = 12 != world_size\(8\); set dp_shard=2 \(or dp_shard=-1 to infer it\)$",
    ):
        ParallelDims(dp_shard=3, cp=2, tp=2).resolve(8)
    with pytest.raises(ValueError, match=r"= 3 does not divide world_size\(8\), so no dp_shard fits; set tp to one of \[1, 2, 4, 8\]"):
        ParallelDims(tp=3).resolve(8)


@pytest.mark.parametrize(
    ("dims", "world", "fix"),
    [
        # issue 38: dp_shard=-1 was suggested although no dp_shard fits tp=3 in 4 ranks
        (dict(dp_shard=2, tp=3), 4, r"no dp_shard fits: set tp to one of \[1, 2, 4\], or use a world size divisible by 3$"),
        (dict(tp=2, cp=3), 4, r"set cp to one of \[1, 2\], or use a world size divisible by 6$"),
        (dict(dp_replicate=3, dp_shard=1, tp=2), 8, r"set dp_replicate to one of \[1, 2, 4\], or use a world size"),
        (dict(tp=3, cp=3), 4, r"choose degrees whose product divides 4, or use a world size divisible by 9$"),
    ],
)
def test_a_misfit_offers_only_what_fits(dims, world, fix):
    with pytest.raises(ValueError, match=fix) as info:
        ParallelDims(**dims).resolve(world)
    assert "dp_shard=-1" not in str(info.value)  # -1 cannot fix any of these
    for axis in ("tp", "cp", "dp_replicate"):  # every offered degree fits (the oracle: resolve itself)
        for degree in ParallelDims(**dims).degrees_that_fit(axis, world):
            ParallelDims(**{**dims, axis: degree, "dp_shard": -1}).resolve(world)


@pytest.mark.parametrize(
    ("device_type", "error", "message"),
    [
        ("gpu", ValueError, r"device_type='gpu'\): not a device type .* did you mean 'cuda'\?$"),
        ("cuda:0", ValueError, r"pass 'cuda' \(each rank uses its current device"),
        ("CPU", ValueError, r"did you mean 'cpu'\?$"),
        ("meta", ValueError, r"device_type='meta'\): not a device type a process-group backend supports"),
        (None, TypeError, r"expected a str such as 'cpu' or 'cuda', got a NoneType$"),
    ],
)
def test_build_mesh_refuses_what_is_not_a_device_type(fake_world, device_type, error, message):
    """init_device_mesh took "gpu" and the run trained on CPU (issue 38)."""
    fake_world(4, 0)
    with pytest.raises(error, match=message):
        ParallelDims(tp=2).build_mesh(device_type)
    import torch

    with pytest.raises(TypeError, match=r"got a device; pass its \.type$"):
        ParallelDims(tp=2).build_mesh(torch.device("cpu"))


def test_ep_must_divide_the_ranks_of_weight():
    with pytest.raises(
        ValueError,
        match=r"ep\(3\) does not divide dp_shard\(2\) \* cp\(1\) \* tp\(2\) = 4, the ranks experts are spread over "
        r"\(ep adds no ranks\); set ep to one of \[1, 2, 4\]",
    ):
        ParallelDims(dp_shard=2, tp=2, ep=3).resolve(4)
    with pytest.raises(ValueError, match=r"ep\(4\) does not divide dp_shard\(2\)"):  # dp_replicate does not count
        ParallelDims(dp_replicate=2, ep=4).resolve(4)
    dims = ParallelDims(dp_replicate=2, cp=2, tp=2, ep=4).resolve(16)  # dp_shard inferred first
    assert (dims.dp_shard, dims.degree("ep"), dims.degree("efsdp")) == (2, 4, 2)
    assert ParallelDims().resolve(8).degree("efsdp") == 8  # ep=1: every rank of weight
    assert str(dims) == "dp_replicate=2, dp_shard=2, cp=2, tp=2, ep=4"


def test_resolve_fills_the_rest():
    dims = ParallelDims(dp_replicate=2, tp=2).resolve(16)
    assert (dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp) == (2, 4, 1, 2)
    assert dims.world_size == 16
    assert dims.degree("weight") == 8 and dims.degree("dp") == 8 and dims.degree("dp_cp") == 8
    assert dims.hsdp_enabled and dims.tp_enabled and dims.fsdp_enabled
    assert not ParallelDims(tp=4).resolve(4).fsdp_enabled
    with pytest.raises(ValueError, match="call resolve"):
        _ = ParallelDims().world_size
    with pytest.raises(ValueError, match="unknown axis 'pp'"):
        ParallelDims().resolve(1).degree("pp")


# ---------------------------------------------------------------- tier 2: fake process group


@pytest.fixture
def fake_world():
    created = []

    def init(world_size, rank):
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", store=fake_store(), rank=rank, world_size=world_size)
        created.append(True)

    yield init
    if dist.is_initialized():
        dist.destroy_process_group()


def _expected_groups(dims, rank):
    """Oracle: the ranks of each axis' group, from index arithmetic on the row-major mesh."""
    shape = dims.mesh_shape()
    coords = dict(zip(MESH_AXES, _unravel(rank, shape)))
    groups = {}
    for name, parts in [(a, (a,)) for a in MESH_AXES] + list(FLATTENED_AXES.items()):
        members = []
        for r in range(math.prod(shape)):
            c = dict(zip(MESH_AXES, _unravel(r, shape)))
            if all(c[a] == coords[a] for a in MESH_AXES if a not in parts):
                members.append(r)
        groups[name] = members
    # Expert axes: the weight index w (dp_shard, cp, tp row-major) of a replica, ep = w % ep
    # (innermost), efsdp = w // ep.
    per_replica = dims.degree("weight")
    replica, w = divmod(rank, per_replica)
    block = range(replica * per_replica, (replica + 1) * per_replica)
    groups["ep"] = [r for r in block if (r - block[0]) // dims.ep == w // dims.ep]
    groups["efsdp"] = [r for r in block if (r - block[0]) % dims.ep == w % dims.ep]
    return groups


def _unravel(rank, shape):
    out = []
    for size in reversed(shape):
        out.append(rank % size)
        rank //= size
    return tuple(reversed(out))


_LAYOUTS = [
    dict(zip(MESH_AXES, d)) for d in itertools.product([1, 2], [1, 2, 4], [1, 2], [1, 2, 4]) if math.prod(d) <= 64
] + [dict(dp_replicate=2, dp_shard=4, cp=2, tp=4), dict(dp_replicate=1, dp_shard=8, cp=1, tp=8)]
_LAYOUTS += [  # expert axes: ep over tp only, over tp x cp, over all of weight, and inside dp_shard
    dict(dp_replicate=1, dp_shard=4, cp=1, tp=2, ep=2),
    dict(dp_replicate=2, dp_shard=2, cp=2, tp=2, ep=4),
    dict(dp_replicate=2, dp_shard=4, cp=2, tp=4, ep=32),
    dict(dp_replicate=1, dp_shard=8, cp=1, tp=1, ep=4),
    dict(dp_replicate=1, dp_shard=8, cp=1, tp=8, ep=16),
]


@pytest.mark.parametrize("layout", _LAYOUTS, ids=lambda d: "-".join(f"{k}{v}" for k, v in d.items()))
def test_every_axis_on_fake_world(fake_world, layout):
    dims = ParallelDims(**layout).resolve(math.prod(v for k, v in layout.items() if k != "ep"))
    world = dims.world_size
    for rank in sorted({0, world - 1, world // 2}):
        fake_world(world, rank)
        pm = dims.build_mesh("cpu")
        expected = _expected_groups(dims, rank)
        for axis, members in expected.items():
            mesh = pm[axis]
            assert mesh.ndim == 1
            assert mesh.mesh.tolist() == members, (axis, rank)
            assert mesh.get_local_rank() == members.index(rank)
        fsdp = pm.fsdp_mesh
        if dims.hsdp_enabled:
            assert fsdp.mesh_dim_names == ("dp_replicate", "dp_shard_cp")
            assert fsdp.mesh.flatten().tolist() == expected["dp_cp"]
            assert fsdp["dp_shard_cp"].mesh.tolist() == expected["dp_shard_cp"]
        else:
            assert fsdp.mesh.tolist() == expected["dp_shard_cp"]
        expert_fsdp = pm.expert_fsdp_mesh
        efsdp_replicas = sorted(
            r for r in range(world) if (r % dims.degree("weight")) % dims.ep == (rank % dims.degree("weight")) % dims.ep
        )
        if dims.hsdp_enabled:
            assert expert_fsdp.mesh_dim_names == ("dp_replicate", "efsdp")
            assert sorted(expert_fsdp.mesh.flatten().tolist()) == efsdp_replicas
        else:
            assert expert_fsdp.mesh.tolist() == expected["efsdp"]
        assert pm.expert_mesh.mesh_dim_names == ("dp_replicate", *EXPERT_AXES)


def test_dp_shard_inferred_at_64(fake_world):
    fake_world(64, 63)
    pm = ParallelDims(dp_replicate=2, cp=2, tp=2).build_mesh("cpu")
    assert pm.dims.dp_shard == 8
    assert pm["weight"].size() == 32 and pm["dp"].size() == 16 and pm["dp_cp"].size() == 32
    assert pm.coordinate() == {
        "dp_replicate": 1,
        "dp_shard": 7,
        "cp": 1,
        "tp": 1,
        "dp": 15,
        "dp_shard_cp": 15,
        "dp_cp": 31,
        "weight": 31,
        "efsdp": 31,
        "ep": 0,
    }


def test_mesh_world_mismatch_is_a_value_error(fake_world):
    fake_world(8, 0)
    with pytest.raises(ValueError, match=r"= 4 != world_size\(8\)"):
        ParallelDims(dp_shard=2, tp=2).build_mesh("cpu")


def test_unknown_axis(fake_world):
    fake_world(4, 0)
    pm = ParallelDims(tp=2).build_mesh("cpu")
    with pytest.raises(KeyError, match="unknown axis 'pp'"):
        pm["pp"]


def test_build_mesh_needs_process_group():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        ParallelDims().build_mesh("cpu")


# ---------------------------------------------------------------- tier 3: real gloo


def _sum_over_axes(layout):
    dims = ParallelDims(**layout)
    pm = dims.build_mesh("cpu")
    rank = dist.get_rank()
    out = {}
    for axis in MESH_AXES + tuple(FLATTENED_AXES) + EXPERT_AXES:
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=pm[axis].get_group())
        out[axis] = t.item()
    return out


@pytest.mark.parametrize(
    "layout",
    [
        dict(dp_shard=-1),
        dict(dp_shard=2, tp=2),
        dict(dp_replicate=2, tp=2),
        dict(tp=4),
        dict(dp_shard=2, cp=2),
        dict(dp_shard=2, tp=2, ep=2),
        dict(dp_shard=4, ep=4),
        dict(dp_replicate=2, dp_shard=2, ep=2),
    ],
    ids=str,
)
def test_groups_reduce_over_the_right_ranks_on_gloo(layout):
    sums = run_distributed(_sum_over_axes, layout, world_size=4)
    dims = ParallelDims(**layout).resolve(4)
    for rank, got in enumerate(sums):
        expected = _expected_groups(dims, rank)
        assert got == {axis: float(sum(members)) for axis, members in expected.items()}
