"""A real S3-compatible server for tests and benchmarks: moto's standalone server on 127.0.0.1.

Not a mock of the client: ``moto_server`` (``pip install "moto[server]"``) answers S3's HTTP API
(multipart uploads, ranged GETs, conditional PUTs, bucket policies), and shardbridge talks to it
through s3fs as it would to AWS. :class:`S3Server` starts it on a free port, waits until it
answers, and can pause (SIGSTOP: a server that stops answering mid-save), resume and stop it.

Clients find it through :meth:`S3Server.client_env` (the standard ``AWS_*`` variables) and
:meth:`S3Server.configure` (fsspec's ``conf["s3"]``: the endpoint, and the client's timeouts: 60 s
by default, so that one Python server answering many ranks on a loaded 2-core machine is never a
timeout; a test that stops the server asks for short ones, ``client_env(timeout_s=3.0)``, so that
the stopped server is an error within seconds). A process that was started before the server (a
worker of a persistent pool) calls :func:`use_server` with those values first.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any

__all__ = ["S3Server", "served", "use_server"]

_READY_S = 60.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class S3Server:
    """``moto_server`` on 127.0.0.1 (see the module docstring).

    Example:
        >>> server = S3Server()  # doctest: +SKIP
        >>> server.bucket("ckpt")  # doctest: +SKIP
        >>> checkpoint.save("s3://ckpt/run/step-00000001", model=model)  # doctest: +SKIP
        >>> server.stop()  # doctest: +SKIP
    """

    def __init__(self, *, timeout_s: float = 60.0) -> None:
        exe = shutil.which("moto_server") or os.path.join(os.path.dirname(sys.executable), "moto_server")
        if not os.path.exists(exe):
            raise ImportError('moto_server is not installed: pip install "moto[server]"')
        self.port = _free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.timeout_s = timeout_s
        self._log = tempfile.NamedTemporaryFile(prefix="sb-moto-", suffix=".log", delete=False)  # noqa: SIM115
        self.proc = subprocess.Popen(
            [exe, "-H", "127.0.0.1", "-p", str(self.port)], stdout=self._log, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + _READY_S
        while True:
            try:
                urllib.request.urlopen(self.endpoint, timeout=1).close()  # noqa: S310 (our own server)
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"moto_server did not start on {self.endpoint} (log: {self._log.name})") from None
                time.sleep(0.05)

    def client_env(self, *, timeout_s: float | None = None) -> dict[str, str]:
        """The ``AWS_*`` environment a client process needs.

        Any key and secret; the server's endpoint; the client's timeouts: ``timeout_s``, or the server's.
        """
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "FSSPEC_S3": json.dumps(self.fsspec_conf(timeout_s=timeout_s)),
        }

    def fsspec_conf(self, *, timeout_s: float | None = None) -> dict[str, Any]:
        """fsspec's ``conf["s3"]`` for this server.

        Endpoint, credentials, connect and read timeouts of ``timeout_s`` (default: the server's), one attempt.
        """
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        return {
            "key": "testing",
            "secret": "testing",
            "client_kwargs": {"endpoint_url": self.endpoint, "region_name": "us-east-1"},
            "config_kwargs": {
                "connect_timeout": timeout_s,
                "read_timeout": timeout_s,
                "retries": {"max_attempts": 1},
            },
        }

    def configure(self) -> None:
        """Point this process's S3 clients at the server (see :func:`use_server`)."""
        use_server(self.client_env())

    def bucket(self, name: str, *, policy: dict[str, Any] | None = None) -> str:
        """Create bucket ``name`` (with a bucket policy, e.g. one denying writes); ``s3://name``."""
        import boto3

        client = boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            region_name="us-east-1",
        )
        client.create_bucket(Bucket=name)
        if policy is not None:
            client.put_bucket_policy(Bucket=name, Policy=json.dumps(policy))
        return f"s3://{name}"

    @property
    def log(self) -> str:
        """The server's log file: a line per request it answered (:func:`served` reads them)."""
        return self._log.name

    def requests(self) -> list[str]:
        """Every HTTP request the server answered so far: ``served(self.log)``."""
        return served(self.log)

    def pause(self) -> None:
        """SIGSTOP: the server keeps its connections and state but answers nothing."""
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT."""
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        """End the server (its buckets are gone)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        os.unlink(self._log.name)


def use_server(env: dict[str, str]) -> None:
    """Make this process's S3 clients use the server ``env`` describes (:meth:`S3Server.client_env`).

    Sets the ``AWS_*`` variables and fsspec's ``conf["s3"]``, forgets cached S3 filesystems (they
    hold a client of another endpoint), and lowers s3fs's own retries to one (its backoff would
    turn a stopped server into a minute-long wait).
    """
    import fsspec.config

    os.environ.update(env)
    fsspec.config.conf["s3"] = json.loads(env["FSSPEC_S3"])
    try:
        import s3fs
    except ImportError:
        return
    s3fs.S3FileSystem.clear_instance_cache()
    s3fs.S3FileSystem.retries = 1


def served(log: str) -> list[str]:
    """Every HTTP request a server's log (:attr:`S3Server.log`) shows answered: ``"GET /bucket/key"``."""
    with open(log, encoding="utf-8", errors="replace") as f:  # werkzeug colours some lines (ANSI escapes)
        return re.findall(r'"(?:\x1b\[[0-9;]*m)*([A-Z]+ /[^ ?"\x1b]*)', f.read())
