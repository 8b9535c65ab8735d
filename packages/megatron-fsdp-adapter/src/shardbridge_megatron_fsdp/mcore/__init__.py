"""shardbridge_megatron_fsdp.mcore: Megatron-Core GPT models under Megatron-Core's own Megatron-FSDP.

The ``megatron-core`` extra (megatron-core 0.16.1; README.md, Install; never together with the
standalone ``megatron-fsdp`` of the ``megatron`` extra). Importing this subpackage imports
neither megatron.core nor megatron_fsdp; the first call that needs megatron.core does.

Public: the names in ``__all__``::

    init_parallel_state(ParallelDims(...))     # Megatron-Core parallel_state from shardbridge dims
    shard_model(model, optimizer, config, policy, strategy=...)   # FullyShardedDataParallel
    save(path, model=..., optimizer=...) / load(...)               # the core's checkpoint format
    MegatronQKVSpec, register_gpt_fused                            # fused QKV / SwiGLU specs
    read_fsdp_dtensor(path, optimizer=True)                        # Megatron-LM fsdp_dtensor checkpoints
    load_hf(model, folder)                                         # from_pretrained folder, shard-on-read
    export_hf / fsdp_dtensor_to_hf / hf_to_checkpoint              # conversions (also: shardbridge ckpt convert)
    hf_name / megatron_name, LlamaArch                             # the Megatron-Core <-> Llama name map
    install_cpu_patch()                                            # CPU/gloo support (0.16.x)

Not public: ``_compat`` (megatron.core internals), ``_cpu_patch`` internals, ``_layout``
helpers other than the exported names.
"""

from shardbridge_megatron_fsdp.mcore._checkpoint import McoreFSDPStateDicts, load, save
from shardbridge_megatron_fsdp.mcore._convert import export_hf, fsdp_dtensor_to_hf, hf_to_checkpoint
from shardbridge_megatron_fsdp.mcore._cpu_patch import install as install_cpu_patch
from shardbridge_megatron_fsdp.mcore._fsdp_dtensor import FsdpDTensorCheckpoint, SwiGLUSplitError, read_fsdp_dtensor
from shardbridge_megatron_fsdp.mcore._hf import LlamaArch, hf_name, load_hf, megatron_name
from shardbridge_megatron_fsdp.mcore._layout import MegatronQKVSpec, register_gpt_fused
from shardbridge_megatron_fsdp.mcore._shard import (
    STRATEGIES,
    check_cpu_config,
    destroy_parallel_state,
    init_parallel_state,
    shard_model,
)

__all__ = [
    "STRATEGIES",
    "FsdpDTensorCheckpoint",
    "LlamaArch",
    "McoreFSDPStateDicts",
    "export_hf",
    "fsdp_dtensor_to_hf",
    "hf_name",
    "hf_to_checkpoint",
    "load",
    "load_hf",
    "megatron_name",
    "save",
    "SwiGLUSplitError",
    "read_fsdp_dtensor",
    "MegatronQKVSpec",
    "check_cpu_config",
    "destroy_parallel_state",
    "init_parallel_state",
    "install_cpu_patch",
    "register_gpt_fused",
    "shard_model",
]
