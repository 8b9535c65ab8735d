"""te-adapter tests: the structural tier fetches TE 2.20.2's Python sources once per machine.

See [Note: the structural tier] in ``_te_structural.py``. The download runs in the pytest
process before any worker imports TE; its time and size are printed in the summary.
"""

from __future__ import annotations

import pytest

_FETCH: dict[str, object] = {}


@pytest.fixture(scope="session", autouse=True)
def _te_sources(request: pytest.FixtureRequest) -> None:
    if not any("structural" in item.nodeid for item in request.session.items):
        return
    from _te_structural import ensure_te_sources

    _FETCH.update(ensure_te_sources())  # raises with pip's output when the registry is unreachable


def pytest_terminal_summary(terminalreporter) -> None:  # type: ignore[no-untyped-def]
    if _FETCH:
        terminalreporter.write_line(
            "te structural tier: TE {v} sources at {path} (cached={cached}; download+extract {download_s}s; "
            "wheel {wheel_bytes} B; {extracted_files} .py files, {extracted_bytes} B)".format(v="2.20.2", **_FETCH)
        )


@pytest.fixture(autouse=True)
def _te_stays_in_workers():
    """TE (the structural tier's) is imported only in pool workers, never in the pytest process:
    there it would be what every later ``import transformer_engine`` of the run gets (megatron-fsdp
    imports it when it can), and its sys.path entry would reach every worker started later."""
    yield
    import sys

    assert "transformer_engine" not in sys.modules, "a test imported TE in the pytest process: use run_distributed"
