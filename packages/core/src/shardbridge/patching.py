"""Deprecated: patch plans are public in :mod:`shardbridge.adapters`; this module goes away in the next release."""

from shardbridge._deprecation import deprecated_getattr as _deprecated_getattr

__all__: list[str] = []

# [Note: deprecated aliases] in shardbridge/_deprecation.py
_DEPRECATED = {
    "Patch": "shardbridge.adapters.Patch",
    "PatchPlan": "shardbridge.adapters.PatchPlan",
    "Version": "shardbridge._patching.Version",
    "fmt_version": "shardbridge.adapters.fmt_version",
    "patch_attr": "shardbridge.adapters.patch_attr",
    "patch_item": "shardbridge.adapters.patch_item",
}
__getattr__ = _deprecated_getattr(__name__, _DEPRECATED)
