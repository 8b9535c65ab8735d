"""FP8 under Megatron-FSDP (the model's conversion): the keywords, the refusals, and that they reach the config.

See [Note: FP8 under Megatron-FSDP] (_precision.py). TE's FP8 kernels need CUDA, so on CPU the
tests check what is checkable: the exact ``DistributedDataParallelConfig`` keywords per recipe,
every refusal by name, and that keywords handed to ``_wrap`` (what ``shard_model`` calls) land in
the real megatron-fsdp config object (``wrapped.ddp_config``). The GPU run is in
tools/gpu/mfsdp_checks.py (``fp8_te_params``).
"""

from __future__ import annotations

import pytest
import torch
from shardbridge import PrecisionPolicy, fp8
from shardbridge.fp8 import FP8Recipe
from shardbridge.fp8 import _recipe as _backend
from shardbridge.testing import run_distributed
from shardbridge_megatron_fsdp import to_megatron_policy
from shardbridge_megatron_fsdp._precision import fp8_ddp_kwargs

TE_RECIPES = ("tensorwise", "current", "delayed", "mxfp8", "blockwise", "block_scaled", "nvfp4")
TORCHAO_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp", "mxfp8")


def te_recipe(name: str = "delayed", **kw: object) -> FP8Recipe:
    return FP8Recipe(backend="te", name=name, fp8_params=True, **kw)


@pytest.mark.parametrize("name", TE_RECIPES)
def test_te_fp8_params_give_fp8_param_gather(name):
    assert fp8_ddp_kwargs(te_recipe(name), device_type="cuda") == {"fp8_param_gather": True}


def test_no_fp8_gives_no_keywords():
    for device_type in ("cpu", "cuda"):
        assert fp8_ddp_kwargs(None, device_type=device_type) == {}


@pytest.mark.parametrize("name", TE_RECIPES)
def test_cpu_is_refused_by_name(name):
    with pytest.raises(NotImplementedError, match=r"on device 'cpu'.*TE's CUDA kernels.*without FP8 on CPU"):
        fp8_ddp_kwargs(te_recipe(name), device_type="cpu")


def test_te_without_fp8_params_is_refused():
    with pytest.raises(NotImplementedError, match=r"fp8_params=False.*backend 'te'") as e:
        fp8_ddp_kwargs(FP8Recipe(backend="te", name="delayed"), device_type="cuda")
    assert 'FP8Recipe(backend="te", name=..., fp8_params=True)' in str(e.value)


def test_all_gather_in_high_precision_is_refused_not_ignored():
    assert fp8_ddp_kwargs(te_recipe(all_gather_fp8=True), device_type="cuda") == {"fp8_param_gather": True}
    with pytest.raises(NotImplementedError, match=r"all_gather_fp8=False, but .*set all_gather_fp8=None"):
        fp8_ddp_kwargs(te_recipe(all_gather_fp8=False), device_type="cuda")


@pytest.mark.parametrize("name", TORCHAO_RECIPES)
@pytest.mark.parametrize("fp8_params", [False, True])
def test_torchao_is_refused_naming_what_megatron_fsdp_supports(name, fp8_params):
    recipe = FP8Recipe(backend="torchao", name=name, fp8_params=fp8_params)
    for device_type in ("cuda", "cpu"):
        with pytest.raises(NotImplementedError) as e:
            fp8_ddp_kwargs(recipe, device_type=device_type)
        message = str(e.value)
        assert "backend='torchao'" in message and "Megatron-FSDP" in message, message
        assert 'FP8Recipe(backend="te", name=..., fp8_params=True)' in message, message


class _NoKernelBackend(fp8.FP8BackendBase):
    """A backend that keeps FP8 parameters and converts nothing (no name branching anywhere)."""

    name, recipes = "test-fp8-params", ("tensorwise",)

    def convert(self, model, recipe, **kwargs):
        return fp8.Converted(modules=())


