"""STRUCTURAL TIER: TE ``GroupedLinear`` experts on the core's ``ep`` axis, in the core's expert checkpoint format.

The core's reference MoE (``MoELlama``) with its routed experts replaced by TE GroupedLinear
pairs (``_te_moe.TEExperts``, Megatron-Core's ``TEGroupedMLP`` layout): ep rank j builds E/ep
experts, ``shardbridge_te.shard_grouped_experts`` puts them on the ep axis, and
``shardbridge_te.ExpertStateDicts`` stores each GroupedLinear's ``weight0 ..`` as ONE global
``[E, out, in]`` tensor, here under the reference MoE's names (``gate_up_proj``, ``down_proj``).
TE's real ``GroupedLinear`` Python code runs forward and backward with the reference grouped
GEMM standing in for cuBLAS ([Note: reference grouped GEMM] in ``_te_reference_kernels.py``),
through ``shardbridge.ep.run_experts``.

Oracles: the one-process reference MoE (its own ``F.linear`` experts, no TE) for losses and
gradients; ``full_tensor()`` of every parameter and optimizer state, the experts assembled by
their global index, for bit-exact round trips (``torch.equal``); torch's ``dcp_to_torch_save``
for what is on disk.

Default suite: ``test_grouped_linear_experts_train_like_one_process_and_reshard_across_ep``
(dp4 x ep2 vs one process; saved at ep2, loaded at ep4, ep1 and into the reference MoE in one
process). ``SHARDBRIDGE_MOE_MATRIX=all`` (``nox -s moe``) adds the layout matrix, the long
checkpoint chain, the structure with TE dense modules and the refusals.
"""

from __future__ import annotations

import os
import re

import pytest
import torch
from _te_moe import CONFIG, build, global_state, loss_of, merge, mesh, reference_state, to_reference
from shardbridge.testing import run_distributed
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.tensor import DTensor, Shard

TIMEOUT = 480  # first use in a fresh pool imports TE in 4 workers (see test_te_structural.py)
LR, ADAM_EPS = 1e-3, 1e-6  # as core test_moe.py
GRAD_RTOL = LOSS_RTOL = 1e-5  # per parameter ||g - g_ref|| <= 1e-5 ||g_ref|| (core test_moe.py's bound)
MATRIX = os.environ.get("SHARDBRIDGE_MOE_MATRIX") == "all"
matrix_only = pytest.mark.skipif(not MATRIX, reason="layout matrix: SHARDBRIDGE_MOE_MATRIX=all (nox -s moe)")

EP2 = {"dp_shard": 4, "ep": 2}  # efsdp 2: experts 0-3 on ranks {0, 2}, 4-7 on {1, 3}
EP4 = {"dp_shard": 4, "ep": 4}
EP1 = {"dp_shard": 4, "ep": 1}
REFUSED = (
    r"^torch's state dicts would store '{fqn}'.* under the same name on every rank, but '{fqn}' is rank-local "
    r".*pass state_dicts=shardbridge_te\.ExpertStateDicts\(\.\.\.\) to shardbridge\.checkpoint\.save and load"
)
"""The ValueError of a save / load without ExpertStateDicts ([Note: rank-local tensors] in the core)."""
GATE_UP = "model.layers.0.feed_forward.experts.gate_up_proj"
DOWN = "model.layers.1.feed_forward.experts.down_proj"


def _provider():
    import shardbridge_te

    return shardbridge_te.ExpertStateDicts(names=to_reference)


def _train(model, pm, opt, steps: int, first_step: int = 0) -> list[float]:
    from _te_reference_kernels import module_execution

    losses = []
    for step in range(first_step, first_step + steps):
        with module_execution():  # TE's GroupedLinear forward AND backward run on the reference GEMM
            loss = loss_of(model, pm, step)
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _assert_equal(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want), sorted(set(got) ^ set(want))
    bad = [k for k in want if got[k].dtype != want[k].dtype or not torch.equal(got[k], want[k])]
    assert not bad, f"values differ for {bad}"


# --------------------------------------------------------------------------- the default test


