"""shardbridge.checkpoint: portable, atomic DCP checkpoints that reshard across layouts.

Save on every rank of any layout (FSDP2, HSDP, TP, their products, one process), load into
any other, export to Hugging Face safetensors::

    from shardbridge import checkpoint

    checkpoint.save(checkpoint.step_dir(root, step), model=model, optimizer=opt, step=step)
    state = checkpoint.load_latest(root, model=model, optimizer=opt)   # None if no checkpoint
    checkpoint.export_safetensors(checkpoint.latest(root), "hf_out", dtype="bfloat16")
    print(checkpoint.inspect(checkpoint.latest(root)))
    pending = checkpoint.save(path, model=model, optimizer=opt, step=step, async_=True)
    ...                                            # training goes on; the save commits meanwhile
    pending.wait()                                 # or checkpoint.wait(); the next save waits too
    assert checkpoint.verify(checkpoint.latest(root)).ok   # sizes + checksums of every file

What a checkpoint directory holds: [Note: checkpoint format] in ``_manifest.py``. How a half-
written one is never taken for good, and how a crash at any point leaves the last good one
restorable: [Note: atomic commit] in ``_commit.py``. How damaged, truncated, missing or foreign
files are detected: [Note: checkpoint integrity] in ``_integrity.py``. How layouts DCP
describes wrongly are repaired: [Note: DCP layout repair] in ``_repair.py``. How fused
parameters are named: [Note: component names] in ``_components.py``. How a framework whose
DTensors' placements do not describe its data (Megatron-FSDP) plugs in its own state dicts
and boxes: [Note: state-dict providers] in ``_provider.py`` (:class:`StateDictProvider`).
How an asynchronous save stages and commits in the background: [Note: async save] in
``_async.py``. How tied parameters are stored once: [Note: tied tensors] in ``_state.py``.

Public: the names in ``__all__``. The ``_``-prefixed modules (the chunk objects handed to DCP,
the planners, the manifest schema, the collective helpers) are not public. Readers of DCP
directories that shardbridge did not write (the megatron adapter's Megatron-LM ``fsdp_dtensor``
reader) use the same no-code-runs reading: :func:`read_metadata`, :class:`TrustedReader`,
:func:`check_no_links` (see [Note: untrusted checkpoints] in ``_trust.py``).
"""

from shardbridge.checkpoint._async import AsyncSave, wait
from shardbridge.checkpoint._commit import latest, step_dir
from shardbridge.checkpoint._export import NameMap, export_safetensors, parse_size
from shardbridge.checkpoint._inspect import CheckpointInfo, TensorInfo, inspect
from shardbridge.checkpoint._integrity import FileProblem, VerifyReport, verify
from shardbridge.checkpoint._load import TrainState, load, load_latest
from shardbridge.checkpoint._provider import StateDictProvider
from shardbridge.checkpoint._save import save
from shardbridge.checkpoint._state import component_fqn
from shardbridge.checkpoint._trust import TrustedReader, UntrustedCheckpointError, check_no_links, read_metadata

__all__ = [
    "AsyncSave",
    "CheckpointInfo",
    "FileProblem",
    "NameMap",
    "StateDictProvider",
    "TensorInfo",
    "TrainState",
    "TrustedReader",
    "UntrustedCheckpointError",
    "VerifyReport",
    "check_no_links",
    "component_fqn",
    "export_safetensors",
    "inspect",
    "latest",
    "load",
    "load_latest",
    "parse_size",
    "read_metadata",
    "save",
    "step_dir",
    "verify",
    "wait",
]
