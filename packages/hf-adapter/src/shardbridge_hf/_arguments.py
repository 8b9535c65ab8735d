"""What Accelerate's and the Trainer's arguments mean under shardbridge: honoured, accepted, or refused by name.

[Note: arguments under shardbridge]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The config file's ``fsdp_config.shardbridge`` block owns wrapping, precision and the layout. An
``Accelerator(...)`` argument, or the ``TrainingArguments`` option a ``Trainer`` turns into one,
that says something about them is honoured, accepted (it says what shardbridge does anyway) or
refused naming the option and the fix; none is dropped::

    Accelerator argument (TrainingArguments)     under shardbridge
    fsdp_plugin (fsdp, fsdp_config)              field by field (_PLUGIN_FIELDS): activation_checkpointing,
                                                   reshard_after_forward, cpu_offload honoured (a block key
                                                   left at its default takes the plugin's value; another
                                                   value must agree); version 2, transformer-based wrapping,
                                                   FULL/SHARDED state dict, cpu_ram_efficient_loading accepted;
                                                   the rest refused
    deepspeed_plugin (deepspeed)                 refused
    mixed_precision (bf16 / fp16)                "bf16" must agree with the block's precision (bf16 compute);
                                                   "fp16", "fp8" refused; "no" / None: the block decides
    parallelism_config (parallelism_config)      must equal the sizes of the config file
    torch.compile (torch_compile, dynamo_config) refused: checked on the accelerator's state after init
    -- seen only by the Trainer, checked at train() (_TRAINING_ARG_CHECKS) --
    auto_find_batch_size                         refused (re-preparing a sharded model is not supported)
    average_tokens_across_devices=False, tp > 1  refused: the Trainer divides the per-rank token count by
                                                   tp, so the loss would be tp times too large

TrainingArguments(activation_checkpointing=True) needs no rule: the Trainer switches on transformers'
own per-layer checkpointing before ``prepare`` (the block's ``activation_checkpointing`` is the same
mechanism; with both, the Trainer itself refuses the pair, as under Accelerate's FSDP).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from shardbridge import ParallelDims

from shardbridge_hf._config import BLOCK_KEY, HFConfig

__all__ = ["check_accelerator_args", "check_compile", "check_training_args"]

_FROM_TRAINER = "TrainingArguments(fsdp=..., fsdp_config=...) passes it"


def _plugin_value(plugin: Any, field: str) -> Any:
    value = getattr(plugin, field, None)
    if field == "cpu_offload":  # FSDP2: CPUOffloadPolicy (on) or OffloadPolicy (off)
        return type(value).__name__ == "CPUOffloadPolicy" if value is not None else None
    return value


# fsdp_plugin field -> the block key it means (honoured), or None (accepted when `ok`, else refused with `why`).
@dataclasses.dataclass(frozen=True)
class _PluginField:
    field: str
    block_key: str | None = None
    """Honoured: the block key of the same meaning."""
    ok: Callable[[Any, Any], bool] = lambda value, plugin: True
    """Accepted when True (fields without a block key)."""
    why: str = ""
    """Why another value cannot take effect under shardbridge."""


def _transformer_wrap(value: Any, plugin: Any) -> bool:
    name = getattr(value, "__name__", value)
    return (value is None or name in ("transformer_auto_wrap_policy", "TRANSFORMER_BASED_WRAP", "NO_WRAP")) and not (
        getattr(plugin, "transformer_cls_names_to_wrap", None)
    )


# fmt: off
_PLUGIN_FIELDS = (
    _PluginField("fsdp_version", ok=lambda v, p: v == 2, why="shardbridge runs FSDP2; set fsdp_config={'version': 2}"),
    _PluginField("activation_checkpointing", block_key="activation_checkpointing"),
    _PluginField("reshard_after_forward", block_key="reshard_after_forward"),
    _PluginField("cpu_offload", block_key="cpu_offload"),
    _PluginField("auto_wrap_policy", ok=_transformer_wrap,
                 why="shardbridge wraps the embeddings, each decoder layer and [norm, lm_head] itself; drop the wrap "
                     "policy and layer classes"),
    _PluginField("state_dict_type", ok=lambda v, p: "LOCAL" not in str(v),
                 why="checkpoints are sharded shardbridge checkpoints and save_model writes the full model"),
    _PluginField("mixed_precision_policy", ok=lambda v, p: v is None,
                 why=f"precision is {BLOCK_KEY}.precision; drop it"),
    _PluginField("ignored_modules", ok=lambda v, p: not v, why="every module is sharded; drop it"),
    _PluginField("activation_checkpointing_offload", ok=lambda v, p: not v,
                 why="offloading checkpointed activations is not supported; drop it"),
)
# fmt: on


def _honour_fsdp_plugin(plugin: Any, config: HFConfig) -> HFConfig:
    """``config`` with the fsdp_plugin's honoured fields; ValueError for a field that cannot take effect."""
    defaults = {f.name: f.default for f in dataclasses.fields(HFConfig)}
    changes: dict[str, Any] = {}
    for rule in _PLUGIN_FIELDS:
        value = _plugin_value(plugin, rule.field)
        where = f"Accelerator(fsdp_plugin=...) ({_FROM_TRAINER}): {rule.field}={value!r}"
        if rule.block_key is None:
            if not rule.ok(value, plugin):
                raise ValueError(f"{where} cannot take effect under shardbridge ({rule.why})")
            continue
        ours = getattr(config, rule.block_key)
        if value is None or value == ours:
            continue
        if ours != defaults[rule.block_key]:
            raise ValueError(
                f"{where} and {BLOCK_KEY}.{rule.block_key}={ours!r} disagree; keep one (or make them equal)"
            )
        changes[rule.block_key] = value
    if getattr(plugin, "cpu_ram_efficient_loading", False) and not config.sync_module_states:
        raise ValueError(
            f"Accelerator(fsdp_plugin=...) ({_FROM_TRAINER}): cpu_ram_efficient_loading=True loads real weights on "
            f"rank 0 only, which needs {BLOCK_KEY}.sync_module_states: true"
        )
    return dataclasses.replace(config, **changes) if changes else config


