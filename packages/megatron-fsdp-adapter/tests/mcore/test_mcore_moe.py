"""Megatron-Core MoE (its local MoE layer spec: TopKRouter, SequentialMLP experts, the alltoall
token dispatcher, its own expert parallelism) under Megatron-Core's Megatron-FSDP on 4 gloo ranks.

- training at dp4 x ep2 matches a single-process run of the same model and data;
- checkpoints hold the experts in GLOBAL expert coordinates (``...mlp.experts.linear_fc1.weight``
  ``[E, 2I, D]``, dim 0 = global expert), so a checkpoint saved at ep2 loads bit-exact at ep4, ep1
  and in one process (every parameter and AdamW state; torch's ``dcp_to_torch_save`` of each
  checkpoint is the oracle that the files agree too), and the loaded model's next loss agrees;
- ep4 on 4 ranks (and one process) loads and saves, but its ``optimizer.step()`` is refused:
  megatron-core 0.16.1 counts gradients twice in a one-rank data-parallel group;
- export to ``MixtralForCausalLM`` (logits equal) and Mixtral folders into the sharded model.

CI runs the resharding test; ``SHARDBRIDGE_MCORE_FULL=1`` (nox -s megatron_core) adds the rest.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from mcore_helpers import (
    EXPERT_FFN,
    EXPERTS,
    FULL,
    HIDDEN,
    STEPS,
    build_sharded_moe,
    gather_stacked,
    moe_reference,
    optimizer_states,
    train,
)
from shardbridge.testing import run_distributed
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

FC1 = "decoder.layers.{}.mlp.experts.linear_fc1.weight"
FC2 = "decoder.layers.{}.mlp.experts.linear_fc2.weight"


def _train(dims: dict, strategy: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    from shardbridge_megatron_fsdp.mcore import destroy_parallel_state

    try:
        model, opt = build_sharded_moe(dims, strategy=strategy)
        return train(model, opt, STEPS), gather_stacked(model)
    finally:
        destroy_parallel_state()


@pytest.mark.skipif(not FULL, reason="SHARDBRIDGE_MCORE_FULL=1 (nox -s megatron_core)")
@pytest.mark.parametrize(
    "dims,strategy",
    [
        pytest.param({"dp_shard": 4, "ep": 2}, "optim_grads_params", id="dp4xep2-optim_grads_params"),
        pytest.param({"dp_shard": 4, "ep": 1}, "optim_grads", id="dp4xep1-optim_grads"),
    ],
)
def test_moe_matches_single_process(dims, strategy):
    ref_losses, ref_params = run_distributed(moe_reference, world_size=1, timeout=600)[0]
    losses, params = run_distributed(_train, dims, strategy, world_size=4, timeout=600)[0]
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert ref_losses[-1] < ref_losses[0]  # it trains
    assert set(params) == set(ref_params)
    assert params[FC1.format(0)].shape == (EXPERTS, 2 * EXPERT_FFN, HIDDEN)
    for name, ref in ref_params.items():
        torch.testing.assert_close(params[name], ref, rtol=0, atol=1e-5, msg=name)


def _gathered(model, opt) -> dict:
    return {
        "params": gather_stacked(model),
        "exp_avg": gather_stacked(model, optimizer_states(model, opt, "exp_avg")),
        "exp_avg_sq": gather_stacked(model, optimizer_states(model, opt, "exp_avg_sq")),
    }


def _next_loss(model) -> float:
    """The global mean loss of the next step's batch (step 2), as ``train`` would report it."""
    from mcore_helpers import batch, loss_of
    from megatron.core import parallel_state

    dp, rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    tokens, labels = batch(2)
    n = tokens.shape[0] // dp
    with torch.no_grad():
        loss = loss_of(model, tokens[rank * n : (rank + 1) * n], labels[rank * n : (rank + 1) * n])
    dist.all_reduce(loss)
    return loss.item() / dist.get_world_size()


