"""shard_model(fp8=...) on the Megatron-Core path: honoured (GPU keywords) or refused by name.

See [Note: FP8 on the Megatron-Core path]. Pure: real TransformerConfig / DistributedDataParallelConfig
objects of megatron-core 0.16.1, no process group, no TE (its kernels need CUDA).
"""

from __future__ import annotations

import pytest
import torch
from mcore_helpers import gpt_config
from shardbridge import PrecisionPolicy
from shardbridge.fp8 import FP8Recipe
from shardbridge_megatron_fsdp.mcore._shard import _ddp_config, fp8_fields

MCORE_RECIPES = ("tensorwise", "delayed", "mxfp8", "blockwise")


def te(name: str, **kw: object) -> FP8Recipe:
    return FP8Recipe(backend="te", name=name, fp8_params=True, **kw)


@pytest.mark.parametrize("name", MCORE_RECIPES)
def test_gpu_keywords_reach_the_ddp_config(name):
    config = gpt_config(fp8="hybrid", fp8_recipe=name, fp8_param=True)
    fields = fp8_fields(te(name), config, device_type="cuda")
    assert fields == {"fp8_param_gather": True}
    ddp = _ddp_config(PrecisionPolicy(), "optim_grads_params", torch.float32, fields)
    assert ddp.fp8_param_gather is True and ddp.use_megatron_fsdp
    assert _ddp_config(PrecisionPolicy(), "optim_grads_params", torch.float32, {}).fp8_param_gather is False


def test_cpu_is_refused_by_name():
    config = gpt_config(fp8="hybrid", fp8_recipe="delayed", fp8_param=True)
    with pytest.raises(NotImplementedError, match=r"on device 'cpu'.*TE's CUDA kernels.*without FP8 on CPU"):
        fp8_fields(te("delayed"), config, device_type="cpu")


@pytest.mark.parametrize("name", ("tensorwise", "rowwise", "mxfp8"))
def test_torchao_is_refused_by_name(name):
    with pytest.raises(NotImplementedError) as e:
        fp8_fields(FP8Recipe(backend="torchao", name=name), gpt_config(), device_type="cuda")
    assert "backend='torchao'" in str(e.value) and 'FP8Recipe(backend="te", name=..., fp8_params=True)' in str(e.value)


def test_nvfp4_is_refused_by_name():
    with pytest.raises(NotImplementedError, match=r"'nvfp4' outside TransformerConfig.fp8_recipe.*'blockwise'"):
        fp8_fields(te("nvfp4"), gpt_config(), device_type="cuda")


def test_config_must_agree_with_the_recipe():
    with pytest.raises(
        ValueError,
        match=r"TransformerConfig fp8=None, fp8_recipe='delayed', fp8_param=False: .*fp8_recipe='mxfp8', fp8_param=True",
    ):
        fp8_fields(te("mxfp8"), gpt_config(), device_type="cuda")
    with pytest.raises(ValueError, match=r"TransformerConfig fp8_recipe='delayed'"):
        fp8_fields(te("mxfp8"), gpt_config(fp8="hybrid", fp8_param=True), device_type="cuda")
    with pytest.raises(
        ValueError, match=r"TransformerConfig fp8='hybrid', fp8_param=True but shard_model\(fp8=None\)"
    ):
        fp8_fields(None, gpt_config(fp8="hybrid", fp8_param=True), device_type="cuda")
    assert fp8_fields(None, gpt_config(), device_type="cpu") == {}


def test_output_dtype_still_refused():
    with pytest.raises(NotImplementedError, match=r"output_dtype=torch.float32 .*set output_dtype=None"):
        _ddp_config(PrecisionPolicy(output_dtype=torch.float32), "optim_grads_params", torch.float32)
