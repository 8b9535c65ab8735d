"""Tier 4: `shardbridge demo` with its checkpoint directory on S3 (moto's real server), as a user runs it.

The demo saves asynchronously to ``s3://...``, reloads into another layout and into one process,
and checks every tensor bit-exact against the trained model and against torch's
``dcp_to_torch_save`` of the stored files; then ``shardbridge ckpt verify`` of the URI runs in a
fresh process with no process group.

Runs with SHARDBRIDGE_DEMO_ALL=1 (``nox -s s3``, ``nox -s beyond_ci``): in CI (its time budget),
``packages/core/tests/checkpoint/test_s3.py`` saves from 4 ranks to the same server, reshards
bit-exact and runs ``latest`` / ``verify`` / ``inspect`` / ``export`` and the CLI on URIs.
"""

import os
import re
import subprocess
import sys

import pytest
from shardbridge.testing._s3 import S3Server


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("SHARDBRIDGE_DEMO_ALL") != "1", reason="SHARDBRIDGE_DEMO_ALL=1 (nox -s s3): CI budget")
def test_demo_with_its_checkpoint_directory_on_s3(tmp_path):
    server = S3Server()
    try:
        root = server.bucket("sb-demo") + "/run"
        env = dict(os.environ, OMP_NUM_THREADS="1", **server.client_env())
        demo = [sys.executable, "-m", "shardbridge.cli._main", "demo", "--out", str(tmp_path / "demo"),
                "--steps", "4", "--checkpoint-dir", root]  # fmt: skip
        run = subprocess.run(demo, capture_output=True, text=True, env=env, timeout=900)
        assert run.returncode == 0, run.stdout + run.stderr
        assert "all checks passed" in run.stdout
        assert len(re.findall(r"\[ok\]", run.stdout)) == 5 and "[FAIL]" not in run.stdout
        assert f"({root}/step-00000004)" in run.stdout  # the checkpoint size row names where it went
        verify = [sys.executable, "-m", "shardbridge.cli._main", "ckpt", "verify", root]
        done = subprocess.run(verify, capture_output=True, text=True, env=env, timeout=300)
        assert done.returncode == 0, done.stderr
        assert re.search(rf"^{re.escape(root)}/step-00000004: \d+ files, \d+ bytes, sizes and xxh3_128 checksums", done.stdout)
        assert not (tmp_path / "demo" / "checkpoints").exists()
    finally:
        server.stop()
