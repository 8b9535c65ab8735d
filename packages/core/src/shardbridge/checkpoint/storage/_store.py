"""The object-store client of the fsspec backend: its settings, the bound on a request, the line a
long wait logs, and its failures named by cause.

[Note: object-store client settings]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Every S3 request ends, answered or not, within a bound. s3fs's defaults do not give one a user
can wait for: its own retry loop (5 tries) around botocore's (5 attempts, legacy mode), each
attempt waiting up to ``read_timeout`` (15 s): a stopped server hung ``ckpt verify`` 330 s and
more (issue 38). Defaults, each used only where the user set nothing::

    connect_timeout, read_timeout   5 s, 15 s (s3fs's own)
    retries                         {"mode": "standard", "total_max_attempts": 3}
    s3fs's own retry loop           1 try (botocore's attempts are the budget)

One place overrides them: fsspec's S3 config (``fsspec.config.conf["s3"]["config_kwargs"]``,
which the ``FSSPEC_S3`` variable fills); botocore's own ``AWS_MAX_ATTEMPTS`` / ``AWS_RETRY_MODE``
and a profile's settings are honoured too. A request then takes at most ``attempts x
(connect_timeout + read_timeout) + backoff`` (:func:`request_bound`, read from the effective
client: 3 x 20 s + 3 s = 63 s by default; a stopped server that still accepts connections, about
48 s). One that has waited ``NOTICE_S`` logs a line naming it and the bound (:class:`Waits`).
For ``FAIL_FAST_S`` (10 s) after a request got no answer (or no connection), the backend's next
requests fail at once with that error: a command never waits out the bound twice (a load reads
the manifest twice before its first round; a failed save's cleanup would wait per object). A
setting that cannot take effect is refused by name: a key botocore's ``Config`` does not take, a
timeout that is not a positive number, a client setting s3fs does not know (at the client's
creation), an ``FSSPEC_S3`` that is not a JSON object (fsspec only warns and drops it).

[Note: object-store errors]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
:func:`store_error` names a failure of the store by its cause, from botocore's error code or
exception class anywhere in the chain (``_CAUSES``): credentials (missing, unknown key, bad
signature, expired), denied (a policy), forbidden (a 403 without a code: either), bucket
(``NoSuchBucket``: never "missing", or ``latest`` would answer None), unreachable (connection,
SSL, proxy), unanswered (read timeout, dropped connection), server (throttling or 5xx after every
attempt); a request the client refuses (a bucket name S3 does not take) is a ``ValueError``. The
error names the object, the cause and the fix, and is an :class:`ObjectStoreError`, which no
reader takes for damage ([Note: DCP errors] in ``_errors.py``); a missing object stays a
``FileNotFoundError``.
"""

from __future__ import annotations

import difflib
import errno
import json
import logging
import os
import re
import threading
import time
from typing import Any

__all__ = [
    "NOTICE_S",
    "S3_RETRIES",
    "ObjectStoreError",
    "StoreAccessError",
    "StoreConnectionError",
    "StoreTimeoutError",
    "Waits",
    "client_options",
    "request_bound",
    "settings_error",
    "store_error",
]

logger = logging.getLogger("shardbridge.checkpoint")


class ObjectStoreError(OSError):
    """An object store failed a request for a cause that is not the object's: wrong or missing
    credentials, an endpoint that cannot be reached, a missing bucket, a server that does not answer.

    Its message names the object, the cause and the fix ([Note: object-store errors]); ``cause`` is
    the short name of the cause. Never taken for damage: integrity checks and ``latest`` raise it
    instead of reporting a file as unreadable or skipping a checkpoint.
    """

    cause = "store"

    def again(self, prefix: str, suffix: str = "") -> ObjectStoreError:
        """The same error (class, errno, cause) with ``prefix`` before its message (``suffix`` after)."""
        error = type(self)(f"{prefix}{self}{suffix}")
        error.errno, error.cause = self.errno, self.cause
        return error


class StoreAccessError(ObjectStoreError, PermissionError):
    """Credentials refused or missing (also a ``PermissionError``)."""


