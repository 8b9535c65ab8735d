"""Tiers 1 and 3: PrecisionPolicy validation, presets, lowering, and bf16 runs on gloo."""

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from shardbridge import ParallelDims, PrecisionPolicy, apply_fsdp
from shardbridge.fp8 import FP8Recipe
from shardbridge.models import Llama, LlamaConfig, parallelize_llama, synthetic_batch
from shardbridge.testing import run_distributed
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

# -- tier 1 ------------------------------------------------------------------------------------


def test_defaults_are_full_precision():
    policy = PrecisionPolicy()
    assert policy == PrecisionPolicy.fp32()
    assert policy.param_dtype is None
    assert policy.main_params_dtype == policy.main_grads_dtype == policy.effective_grad_comm_dtype == torch.float32
    assert policy.to_fsdp2() == TorchMixedPrecisionPolicy(reduce_dtype=torch.float32)


def test_old_name_is_a_deprecated_alias_of_precision_policy():
    """``shardbridge.MixedPrecisionPolicy`` was renamed: torch's FSDP2 has another class of that name."""
    import shardbridge

    assert "MixedPrecisionPolicy" not in shardbridge.__all__ and "PrecisionPolicy" in shardbridge.__all__
    with pytest.warns(DeprecationWarning, match=r"shardbridge.MixedPrecisionPolicy is now shardbridge.PrecisionPolicy"):
        old = shardbridge.MixedPrecisionPolicy
    assert old is PrecisionPolicy and old is not TorchMixedPrecisionPolicy
    with pytest.warns(DeprecationWarning, match="PrecisionPolicy"):
        from shardbridge import MixedPrecisionPolicy  # noqa: F401 (the from-import form goes through __getattr__ too)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"param_dtype": torch.int8}, r"param_dtype=torch.int8 is not an allowed dtype; choose one of torch.float64"),
        ({"main_params_dtype": None}, r"main_params_dtype=None is not an allowed dtype; .*torch.float16$"),
        ({"grad_comm_dtype": "bf16"}, r"grad_comm_dtype='bf16' is not an allowed dtype"),
        ({"output_dtype": torch.float8_e4m3fn}, r"output_dtype=torch.float8_e4m3fn .* shardbridge.fp8.convert\(model"),
        ({"cast_forward_inputs": 1}, r"cast_forward_inputs=1 must be a bool"),
    ],
)
def test_validation_names_field_and_allowed_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PrecisionPolicy(**kwargs)


def test_fp8_is_not_a_field_of_the_policy():
    """FP8 is a conversion of the model (shardbridge.fp8.convert), not a dtype FSDP2 lowers."""
    with pytest.raises(TypeError, match="fp8"):
        PrecisionPolicy(fp8=FP8Recipe())


def test_narrow_grad_comm_warns_with_what_is_lost():
    with pytest.warns(UserWarning, match=r"8 significant bits instead of 24"):
        PrecisionPolicy(grad_comm_dtype=torch.bfloat16)
    with pytest.warns(UserWarning, match=r"11 significant bits instead of 24 and a largest finite value of 6.55e\+04"):
        PrecisionPolicy(grad_comm_dtype=torch.float16)
    with pytest.warns(UserWarning, match=r"largest finite value of 6.55e\+04 instead of 3.39e\+38"):
        PrecisionPolicy(
            main_params_dtype=torch.bfloat16, main_grads_dtype=torch.bfloat16, grad_comm_dtype=torch.float16
        )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        PrecisionPolicy(grad_comm_dtype=torch.float64)  # wider: fine
        PrecisionPolicy(main_grads_dtype=torch.bfloat16, main_params_dtype=torch.bfloat16)
        PrecisionPolicy.bf16_comm()  # the preset is the intent: no warning


def test_presets_and_from_name():
    bf16 = PrecisionPolicy.bf16()
    assert (bf16.param_dtype, bf16.main_params_dtype, bf16.main_grads_dtype, bf16.effective_grad_comm_dtype) == (
        torch.bfloat16,
        torch.float32,
        torch.float32,
        torch.float32,
    )
    comm = PrecisionPolicy.bf16_comm()
    assert comm.effective_grad_comm_dtype == torch.bfloat16 and comm.main_grads_dtype == torch.float32
    for name in PrecisionPolicy.PRESETS:
        assert PrecisionPolicy.from_name(name) == getattr(PrecisionPolicy, name)()
    valid = r"choose one of \['fp32', 'bf16', 'bf16_comm'\]"
    with pytest.raises(ValueError, match=r"unknown mixed-precision preset 'fp16'; " + valid):
        PrecisionPolicy.from_name("fp16")


