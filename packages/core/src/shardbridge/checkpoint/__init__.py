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

Every path may be a URI: ``s3://bucket/ckpt`` (the ``s3`` extra: s3fs), ``gs://``,
``az://``, ``file://``.

Two layers below the verbs (both private):

- ``state/``: what is saved. The portable state dict handed to DCP (``_state.py``; tied
  parameters stored once: [Note: tied tensors]), layouts DCP describes wrongly repaired
  ([Note: DCP layout repair] in ``_repair.py``), fused parameters as components ([Note:
  component names] in ``_components.py``), frameworks' own state dicts ([Note: state-dict
  providers] in ``_provider.py``, :class:`StateDictProvider`; tensors only a provider can store,
  :func:`mark_rank_local`: [Note: rank-local tensors]), the chunk objects and planners
  (``_chunks.py``), host staging for async saves (``_stage.py``), RNG states (``_rng.py``).
- ``storage/``: how it lands. DCP's ``StorageWriter`` / ``StorageReader`` (``_writer.py``,
  ``_reader.py``) on a backend: local disk or fsspec ([Note: storage backends] in
  ``_backend.py``); what a checkpoint holds ([Note: checkpoint format] in ``_manifest.py``); how
  a half-written one is never taken for good ([Note: atomic commit] in ``_local.py``, [Note:
  object-store commit] in ``_fsspec.py``); damaged, missing or foreign files ([Note: checkpoint
  integrity] in ``_integrity.py``); no code runs from a checkpoint ([Note: untrusted
  checkpoints] in ``_trust.py``); records read in one pass per file ([Note: reading records in one pass] in
  ``_read.py``).

Between them, ``_protocol.py`` decides how the ranks of a save coordinate ([Note: save
protocols]), ``_async.py`` runs a save in the background ([Note: async save]) and ``_dist.py``
keeps every step symmetric across ranks ([Note: symmetric errors]).

Public: the names in ``__all__``. Readers of DCP
directories that shardbridge did not write (the megatron adapter's Megatron-LM ``fsdp_dtensor``
reader) use the same no-code-runs reading: :func:`read_metadata`, :class:`TrustedReader`,
:func:`check_no_links`, and :func:`raise_untrusted` around ``dcp.load`` (a refusal comes out as
itself, not wrapped in DCP's ``CheckpointException``; see [Note: untrusted checkpoints] in
``storage/_trust.py``). Writers of
other formats (``ckpt convert``, the hf adapter's ``export_pretrained``) hold the same line as
``export_safetensors``: :func:`check_destination` before anything is written, :func:`write_file`
for each file (never through a link, never over a file without ``overwrite``: [Note: writer
destinations] in ``storage/_destination.py``).
"""

from shardbridge.checkpoint._async import AsyncSave, wait
from shardbridge.checkpoint._export import NameMap, export_safetensors, parse_size
from shardbridge.checkpoint._inspect import CheckpointInfo, TensorInfo, inspect
from shardbridge.checkpoint._load import TrainState, load, load_latest
from shardbridge.checkpoint._save import save
from shardbridge.checkpoint._verify import verify
from shardbridge.checkpoint.state._chunks import LocalChunks
from shardbridge.checkpoint.state._provider import StateDictProvider, mark_rank_local
from shardbridge.checkpoint.state._state import component_fqn
from shardbridge.checkpoint.storage._catalog import latest, step_dir
from shardbridge.checkpoint.storage._destination import check_destination, write_file
from shardbridge.checkpoint.storage._integrity import FileProblem, VerifyReport
from shardbridge.checkpoint.storage._reader import TrustedReader
from shardbridge.checkpoint.storage._trust import (
    UntrustedCheckpointError,
    check_no_links,
    raise_untrusted,
    read_metadata,
)

__all__ = [
    "AsyncSave",
    "CheckpointInfo",
    "FileProblem",
    "LocalChunks",
    "NameMap",
    "StateDictProvider",
    "TensorInfo",
    "TrainState",
    "TrustedReader",
    "UntrustedCheckpointError",
    "VerifyReport",
    "check_destination",
    "check_no_links",
    "component_fqn",
    "export_safetensors",
    "inspect",
    "latest",
    "load",
    "load_latest",
    "mark_rank_local",
    "parse_size",
    "raise_untrusted",
    "read_metadata",
    "save",
    "step_dir",
    "verify",
    "wait",
    "write_file",
]