class StoreConnectionError(ObjectStoreError, ConnectionError):
    """The endpoint cannot be reached (also a ``ConnectionError``)."""


class StoreTimeoutError(ObjectStoreError, TimeoutError):
    """The server did not answer within the client's timeouts and retries (also a ``TimeoutError``)."""


NOTICE_S = 5.0
"""A request that has waited this long logs one line (requests due within ``_TOGETHER_S`` of it: the same line)."""
_TOGETHER_S = 0.5
S3_RETRIES = {"mode": "standard", "total_max_attempts": 3}
"""botocore's retries for shardbridge's S3 clients, each key unless the user set it."""
S3FS_OWN_RETRIES = 5
"""s3fs's retry loop around botocore's (its class default): replaced by 1 try."""
_SETTINGS = "fsspec's S3 config (fsspec.config.conf['s3'], or the FSSPEC_S3 variable)"
_CAUSES = (  # (cause, botocore error codes and exception class names)
    ("credentials", {"NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError", "InvalidAccessKeyId",
                     "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken", "TokenRefreshRequired"}),
    ("denied", {"AccessDenied", "AllAccessDisabled"}),
    ("forbidden", {"403"}),
    ("bucket", {"NoSuchBucket"}),
    ("unreachable", {"EndpointConnectionError", "ConnectTimeoutError", "ProxyConnectionError", "SSLError",
                     "ClientConnectorError"}),
    ("unanswered", {"ReadTimeoutError", "ConnectionClosedError", "ServerTimeoutError", "FSTimeoutError", "TimeoutError"}),
    ("server", {"SlowDown", "InternalError", "ServiceUnavailable", "500", "502", "503", "504"}),
    ("request", {"ParamValidationError", "InvalidBucketName"}),
)  # fmt: skip
_FIX = {
    "credentials": "no valid credentials for the S3 server at {endpoint} ({detail}); set them: AWS_ACCESS_KEY_ID / "
    "AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or key / secret in " + _SETTINGS,
    "denied": "access denied ({detail}): the credentials in use may not access it; check the bucket's policy and "
    "the credentials' IAM policy",
    "forbidden": "the S3 server at {endpoint} refused access ({detail}): the credentials are wrong, or a bucket or "
    "IAM policy denies them this object; check both",
    "bucket": "the bucket {bucket!r} does not exist at {endpoint} ({detail}); check the bucket name in the path, or "
    "create the bucket",
    "unreachable": "cannot connect to the S3 endpoint {endpoint} ({detail}); check AWS_ENDPOINT_URL (or "
    "client_kwargs.endpoint_url in " + _SETTINGS + ") and the network",
    "unanswered": "the S3 server at {endpoint} did not answer ({detail}) within the client's bound ({bound}); it is "
    "stopped or overloaded. A slow server: raise read_timeout / retries in config_kwargs of " + _SETTINGS,
    "server": "the S3 server at {endpoint} kept failing ({detail}) after every attempt ({bound}); retry later, or "
    "raise retries in config_kwargs of " + _SETTINGS,
}
_CLASS = {"credentials": StoreAccessError, "denied": StoreAccessError, "forbidden": StoreAccessError,
          "unreachable": StoreConnectionError, "unanswered": StoreTimeoutError}  # fmt: skip
_S3_KEYS = ("key", "secret", "token", "endpoint_url", "client_kwargs", "config_kwargs", "s3_additional_kwargs", "anon",
            "use_ssl", "requester_pays", "version_aware", "profile", "session", "cache_regions")  # fmt: skip


