"""Checkpoints written by Megatron-Core's own fsdp_dtensor path (Megatron-LM's
``--ckpt-format fsdp_dtensor``: ``handle_swiglu_in_state_dict`` + the bundled Megatron-FSDP's
``preprocess_state_dict_for_uneven_dtensor`` + ``dcp.save``), read in one process without a
process group; and upstream's SwiGLU split of plain-tensor optimizer states (Megatron-LM #4423)
shown wrong against an item-coordinate oracle, where shardbridge's split is right."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from mcore_helpers import FULL, build_sharded, gather_full, optimizer_states, train
from shardbridge.testing import run_distributed
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

FC1 = "decoder.layers.0.mlp.linear_fc1.weight"


class PlainState(torch.Tensor):
    """A plain local optimizer state as Megatron-LM main's split takes it.

    megatron-core 0.16.1 calls ``data.to_local()`` on every state, so a plain tensor raises
    AttributeError there (or the even-size assert fires first); Megatron-LM main reads plain
    states as ``data if not DTensor`` and computes the #4423 slices from their local numel.
    This subclass only adds that ``to_local`` (returning the plain tensor), so 0.16.1's own
    function runs main's plain-tensor path; every number it computes is upstream's.
    """

    def to_local(self) -> torch.Tensor:
        return self.as_subclass(torch.Tensor)


def _upstream_state_dicts(model, opt, *, plain: bool, like_main: bool = False):
    """What Megatron-LM hands to handle_swiglu_in_state_dict: the wrapper's model state dict and
    optimizer states keyed ``module.<wrapper param name>``; ``plain`` = FusedAdam-style local tensors."""
    names = {id(p): n for n, p in model.named_parameters()}

    def convert(name, v):
        # Only fc1's states go plain: the other states stay DTensors, which upstream handles.
        if not (plain and "linear_fc1" in name and hasattr(v, "to_local")):
            return v
        local = v.to_local().detach().clone()
        return local.as_subclass(PlainState) if like_main else local

    state = {
        f"module.{names[id(p)]}": {k: convert(names[id(p)], v) for k, v in st.items()} for p, st in opt.state.items()
    }
    return model.state_dict_for_save_checkpoint(), {"state": state, "param_groups": []}


def _write_upstream(root: str, dims: dict | None = None, plain: bool = False, **overrides) -> dict:
    """2 AdamW steps, saved exactly as Megatron-LM's fsdp_dtensor format does; ``plain``: with
    FusedAdam-style plain optimizer states (the #4423 case)."""
    import torch.distributed.checkpoint as dcp
    from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import (
        preprocess_state_dict_for_uneven_dtensor,
    )
    from megatron.core.transformer.fsdp_dtensor_checkpoint import handle_swiglu_in_state_dict
    from shardbridge_megatron_fsdp.mcore import destroy_parallel_state

    try:
        model, opt = build_sharded(dims or {"dp_shard": 2, "tp": 2}, adam=True, **overrides)
        train(model, opt, steps=2)
        expected = {"model": gather_full(model), "exp_avg": gather_full(model, optimizer_states(model, opt, "exp_avg"))}
        model_sd, optim_sd = _upstream_state_dicts(model, opt, plain=plain, like_main=plain)
        model_sd, optim_sd = handle_swiglu_in_state_dict(model, model_sd, optim_sd)
        state_dict = {"model": model_sd, "optimizer": optim_sd}
        preprocess_state_dict_for_uneven_dtensor(state_dict)
        dcp.save(state_dict, checkpoint_id=f"{root}/fsdp_dtensor")
        dist.barrier()
        return expected
    finally:
        destroy_parallel_state()


def test_read_megatron_fsdp_dtensor_checkpoint(tmp_path):
    from shardbridge_megatron_fsdp.mcore import read_fsdp_dtensor

    expected = run_distributed(_write_upstream, str(tmp_path), world_size=4, timeout=300)[0]
    ckpt = read_fsdp_dtensor(tmp_path / "fsdp_dtensor")  # this process has no process group
    assert ckpt.model.keys() == expected["model"].keys()
    for name, value in expected["model"].items():
        assert torch.equal(ckpt.model[name], value), name
    assert ckpt.optimizer.keys() == expected["exp_avg"].keys()
    for name, value in expected["exp_avg"].items():
        assert torch.equal(ckpt.optimizer[name]["exp_avg"], value), name
    assert ckpt.optimizer[FC1].keys() == {"exp_avg", "exp_avg_sq"}


def _split_plain_states(root: str, dims: dict, ffn: int) -> dict:
    """Upstream's split and shardbridge's split of the same plain (FusedAdam-style) fc1 states."""
    from megatron.core.transformer.fsdp_dtensor_checkpoint import handle_swiglu_in_state_dict
    from shardbridge_megatron_fsdp.mcore import destroy_parallel_state, save

    try:
        model, opt = build_sharded(dims, adam=True, ffn_hidden_size=ffn)
        train(model, opt, steps=2)
        oracle = gather_full(model, optimizer_states(model, opt, "exp_avg"))[FC1]
        # Upstream: the #4423 split of plain local tensors.
        from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import (
            gather_uneven_dtensor_to_full_tensor,
        )

        results = {}
        for like_main in (False, True):
            model_sd, optim_sd = _upstream_state_dicts(model, opt, plain=True, like_main=like_main)
            key = next(k for k in optim_sd["state"] if k.endswith(FC1))
            optim_sd["state"] = {key: optim_sd["state"][key]}
            try:
                _, split = handle_swiglu_in_state_dict(model, {}, optim_sd)
                outcome = "split"
            except (AssertionError, AttributeError) as err:  # 0.16.1: odd row count, or no to_local (#5265)
                outcome = f"raised {type(err).__name__}"
            outcomes = [None] * dist.get_world_size()
            dist.all_gather_object(outcomes, outcome)
            halves = None
            if all(o == "split" for o in outcomes):
                parts = [split["state"][f"{key}_{p}"]["exp_avg"] for p in "wv"]
                halves = [gather_uneven_dtensor_to_full_tensor(t).to_local().clone() for t in parts]
            results["main" if like_main else "0.16.1"] = (outcomes, halves)
        # shardbridge: the same plain local tensors, saved through the core's item coordinates.
        for st in opt.state.values():
            for k, v in list(st.items()):
                if hasattr(v, "to_local"):
                    st[k] = v.to_local().clone()  # plain, as FusedAdam keeps them
        save(f"{root}/ours", model=model, optimizer=opt)
        dist.barrier()
        return {"oracle": oracle, "upstream": results}
    finally:
        destroy_parallel_state()


def _is_right(outcome, gate, up) -> bool:
    outcomes, halves = outcome
    if halves is None:
        return False
    w, v = halves
    return w.shape == gate.shape and torch.equal(w, gate) and torch.equal(v, up)


SPLIT_CASES = [pytest.param({"dp_shard": 2, "tp": 2}, 96, id="dp2xtp2")]
if FULL:  # full only: main's plain path writes without an error here (test_refuse_... reads that file)
    SPLIT_CASES.append(pytest.param({"dp_shard": 1, "tp": 4}, 96, id="tp4"))


@pytest.mark.parametrize("dims,ffn", SPLIT_CASES)
def test_upstream_swiglu_split_of_plain_states_is_wrong_ours_is_right(tmp_path, dims, ffn):
    out = run_distributed(_split_plain_states, str(tmp_path), dims, ffn, world_size=4, timeout=300)[0]
    gate, up = out["oracle"].chunk(2)
    # Upstream's split of plain (FusedAdam-style) states, against the item-coordinate oracle:
    # 0.16.1 raises (odd local row counts: the even-size assert; else no .to_local on a plain
    # tensor); Megatron-LM main's plain path runs and returns wrong gate/up values.
    # These assertions fail once upstream computes the split in item coordinates (#4423).
    assert not _is_right(out["upstream"]["0.16.1"], gate, up), out["upstream"]["0.16.1"][0]
    assert not _is_right(out["upstream"]["main"], gate, up), out["upstream"]["main"][0]
    # Ours: the checkpoint's gate/up exp_avg equal the oracle, read by torch's own reader.
    dcp_to_torch_save(tmp_path / "ours", tmp_path / "ours.pt")
    optim = torch.load(tmp_path / "ours.pt", weights_only=True)["optim"]
    assert torch.equal(optim["state.decoder.layers.0.mlp.gate_proj.weight.exp_avg"], gate)
    assert torch.equal(optim["state.decoder.layers.0.mlp.up_proj.weight.exp_avg"], up)


def test_refuse_fsdp_dtensor_written_with_the_4423_split(tmp_path):
    """tp4 (dp 1): Megatron-LM main's split of plain states passes every upstream check and writes
    _w/_v exp_avg of 24 rows (the first eighth of each TP piece) for a 96-row gate."""
    from shardbridge_megatron_fsdp.mcore import SwiGLUSplitError, read_fsdp_dtensor

    expected = run_distributed(
        _write_upstream, str(tmp_path), {"dp_shard": 1, "tp": 4}, True, world_size=4, timeout=300
    )[0]
    with pytest.raises(
        SwiGLUSplitError, match=r"linear_fc1\.weight_[wv]\.exp_avg.*not shaped like its parameter.*#4423"
    ):
        read_fsdp_dtensor(tmp_path / "fsdp_dtensor")
    # What upstream wrote is wrong: torch's own reader gives a _w state that is not the gate's.
    dcp_to_torch_save(tmp_path / "fsdp_dtensor", tmp_path / "up.pt")
    optim = torch.load(tmp_path / "up.pt", weights_only=True)["optimizer"]
    gate = expected["exp_avg"][FC1].chunk(2)[0]
    w = next(v for k, v in optim["state"].items() if k.endswith(FC1 + "_w"))["exp_avg"]
    assert not torch.equal(w, gate)
    # The model weights (DTensors, split right upstream) read fine without the optimizer.
    ckpt = read_fsdp_dtensor(tmp_path / "fsdp_dtensor", optimizer=False)
    assert not ckpt.optimizer
    for name, value in expected["model"].items():
        assert torch.equal(ckpt.model[name], value), name
