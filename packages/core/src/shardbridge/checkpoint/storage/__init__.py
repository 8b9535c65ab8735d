"""How a checkpoint lands (private): DCP's StorageWriter / StorageReader on local disk or fsspec.

See [Note: storage backends] in ``_backend.py``: the backends (``_local.py``, ``_fsspec.py``),
paths and URIs (``_location.py``), the writer and reader DCP drives (``_writer.py``,
``_reader.py``), boxes read in place (``_read.py``), the manifest (``_manifest.py``), integrity
(``_integrity.py``), trust (``_trust.py``), DCP's errors (``_errors.py``), ``latest``
(``_catalog.py``). Nothing here knows which rank plans or how ranks talk: that is
``checkpoint/_protocol.py``.
"""