def _reshard(root: str) -> dict:
    """ep2 (train 2 AdamW steps, save a) -> ep4 (load a, save b) -> ep1 (load b, save c)."""
    from shardbridge_megatron_fsdp.mcore import destroy_parallel_state, load, save

    out: dict = {"state": {}, "losses": {}, "steps": []}
    try:
        model, opt = build_sharded_moe({"dp_shard": 4, "ep": 2}, adam=True)
        train(model, opt, steps=2)
        out["state"]["a"] = _gathered(model, opt)
        save(f"{root}/a", model=model, optimizer=opt, step=2)
        out["losses"]["a"] = train(model, opt, steps=1, start=2)[0]
    finally:
        destroy_parallel_state()
    for src, dst, dims in (("a", "b", {"dp_shard": 4, "ep": 4}), ("b", "c", {"dp_shard": 4, "ep": 1})):
        try:
            model, opt = build_sharded_moe(dims, seed=1, adam=True, weights=False)
            out["steps"].append(load(f"{root}/{src}", model=model, optimizer=opt).step)
            out["state"][dst] = _gathered(model, opt)
            save(f"{root}/{dst}", model=model, optimizer=opt, step=2)
            out["losses"][dst] = _next_loss(model)
            if dims["ep"] == 4:  # one rank per expert copy: megatron-core 0.16.1 would double the expert gradients
                with pytest.raises(NotImplementedError, match=r"expert data-parallel group \(efsdp\) has 1 rank"):
                    opt.step()
        finally:
            destroy_parallel_state()
    dist.barrier()
    return out


def _one_process(path: str) -> dict:
    from shardbridge_megatron_fsdp.mcore import destroy_parallel_state, load

    try:
        model, opt = build_sharded_moe({"dp_shard": 1}, seed=1, adam=True, weights=False)
        step = load(path, model=model, optimizer=opt).step
        return {"step": step, "state": _gathered(model, opt), "loss": _next_loss(model)}
    finally:
        destroy_parallel_state()


def test_moe_checkpoint_reshards_across_ep_bit_exact(tmp_path):
    out = run_distributed(_reshard, str(tmp_path), world_size=4, timeout=600)[0]
    assert out["steps"] == [2, 2]
    one = run_distributed(_one_process, str(tmp_path / "a"), world_size=1, timeout=600)[0]
    assert one["step"] == 2
    states = {**out["state"], "one": one["state"]}
    src = states["a"]
    assert src["params"][FC1.format(0)].shape == (EXPERTS, 2 * EXPERT_FFN, HIDDEN)
    assert src["exp_avg"][FC2.format(1)].shape == (EXPERTS, HIDDEN, EXPERT_FFN)
    for layout in ("b", "c", "one"):
        for kind in ("params", "exp_avg", "exp_avg_sq"):
            assert states[layout][kind].keys() == src[kind].keys(), (layout, kind)
            bad = [n for n, v in src[kind].items() if not torch.equal(states[layout][kind][n], v)]
            assert not bad, (layout, kind, bad)
    # The loaded model computes what the saved one computes: the next step's loss agrees.
    for layout in ("b", "c"):
        assert abs(out["losses"][layout] - out["losses"]["a"]) < 1e-5, layout
    assert abs(one["loss"] - out["losses"]["a"]) < 1e-5
    # torch's own reader: the three checkpoints hold the same tensors, the experts as [E, ...].
    flat = {}
    for name in "abc":
        dcp_to_torch_save(tmp_path / name, tmp_path / f"{name}.pt")
        flat[name] = torch.load(tmp_path / f"{name}.pt", weights_only=True)
    model = flat["a"]["model"]
    assert not [k for k in model if "local_experts" in k]
    for layer in range(2):
        assert torch.equal(model[FC1.format(layer)], src["params"][FC1.format(layer)])
        assert torch.equal(model[FC2.format(layer)], src["params"][FC2.format(layer)])
    for name in "bc":
        assert flat[name]["model"].keys() == model.keys()
        assert all(torch.equal(flat[name]["model"][k], v) for k, v in model.items()), name
        optim_a = {k: v for k, v in flat["a"]["optim"].items() if isinstance(v, torch.Tensor)}
        bad = [k for k, v in optim_a.items() if not torch.equal(flat[name]["optim"][k], v)]
        assert not bad, (name, bad)
    assert torch.equal(flat["a"]["optim"][f"state.{FC1.format(0)}.exp_avg"], src["exp_avg"][FC1.format(0)])
    steps = {k: float(v) for k, v in flat["a"]["optim"].items() if k.endswith(".step")}
    assert steps and set(steps.values()) == {2.0}, steps


# ----------------------------------------------------------------------------- Hugging Face (Mixtral)


def _full_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    from mcore_helpers import positions

    with torch.no_grad():
        return model(tokens, positions(tokens.shape[0]), None).clone()  # tp=1: the full vocab


