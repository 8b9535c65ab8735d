"""shardbridge_megatron_fsdp._tp_patch: TP DTensor parameters (row-parallel, no_shard x TP) in Megatron-FSDP.

The canaries run megatron-fsdp 0.6.1 WITHOUT the patch on the same model and show what it
gets wrong; they fail once upstream fixes it (then the patch can be retired).
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist
from mfsdp_helpers import CFG, item_to_plain
from shardbridge.testing import run_distributed
from shardbridge_megatron_fsdp import _tp_patch

# -- gate and lifecycle (one process) ---------------------------------------------------------


def test_gate_checked_versions():
    standalone = _tp_patch._plan("megatron_fsdp")
    bundled = _tp_patch._plan("megatron.core.distributed.fsdp.src.megatron_fsdp")
    for name in _tp_patch.PATCHES:
        assert standalone.gate(name, (0, 6, 1)) and bundled.gate(name, (0, 3, 1))
        with pytest.raises(
            RuntimeError, match=r"checked against megatron_fsdp 0\.6\.1 to 0\.6\.1; this is megatron_fsdp 0\.7\.0"
        ):
            standalone.gate(name, (0, 7, 0))
        with pytest.raises(RuntimeError, match=r'pip install "megatron-core==0\.16\.1"'):
            bundled.gate(name, (0, 4, 0))


def test_install_is_idempotent_and_reversible():
    import megatron_fsdp
    from megatron_fsdp import param_and_grad_buffer as pgb

    was = _tp_patch.installed(megatron_fsdp)
    _tp_patch.uninstall(megatron_fsdp)
    original_make, original_update = pgb.make_fsdp_dtensor, vars(pgb.ParamAndGradBuffer)["update_main_grads"]
    try:
        assert _tp_patch.install(megatron_fsdp) and _tp_patch.install()  # None = the standalone copy
        patched = pgb.make_fsdp_dtensor
        assert patched is not original_make and patched.__wrapped__ is original_make
        assert pgb.ParamAndGradBuffer.update_main_grads.__wrapped__ is original_update
        _tp_patch.uninstall(megatron_fsdp)
        assert pgb.make_fsdp_dtensor is original_make
        assert vars(pgb.ParamAndGradBuffer)["update_main_grads"] is original_update
        assert not _tp_patch.installed(megatron_fsdp)
    finally:
        if was:
            _tp_patch.install(megatron_fsdp)


def test_unknown_package_is_refused():
    with pytest.raises(ValueError, match=r"package 'torch' is not a Megatron-FSDP copy.*`megatron_fsdp`"):
        _tp_patch.install(torch)
    with pytest.raises(ValueError, match=r"megatron\.core\.distributed\.fsdp\.src\.megatron_fsdp"):
        _tp_patch.installed(types.ModuleType("megatron_fsdp_fork"))


# -- 4 gloo ranks -----------------------------------------------------------------------------


def _upstream_view(strategy: str) -> tuple[tuple[int, ...], tuple[int, ...]] | str:
    """upstream's make_fsdp_dtensor (the patch's ``__wrapped__``) on o_proj's real slice of a
    patched dp2 x tp2 model: (upstream local shape, the right one), or upstream's error.
    Collective-free (no check, no chunk metadata), so a rank-dependent result cannot hang."""
    from megatron_fsdp import param_and_grad_buffer as pgb
    from mfsdp_helpers import build
    from shardbridge_megatron_fsdp._checkpoint import dist_params
    from shardbridge_megatron_fsdp._compat import raw_parameters

    pm, model, _ = build({"dp_shard": 2, "tp": 2}, strategy)
    fqn = "layers.0.attention.o_proj.weight"
    (dp,) = [d for d in dist_params(model) if d.fqn == fqn]
    raw = dict(zip(dict(model.module.named_parameters()), raw_parameters(model)))[fqn]
    upstream = pgb.make_fsdp_dtensor.__wrapped__
    try:
        out = upstream(dp.local.flatten(), raw, model.dist_index, is_sharded_param=strategy != "no_shard")
    except ValueError as e:
        return f"ValueError: {e}"
    return tuple(out._local_tensor.shape), tuple(dp.local.shape)


def test_upstream_misdescribes_row_parallel_params():
    # Shard(1) o_proj (64, 64) over tp=2: the slice is viewed with the GLOBAL column count
    for upstream, ours in run_distributed(_upstream_view, "optim_grads_params", world_size=4, timeout=300):
        assert ours[1] == 32 and upstream[1] == 64 and upstream[0] * 64 == ours[0] * 32, (upstream, ours)


def test_upstream_refuses_no_shard_with_tp():
    # no_shard compares the TP DTensor's GLOBAL numel with its local slice (column params too)
    for message in run_distributed(_upstream_view, "no_shard", world_size=4, timeout=300):
        assert "[Megatron-FSDP] Mismatch between param shape torch.Size([64, 64])" in message, message


def _unaligned_embedding() -> str:
    """fully_shard_model on the core TP plan (dp2 x tp2), patched but without align_tp_grads."""
    import megatron_fsdp
    from mfsdp_helpers import backward
    from shardbridge import ParallelDims
    from shardbridge.models import Llama, apply_llama_tp
    from shardbridge_megatron_fsdp import _cpu_patch
    from shardbridge_megatron_fsdp._shard import _quiet_device_warning

    pm = ParallelDims(dp_shard=2, tp=2).build_mesh("cpu")
    _cpu_patch.install()
    _tp_patch.install(megatron_fsdp)
    model = Llama(CFG, seed=0)
    apply_llama_tp(model, pm["tp"])
    with _quiet_device_warning(True):
        model = megatron_fsdp.fully_shard_model(
            model,
            fsdp_unit_modules=[type(model.layers[0])],
            device_mesh=pm.mesh,
            dp_shard_dim="dp_shard",
            tp_dim="tp",
            zero_dp_strategy="optim_grads_params",
            device=torch.device("cpu"),
            sync_model_each_microbatch=True,
        )
    model.ddp_config.gradient_reduce_div_fusion = False  # gloo: no PREMUL_SUM
    try:
        backward(pm, model)  # every rank fails at the same hook (the embedding's, the last)
        return "no error"
    except RuntimeError as e:
        return str(e)
    finally:
        dist.barrier()


def test_vocab_parallel_embedding_needs_aligned_gradients():
    # torch gives the Shard(0) embedding a Replicate (256, 64) gradient; Megatron-FSDP copies it
    # into the TP-local (128, 64) main-gradient slot
    for message in run_distributed(_unaligned_embedding, world_size=4, timeout=300):
        assert "The size of tensor a (128) must match the size of tensor b (256)" in message, message


def _boxes(dims: dict, strategy: str, outer: str | None, bf16: bool) -> dict[str, object]:
    """Right after shard_model (no step): every distributed param's box (all ranks) and the values
    assembled from the boxes."""
    from mfsdp_helpers import build, full_params
    from shardbridge import PrecisionPolicy
    from shardbridge_megatron_fsdp._checkpoint import dist_params
    from shardbridge_megatron_fsdp._compat import raw_parameters

    # bf16: the module computes in bf16, the main weights must still be the fp32 originals
    pm, model, _ = build(dims, strategy, outer, policy=PrecisionPolicy.bf16() if bf16 else None)
    boxes = {dp.fqn: (dp.offsets, tuple(dp.local.shape), dp.shape) for dp in dist_params(model)}
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, boxes)
    full = {fqn: item_to_plain(fqn, t, pm.dims.tp) for fqn, t in full_params(model).items()}
    hooked = _tp_patch.align_tp_grads(raw_parameters(model))  # already hooked by shard_model: counted
    return {"boxes": gathered, "full": full, "hooked": hooked}


@pytest.mark.parametrize(
    ("dims", "strategy", "outer", "replicas", "bf16"),
    [
        ({"dp_shard": 2, "tp": 2}, "optim_grads_params", None, 1, True),
        ({"dp_shard": 2, "tp": 2}, "no_shard", None, 2, False),  # not sharded over dp: both dp ranks hold it
        ({"dp_replicate": 2, "dp_shard": 1, "tp": 2}, "optim_grads_params", "optim", 1, False),  # HFSDP
    ],
    ids=["fsdp2_tp2_bf16", "no_shard_tp2", "hsdp_optim_tp2"],
)
def test_boxes_tile_every_param_and_hold_its_values(dims, strategy, outer, replicas, bf16):
    from shardbridge.models import Llama

    original = dict(Llama(CFG, seed=0).named_parameters())
    results = run_distributed(_boxes, dims, strategy, outer, bf16, world_size=4, timeout=300)
    for rank_result in results:
        # 5 TP DTensor params hooked per block pair + embedding + output: 2 * 4 + 2
        assert rank_result["hooked"] == 10
        for fqn, value in rank_result["full"].items():
            assert torch.equal(value, original[fqn].detach()), fqn  # bit-exact, no step taken
    # The boxes of all ranks cover every element exactly as often as it is replicated.
    for fqn, (_, _, shape) in results[0]["boxes"][0].items():
        count = torch.zeros(shape, dtype=torch.int32)
        for rank_boxes in results[0]["boxes"]:
            offsets, local, _ = rank_boxes[fqn]
            if all(local):
                count[tuple(slice(o, o + s) for o, s in zip(offsets, local))] += 1
        # norms are plain tensors replicated over tp; every other param is TP-sharded
        expected = replicas * (dims["tp"] if fqn.endswith("norm.weight") else 1)
        assert torch.all(count == expected), (fqn, count.unique())
    o_proj = [b["layers.0.attention.o_proj.weight"] for b in results[0]["boxes"]]
    # row-parallel: tp rank j's boxes lie in columns [32 j, 32 j + 32) of the (64, 64) weight
    assert {(off[1], loc[1]) for off, loc, _ in o_proj if all(loc)} == {(0, 32), (32, 32)}