def _train_and_save(dims: dict, path: str, dispatch: str = "auto") -> dict:
    import shardbridge.checkpoint as ckpt
    from _te_reference_kernels import module_execution

    pm = mesh(dims)
    model = build(pm, seed=0, dispatch=dispatch)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=ADAM_EPS)
    with module_execution():
        loss = loss_of(model, pm, 0)
        loss.backward()
    grads = global_state(model, None, grads=True)
    opt.step()
    opt.zero_grad()
    with pytest.raises(ValueError) as refused:  # without the provider: refused, see test_without_the_provider_*
        ckpt.save(path, model=model, optimizer=opt, step=1)
    ckpt.save(path, model=model, optimizer=opt, step=1, state_dicts=_provider())
    placements = {
        n: (tuple(p.device_mesh.mesh_dim_names), tuple(p.placements))
        for n, p in model.named_parameters()
        if ".linear_fc" in n and isinstance(p, DTensor)
    }
    return {
        "loss": loss.item(),
        "grads": grads,
        "state": global_state(model, opt),
        "placements": placements,
        "refused": str(refused.value),
    }


def _reference_step() -> tuple[float, dict, dict]:
    """One step of the core reference MoE in this process (no TE): loss, gradients, state."""
    from shardbridge.models import MoELlama

    model = MoELlama(CONFIG, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=ADAM_EPS)
    loss = loss_of(model, None, 0)
    loss.backward()
    grads = _reference_grads(model)
    opt.step()
    return loss.item(), grads, reference_state(model, opt)


def _reference_grads(model) -> dict:
    return merge([global_state(model, None, grads=True)])


def _load_te(dims: dict | None, path: str) -> dict:
    """A TE-experts model at ``dims`` (other seed, other lr, one step of its own) loads ``path``."""
    import shardbridge.checkpoint as ckpt

    pm = mesh(dims)
    model = build(pm, seed=7)
    opt = torch.optim.AdamW(model.parameters(), lr=0.5, eps=ADAM_EPS)
    _train(model, pm, opt, 1, first_step=5)  # optimizer state for the load to overwrite
    ckpt.load(path, model=model, optimizer=opt, state_dicts=_provider(), rng=False)
    return {"state": global_state(model, opt), "lr": opt.param_groups[0]["lr"], "live": (model, opt)}


def _loaded_te(dims: dict | None, path: str) -> dict:
    got = _load_te(dims, path)
    del got["live"]
    return got


def _load_reference(path: str, dims: dict | None = None) -> dict:
    """The core reference MoE (no TE; parallelize_moe when ``dims``) loads ``path`` with the default path."""
    import shardbridge.checkpoint as ckpt
    from shardbridge.models import MoELlama, parallelize_moe

    model = MoELlama(CONFIG, seed=11)
    pm = mesh(dims)
    if pm is not None:
        parallelize_moe(model, pm)
    opt = torch.optim.AdamW(model.parameters(), lr=0.5, eps=ADAM_EPS)
    loss_of(model, pm, 3).backward()
    opt.step()
    ckpt.load(path, model=model, optimizer=opt, rng=False)
    return {"state": reference_state(model, opt), "lr": opt.param_groups[0]["lr"], "live": (model, opt)}