@pytest.fixture
def no_kernel_backend():
    fp8.register_backend(_NoKernelBackend())
    yield _NoKernelBackend.name
    _backend._BACKENDS.pop(_NoKernelBackend.name)


def test_gpu_path_checks_the_model(no_kernel_backend):
    from shardbridge_megatron_fsdp._shard import _check_fp8_model

    recipe = FP8Recipe(backend=no_kernel_backend, fp8_params=True)
    # a backend that keeps FP8 parameters gets the keywords by capability, not by its name
    assert fp8_ddp_kwargs(recipe, device_type="cuda") == {"fp8_param_gather": True}
    model = torch.nn.Sequential(torch.nn.Linear(16, 16))
    fp8.convert(model, recipe)
    with pytest.raises(ValueError, match=r"no parameter of the Sequential is a TransformerEngine FP8 tensor"):
        _check_fp8_model(model, PrecisionPolicy())


def _wrap_config(fields: dict) -> tuple:
    import importlib

    from mfsdp_helpers import CFG
    from shardbridge import ParallelDims
    from shardbridge.models import Llama
    from shardbridge_megatron_fsdp import _cpu_patch
    from shardbridge_megatron_fsdp._shard import _quiet_device_warning, _unit_modules, _wrap

    upstream = importlib.import_module("megatron_fsdp.fully_shard")  # the module (the package exports the function)
    pm = ParallelDims(dp_shard=-1).build_mesh("cpu")
    _cpu_patch.install(pin=True)
    model = Llama(CFG)
    units = _unit_modules(model, None, "optim_grads_params")
    config_cls = upstream.DistributedDataParallelConfig
    with _quiet_device_warning(True):
        wrapped = _wrap(
            model, pm, to_megatron_policy(PrecisionPolicy()), "optim_grads_params", None, units, True, fields
        )
    restored = upstream.DistributedDataParallelConfig is config_cls
    return type(wrapped.ddp_config).__name__, wrapped.ddp_config.fp8_param_gather, restored


def _shard_model_refusals() -> list[str]:
    from mfsdp_helpers import CFG
    from shardbridge import ParallelDims
    from shardbridge.models import Llama
    from shardbridge_megatron_fsdp import shard_model

    pm = ParallelDims(dp_shard=-1).build_mesh("cpu")
    fp8.register_backend(_NoKernelBackend())  # in this worker process
    out = []
    # The model's conversion is the FP8 setting shard_model reads (fp8.recipe_of).
    for recipe in (FP8Recipe(backend=_NoKernelBackend.name, fp8_params=True), FP8Recipe(name="rowwise")):
        model = Llama(CFG)
        fp8.convert(model, recipe)
        try:
            shard_model(model, None, pm, PrecisionPolicy())
            out.append("no error")
        except NotImplementedError as e:
            out.append(str(e))
    return out


def test_wrap_puts_the_keywords_into_the_real_ddp_config():
    # fp8_param_gather=True with no FP8 parameter and no meta-device init changes nothing else on CPU
    on = run_distributed(_wrap_config, {"fp8_param_gather": True}, world_size=2)[0]
    off = run_distributed(_wrap_config, {}, world_size=2)[0]
    assert on == ("DistributedDataParallelConfig", True, True)
    assert off == ("DistributedDataParallelConfig", False, True)


def test_shard_model_refuses_fp8_on_cpu_by_name():
    cpu, torchao = run_distributed(_shard_model_refusals, world_size=2)[0]
    assert "on device 'cpu'" in cpu and "TE's CUDA kernels" in cpu, cpu
    assert "backend='torchao'" in torchao and "Megatron-FSDP" in torchao, torchao


def test_unknown_config_field_is_refused():
    from shardbridge_megatron_fsdp._compat import _ddp_config_fields

    with pytest.raises(NotImplementedError, match=r"no field\(s\) \['fp9_param_gather'\]"):
        with _ddp_config_fields({"fp9_param_gather": True}):
            pass