def client_options(scheme: str) -> dict[str, Any]:
    """The storage options shardbridge passes to fsspec for ``scheme``: the user's S3 settings, defaults filled in.

    Raises:
        ValueError: a setting that cannot take effect, named with the fix.
    """
    options: dict[str, Any] = {"use_listings_cache": False}  # another process's commit must be seen at once
    if scheme not in ("s3", "s3a"):
        return options
    import fsspec.config
    from botocore.config import Config

    raw = os.environ.get("FSSPEC_S3")
    if raw is not None and not isinstance(_json(raw), dict):
        raise ValueError(f"FSSPEC_S3={raw!r} is not a JSON object, so fsspec ignores it; write it as JSON, e.g. "
                         """FSSPEC_S3='{"config_kwargs": {"read_timeout": 60}}'""")  # fmt: skip
    user = {**fsspec.config.conf.get("s3a", {}), **fsspec.config.conf.get("s3", {})}  # s3fs's protocols
    config = dict(user.get("config_kwargs") or {})
    for key, value in config.items():
        close = difflib.get_close_matches(key, list(Config.OPTION_DEFAULTS), n=1)
        if key not in Config.OPTION_DEFAULTS:
            raise ValueError(f"config_kwargs key {key!r} of {_SETTINGS} is not a botocore Config setting"
                             f"{f' (did you mean {close[0]!r}?)' if close else ''}; fix or remove it")  # fmt: skip
        if key in ("connect_timeout", "read_timeout") and (type(value) not in (int, float) or value <= 0):
            raise ValueError(f"config_kwargs {key}={value!r} of {_SETTINGS} must be a number of seconds > 0")
    retries, own = dict(config.get("retries") or {}), _botocore_settings(user.get("profile"))
    if "mode" not in retries and own["retry_mode"] is None:
        retries["mode"] = S3_RETRIES["mode"]
    if not {"max_attempts", "total_max_attempts"} & set(retries) and own["max_attempts"] is None:
        retries["total_max_attempts"] = S3_RETRIES["total_max_attempts"]
    return {**options, "config_kwargs": {**config, "retries": retries}}


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _botocore_settings(profile: str | None) -> dict[str, Any]:
    """The retry settings the user gave botocore itself (AWS_MAX_ATTEMPTS / AWS_RETRY_MODE, the profile's)."""
    import botocore.session

    try:
        scoped = botocore.session.Session(profile=profile).get_scoped_config()
    except Exception:  # noqa: BLE001 (a broken profile: the client's creation names it)
        scoped = {}
    return {k: os.environ.get(f"AWS_{k.upper()}") or scoped.get(k) for k in ("max_attempts", "retry_mode")}


def settings_error(exc: Exception) -> ValueError:
    """The error for a client that cannot be made from the user's settings (a ``TypeError`` of s3fs ...)."""
    text = (str(exc).strip().splitlines() or [""])[0]
    name = re.search(r"keyword argument '(\w+)'", text)
    close = difflib.get_close_matches(name[1], _S3_KEYS, n=1) if name else []
    return ValueError(
        f"the S3 client settings are invalid ({type(exc).__name__}: {text})"
        f"{f' (did you mean {close[0]!r}?)' if close else ''}; fix them in {_SETTINGS} or the AWS_* variables"
    )


def request_bound(fs: Any) -> tuple[float, str]:
    """The longest one request of ``fs``'s S3 client can wait unanswered, and how it adds up.

    Backoff: botocore's jittered exponential backoff at its largest (1 s, 2 s, 4 s ..., at most 20 s).
    """
    config = fs.s3.meta.config
    retries = config.retries or {}
    attempts = int(retries.get("total_max_attempts") or (5 if retries.get("mode", "legacy") == "legacy" else 3))
    tries, connect, read = max(1, int(getattr(fs, "retries", 1))), float(config.connect_timeout), float(config.read_timeout)
    backoff = sum(min(2.0**k, 20.0) for k in range(attempts - 1))
    how = f"{attempts} attempt(s) x (connect_timeout {connect:g} s + read_timeout {read:g} s) + {backoff:g} s backoff"
    return tries * (attempts * (connect + read) + backoff), how if tries == 1 else f"{tries} x ({how})"


def describe_bound(fs: Any) -> str:
    try:
        seconds, how = request_bound(fs)
    except Exception:  # noqa: BLE001 (not an S3 client)
        return "the client's timeouts and retries"
    return f"about {seconds:.0f} s: {how}"


def endpoint(fs: Any) -> str:
    try:
        return str(fs.s3.meta.endpoint_url)
    except Exception:  # noqa: BLE001 (no S3 client)
        return "the store"