def test_grouped_linear_experts_train_like_one_process_and_reshard_across_ep(tmp_path) -> None:
    """dp4 x ep2 with TE GroupedLinear experts: one step matches the one-process reference MoE
    (loss, every gradient, the state after AdamW); its checkpoint holds the experts as [E, ...]
    tensors (torch's own reader) and loads bit-exact at ep4, at ep1 and into the reference MoE
    in one process, optimizer state included."""
    path = str(tmp_path / "ep2")
    saved = run_distributed(_train_and_save, EP2, path, world_size=4, timeout=TIMEOUT)

    # 1. numerics vs one process (TE's GroupedLinear code + reference GEMM vs the core's F.linear experts)
    ref_loss, ref_grads, ref_state = _reference_step()
    for r in saved:
        assert abs(r["loss"] - ref_loss) <= LOSS_RTOL * abs(ref_loss), (r["loss"], ref_loss)
    grads = merge([r["grads"] for r in saved])
    assert sorted(grads) == sorted(ref_grads)
    worst = {k: _rel(grads[k], ref_grads[k]) for k in ref_grads}
    assert max(worst.values()) <= GRAD_RTOL, sorted(worst.items(), key=lambda kv: -kv[1])[:3]
    want = merge([r["state"] for r in saved])
    assert sorted(want) == sorted(ref_state)
    for k in ref_state:
        torch.testing.assert_close(want[k], ref_state[k], rtol=1e-5, atol=1e-5, msg=k)
    # the experts really are split: E/ep = 4 GEMMs per rank, FSDP2 over efsdp
    assert saved[0]["placements"]["layers.0.feed_forward.experts.linear_fc1.weight3"] == (("efsdp",), (Shard(0),))
    # and a save without ExpertStateDicts is refused on every rank, naming the expert and the provider
    for r in saved:
        assert re.search(REFUSED.format(fqn=r"layers\.0\.feed_forward\.experts\.linear_fc1\.weight0"), r["refused"])

    # 2. on disk (torch's reader): ONE [E, 2I, D] tensor per layer and kind, dim 0 = global expert
    out = tmp_path / "oracle.pt"
    dcp_to_torch_save(path, out)
    sd = torch.load(out, weights_only=True)
    for key in (GATE_UP, DOWN):
        fqn = key[len("model.") :]
        assert tuple(sd["model"][fqn].shape)[0] == CONFIG.num_experts
        assert torch.equal(sd["model"][fqn], want[key]), key
        assert torch.equal(sd["optim"][f"state.{fqn}.exp_avg"], want[f"optim.state.{fqn}.exp_avg"]), fqn
    assert not any("linear_fc" in k for k in sd["model"]), [k for k in sd["model"] if "linear_fc" in k]

    # 3. loads bit-exact at ep4 and ep1 (TE), and into the reference MoE in one process (no TE)
    for dims in (EP4, EP1):
        loaded = run_distributed(_loaded_te, dims, path, world_size=4, timeout=TIMEOUT)
        _assert_equal(merge([r["state"] for r in loaded]), want)
        assert all(r["lr"] == LR for r in loaded)
    one = _load_reference(path)
    del one["live"]
    _assert_equal(one["state"], want)
    assert one["lr"] == LR


def _save_with_and_without_ac(root: str) -> dict:
    import shardbridge.checkpoint as ckpt
    import shardbridge_te
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    paths = {}
    for ac in (False, True):
        model = build(None, seed=0)
        if ac:  # activation checkpointing as torchtitan applies it: each block in torch's wrapper
            for i, layer in enumerate(model.layers):
                model.layers[i] = checkpoint_wrapper(layer)
        paths[ac] = os.path.join(root, f"ac-{ac}")
        ckpt.save(paths[ac], model=model, step=1, state_dicts=shardbridge_te.ExpertStateDicts())
    return paths


def test_experts_under_activation_checkpointing(tmp_path) -> None:
    """torch's activation-checkpoint wrapper adds ``_checkpoint_wrapped_module`` to every name; the
    state dict drops it, and ExpertStateDicts finds its experts there all the same: the checkpoint
    of a wrapped model is the unwrapped model's, key for key and bit for bit (torch's reader)."""
    paths = run_distributed(_save_with_and_without_ac, str(tmp_path), world_size=1, timeout=TIMEOUT)[0]
    sds = {}
    for ac, path in paths.items():
        dcp_to_torch_save(path, tmp_path / f"ac-{ac}.pt")
        sds[ac] = torch.load(tmp_path / f"ac-{ac}.pt", weights_only=True)["model"]
    assert "layers.0.feed_forward.experts.linear_fc1.weight" in sds[True], sorted(sds[True])
    assert sorted(sds[True]) == sorted(sds[False])
    for key, value in sds[False].items():
        assert torch.equal(sds[True][key], value), key


# --------------------------------------------------------------------------- the layout matrix

