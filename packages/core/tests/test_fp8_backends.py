"""shardbridge.fp8: the recipe, the backend registry and protocol, and the core's torchao backend.

Tier 1 (pure) for the recipe, the registry and the protocol's size; tier 3 (gloo) for the
conversion before FSDP (apply_fsdp itself knows nothing of FP8). The recipes
under FSDP2 x TP (numerics, bytes, checkpoints) are tested through the hf adapter
(``packages/hf-adapter/tests/test_hf_fp8.py``); TE's backend in the te / hf adapters' tests.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from shardbridge import ParallelDims, apply_fsdp, fp8
from shardbridge._compat import local_tensor
from shardbridge.fp8 import FP8Recipe
from shardbridge.testing import run_distributed
from torch import nn


def test_recipe_names_aliases_and_plain_params():
    assert FP8Recipe().to_dict() == {
        "backend": "torchao",
        "name": "tensorwise",
        "params": {},
        "all_gather_fp8": None,
        "fp8_params": False,
    }
    assert FP8Recipe(backend="te", name="current").name == "tensorwise"
    assert FP8Recipe(backend="te", name="block-scaled").name == "blockwise"
    with pytest.raises(ValueError, match=r"FP8Recipe.name='e4m3' is not a known recipe; choose one of"):
        FP8Recipe(name="e4m3")
    with pytest.raises(ValueError, match=r"FP8Recipe.params=.* must hold plain values"):
        FP8Recipe(params={"fn": max})
    with pytest.raises(ValueError, match=r"FP8Recipe has no field\(s\) \['recipe'\]"):
        FP8Recipe.from_dict({"recipe": "rowwise"})
    recipe = FP8Recipe(backend="te", name="delayed", params={"margin": 1}, fp8_params=True)
    assert FP8Recipe.from_dict(recipe.to_dict()) == recipe


def test_registry_knows_torchao_and_te_without_importing_them():
    code = (
        "import sys; from shardbridge import fp8; names = fp8.backend_names(); fp8.get_backend('te'); "
        "print(names, [m for m in ('torchao', 'transformer_engine') if m in sys.modules])"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "('te', 'torchao') []"
    with pytest.raises(ValueError, match=r"fp8 backend 'nope' is not available; available: \['te', 'torchao'\]"):
        fp8.get_backend("nope")
    with pytest.raises(ValueError, match="does not implement shardbridge.fp8.FP8Backend"):
        fp8.register_backend(object())


def test_the_protocol_is_what_its_callers_use():
    """Four hooks, each with a caller ([Note: the FP8 backend protocol]); nine before issue 24."""
    import inspect

    hooks = sorted(n for n, v in vars(fp8.FP8Backend).items() if inspect.isfunction(v) and not n.startswith("_"))
    assert hooks == ["check", "convert", "refresh", "require_runtime"]
    assert all(callable(getattr(fp8.get_backend(name), hook)) for name in ("torchao", "te") for hook in hooks)


def test_torchao_backend_refuses_by_name():
    backend = fp8.get_backend("torchao")
    with pytest.raises(ValueError, match=r"'delayed' is not supported by backend 'torchao'.*\['te'\] run 'delayed'"):
        backend.check(FP8Recipe(name="delayed"))
    with pytest.raises(ValueError, match=r"fp8.params.margin: torchao recipe 'rowwise' takes no parameters"):
        backend.check(FP8Recipe(name="rowwise", params={"margin": 0}))
    backend.check(FP8Recipe(name="mxfp8", params={"kernel": "emulated", "wgrad_with_hp": True}))


def test_the_conversion_hands_the_tp_styles_of_its_modules():
    pytest.importorskip("torchao")
    every = {"module_filter": lambda m, fqn: isinstance(m, nn.Linear)}
    mx, rowwise = nn.Sequential(nn.Linear(64, 64)), nn.Sequential(nn.Linear(64, 64))
    # mxfp8 with tp > 1 runs through the backend's local-shard styles (test_fp8_tp_styles.py).
    assert fp8.convert(mx, FP8Recipe(name="mxfp8"), **every).tp_styles == {
        "colwise": fp8.MXFP8ColwiseParallel,
        "rowwise": fp8.MXFP8RowwiseParallel,
    }
    assert fp8.convert(rowwise, FP8Recipe(name="rowwise"), **every).tp_styles is None  # torch's
    assert fp8.converted(mx).tp_styles is not None and fp8.converted(rowwise).modules == ("0",)
    assert fp8.converted_fqn(mx[0]) == "0" and fp8.recipe_of(mx) == FP8Recipe(name="mxfp8")


def test_old_hook_names_are_deprecated_aliases_of_refresh():
    for old in ("after_load", "after_optimizer_step"):
        with pytest.warns(DeprecationWarning, match=rf"shardbridge.fp8.{old} is now shardbridge.fp8.refresh"):
            assert getattr(fp8, old) is fp8.refresh


def test_install_step_hook_rejects_non_optimizer():
    with pytest.raises(ValueError, match="wraps no torch.optim.Optimizer"):
        fp8.install_step_hook(object(), nn.Linear(2, 2))


def _convert_then_fsdp_then_refresh() -> dict:
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    pm = ParallelDims(dp_shard=2).build_mesh("cpu")
    recipe = FP8Recipe(name="tensorwise")
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))
    done = fp8.convert(model, recipe, module_filter=lambda m, fqn: isinstance(m, nn.Linear))
    apply_fsdp(model, pm, units=[model[0], model[1]])  # knows nothing of FP8
    weights = [local_tensor(p) for p in model.parameters() if isinstance(local_tensor(p), WeightWithDynamicFloat8CastTensor)]
    before = [w._precomputed_scale for w in weights]
    fp8.refresh(model)  # the first scales, from the sharded weights (one all-reduce)
    after = [w._precomputed_scale for w in weights]
    model(torch.randn(4, 32)).sum().backward()  # float8 all-gathers on gloo (uint8 view, apply_fsdp's gloo rule)
    return {"converted": done.modules, "recipe": fp8.recipe_of(model) == recipe, "before": before, "after": after}


def test_convert_before_fsdp_then_refresh_gives_the_first_scales():
    pytest.importorskip("torchao")  # the core without extras (nox -s core) has no torchao
    result = run_distributed(_convert_then_fsdp_then_refresh, world_size=2)[0]
    assert result["converted"] == ("0", "1") and result["recipe"]
    assert len(result["before"]) == 2 and all(s is None for s in result["before"])
    assert all(isinstance(s, torch.Tensor) and s.numel() == 1 for s in result["after"])


def test_torchao_convert_refuses_what_would_silently_not_run_fp8():
    """From a new user's review: a model with no Linear the filter takes (an "FP8 run" in high
    precision), and mxfp8's Triton kernels asked for on CPU (torchao asserted inside forward)."""
    pytest.importorskip("torchao", reason="needs torchao (the fp8 extra); nox -s core runs without it")
    with pytest.raises(ValueError, match=r"fp8 recipe tensorwise: no module of the model is selected for FP8"):
        fp8.convert(nn.Sequential(nn.Linear(40, 88)), FP8Recipe(name="tensorwise"))
    with pytest.raises(ValueError, match=r"the module_filter selects none"):
        fp8.convert(nn.Sequential(nn.Linear(64, 64)), FP8Recipe(name="rowwise"), module_filter=lambda m, n: False)
    with pytest.raises(ValueError, match=r"params.kernel='auto' picks torchao's Triton / CUTLASS kernels"):
        fp8.convert(nn.Sequential(nn.Linear(64, 64)), FP8Recipe(name="mxfp8", params={"kernel": "auto"}),
                    module_filter=lambda m, n: isinstance(m, nn.Linear))  # fmt: skip


def _convert_after_fsdp() -> str:
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))
    apply_fsdp(model, ParallelDims(dp_shard=2).build_mesh("cpu"), units=[model[0], model[1]])
    try:
        fp8.convert(model, FP8Recipe(name="rowwise"), module_filter=lambda m, n: isinstance(m, nn.Linear))
    except ValueError as e:
        return str(e)
    return "accepted"


def test_convert_after_fsdp_or_tp_is_refused():
    """Before: accepted, then the first step failed inside torchao / FSDP (mixed Tensor and DTensor)."""
    pytest.importorskip("torchao", reason="needs torchao (the fp8 extra); nox -s core runs without it")
    for message in run_distributed(_convert_after_fsdp, world_size=2):
        assert "parameter '0.weight' is already a DTensor" in message and "convert the model first" in message
