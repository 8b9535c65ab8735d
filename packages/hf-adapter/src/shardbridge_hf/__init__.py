"""shardbridge_hf: Hugging Face transformers + Accelerate under shardbridge's FSDP2 x TP.

A run is launched with ``shardbridge launch --config_file cfg.yaml train.py`` (an ordinary
Accelerate config with a ``fsdp_config.shardbridge`` block; see docs/hf.md). The launcher's
workers install the Accelerate plugin: there ``accelerate.Accelerator`` is
:class:`ShardbridgeAccelerator`, so unmodified scripts, ``transformers.Trainer`` and TRL's
trainers train under it; a script may also name the class itself::

    from shardbridge_hf import ShardbridgeAccelerator as Accelerator

Public: the names in ``__all__``. The ``_``-prefixed modules are not public. FP8 (torchao, TE)
runs through the core's ``shardbridge.fp8`` backends, chosen by the config's fp8 block.
Importing this package does not import accelerate; :class:`ShardbridgeAccelerator` does.
"""

from shardbridge_hf._checkpoint import export_pretrained
from shardbridge_hf._config import BLOCK_KEY, ENV_VAR, CheckpointConfig, FP8Config, HFConfig
from shardbridge_hf._cp import CP_ATTENTION, cp_batch, enable_cp
from shardbridge_hf._launch import LaunchPlan, main, read_config_file
from shardbridge_hf._parallelize import fsdp_units, load_full_from_rank0, parallelize
from shardbridge_hf._tp import SUPPORTED_STYLES, apply_tp, check_tp_divides, resolve_tp_plan

__all__ = [
    "BLOCK_KEY",
    "CP_ATTENTION",
    "ENV_VAR",
    "SUPPORTED_STYLES",
    "CheckpointConfig",
    "FP8Config",
    "HFConfig",
    "LaunchPlan",
    "ShardbridgeAccelerator",
    "apply_tp",
    "check_tp_divides",
    "cp_batch",
    "enable_cp",
    "export_pretrained",
    "fsdp_units",
    "load_full_from_rank0",
    "main",
    "parallelize",
    "read_config_file",
    "resolve_tp_plan",
]


def __getattr__(name: str):
    # Lazy: ShardbridgeAccelerator imports accelerate (and, through it, transformers).
    if name == "ShardbridgeAccelerator":
        from shardbridge_hf._accelerator import ShardbridgeAccelerator

        return ShardbridgeAccelerator
    raise AttributeError(f"module 'shardbridge_hf' has no attribute {name!r}")
