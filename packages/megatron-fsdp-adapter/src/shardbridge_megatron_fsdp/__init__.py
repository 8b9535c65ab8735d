"""shardbridge_megatron_fsdp: Megatron-FSDP with shardbridge's mesh, precision policy and checkpoints.

One adapter with two entry points over Megatron-FSDP: this package's :func:`shard_model` runs
the standalone ``megatron_fsdp`` package (the ``megatron`` extra: ``pip install -e ".[megatron]"`` in a clone; README.md, Install);
``shardbridge_megatron_fsdp.mcore`` runs Megatron-Core models under the copy megatron-core
bundles (the ``megatron-core`` extra; never in one environment with the
standalone one). Both share one CPU patch, one checkpoint provider and one ``_compat``.

Public: the names in ``__all__``::

    shard_model(model, optimizer, mesh, policy, strategy=..., outer_strategy=...)
    microbatches(model, n)                             # contexts for gradient accumulation
    save(path, model=..., optimizer=..., step=...)     # the core's checkpoint format (either entry point)
    load(path, model=..., optimizer=...)               # from Megatron-FSDP, Megatron-Core or torch FSDP2 runs
    MegatronFSDPStateDicts                             # the StateDictProvider save / load hand the core
    to_megatron_policy(policy)                         # PrecisionPolicy lowering (dtypes)
    fp8_ddp_kwargs(recipe, device_type=)               # the model's FP8 recipe -> DistributedDataParallelConfig keywords
    apply_llama_tp(llama, mesh["tp"])                  # shardbridge.models.apply_llama_tp: the core's full TP plan
    cpu_patch() / install_cpu_patch()                  # CPU/gloo support for megatron-fsdp 0.6.x
    megatron_fsdp_version()

Not public: ``_compat`` (version probes, both copies' internals), ``_cpu_patch`` internals
(``install(host)``: ``MEGATRON_FSDP`` or ``MEGATRON_CORE``), ``_tp_patch`` (TP DTensor parameters
in either Megatron-FSDP copy: ``install(package)``, ``align_tp_grads``), ``_optimizer``
(``zero_step``), ``_checkpoint``'s box helpers (``dist_params``, ``local_box``: used by tests and
the benchmark).
Importing this package does not import megatron_fsdp; the first call that needs it does
(with an ImportError carrying the install hint when it is missing).
"""

from shardbridge.models import apply_llama_tp

from shardbridge_megatron_fsdp._accumulate import microbatches
from shardbridge_megatron_fsdp._checkpoint import MegatronFSDPStateDicts, load, save
from shardbridge_megatron_fsdp._compat import STRATEGIES, megatron_fsdp_version
from shardbridge_megatron_fsdp._cpu_patch import cpu_patch
from shardbridge_megatron_fsdp._cpu_patch import install as install_cpu_patch
from shardbridge_megatron_fsdp._precision import fp8_ddp_kwargs, to_megatron_policy
from shardbridge_megatron_fsdp._shard import OUTER_STRATEGIES, shard_model

__all__ = [
    "MegatronFSDPStateDicts",
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
