"""STRUCTURAL TIER: TE FP8 with tp > 1 through ``ShardbridgeAccelerator`` (the fp8 block -> the te backend).

TransformerEngine 2.20.2's real Python code with its compiled extension stood in (see
[Note: the structural tier] in ``packages/te-adapter/tests/_te_structural.py``), the real
Accelerate 1.15 and transformers, 4 gloo ranks at dp_shard 2 x tp 2 (and HSDP 2 x tp 2). No TE
kernel runs: a forward pre-hook on the first ``te.Linear`` records TE's global FP8 state, then stops
the forward. Asserted (structure only, never numerics):

- the Linears the model's TP plan shards colwise / rowwise are ``te.Linear`` with TE's own TP
  (``tp_size=2``, ``parallel_mode`` column / row, the TP group) and DTensor parameters whose placements
  are TE's TP placement with FSDP2's in front (``(_StridedShard(0, sf=2), Shard(0))`` / ``(Shard(0),
  Shard(1))``); ``lm_head`` (``colwise_gather_output``, no TE mode) stays ``nn.Linear`` under torch TP;
- the forward runs inside TE's autocast with FP8 ON, the yaml's recipe object (each of delayed,
  current, mxfp8, block-scaled, nvfp4) and the ``weight`` mesh as amax-reduction group; every TE
  module's recorded amax group is the ``weight`` mesh (``dp_shard_cp x tp``; no ``dp_replicate``).
"""

from __future__ import annotations

import contextlib
import os
import sys
import types
from pathlib import Path

import pytest
import torch

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

from shardbridge._extras import missing_requirements  # noqa: E402
from shardbridge.adapters import install_hint  # noqa: E402

if missing_requirements("te-structural"):  # what TE's Python code imports (nox -s "adapter(hf-adapter)" installs it)
    pytest.skip(
        f"needs the te-structural extra ({', '.join(missing_requirements('te-structural'))} not installed): "
        f"{install_hint('te-structural')}",
        allow_module_level=True,
    )

TESTS = Path(__file__).resolve().parents[2] / "te-adapter" / "tests"
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))  # the structural harness (run_distributed hands sys.path on)

DP2_TP2 = {"dp_shard": 2, "tp": 2}
HSDP_TP2 = {"dp_replicate": 2, "dp_shard": 1, "tp": 2}

# yaml fp8 block -> (TE recipe class, fields that must arrive)
RECIPES = {
    "delayed": (
        {"recipe": "delayed", "amax_history_length": 16, "amax_compute_algo": "max", "margin": 1},
        "DelayedScaling",
        {"amax_history_len": 16, "amax_compute_algo": "max", "margin": 1, "fp8_format": "HYBRID"},
    ),
    "current": ({"recipe": "current", "fp8_format": "E4M3"}, "Float8CurrentScaling", {"fp8_format": "E4M3"}),
    "mxfp8": ({"recipe": "mxfp8", "margin": 1}, "MXFP8BlockScaling", {"fp8_format": "E4M3", "margin": 1}),
    "block-scaled": ({"recipe": "block-scaled"}, "Float8BlockScaling", {"fp8_format": "E4M3"}),
    "nvfp4": ({"recipe": "nvfp4"}, "NVFP4BlockScaling", {"fp8_format": "E4M3"}),
}


class _Recorded(Exception):
    """Raised by the probe hook after recording: the layer's forward (a TE kernel) never runs."""


@contextlib.contextmanager
def _cuda_probes():
    from _te_structural import cuda_construction

    # Only CUDA *probes* are answered, as an sm100 machine with CUDA 12.9 would (TE's recipe
    # support checks: MXFP8 / NVFP4 need sm100, block scaling CUDA >= 12.9); nothing runs on a GPU.
    saved = (torch.cuda.is_current_stream_capturing, torch.cuda.get_device_properties, torch.version.cuda)
    torch.cuda.is_current_stream_capturing = lambda: False
    torch.cuda.get_device_properties = lambda *a, **k: types.SimpleNamespace(major=10, minor=0, name="structural")
    torch.version.cuda = "12.9"
    try:
        with cuda_construction("cpu"):
            yield
    finally:
        torch.cuda.is_current_stream_capturing, torch.cuda.get_device_properties, torch.version.cuda = saved


def _prepare_and_probe(block: dict, dims: dict) -> dict:
    import torch.distributed as dist
    from _te_structural import import_te

    te = import_te()
    from hf_helpers import SEQ, VOCAB, sb_accelerator, tiny_model
    from shardbridge import ParallelDims
    from shardbridge_hf import HFConfig
    from torch.distributed.tensor import DTensor
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager

    acc = sb_accelerator(ParallelDims(**dims), HFConfig.from_block({"fp8": {"backend": "te", **block}}))
    model = tiny_model()
    optimizer = torch.optim.AdamW(model.parameters())
    with _cuda_probes():
        model, optimizer = acc.prepare(model, optimizer)
    pm = acc.parallel_mesh
    weight_ranks = dist.get_process_group_ranks(pm["weight"].get_group())
    tp_ranks = dist.get_process_group_ranks(pm["tp"].get_group())
    layers = {}
    for fqn, m in model.named_modules():
        if isinstance(m, te.Linear):
            w = m.weight
            layers[fqn] = {
                "mode": m.parallel_mode,
                "tp_size": m.tp_size,
                "tp_group": dist.get_process_group_ranks(m.tp_group) == tp_ranks,
                "placements": tuple(repr(p) for p in w.placements) if isinstance(w, DTensor) else None,
                "mesh": tuple(w.device_mesh.mesh_dim_names) if isinstance(w, DTensor) else None,
                "shape": tuple(w.shape),
                "amax": dist.get_process_group_ranks(m._shardbridge_amax_group) == weight_ranks,
            }
    seen: dict = {}

    def hook(module, args):
        seen["enabled"] = FP8GlobalStateManager.is_fp8_enabled()
        seen["recipe"] = FP8GlobalStateManager.get_fp8_recipe()
        group = FP8GlobalStateManager.get_fp8_group()
        seen["group"] = None if group is None else dist.get_process_group_ranks(group) == weight_ranks
        raise _Recorded

    first = model.get_submodule("model.layers.0.self_attn.q_proj")
    handle = first.register_forward_pre_hook(hook)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    with contextlib.suppress(_Recorded), _cuda_probes():
        model(input_ids=ids)
    handle.remove()
    recipe = seen.get("recipe")
    fields = {}
    for name in ("amax_history_len", "amax_compute_algo", "margin", "fp8_format"):
        value = getattr(recipe, name, None)
        if value is not None:
            fields[name] = getattr(value, "name", value)
    return {
        "layers": layers,
        "nn_linears": sorted(n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)),
        "enabled": seen.get("enabled"),
        "recipe": type(recipe).__name__,
        "fields": fields,
        "autocast_group_is_weight": seen.get("group"),
        "weight_ranks": weight_ranks,
    }


