"""Deprecated: install hints and version checks are public in :mod:`shardbridge.adapters`; this module goes away in the next release."""

from shardbridge._deprecation import deprecated_getattr as _deprecated_getattr

__all__: list[str] = []

# [Note: deprecated aliases] in shardbridge/_deprecation.py
_DEPRECATED = {
    "DISTRIBUTION": "shardbridge._extras.DISTRIBUTION",
    "UntestedVersionWarning": "shardbridge.UntestedVersionWarning",
    "extra_requirements": "shardbridge._extras.extra_requirements",
    "install_hint": "shardbridge.adapters.install_hint",
    "missing_requirements": "shardbridge._extras.missing_requirements",
    "warn_if_untested": "shardbridge.adapters.warn_if_untested",
}
__getattr__ = _deprecated_getattr(__name__, _DEPRECATED)
