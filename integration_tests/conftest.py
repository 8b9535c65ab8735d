"""Print the docs test's count (integration_tests/test_docs.py, [Note: executed docs]) at the end of a run."""

from __future__ import annotations

import sys


def pytest_terminal_summary(terminalreporter):
    for module in list(sys.modules.values()):
        if str(getattr(module, "__file__", "")).replace("\\", "/").endswith("integration_tests/test_docs.py"):
            line = module.summary()
            if line:
                terminalreporter.write_sep("-", "docs test")
                terminalreporter.write_line(line)
            return