# name -> (ParallelDims, dispatch). tp4_ep4: efsdp = dp_cp = 1, so the experts stay plain tensors.
LAYOUTS = {
    "fsdp4_ep2_a2a": (EP2, "all_to_all"),
    "fsdp4_ep4": (EP4, "all_to_all"),
    "fsdp4_ep1": (EP1, "auto"),
    "fsdp2_tp2_ep2": ({"dp_shard": 2, "tp": 2, "ep": 2}, "all_to_all"),
    "fsdp2_tp2_ep4_gather": ({"dp_shard": 2, "tp": 2, "ep": 4}, "all_gather"),
    "hsdp2x2_ep2": ({"dp_replicate": 2, "dp_shard": 2, "ep": 2}, "all_to_all"),
    "tp4_ep4": ({"dp_shard": 1, "tp": 4, "ep": 4}, "all_to_all"),
}
STEPS = 3


def _train_layout(dims: dict | None, dispatch: str) -> dict:
    pm = mesh(dims)
    model = build(pm, seed=0, dispatch=dispatch)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=ADAM_EPS)
    from _te_reference_kernels import module_execution

    losses, grads = [], None
    for step in range(STEPS):
        with module_execution():
            loss = loss_of(model, pm, step)
            loss.backward()
        if step == 0:
            grads = global_state(model, None, grads=True)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "grads": grads, "final": global_state(model, None)}


def _reference_training() -> dict:
    from shardbridge.models import MoELlama

    model = MoELlama(CONFIG, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=ADAM_EPS)
    losses, grads = [], None
    for step in range(STEPS):
        loss = loss_of(model, None, step)
        loss.backward()
        if step == 0:
            grads = _reference_grads(model)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "grads": grads, "final": reference_state(model, None)}


@matrix_only
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_training_matches_one_process(layout: str) -> None:
    """3 AdamW steps with TE experts at each layout vs the one-process reference MoE (no TE):
    every rank's losses, every step-1 gradient, every parameter after the last step."""
    dims, dispatch = LAYOUTS[layout]
    results = run_distributed(_train_layout, dims, dispatch, world_size=4, timeout=TIMEOUT)
    ref = _reference_training()
    for r in results:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]), rtol=LOSS_RTOL, atol=0)
    grads = merge([r["grads"] for r in results])
    final = merge([r["final"] for r in results])
    assert sorted(grads) == sorted(ref["grads"]) and sorted(final) == sorted(ref["final"])
    worst = {k: _rel(grads[k], ref["grads"][k]) for k in grads}
    assert max(worst.values()) <= GRAD_RTOL, sorted(worst.items(), key=lambda kv: -kv[1])[:3]
    for k in final:
        torch.testing.assert_close(final[k], ref["final"][k], rtol=1e-5, atol=1e-5, msg=k)


# (name, ParallelDims or None, world size, "te" | "reference")
CHAIN = [
    ("te_ep2", EP2, 4, "te"),
    ("te_ep1", EP1, 4, "te"),
    ("te_dp2_tp2_ep2", {"dp_shard": 2, "tp": 2, "ep": 2}, 4, "te"),
    ("te_hsdp2x2_ep2", {"dp_replicate": 2, "dp_shard": 2, "ep": 2}, 4, "te"),
    ("te_tp4_ep4_plain", {"dp_shard": 1, "tp": 4, "ep": 4}, 4, "te"),
    ("reference_dp2_tp2_ep4", {"dp_shard": 2, "tp": 2, "ep": 4}, 4, "reference"),
    ("te_one_process", None, 1, "te"),
    ("te_ep4", EP4, 4, "te"),
]


def _chain_step(kind: str, dims: dict | None, source: str, target: str) -> dict:
    import shardbridge.checkpoint as ckpt

    if kind == "te":
        got = _load_te(dims, source)
        state, provider, model_and_opt = got["state"], _provider(), got.pop("live")
    else:
        got = _load_reference(source, dims)
        state, provider, model_and_opt = got["state"], None, got.pop("live")
    model, opt = model_and_opt
    ckpt.save(target, model=model, optimizer=opt, step=1, state_dicts=provider)
    return {"state": state, "lr": got["lr"]}


