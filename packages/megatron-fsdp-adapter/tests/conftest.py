"""Fixtures shared by the megatron-fsdp adapter's test modules."""

from __future__ import annotations

import pytest
from mfsdp_helpers import reference


@pytest.fixture(scope="module")
def oracle():
    """(losses, params) of the single-process fp32 reference run (mfsdp_helpers.reference)."""
    return reference()
