"""shardbridge_megatron_fsdp.mcore: the Megatron-Core entry point of the megatron adapter.

The ``megatron-core`` extra (megatron-core 0.16.1; README.md, Install; never together with the
standalone ``megatron-fsdp`` of the ``megatron`` extra). Importing this subpackage imports
neither megatron.core nor megatron_fsdp; the first call that needs megatron.core does.

One adapter, two entry points: this one and the standalone ``shardbridge_megatron_fsdp.shard_model``
share the CPU patch (``_cpu_patch``, host ``MEGATRON_CORE`` here), the checkpoint provider
(``_checkpoint.MegatronFSDPStateDicts``: ``save`` / ``load`` below are the adapter's own), the
TP DTensor patch, the optimizer handling (``_optimizer``) and one ``_compat`` (version probes
with one contract, both copies' internals). What is Megatron-Core's alone lives here: the
parallel state (expert parallelism included), the ``FullyShardedDataParallel`` wrap, GPT
parameter layouts (MoE experts in global expert coordinates), the Llama / Mixtral name map, Megatron-LM's ``fsdp_dtensor`` checkpoints and the ``shardbridge ckpt convert`` verb.

Public: the names in ``__all__``::

    init_parallel_state(ParallelDims(...))     # Megatron-Core parallel_state from shardbridge dims
    shard_model(model, optimizer, config, policy, strategy=..., fp8=...)   # FullyShardedDataParallel
    save(path, model=..., optimizer=...) / load(...)               # the core's checkpoint format
    MegatronQKVSpec, register_gpt_fused                            # fused QKV / SwiGLU specs
    register_gpt_experts                                           # MoE experts in global expert coordinates
    read_fsdp_dtensor(path, optimizer=True)                        # Megatron-LM fsdp_dtensor checkpoints
    load_hf(model, folder)                                         # from_pretrained folder, shard-on-read
    export_hf / fsdp_dtensor_to_hf / hf_to_checkpoint              # conversions (also: shardbridge ckpt convert)
    hf_name / megatron_name, LlamaArch                             # the Megatron-Core <-> Llama / Mixtral name map
    install_cpu_patch()                                            # CPU/gloo support (0.16.x)

Not public: the ``_``-prefixed modules.
"""

import functools as _functools

from shardbridge_megatron_fsdp._checkpoint import MegatronFSDPStateDicts, load, save
from shardbridge_megatron_fsdp._compat import STRATEGIES
from shardbridge_megatron_fsdp._cpu_patch import MEGATRON_CORE as _MEGATRON_CORE
from shardbridge_megatron_fsdp._cpu_patch import install as _install
from shardbridge_megatron_fsdp.mcore._convert import export_hf, fsdp_dtensor_to_hf, hf_to_checkpoint
from shardbridge_megatron_fsdp.mcore._fsdp_dtensor import FsdpDTensorCheckpoint, SwiGLUSplitError, read_fsdp_dtensor
from shardbridge_megatron_fsdp.mcore._hf import LlamaArch, hf_name, load_hf, megatron_name
from shardbridge_megatron_fsdp.mcore._layout import MegatronQKVSpec, register_gpt_experts, register_gpt_fused
from shardbridge_megatron_fsdp.mcore._shard import (
    check_cpu_config,
    destroy_parallel_state,
    init_parallel_state,
    shard_model,
)

install_cpu_patch = _functools.partial(_install, _MEGATRON_CORE)
"""``install_cpu_patch(pin=False) -> bool``: the CPU patch for megatron-core ([Note: the CPU patch])."""

__all__ = [
    "STRATEGIES",
    "FsdpDTensorCheckpoint",
    "LlamaArch",
    "MegatronFSDPStateDicts",
    "MegatronQKVSpec",
    "SwiGLUSplitError",
    "check_cpu_config",
    "destroy_parallel_state",
    "export_hf",
    "fsdp_dtensor_to_hf",
    "hf_name",
    "hf_to_checkpoint",
    "init_parallel_state",
    "install_cpu_patch",
    "load",
    "load_hf",
    "megatron_name",
    "read_fsdp_dtensor",
    "register_gpt_experts",
    "register_gpt_fused",
    "save",
    "shard_model",
]