def test_lowering_to_fsdp2():
    policy = PrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32, cast_forward_inputs=False)
    assert policy.to_fsdp2() == TorchMixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32, cast_forward_inputs=False
    )
    assert PrecisionPolicy.bf16_comm().to_fsdp2().reduce_dtype == torch.bfloat16


def test_lowering_refuses_what_fsdp2_cannot_express():
    match = r"main_grads_dtype=torch.bfloat16 cannot be lowered.*pip install \"megatron-fsdp<0\.7"
    with pytest.raises(NotImplementedError, match=match):
        PrecisionPolicy(main_grads_dtype=torch.bfloat16).to_fsdp2()


def test_policy_is_frozen_and_keyword_only():
    with pytest.raises(TypeError):
        PrecisionPolicy(torch.bfloat16)  # noqa: the fields are keyword-only
    with pytest.raises(AttributeError):
        PrecisionPolicy().param_dtype = torch.bfloat16


# -- tier 3: what actually travels on gloo ------------------------------------------------------


class _RecordingReduceScatter(DefaultReduceScatter):
    def __init__(self):
        self.dtypes = set()

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.dtypes.add(input_tensor.dtype)
        return super().__call__(output_tensor, input_tensor, group, op, async_op)


def _one_step(dims: dict, preset: str):
    pm = ParallelDims(**dims).build_mesh("cpu")
    cfg = LlamaConfig.tiny()
    model = parallelize_llama(Llama(cfg, seed=0), pm, PrecisionPolicy.from_name(preset))
    recorder = _RecordingReduceScatter()
    for module in [model, *model.layers]:
        module.set_custom_reduce_scatter(recorder)
    tokens, labels = synthetic_batch(cfg, 4, 16, dp_rank=pm["dp"].get_local_rank(), dp_size=pm["dp"].size())
    logits = model(tokens)
    loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
    loss.backward()
    global_loss = loss.detach()
    dist.all_reduce(global_loss, group=pm["dp"].get_group())
    grad = model.layers[0].feed_forward.down.weight.grad
    return (
        logits.dtype,
        model.layers[0].attention.qkv.weight.dtype,
        grad.dtype,
        recorder.dtypes,
        global_loss.item() / pm["dp"].size(),
        grad.full_tensor(),
    )


@pytest.mark.parametrize("dims", [dict(dp_shard=4), dict(dp_replicate=2, dp_shard=2)], ids=["fsdp4", "hsdp2x2"])
def test_bf16_compute_and_bf16_reduce_scatter_run_on_gloo(dims):
    fp32 = run_distributed(_one_step, dims, "fp32", world_size=4)[0]
    bf16 = run_distributed(_one_step, dims, "bf16", world_size=4)[0]
    comm = run_distributed(_one_step, dims, "bf16_comm", world_size=4)[0]
    assert fp32[:4] == (torch.float32, torch.float32, torch.float32, {torch.float32})
    # bf16 compute; the sharded (main) params and grads stay fp32; the wire carries reduce_dtype
    assert bf16[:4] == (torch.bfloat16, torch.float32, torch.float32, {torch.float32})
    assert comm[:4] == (torch.bfloat16, torch.float32, torch.float32, {torch.bfloat16})
    for run in (bf16, comm):
        assert abs(run[4] - fp32[4]) / fp32[4] < 1e-2
        torch.testing.assert_close(run[5], fp32[5], rtol=0.1, atol=2e-3)


def _wrong_model_dtype():
    pm = ParallelDims(dp_shard=2).build_mesh("cpu")
    model = Llama(LlamaConfig.tiny()).to(torch.bfloat16)
    match = r"'tok_embeddings.weight' has dtype torch.bfloat16 .* model.to\(torch.float32\)"
    with pytest.raises(ValueError, match=match):
        apply_fsdp(model, pm, PrecisionPolicy.bf16())
    # A pure-bf16 policy accepts the bf16 model.
    pure = PrecisionPolicy(main_params_dtype=torch.bfloat16, main_grads_dtype=torch.bfloat16)
    apply_fsdp(model, pm, pure)
    return model.output.weight.dtype


def test_apply_fsdp_checks_main_params_dtype():
    assert run_distributed(_wrong_model_dtype, world_size=2) == [torch.bfloat16] * 2