@matrix_only
def test_checkpoint_chain_across_layouts_and_frameworks(tmp_path) -> None:
    """Saved at ep2 by TE experts; each next layout (TE at ep1, dp2 x tp2 x ep2, HSDP x ep2, tp4 x ep4
    with unsharded experts, the reference MoE's own experts at dp2 x tp2 x ep4, TE in one process,
    TE at ep4) loads the previous one's checkpoint bit-exact and saves it again."""
    name, dims, world, _kind = CHAIN[0]
    source = str(tmp_path / name)
    saved = run_distributed(_train_and_save, dims, source, world_size=world, timeout=TIMEOUT)
    want = merge([r["state"] for r in saved])
    for name, dims, world, kind in CHAIN[1:]:
        target = str(tmp_path / name)
        got = run_distributed(_chain_step, kind, dims, source, target, world_size=world, timeout=TIMEOUT)
        state = merge([r["state"] for r in got]) if kind == "te" else got[0]["state"]
        _assert_equal(state, want)
        assert all(r["lr"] == LR for r in got), name
        source = target


# --------------------------------------------------------------------------- structure, refusals, the control

NUM_EXPERTS = 4
DP2_TP2_EP2 = {"dp_shard": 2, "tp": 2, "ep": 2}
DP2_TP2_EP4 = {"dp_shard": 2, "tp": 2, "ep": 4}


