"""Tier 1: the core imports torch only (dependencies point down: docs/architecture.md, Layers)."""

import subprocess
import sys

FRAMEWORKS = ("transformer_engine", "megatron", "accelerate", "transformers", "torchao")


def test_import_shardbridge_pulls_in_no_host_framework():
    # A fresh interpreter: this test process may already have imported anything.
    code = (
        "import sys, shardbridge, shardbridge.checkpoint, shardbridge.models, shardbridge.testing\n"
        "import shardbridge.adapters, shardbridge.cp, shardbridge.ep, shardbridge.fp8, shardbridge.fused, shardbridge.tp\n"
        "import shardbridge.layout, shardbridge.pretrained, shardbridge.cli._main\n"
        f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {FRAMEWORKS!r})\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"core imported host frameworks: {out.stdout.strip()}"


def test_the_check_would_see_a_framework_import():
    # Guard against a vacuous pass: the same probe does see a module we know is imported.
    code = "import sys, shardbridge\nprint('torch' in sys.modules)\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"
