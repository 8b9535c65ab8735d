"""Accelerator / TrainingArguments options under shardbridge (``_arguments``): honoured, accepted, or refused by name.

Pure tests against the real accelerate and transformers objects: Accelerate's
``FullyShardedDataParallelPlugin`` built the way ``Trainer`` builds it (from
``TrainingArguments(fsdp=..., fsdp_config=...).fsdp_plugin_args``), ``ParallelismConfig``,
``TorchDynamoPlugin``. [Note: arguments under shardbridge].
"""

from __future__ import annotations

import types

import pytest

pytest.importorskip("accelerate")

from shardbridge import ParallelDims  # noqa: E402
from shardbridge_hf import HFConfig  # noqa: E402
from shardbridge_hf._arguments import check_accelerator_args, check_compile, check_training_args  # noqa: E402


@pytest.fixture(autouse=True)
def _no_accelerate_env(monkeypatch):
    import os

    for key in [k for k in os.environ if k.startswith(("FSDP_", "ACCELERATE_"))]:
        monkeypatch.delenv(key)


def _trainer_plugin(tmp_path, **fsdp_config):
    """The FSDP plugin Trainer hands its Accelerator for these TrainingArguments (create_accelerator_and_postprocess)."""
    from accelerate.utils import FullyShardedDataParallelPlugin
    from transformers import TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), fsdp=True, fsdp_config=fsdp_config, report_to="none")
    return FullyShardedDataParallelPlugin(**args.fsdp_plugin_args)


def test_trainer_fsdp_plugin_settings_are_honoured(tmp_path):
    kwargs = {"fsdp_plugin": _trainer_plugin(tmp_path, activation_checkpointing=True, cpu_offload=True)}
    config = check_accelerator_args(kwargs, HFConfig())
    assert "fsdp_plugin" not in kwargs  # never reaches Accelerate
    assert (config.activation_checkpointing, config.cpu_offload, config.reshard_after_forward) == (True, True, True)
    plain = check_accelerator_args({"fsdp_plugin": _trainer_plugin(tmp_path, reshard_after_forward=False)}, HFConfig())
    assert plain.reshard_after_forward is False and plain.activation_checkpointing is False


def test_trainer_fsdp_plugin_that_contradicts_the_block_is_refused(tmp_path):
    plugin = _trainer_plugin(tmp_path, reshard_after_forward=False)
    with pytest.raises(ValueError, match=r"reshard_after_forward=False and fsdp_config.shardbridge.reshard_after_forward=True disagree"):
        check_accelerator_args({"fsdp_plugin": plugin}, HFConfig(reshard_after_forward=True))


@pytest.mark.parametrize(
    "fsdp_config, match",
    [
        ({"auto_wrap_policy": "SIZE_BASED_WRAP", "min_num_params": 10}, r"auto_wrap_policy=.* wraps the embeddings"),
        ({"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}, r"auto_wrap_policy=.* drop the wrap policy and layer classes"),
    ],
)
def test_trainer_fsdp_plugin_settings_without_effect_are_refused_by_name(tmp_path, fsdp_config, match):
    with pytest.raises(ValueError, match=r"TrainingArguments\(fsdp=..., fsdp_config=...\) passes it.*" + match):
        check_accelerator_args({"fsdp_plugin": _trainer_plugin(tmp_path, **fsdp_config)}, HFConfig())


def test_fsdp1_is_refused_by_name():
    # Accelerate builds no FSDP1 plugin without an accelerator device; the field is what is read.
    with pytest.raises(ValueError, match=r"fsdp_version=1 cannot take effect .*set fsdp_config=\{'version': 2\}"):
        check_accelerator_args({"fsdp_plugin": types.SimpleNamespace(fsdp_version=1)}, HFConfig())


def test_deepspeed_fp16_and_mismatched_bf16_are_refused_by_name():
    with pytest.raises(ValueError, match=r"TrainingArguments\(deepspeed=...\).*drop the DeepSpeed config"):
        check_accelerator_args({"deepspeed_plugin": object()}, HFConfig())
    with pytest.raises(ValueError, match=r"mixed_precision='fp16'.*TrainingArguments\(fp16=True\)"):
        check_accelerator_args({"mixed_precision": "fp16"}, HFConfig())
    with pytest.raises(ValueError, match=r"TrainingArguments\(bf16=True\).*precision='fp32' does not compute in bf16"):
        check_accelerator_args({"mixed_precision": "bf16"}, HFConfig())
    assert check_accelerator_args({"mixed_precision": "bf16"}, HFConfig(precision="bf16")).precision == "bf16"
    assert check_accelerator_args({"mixed_precision": "no"}, HFConfig()) == HFConfig()


def test_parallelism_config_must_equal_the_files():
    from accelerate.parallelism_config import ParallelismConfig

    config = HFConfig(dims=ParallelDims(dp_shard=2, tp=2).resolve(4))
    same = {"parallelism_config": ParallelismConfig(dp_shard_size=2, tp_size=2)}
    assert check_accelerator_args(same, config) == config
    with pytest.raises(ValueError, match=r"TrainingArguments\(parallelism_config=...\).*asks for .*tp=1.* config file"):
        check_accelerator_args({"parallelism_config": ParallelismConfig(dp_shard_size=4)}, config)


def test_torch_compile_is_refused_by_name():
    from accelerate.utils import TorchDynamoPlugin

    check_compile(types.SimpleNamespace(dynamo_plugin=TorchDynamoPlugin()))  # backend "no": nothing to refuse
    with pytest.raises(NotImplementedError, match=r"TrainingArguments\(torch_compile=True\).*not supported"):
        check_compile(types.SimpleNamespace(dynamo_plugin=TorchDynamoPlugin(backend="inductor")))


def _accelerator(tp: int):
    dims = ParallelDims(dp_shard=4 // tp, tp=tp).resolve(4)
    return types.SimpleNamespace(parallel_mesh=types.SimpleNamespace(dims=dims))


def test_training_arguments_the_accelerator_never_sees_are_checked_at_train(tmp_path):
    from transformers import TrainingArguments

    def args(**kw):
        return TrainingArguments(output_dir=str(tmp_path), report_to="none", **kw)

    check_training_args(args(), _accelerator(tp=2))
    with pytest.raises(NotImplementedError, match=r"TrainingArguments\(auto_find_batch_size=True\)"):
        check_training_args(args(auto_find_batch_size=True), _accelerator(tp=1))
    with pytest.raises(ValueError, match=r"average_tokens_across_devices=False\) with tp > 1.*tp times too large"):
        check_training_args(args(average_tokens_across_devices=False), _accelerator(tp=2))
    check_training_args(args(average_tokens_across_devices=False), _accelerator(tp=1))  # no tp: the count is right
