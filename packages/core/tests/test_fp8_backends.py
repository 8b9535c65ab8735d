"""shardbridge.fp8: the recipe, the backend registry and protocol, and the core's torchao backend.

Tier 1 (pure) for the recipe and the registry; tier 3 (gloo) for apply_fsdp's check. The recipes
under FSDP2 x TP (numerics, bytes, checkpoints) are tested through the hf adapter
(``packages/hf-adapter/tests/test_hf_fp8.py``); TE's backend in the te / hf adapters' tests.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from shardbridge import FP8Recipe, MixedPrecisionPolicy, ParallelDims, apply_fsdp, fp8
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
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "('te', 'torchao') []"
    with pytest.raises(ValueError, match=r"fp8 backend 'nope' is not available; available: \['te', 'torchao'\]"):
        fp8.get_backend("nope")
    with pytest.raises(ValueError, match="does not implement shardbridge.fp8.FP8Backend"):
        fp8.register_backend(object())


def test_torchao_backend_refuses_by_name():
    backend = fp8.get_backend("torchao")
    with pytest.raises(ValueError, match=r"'delayed' is not supported by backend 'torchao'.*\['te'\] run 'delayed'"):
        backend.check(FP8Recipe(name="delayed"))
    with pytest.raises(ValueError, match=r"fp8.params.margin: torchao recipe 'rowwise' takes no parameters"):
        backend.check(FP8Recipe(name="rowwise", params={"margin": 0}))
    # mxfp8 with tp > 1 runs through the backend's local-shard styles (test_fp8_tp_styles.py): not refused.
    backend.check(FP8Recipe(name="mxfp8"), tp=2)
    assert backend.tp_styles(FP8Recipe(name="mxfp8")) == {
        "colwise": fp8.MXFP8ColwiseParallel,
        "rowwise": fp8.MXFP8RowwiseParallel,
    }
    assert backend.tp_styles(FP8Recipe(name="rowwise")) is None
    backend.check(FP8Recipe(name="mxfp8", params={"kernel": "emulated", "wgrad_with_hp": True}))


def test_policy_carries_the_recipe_and_to_fsdp2_ignores_it():
    policy = MixedPrecisionPolicy(fp8=FP8Recipe(name="rowwise"))
    assert policy.to_fsdp2() == MixedPrecisionPolicy().to_fsdp2()
    with pytest.raises(ValueError, match=r"fp8='rowwise' must be an FP8Recipe or None"):
        MixedPrecisionPolicy(fp8="rowwise")


def test_install_step_hook_rejects_non_optimizer():
    with pytest.raises(ValueError, match="wraps no torch.optim.Optimizer"):
        fp8.install_step_hook(object(), nn.Linear(2, 2))


def _apply_fsdp_checks_conversion() -> dict:
    pm = ParallelDims(dp_shard=2).build_mesh("cpu")
    recipe = FP8Recipe(name="tensorwise")
    plain = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))
    try:
        apply_fsdp(plain, pm, MixedPrecisionPolicy(fp8=recipe), units=[plain[0], plain[1]])
        unconverted = "no error"
    except ValueError as e:
        unconverted = str(e)
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))
    done = fp8.convert(model, recipe, module_filter=lambda m, fqn: isinstance(m, nn.Linear))
    apply_fsdp(model, pm, MixedPrecisionPolicy(fp8=recipe), units=[model[0], model[1]])
    model(torch.randn(4, 32)).sum().backward()
    return {"unconverted": unconverted, "converted": done.modules, "recipe": fp8.recipe_of(model) == recipe}


def test_apply_fsdp_runs_the_backend_and_refuses_an_unconverted_model():
    pytest.importorskip("torchao", reason="needs torchao (the fp8 extra); nox -s core runs without it")
    result = run_distributed(_apply_fsdp_checks_conversion, world_size=2)[0]
    assert "policy.fp8=FP8Recipe(backend='torchao', name='tensorwise'" in result["unconverted"]
    assert "call shardbridge.fp8.convert(model, policy.fp8) before" in result["unconverted"]
    assert result["converted"] == ("0", "1") and result["recipe"]


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
