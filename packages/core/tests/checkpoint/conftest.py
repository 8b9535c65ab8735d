"""Fixtures of the checkpoint tests: a real S3-compatible server (moto's standalone server)."""

from __future__ import annotations

import itertools
import os

import pytest
from shardbridge.testing._s3 import S3Server

_BUCKETS = itertools.count()


@pytest.fixture(scope="session")
def s3_server():
    """``moto_server`` on a free port of 127.0.0.1 for the whole session; this process's clients use it."""
    server = S3Server()
    saved = {k: os.environ.get(k) for k in server.client_env()}
    server.configure()
    yield server
    server.stop()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture
def s3_root(s3_server):
    """A fresh bucket of the session's server: ``s3://<bucket>/ckpt`` (buckets are never shared)."""
    return s3_server.bucket(f"sb-test-{next(_BUCKETS)}") + "/ckpt"
