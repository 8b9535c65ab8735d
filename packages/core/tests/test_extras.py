"""Tier 1: install hints (``_extras.py``) name commands that work without an index hosting shardbridge.

[Note: install hints]: the host packages with the extra's bounds, read from the installed
metadata, and the extra as it installs from a clone or a wheel -- never ``pip install
"shardbridge[x]"``, which fails wherever shardbridge is on no index.
"""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import pytest
import shardbridge
from shardbridge._extras import extra_requirements
from shardbridge.adapters import install_hint

EXTRAS = importlib.metadata.metadata("shardbridge").get_all("Provides-Extra") or []


def test_the_metadata_declares_the_extras_the_docs_name():
    assert {"te", "megatron", "megatron-core", "hf", "fp8", "plot", "test", "all"} <= set(EXTRAS), EXTRAS


@pytest.mark.parametrize("extra", EXTRAS)
def test_every_hint_names_the_packages_of_its_extra(extra):
    hint = install_hint(extra)
    requirements = extra_requirements(extra)
    assert requirements, extra
    for req in requirements:
        assert f'"{req}"' in hint, (req, hint)
        assert not req.startswith("shardbridge"), req  # nested extras are expanded
    assert f'pip install -e ".[{extra}]"' in hint
    assert not re.search(r'pip install "shardbridge\[', hint), hint


def test_all_expands_to_the_union_of_its_extras():
    union = {r for e in ("megatron", "hf", "fp8", "plot", "test") for r in extra_requirements(e)}
    assert set(extra_requirements("all")) == union


def test_unknown_extra_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match=r"no extra 'nope'; its extras are \[.*'hf'"):
        install_hint("nope")


def test_no_source_file_recommends_installing_shardbridge_from_an_index():
    """Every "missing extra" message goes through install_hint (the sources, when this runs from a clone)."""
    root = Path(shardbridge.__file__).resolve().parents[4]  # packages/core/src/shardbridge/__init__.py
    # _extras.py itself quotes the failing command in [Note: install hints]
    sources = sorted(p for p in root.glob("packages/*/src/**/*.py") if p.name != "_extras.py")
    if not sources:
        pytest.skip("not run from a source tree (the installed wheel has no packages/ folder)")
    bad = [
        f"{path.relative_to(root)}:{n}"
        for path in sources
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"""pip install ["'`]?shardbridge\[[^\]]*\]["'`]?(?! @)""", line)
    ]
    assert not bad, bad