def _check_mixed_precision(value: Any, config: HFConfig) -> None:
    value = getattr(value, "value", value)  # PrecisionType enum or str
    if value in (None, "no"):
        return
    if value == "bf16":
        if config.policy().param_dtype != torch.bfloat16:
            raise ValueError(
                f"Accelerator(mixed_precision='bf16') (TrainingArguments(bf16=True) passes it) but {BLOCK_KEY}.precision="
                f"{config.precision!r} does not compute in bf16; set precision: bf16 (or bf16_comm) in the block (FSDP2 "
                "casts the parameters, no autocast), or drop bf16"
            )
        return
    raise ValueError(
        f"Accelerator(mixed_precision={value!r}) (TrainingArguments(fp16=True) passes 'fp16') is not supported under "
        f"shardbridge; use bf16 ({BLOCK_KEY}.precision: bf16) or FP8 ({BLOCK_KEY}.fp8.backend)"
    )


def _dims_of(pc: Any) -> ParallelDims:
    return ParallelDims(dp_replicate=pc.dp_replicate_size, dp_shard=pc.dp_shard_size, cp=pc.cp_size, tp=pc.tp_size)


def check_accelerator_args(kwargs: dict[str, Any], config: HFConfig) -> HFConfig:
    """Honour, accept or refuse the ``Accelerator(...)`` arguments of [Note: arguments under shardbridge].

    Removes ``fsdp_plugin`` from ``kwargs`` (shardbridge builds Accelerate's plugin itself) and
    returns ``config`` with the plugin's honoured fields.

    Raises:
        ValueError: an argument that cannot take effect, naming it (and the TrainingArguments
            option that passes it) and the fix.
    """
    if kwargs.get("deepspeed_plugin") is not None or kwargs.get("deepspeed_plugins") is not None:
        raise ValueError(
            "Accelerator(deepspeed_plugin=...) (TrainingArguments(deepspeed=...) passes it): shardbridge trains with "
            "FSDP2 from the config file's fsdp_config.shardbridge block; drop the DeepSpeed config"
        )
    _check_mixed_precision(kwargs.get("mixed_precision"), config)
    plugin = kwargs.pop("fsdp_plugin", None)
    if plugin is not None:
        config = _honour_fsdp_plugin(plugin, config)
    pc = kwargs.get("parallelism_config")
    if pc is not None and config.dims is not None:
        theirs, ours = config.parallel_dims(_dims_of(pc)), config.dims
        if theirs.is_resolved and ours.is_resolved and theirs != ours:
            raise ValueError(
                f"Accelerator(parallelism_config=...) (TrainingArguments(parallelism_config=...) passes it) asks for "
                f"{theirs} but the config file's parallelism_config gives {ours}; drop the argument (the config file "
                "decides) or make them equal"
            )
    return config


def check_compile(state: Any) -> None:
    """Refuse torch.compile: ``prepare`` never hands the model to Accelerate's compile step.

    Accelerate's dynamo plugin is set by TrainingArguments(torch_compile=True) or the config
    file's ``dynamo_config``.

    Raises:
        NotImplementedError: a dynamo backend other than "no".
    """
    backend = getattr(getattr(state, "dynamo_plugin", None), "backend", None)
    name = str(getattr(backend, "value", backend) or "no")
    if name.lower() != "no":
        raise NotImplementedError(
            f"torch.compile (dynamo backend {name!r}; TrainingArguments(torch_compile=True) or the config file's "
            "dynamo_config set it) is not supported under shardbridge yet; drop it"
        )


# TrainingArguments the accelerator never sees: (option, when it cannot be honoured, error, message).
_TRAINING_ARG_CHECKS: tuple[tuple[str, Callable[[Any, Any], bool], type[Exception], str], ...] = (
    (
        "auto_find_batch_size",
        lambda args, acc: bool(getattr(args, "auto_find_batch_size", False)),
        NotImplementedError,
        "TrainingArguments(auto_find_batch_size=True): re-preparing a sharded model with a smaller batch after an "
        "out-of-memory error is not supported under shardbridge; set per_device_train_batch_size and drop it",
    ),
    (
        "average_tokens_across_devices",
        lambda args, acc: getattr(args, "average_tokens_across_devices", True) is False
        and acc.parallel_mesh.dims.tp > 1,
        ValueError,
        "TrainingArguments(average_tokens_across_devices=False) with tp > 1: the Trainer then divides each rank's own "
        "token count by tp (transformers' _get_num_items_in_batch), which makes the loss tp times too large; keep "
        "average_tokens_across_devices=True (the default)",
    ),
)


def check_training_args(args: Any, accelerator: Any) -> None:
    """Refuse the TrainingArguments of [Note: arguments under shardbridge] the accelerator never sees.

    Raises:
        ValueError, NotImplementedError: the first option that cannot be honoured, by name.
    """
    for _option, bad, error, message in _TRAINING_ARG_CHECKS:
        if bad(args, accelerator):
            raise error(message)