@pytest.fixture(scope="module")
def te_sources() -> None:
    from _te_structural import ensure_te_sources

    ensure_te_sources()  # once, before 4 workers want it (raises with pip's output offline)


COLWISE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
ROWWISE = ("self_attn.o_proj", "mlp.down_proj")


def _check_layout(out: dict, dims: dict) -> None:
    from hf_helpers import tiny_config

    cfg = tiny_config()
    assert out["nn_linears"] == ["lm_head"], out["nn_linears"]  # colwise_gather_output: torch TP, high precision
    assert len(out["layers"]) == 7 * cfg.num_hidden_layers
    hsdp = dims.get("dp_replicate", 1) > 1
    for fqn, layer in out["layers"].items():
        suffix = fqn.split(".", 3)[-1]
        assert layer["tp_size"] == 2 and layer["tp_group"] and layer["amax"], (fqn, layer)
        # TE's TP placement (column Shard(0), row Shard(1)) with FSDP2's dp placement in front,
        # and Replicate in front of that on an HSDP mesh (even over a size-1 shard axis).
        if suffix in COLWISE:
            assert layer["mode"] == "column", (fqn, layer)
            want = ("_StridedShard(dim=0, sf=2)", "Shard(dim=0)")
        else:
            assert suffix in ROWWISE and layer["mode"] == "row", (fqn, layer)
            want = ("Shard(dim=0)", "Shard(dim=1)")
        if hsdp:
            want = ("Replicate()", *want)
        assert layer["placements"] == want, (fqn, layer)
        mesh = ("dp_replicate", "dp_shard_cp", "tp") if hsdp else ("dp_shard_cp", "tp")
        assert layer["mesh"] == mesh, (fqn, layer)
    q = out["layers"]["model.layers.0.self_attn.q_proj"]
    assert q["shape"] == (cfg.num_attention_heads * cfg.hidden_size // cfg.num_attention_heads, cfg.hidden_size)


@pytest.mark.parametrize("name", list(RECIPES))
def test_each_yaml_recipe_maps_to_its_te_recipe(name):
    """Pure (no TE import): the yaml block -> its recipe -> the TE recipe class and keywords the backend builds."""
    from shardbridge_hf import HFConfig
    from shardbridge_te import recipe_spec

    block, cls, fields = RECIPES[name]
    got_cls, kwargs = recipe_spec(HFConfig.from_block({"fp8": {"backend": "te", **block}}).fp8.to_recipe())
    # The keywords passed are the expected fields (TE's own defaults fill the rest, e.g. nvfp4's format).
    assert got_cls == cls and kwargs == {k: v for k, v in fields.items() if k in kwargs}, kwargs


# CI: two recipes at dp2 x tp2 (+ current on HSDP below); SHARDBRIDGE_FP8_MATRIX=all: all five.
CI_RECIPES = ("delayed", "nvfp4")
CASES = list(RECIPES) if os.environ.get("SHARDBRIDGE_FP8_MATRIX") == "all" else list(CI_RECIPES)


@pytest.mark.parametrize("name", CASES)
def test_te_fp8_with_tp2_through_accelerator(te_sources, name):
    from shardbridge.testing import run_distributed

    block, cls, fields = RECIPES[name]
    outs = run_distributed(_prepare_and_probe, block, DP2_TP2, world_size=4, timeout=480)
    for out in outs:
        _check_layout(out, DP2_TP2)
        assert out["enabled"] is True, out
        assert out["recipe"] == cls and out["fields"] == fields, out
        assert out["autocast_group_is_weight"] is True, out
    # The weight mesh of dp2 x tp2 is the whole world; of HSDP 2 x tp2 only a tp pair (below).
    assert all(out["weight_ranks"] == [0, 1, 2, 3] for out in outs)


def test_te_fp8_with_tp2_on_hsdp(te_sources):
    from shardbridge.testing import run_distributed

    block, cls, _ = RECIPES["current"]
    outs = run_distributed(_prepare_and_probe, block, HSDP_TP2, world_size=4, timeout=480)
    for rank, out in enumerate(outs):
        _check_layout(out, HSDP_TP2)
        assert out["enabled"] is True and out["recipe"] == cls and out["autocast_group_is_weight"] is True
        assert out["weight_ranks"] == [rank - rank % 2, rank - rank % 2 + 1]  # no dp_replicate in the amax group