def _train_save_logits(root: str) -> torch.Tensor:
    from mcore_helpers import batch
    from shardbridge_megatron_fsdp.mcore import destroy_parallel_state, save

    try:
        model, opt = build_sharded_moe({"dp_shard": 4, "ep": 2}, adam=True)
        train(model, opt, steps=1)
        save(f"{root}/ckpt", model=model, optimizer=opt, step=1)
        logits = _full_logits(model, batch(5)[0])
        dist.barrier()
        return logits
    finally:
        destroy_parallel_state()


@pytest.mark.skipif(not FULL, reason="SHARDBRIDGE_MCORE_FULL=1 (nox -s megatron_core)")
def test_moe_export_to_mixtral_logits_match(tmp_path):
    transformers = pytest.importorskip("transformers")
    import json

    from mcore_helpers import HEADS, SEQ, TOP_K, VOCAB, batch
    from shardbridge.cli._main import main

    logits = run_distributed(_train_save_logits, str(tmp_path), world_size=4, timeout=600)[0]
    argv = ["ckpt", "convert", str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--to", "hf",
            "--num-attention-heads", str(HEADS), "--max-position-embeddings", str(SEQ)]  # fmt: skip
    assert main(argv) == 2  # a MoE checkpoint needs the experts per token: refused, nothing written
    assert not (tmp_path / "hf").exists() or not any((tmp_path / "hf").iterdir())
    assert main([*argv, "--num-experts-per-tok", str(TOP_K)]) == 0
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == ["MixtralForCausalLM"]
    assert (config["num_local_experts"], config["num_experts_per_tok"], config["intermediate_size"]) == (
        EXPERTS, TOP_K, EXPERT_FFN)  # fmt: skip
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    assert type(hf).__name__ == "MixtralForCausalLM"
    with torch.no_grad():
        hf_logits = hf(batch(5)[0]).logits
    assert hf_logits.shape == logits.shape == (8, SEQ, VOCAB)
    torch.testing.assert_close(hf_logits, logits, rtol=0, atol=1e-5)


def _mixtral_folder(folder, *, hub: bool) -> torch.Tensor:
    """A random MixtralForCausalLM of the test model's shape (norms away from 1); its logits of batch 0.

    ``hub``: ``save_pretrained`` (one tensor per expert, as hub folders); else the model's own
    state dict (fused expert names, as ``export_hf`` writes)."""
    import transformers
    from mcore_helpers import GROUPS, HEADS, LAYERS, SEQ, VOCAB, batch

    torch.manual_seed(7)
    config = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=EXPERT_FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=GROUPS, head_dim=HIDDEN // HEADS, rms_norm_eps=1e-5,
        max_position_embeddings=SEQ, tie_word_embeddings=False, num_local_experts=EXPERTS, num_experts_per_tok=2,
        router_jitter_noise=0.0, sliding_window=None, rope_theta=10000.0,  # Mixtral's default is 1e6; GPTModel's 1e4
    )  # fmt: skip
    model = transformers.MixtralForCausalLM(config).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            elif "experts" in name:
                p.normal_(0, 0.05)  # transformers leaves fused experts uninitialised
    if hub:
        model.save_pretrained(folder)
    else:
        from safetensors.torch import save_file

        folder.mkdir(parents=True)
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"))
        (folder / "config.json").write_text(config.to_json_string())
    with torch.no_grad():
        return model(batch(0)[0]).logits


def _load_and_logits(folder: str | None, ckpt: str | None) -> dict:
    from mcore_helpers import batch
    from shardbridge_megatron_fsdp.mcore import destroy_parallel_state, load, load_hf

    try:
        model, _ = build_sharded_moe({"dp_shard": 4, "ep": 2}, seed=3, weights=False)
        report = load_hf(model, folder) if folder is not None else {}
        if ckpt is not None:
            load(ckpt, model=model, strict=True, rng=False)
        return {"logits": _full_logits(model, batch(0)[0]), **report}  # the full batch on every rank
    finally:
        destroy_parallel_state()


