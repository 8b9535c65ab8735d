"""The derived protocol (private): plans and storage records derived from the layout, not gathered.

One module family behind the protocol seam ([Note: save protocols] in ``checkpoint/_protocol.py``);
the state and storage layers below know nothing of it. Handed the flattened state a save
writes, it computes every rank's boxes from the mesh (``_spread.py``, ``_layouts.py``), every
storage record from the file rule (``_records.py``) and saves in constant-size rounds
(``_save.py``: :class:`DerivedSave`); a load derives the records the same way from the manifest
(``_records.py``: :func:`derive_load`), used once it renders ``.metadata`` byte for byte
(:func:`checkpoint_records`; inspect and export read through :func:`metadata_of`).
``_recipes.py`` stores a spread as JSON values.
"""

from shardbridge.checkpoint.derived._records import (
    DerivedRecords,
    checkpoint_records,
    declared_digest,
    derive_load,
    metadata_of,
)
from shardbridge.checkpoint.derived._save import DerivedSave

__all__ = ["DerivedRecords", "DerivedSave", "checkpoint_records", "declared_digest", "derive_load", "metadata_of"]
