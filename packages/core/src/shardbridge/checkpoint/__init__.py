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

Below the verbs (all private; the modules by layer: docs/checkpoints.md, generated):

- ``derived/``: the derived save protocol, plans and storage records derived from the layout
  ([Note: the derived protocol] in ``derived/_save.py``); nothing below imports it.
- ``state/``: what is saved. The portable state dict handed to DCP (``_state.py``; tied
  parameters stored once: [Note: tied tensors]), layouts DCP describes wrongly repaired
  ([Note: DCP layout repair] in ``_repair.py``), fused parameters as components ([Note:
  component names] in ``_components.py``), frameworks' own state dicts ([Note: state-dict
  providers] in ``_provider.py``, :class:`StateDictProvider`; tensors only a provider can store,
  :func:`shardbridge.adapters.mark_rank_local`: [Note: rank-local tensors]), the chunk objects and planners
  (``_chunks.py``), host staging for async saves (``_stage.py``), RNG states (``_rng.py``).
- ``storage/``: how it lands. DCP's ``StorageWriter`` / ``StorageReader`` (``_writer.py``,
  ``_reader.py``) on a backend: local disk or fsspec ([Note: storage backends] in
  ``_backend.py``); what a checkpoint holds ([Note: checkpoint format] in ``_manifest.py``); how
  a half-written one is never taken for good ([Note: atomic commit] in ``_local.py``, [Note:
  object-store commit] in ``_fsspec.py``); damaged, missing or foreign files ([Note: checkpoint
  integrity] in ``_integrity.py``); no code runs from a checkpoint ([Note: untrusted
  checkpoints] in ``_trust.py``); boxes read in place ([Note: reading boxes in place] in
  ``_read.py``).

Between them, ``_protocol.py`` decides how the ranks of a save coordinate ([Note: save
protocols]), ``_async.py`` runs a save in the background ([Note: async save]) and ``_dist.py``
keeps every step symmetric across ranks ([Note: symmetric errors]).

Public: the names in ``__all__``: the verbs, what they return that a caller names
(:class:`TrainState`, :class:`AsyncSave`), the seam a framework plugs its own state dicts into
(:class:`StateDictProvider`) and the error a reader of checkpoints from elsewhere catches
(:class:`UntrustedCheckpointError`). What an adapter needs beyond that (chunk objects for a
provider, the no-code-runs readers for DCP directories shardbridge did not write, writer
destinations) is public in :mod:`shardbridge.adapters`. ``verify``, ``inspect`` and
``export_safetensors`` return objects whose classes are not public names.
"""

from shardbridge._deprecation import deprecated_getattr as _deprecated_getattr
from shardbridge.checkpoint._async import AsyncSave, wait
from shardbridge.checkpoint._export import export_safetensors
from shardbridge.checkpoint._inspect import inspect
from shardbridge.checkpoint._load import TrainState, load, load_latest
from shardbridge.checkpoint._save import save
from shardbridge.checkpoint._verify import verify
from shardbridge.checkpoint.state._provider import StateDictProvider
from shardbridge.checkpoint.storage._catalog import latest, step_dir
from shardbridge.checkpoint.storage._trust import UntrustedCheckpointError

__all__ = [
    # -- the verbs -------------------------------------------------------------------------
    "save",
    "wait",
    "load",
    "load_latest",
    "latest",
    "step_dir",
    "verify",
    "inspect",
    "export_safetensors",
    # -- what a caller names ---------------------------------------------------------------
    "AsyncSave",
    "StateDictProvider",
    "TrainState",
    "UntrustedCheckpointError",
]

# Public here in 0.1.0; the old names keep working until the next release ([Note: deprecated aliases]
# in shardbridge/_deprecation.py): what adapters use is in shardbridge.adapters, and the classes of
# returned objects are no longer public names.
_DEPRECATED = {
    "LocalChunks": "shardbridge.adapters.LocalChunks",
    "TrustedReader": "shardbridge.adapters.TrustedReader",
    "check_destination": "shardbridge.adapters.check_destination",
    "check_no_links": "shardbridge.adapters.check_no_links",
    "component_fqn": "shardbridge.adapters.component_fqn",
    "mark_rank_local": "shardbridge.adapters.mark_rank_local",
    "parse_size": "shardbridge.adapters.parse_size",
    "raise_untrusted": "shardbridge.adapters.raise_untrusted",
    "read_metadata": "shardbridge.adapters.read_metadata",
    "write_file": "shardbridge.adapters.write_file",
    "CheckpointInfo": "shardbridge.checkpoint._inspect.CheckpointInfo",
    "TensorInfo": "shardbridge.checkpoint._inspect.TensorInfo",
    "NameMap": "shardbridge.checkpoint._export.NameMap",
    "VerifyReport": "shardbridge.checkpoint.storage._integrity.VerifyReport",
    "FileProblem": "shardbridge.checkpoint.storage._integrity.FileProblem",
}
__getattr__ = _deprecated_getattr(
    __name__,
    _DEPRECATED,
    {
        "CheckpointInfo": "inspect() returns it",
        "TensorInfo": "CheckpointInfo.tensors holds them",
        "NameMap": "export_safetensors(name_map=) takes a dict or a function",
        "VerifyReport": "verify() returns it",
        "FileProblem": "VerifyReport.problems holds them",
    },
)
