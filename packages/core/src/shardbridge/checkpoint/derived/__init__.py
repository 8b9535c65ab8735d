"""The derived protocol (private): plans and storage records derived from the layout, not gathered.

One module family behind the protocol seam ([Note: save protocols] in ``checkpoint/_protocol.py``);
the state and storage layers below know nothing of it. Handed the flattened state a save
writes, it computes every rank's boxes from the mesh (``_spread.py``, ``_layouts.py``), every
storage record from the file rule (``_records.py``) and saves in constant-size rounds
(``_save.py``: :class:`DerivedSave`); a load derives the records the same way from the manifest
(``_records.py``: :func:`derive_load`). ``_recipes.py`` stores a spread as JSON values.
"""

from shardbridge.checkpoint.derived._records import DerivedRecords, derive_load
from shardbridge.checkpoint.derived._save import DerivedSave

__all__ = ["DerivedRecords", "DerivedSave", "derive_load"]