@pytest.mark.skipif(not FULL, reason="SHARDBRIDGE_MCORE_FULL=1 (nox -s megatron_core)")
def test_mixtral_folders_into_megatron_core_moe(tmp_path):
    pytest.importorskip("transformers")
    from shardbridge.cli._main import main

    # A hub-style folder (one tensor per expert) -> --to megatron -> load at dp4 x ep2.
    hub_logits = _mixtral_folder(tmp_path / "hub", hub=True)
    assert main(["ckpt", "convert", str(tmp_path / "hub"), str(tmp_path / "mc"), "--to", "megatron"]) == 0
    out = run_distributed(_load_and_logits, None, str(tmp_path / "mc"), world_size=4, timeout=600)
    for rank, result in enumerate(out):
        torch.testing.assert_close(result["logits"], hub_logits, rtol=0, atol=1e-5, msg=f"rank {rank}")
    # A folder with the fused expert names -> shard-on-read: each rank reads its experts' rows.
    fused_logits = _mixtral_folder(tmp_path / "fused", hub=False)
    out = run_distributed(_load_and_logits, str(tmp_path / "fused"), None, world_size=4, timeout=600)
    for rank, result in enumerate(out):
        torch.testing.assert_close(result["logits"], fused_logits, rtol=0, atol=1e-5, msg=f"rank {rank}")
        assert 0 < result["bytes_read"] < 0.5 * result["checkpoint_bytes"], (rank, result)
    # Every byte once: each expert by its ep2 rank pair (FSDP halves), the rest by FSDP quarters.
    assert sum(r["bytes_read"] for r in out) == out[0]["checkpoint_bytes"]


@pytest.mark.skipif(not FULL, reason="SHARDBRIDGE_MCORE_FULL=1 (nox -s megatron_core)")
@pytest.mark.parametrize(
    "field,value",
    [
        ("moe_router_score_function", "sigmoid"),
        ("moe_router_pre_softmax", True),
        ("moe_shared_expert_intermediate_size", 32),
        ("moe_router_topk_scaling_factor", 2.5),
        ("moe_expert_capacity_factor", 1.0),
    ],
)
def test_routing_without_a_mixtral_twin_is_refused_by_name(field, value):
    from mcore_helpers import moe_config
    from shardbridge_megatron_fsdp.mcore import LlamaArch

    assert LlamaArch.from_config(moe_config()).num_experts_per_tok == 2
    with pytest.raises(ValueError, match=rf"{field}={value!r} \(Mixtral: "):
        LlamaArch.from_config(moe_config(**{field: value}))


# ----------------------------------------------------------------------------- ep x tp (forward only)


def _ep_tp(root: str) -> dict:
    """Save at dp4 x ep2; load at dp2 x tp2 x ep2 (no sequence parallelism: forward only)."""
    from mcore_helpers import batch, positions
    from megatron.core import tensor_parallel
    from shardbridge_megatron_fsdp.mcore import destroy_parallel_state, load, save

    out = {}
    tokens = batch(5)[0]
    try:
        model, opt = build_sharded_moe({"dp_shard": 4, "ep": 2}, adam=True)
        train(model, opt, steps=1)
        save(f"{root}/a", model=model, optimizer=opt, step=1)
        out["params_a"], out["logits_a"] = gather_stacked(model), _full_logits(model, tokens)
    finally:
        destroy_parallel_state()
    try:
        model, opt = build_sharded_moe({"dp_shard": 2, "tp": 2, "ep": 2}, seed=1, adam=True, weights=False,
                                       sequence_parallel=False)  # fmt: skip
        load(f"{root}/a", model=model, optimizer=opt)
        out["params_b"] = gather_stacked(model)
        model.eval()
        with torch.no_grad():
            local = model(tokens, positions(tokens.shape[0]), None)  # [b, s, vocab / tp]
            out["logits_b"] = tensor_parallel.gather_from_tensor_model_parallel_region(local).clone()
        model.train()
        with pytest.raises(ValueError, match="without also enabling sequence parallelism"):
            model(tokens, positions(tokens.shape[0]), None)
    finally:
        destroy_parallel_state()
    return out


@pytest.mark.skipif(not FULL, reason="SHARDBRIDGE_MCORE_FULL=1 (nox -s megatron_core)")
def test_moe_checkpoint_loads_at_ep2_x_tp2_forward(tmp_path):
    out = run_distributed(_ep_tp, str(tmp_path), world_size=4, timeout=600)[0]
    assert out["params_a"].keys() == out["params_b"].keys()
    bad = [n for n, v in out["params_a"].items() if not torch.equal(out["params_b"][n], v)]
    assert not bad, bad
    torch.testing.assert_close(out["logits_b"], out["logits_a"], rtol=0, atol=1e-5)