def store_error(exc: BaseException, fs: Any, uri: str, bucket: str) -> Exception | None:
    """The error of [Note: object-store errors] for ``exc`` raised on ``uri``; None: an error of the object."""
    seen: BaseException | None = exc
    for _ in range(8):  # the chain: s3fs translates botocore's errors, keeping them as the cause
        if seen is None:
            return None
        error = (getattr(seen, "response", None) or {}).get("Error") or {}
        code, names = str(error.get("Code") or ""), {c.__name__ for c in type(seen).__mro__}
        cause = next((cause for cause, marks in _CAUSES if code in marks or names & marks), None)
        if cause is not None:
            break
        seen = seen.__cause__ or seen.__context__
    else:
        return None
    text = error.get("Message") or (str(seen).strip().splitlines() or [""])[0]
    detail = f"{code or type(seen).__name__}: {text}".rstrip(": ")
    if cause == "request":
        return ValueError(f"{uri}: the S3 client refused the request ({detail}); check the bucket and key in the path")
    kind = _CLASS.get(cause, ObjectStoreError)
    bound = describe_bound(fs) if cause in ("unanswered", "server") else ""
    found = kind(f"{uri}: " + _FIX[cause].format(endpoint=endpoint(fs), detail=detail, bucket=bucket, bound=bound))
    found.errno = {StoreAccessError: errno.EACCES, StoreTimeoutError: errno.ETIMEDOUT}.get(kind, errno.EIO)
    found.cause = cause
    return found


class Waits:
    """The S3 requests of one filesystem in flight: one log line for each that has waited ``NOTICE_S``.

    botocore handlers (:meth:`begin` on ``before-call``, :meth:`end` after the call or its error)
    bracket each request with its retries; one daemon thread sleeps until the next is due.
    """

    def __init__(self, fs: Any) -> None:
        self._fs = fs
        self._cond = threading.Condition()
        self._open: dict[object, list[Any]] = {}  # token -> [start, what, said]
        self._thread: threading.Thread | None = None

    def name(self, params: Any = None, model: Any = None, context: Any = None, **_: Any) -> None:
        """``before-parameter-build``: what the request is, for the line (the call may still be refused)."""
        if isinstance(context, dict) and isinstance(params, dict):
            what = f"{getattr(model, 'name', 'a request')} s3://{params.get('Bucket', '')}/{params.get('Key', '')}"
            context["shardbridge_what"] = what.rstrip("/")

    def begin(self, context: Any = None, **_: Any) -> None:
        """``before-call``: the request is about to be sent (validated, signed next)."""
        if not isinstance(context, dict):
            return
        token = context["shardbridge_wait"] = object()
        with self._cond:
            self._open[token] = [time.monotonic(), context.get("shardbridge_what", "a request"), False]
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="shardbridge-s3-waits", daemon=True)
                self._thread.start()
            self._cond.notify()

    def end(self, context: Any = None, **_: Any) -> None:
        token = context.pop("shardbridge_wait", None) if isinstance(context, dict) else None
        with self._cond:
            self._open.pop(token, None)

    def _run(self) -> None:
        while True:
            with self._cond:
                now = time.monotonic()
                pending = [w for w in self._open.values() if not w[2]]
                due = []
                if pending and now - min(w[0] for w in pending) >= NOTICE_S:
                    # requests sent together (a save's first reads go at once) wait together: one line
                    due = [w for w in pending if now - w[0] >= NOTICE_S - _TOGETHER_S]
                for wait in due:
                    wait[2] = True
                later = [w[0] + NOTICE_S - now for w in self._open.values() if not w[2]]
                if not due:
                    self._cond.wait(timeout=max(0.05, min(later)) if later else None)
                    continue
            start, what, _ = min(due, key=lambda w: w[0])
            more = f" and {len(due) - 1} more request(s)" if len(due) > 1 else ""
            logger.warning("shardbridge.checkpoint: waiting for the S3 server at %s to answer %s%s (%.0f s so far); "
                           "without an answer it fails after %s", endpoint(self._fs), what, more, now - start,
                           describe_bound(self._fs))  # fmt: skip