def _te_model(pm, seed: int):
    """A TE dense column Linear (TP) next to GroupedLinear experts, through shardbridge_te.parallelize."""
    import shardbridge_te
    from _te_structural import cuda_construction, import_te

    te = import_te()
    torch.manual_seed(seed)
    with cuda_construction("meta"), torch.device("meta"):
        model = torch.nn.Module()
        model.dense = te.Linear(16, 32, bias=False, parallel_mode="column", tp_size=pm.dims.tp, params_dtype=torch.float32)
        model.experts = te.GroupedLinear(NUM_EXPERTS // pm.dims.ep, 16, 32, bias=False, params_dtype=torch.float32)
    shardbridge_te.shard_grouped_experts(model.experts, pm, num_experts=NUM_EXPERTS)
    shardbridge_te.parallelize(model, pm)
    # materialize drew the same values on every ep rank (same seed, same local shapes): give each
    # GLOBAL expert its own values, so an expert stored under another's name shows
    efsdp, efsdp_rank = pm["efsdp"].size(), pm["efsdp"].get_local_rank()
    first = pm["ep"].get_local_rank() * (NUM_EXPERTS // pm.dims.ep)
    with torch.no_grad():
        for i in range(NUM_EXPERTS // pm.dims.ep):
            full = torch.randn(32, 16, generator=torch.Generator().manual_seed(1000 * seed + first + i))
            getattr(model.experts, f"weight{i}").to_local().copy_(full.chunk(efsdp)[efsdp_rank])
    return model


def _experts_by_index(model, pm) -> dict[int, torch.Tensor]:
    first = pm["ep"].get_local_rank() * (NUM_EXPERTS // pm.dims.ep)
    return {first + i: getattr(model.experts, f"weight{i}").full_tensor().clone() for i in range(NUM_EXPERTS // pm.dims.ep)}


def _structure_save(path: str) -> dict:
    import shardbridge.checkpoint as ckpt
    import shardbridge_te
    from shardbridge_te._apply import STATE_ATTR

    pm = mesh(DP2_TP2_EP2)
    model = _te_model(pm, seed=1)
    w = model.experts.weight1
    out = {
        "dense": (tuple(model.dense.weight.device_mesh.mesh_dim_names), tuple(model.dense.weight.placements)),
        "experts": (tuple(w.device_mesh.mesh_dim_names), tuple(w.placements), tuple(w.shape)),
        "experts_untouched": STATE_ATTR not in vars(model.experts) and "forward" not in vars(model.experts),
        "dense_converted": STATE_ATTR in vars(model.dense),
        "units": [n for n, m in model.named_modules() if any(m is u for u in shardbridge_te.default_units(model))],
        "materialized": not w.to_local().is_meta,
        "experts_by_index": _experts_by_index(model, pm),
        "dense_full": model.dense.weight.full_tensor().clone(),
    }
    ckpt.save(path, model=model, step=1, state_dicts=shardbridge_te.ExpertStateDicts())
    return out


def _structure_load(path: str, dims: dict) -> dict:
    import shardbridge.checkpoint as ckpt
    import shardbridge_te

    pm = mesh(dims)
    model = _te_model(pm, seed=2)
    ckpt.load(path, model=model, state_dicts=shardbridge_te.ExpertStateDicts(), rng=False)
    return {"experts_by_index": _experts_by_index(model, pm), "dense_full": model.dense.weight.full_tensor().clone()}


@matrix_only
def test_structure_with_te_dense_modules_and_reshard(tmp_path) -> None:
    """shard_grouped_experts + shardbridge_te.parallelize on a TE model: the dense Linear gets TP x FSDP2,
    the experts only FSDP2 over efsdp (no TP DTensor, no local-forward patch, not a default unit); the
    checkpoint holds experts.weight [E, out, in]; dp2 x tp2 x ep2 -> dp2 x tp2 x ep4 bit-exact."""
    import shardbridge.checkpoint as ckpt

    path = str(tmp_path / "ckpt")
    saved = run_distributed(_structure_save, path, world_size=4, timeout=TIMEOUT)
    r = saved[0]
    assert r["dense"][0] == ("dp_shard_cp", "tp") and type(r["dense"][1][0]).__name__ == "_StridedShard", r["dense"]
    assert r["experts"] == (("efsdp",), (Shard(0),), (32, 16)), r["experts"]
    assert r["experts_untouched"] and r["dense_converted"] and r["materialized"]
    assert r["units"] == ["dense"], r["units"]
    names = {t.name: tuple(t.shape) for t in ckpt.inspect(path).tensors}
    assert names.get("model.experts.weight") == (NUM_EXPERTS, 32, 16), names
    assert not any("experts.weight0" in n for n in names), names
    want = {}
    for s in saved:
        want.update(s["experts_by_index"])
    for got in run_distributed(_structure_load, path, DP2_TP2_EP4, world_size=4, timeout=TIMEOUT):
        assert all(torch.equal(v, want[i]) for i, v in got["experts_by_index"].items())
        assert torch.equal(got["dense_full"], r["dense_full"])


def _refusals() -> dict[str, str]:
    import shardbridge_te
    from _te_structural import cuda_construction, import_te
    from shardbridge.fp8 import FP8Recipe

    te = import_te()
    pm = mesh(DP2_TP2_EP2)
    out: dict[str, str] = {}

    def grouped(n, **kw):
        with cuda_construction("meta"), torch.device("meta"):
            return te.GroupedLinear(n, 16, 32, bias=False, params_dtype=torch.float32, **kw)

    def refused(name, fn):
        try:
            fn()
            out[name] = "no error"
        except (ValueError, NotImplementedError) as e:
            out[name] = f"{type(e).__name__}: {e}"

    refused("count", lambda: shardbridge_te.shard_grouped_experts(grouped(3), pm, num_experts=4))
    refused("tp", lambda: shardbridge_te.shard_grouped_experts(
        grouped(2, parallel_mode="column", tp_size=2), pm, num_experts=4))  # fmt: skip
    refused("none", lambda: shardbridge_te.shard_grouped_experts(torch.nn.Linear(2, 2), pm, num_experts=4))
    twice = grouped(2)
    shardbridge_te.shard_grouped_experts(twice, pm, num_experts=4)
    refused("twice", lambda: shardbridge_te.shard_grouped_experts(twice, pm, num_experts=4))
    recipe = FP8Recipe(backend="te", name="tensorwise", fp8_params=True)
    with cuda_construction("cpu"), torch.device("meta"), shardbridge_te.model_init_context(recipe):
        fp8 = te.GroupedLinear(2, 16, 32, bias=False, params_dtype=torch.float32, device="meta")
    refused("fp8", lambda: shardbridge_te.shard_grouped_experts(fp8, pm, num_experts=4))
    refused("names_type", lambda: shardbridge_te.ExpertStateDicts(names=3))

    # a stacked name that collides with a model key; experts of one GroupedLinear in two param groups
    model = _te_model(pm, seed=0)
    clash = shardbridge_te.ExpertStateDicts(names={"experts.weight": "dense.weight"})
    refused("clash", lambda: clash.state_dicts(model, None, for_load=False))
    groups = [{"params": [model.dense.weight, model.experts.weight0]}, {"params": [model.experts.weight1], "lr": 0.1}]
    opt = torch.optim.AdamW(groups, lr=1e-3)
    refused("groups", lambda: shardbridge_te.ExpertStateDicts().state_dicts(model, opt, for_load=True))
    return out


@matrix_only
def test_refusals_name_the_field_and_the_fix() -> None:
    out = run_distributed(_refusals, world_size=4, timeout=TIMEOUT)[0]
    want = {
        "count": r"GroupedLinear.num_gemms\(3\) \* ep\(2\) != num_experts\(4\).*choose ep dividing num_experts",
        "tp": r"tp_size=2, parallel_mode='column'\) is tensor-parallel.*tp_size=1, parallel_mode=None",
        "none": r"holds no TransformerEngine GroupedLinear",
        "twice": r"already on the ep axis; call shard_grouped_experts once",
        "fp8": r"NotImplementedError: .*FP8 parameters \(quantized_model_init\) on GroupedLinear experts",
        "names_type": r"names=int must be a mapping or a function",
        "clash": r"would be stored as 'dense.weight', which the model already has",
        "groups": r"param_groups\.experts\.weight0\.lr differs across the experts of one GroupedLinear",
    }
    import re

    for name, pattern in want.items():
        assert re.search(pattern, out[name]), (name, out[name])


def _default_path_refused(path: str) -> dict:
    """The control: the same model saved and loaded WITHOUT ExpertStateDicts (torch's state dicts)."""
    import shardbridge.checkpoint as ckpt
    import shardbridge_te

    pm = mesh(DP2_TP2_EP2)
    model = _te_model(pm, seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    out = {}
    with pytest.raises(ValueError) as save:
        ckpt.save(path, model=model, optimizer=opt, step=1)
    out["save"], out["written"] = str(save.value), os.path.exists(path)
    ckpt.save(path, model=model, step=1, state_dicts=shardbridge_te.ExpertStateDicts())
    other = _te_model(pm, seed=2)
    before = _experts_by_index(other, pm)
    with pytest.raises(ValueError) as load:
        ckpt.load(path, model=other, rng=False)
    out["load"], out["untouched"] = str(load.value), _experts_by_index(other, pm)
    out["before"] = before
    return out


@matrix_only
def test_without_the_provider_save_and_load_raise(tmp_path) -> None:
    """Why the mark exists: torch's state dicts name weight0 alike on both ep ranks, and DCP would keep one
    ep rank's copy of each piece (measured before the guard: the same layout loaded experts back wrong,
    with no error). shard_grouped_experts marks the experts rank-local, so a save or load without
    ExpertStateDicts raises on every rank, naming the expert and the fix; nothing is written or loaded."""
    path = str(tmp_path / "ckpt")
    res = run_distributed(_default_path_refused, path, world_size=4, timeout=TIMEOUT)
    want = REFUSED.format(fqn=r"experts\.weight0")
    for rank, r in enumerate(res):
        assert re.search(want, r["save"]), (rank, r["save"])
        assert re.search(want, r["load"]), (rank, r["load"])
        # both local experts and their AdamW states (step, exp_avg, exp_avg_sq): 2 + 2 * 3 keys
        assert "'experts.weight0', 'experts.weight1', 'state.experts.weight0.step' and 5 more" in r["save"], r["save"]
        assert not r["written"], rank
        assert all(torch.equal(v, r["before"][i]) for i, v in r["untouched"].items()), rank
