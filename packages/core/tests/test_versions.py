"""Tier 1: the version policy (``shardbridge._extras``): one warning naming an untested host-framework version."""

from __future__ import annotations

import subprocess
import sys
import warnings

from shardbridge import UntestedVersionWarning
from shardbridge._compat import TORCH_CHECKED
from shardbridge.adapters import warn_if_untested


def test_inside_the_checked_range_is_silent_and_outside_warns_once():
    checked = ((5, 0), (5, 24))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert not warn_if_untested("pkgx", (5, 24, 3), checked)  # a patch release of the newest checked
        assert not warn_if_untested("pkgx", (5, 0, 0), checked)
        assert warn_if_untested("pkgx", (5, 25, 0), checked)
        assert warn_if_untested("pkgx", (5, 25, 0), checked)  # cached: no second warning
        assert warn_if_untested("pkgx", (4, 57, 1), checked)
    messages = [str(w.message) for w in caught]
    assert [w.category for w in caught] == [UntestedVersionWarning] * 2, messages
    assert messages[0] == (
        "pkgx 5.25.0 is untested with shardbridge: its CI and nox runs checked pkgx 5.0 .. 5.24 "
        "(docs/testing.md, Version policy)"
    )


def test_import_warns_for_a_torch_outside_the_checked_range():
    """What a user of a newer torch sees: one line at import (torch's version faked in a fresh interpreter)."""
    newer = ".".join(map(str, (TORCH_CHECKED[1][0], TORCH_CHECKED[1][1] + 1, 0)))
    code = (
        f"import torch, warnings; torch.__version__ = '{newer}'; warnings.simplefilter('always')\n"
        "import shardbridge\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, run.stderr  # one line: no source line of the caller under it
    assert "UntestedVersionWarning" in lines[0] and f"torch {newer} is untested with shardbridge" in lines[0], lines

