"""shardbridge_megatron_fsdp: Megatron-FSDP with shardbridge's mesh, precision policy and checkpoints.

Megatron-FSDP is the standalone ``megatron_fsdp`` package: the ``megatron`` extra
(``pip install -e ".[megatron]"`` in a clone; README.md, Install).

Public: the names in ``__all__``::

    shard_model(model, optimizer, mesh, policy, strategy=..., outer_strategy=...)
    microbatches(model, n)                             # contexts for gradient accumulation
    save(path, model=..., optimizer=..., step=...)     # the core's checkpoint format
    load(path, model=..., optimizer=...)               # from Megatron-FSDP or torch FSDP2 runs
    to_megatron_policy(policy)                         # MixedPrecisionPolicy lowering (dtypes)
    fp8_ddp_kwargs(policy, device_type=)               # policy.fp8 -> DistributedDataParallelConfig keywords
    apply_llama_tp(llama, mesh["tp"])                   # the full TP plan (column + row) for the reference Llama
    cpu_patch() / install_cpu_patch()                  # CPU/gloo support for megatron-fsdp 0.6.x
    megatron_fsdp_version()

Not public: ``_compat`` (version probes), ``_cpu_patch`` internals, ``_tp_patch`` (TP DTensor
parameters in either Megatron-FSDP copy: ``install(package)``, ``align_tp_grads``; used by
``shard_model`` and the Megatron-Core path), ``_checkpoint``'s
provider and box helpers (``MegatronFSDPStateDicts``, the ``StateDictProvider`` that
``save``/``load`` hand to ``shardbridge.checkpoint``; ``dist_params``, ``local_box``: used by
tests and the benchmark).
Importing this package does not import megatron_fsdp; the first call that needs it does
(with an ImportError carrying the install hint when it is missing).
"""

from shardbridge_megatron_fsdp._accumulate import microbatches
from shardbridge_megatron_fsdp._checkpoint import load, save
from shardbridge_megatron_fsdp._compat import megatron_fsdp_version
from shardbridge_megatron_fsdp._cpu_patch import cpu_patch
from shardbridge_megatron_fsdp._cpu_patch import install as install_cpu_patch
from shardbridge_megatron_fsdp._llama_tp import apply_llama_tp
from shardbridge_megatron_fsdp._precision import fp8_ddp_kwargs, to_megatron_policy
from shardbridge_megatron_fsdp._shard import OUTER_STRATEGIES, STRATEGIES, shard_model

__all__ = [
    "OUTER_STRATEGIES",
    "STRATEGIES",
    "apply_llama_tp",
    "cpu_patch",
    "fp8_ddp_kwargs",
    "install_cpu_patch",
    "load",
    "megatron_fsdp_version",
    "microbatches",
    "save",
    "shard_model",
    "to_megatron_policy",
]
