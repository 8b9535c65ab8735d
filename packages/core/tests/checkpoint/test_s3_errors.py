"""Object-store errors against a real S3 server (moto's): each cause named by every verb with its fix, never
taken for damage, and a server that stops answering ends every verb within the documented bound.

[Note: object-store errors] and [Note: object-store client settings] in ``storage/_store.py``. Generated:
each cause x each verb (``fault_child.verbs``: the API's save, load, load_latest, latest, verify, inspect,
export and the CLI's ckpt verify / inspect / export). The default suite runs every cause on 3 verbs (a
different 3 per cause, every verb covered; the missing extra in a child) and the stopped server for one verb
(``ckpt verify``, in a child, as a user sees it); ``SHARDBRIDGE_S3_FAULTS=all`` (``nox -s s3``) every cause x
every verb, the stopped server for every verb, and once under the defaults a user gets (no override). Each
test prints its counts (``pytest -s``).
"""

from __future__ import annotations

import json
import os
import re
import socket
import urllib.request

import fault_child
import pytest
import s3fs
from fsspec.config import conf as fsspec_conf
from shardbridge import checkpoint as ck
from shardbridge.checkpoint.storage._location import locate
from test_faults import _record, _report, _run
from test_s3_faults import _settled

FULL = os.environ.get("SHARDBRIDGE_S3_FAULTS") == "all"
VERBS = list(fault_child.verbs(dict.fromkeys(("root", "ckpt", "new", "out"), ""), None))
DEFAULT_BOUND_S = 63  # docs/checkpoints.md, Object stores: 3 attempts x (5 s + 15 s) + 3 s backoff
STOPPED_TIMEOUT_S = 10.0
"""The client's timeouts where a test stops the server (elsewhere the server's 60 s): an error in seconds,
and twice NOTICE_S (5 s), so that the line a user sees while a request waits is always due."""
SLACK_S = 10  # a loaded machine: scheduling, the CLI's own reads before its first request
__all__ = ["_stop_zygote"]  # the zygote of test_faults.py, stopped after this module too
from test_faults import _stop_zygote  # noqa: E402


def _bound(fs) -> float:
    """The longest one request can wait unanswered, from the effective client (an oracle independent of
    shardbridge's own ``request_bound``): attempts x (connect + read) + botocore's largest backoff."""
    config = fs.s3.meta.config
    attempts = config.retries.get("total_max_attempts", 5 if config.retries.get("mode") == "legacy" else 3)
    backoff = sum(min(2**k, 20) for k in range(attempts - 1))
    return fs.retries * (attempts * (config.connect_timeout + config.read_timeout) + backoff)


def test_the_default_client_settings_bound_every_request(monkeypatch):
    """What a user gets without settings: connect 5 s, read 15 s, 3 attempts (botocore's standard mode),
    s3fs's own loop 1 try: 63 s at most per request (before: s3fs's 5 tries x botocore's 5 legacy attempts x
    20 s = 575 s; 330 s measured hanging `ckpt verify`). The user's settings win, from fsspec's config or
    botocore's own variables."""
    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 5)  # s3fs's own default (use_server lowered it)
    for name in ("FSSPEC_S3", "AWS_MAX_ATTEMPTS", "AWS_RETRY_MODE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setitem(fsspec_conf, "s3", {"client_kwargs": {"endpoint_url": "http://127.0.0.1:9"}})
    fs = locate("s3://sb-defaults/run").backend.fs
    config = fs.s3.meta.config
    assert (config.connect_timeout, config.read_timeout, config.retries, fs.retries) == (
        5, 15, {"mode": "standard", "total_max_attempts": 3}, 1)  # fmt: skip
    assert _bound(fs) == DEFAULT_BOUND_S
    monkeypatch.setitem(fsspec_conf, "s3", {"client_kwargs": {"endpoint_url": "http://127.0.0.1:9"},
                                            "config_kwargs": {"read_timeout": 60, "retries": {"mode": "adaptive"}}})  # fmt: skip
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "7")
    config = locate("s3://sb-defaults/run").backend.fs.s3.meta.config
    assert (config.read_timeout, config.retries) == (60, {"mode": "adaptive", "total_max_attempts": 7})


# -- each cause x each verb ------------------------------------------------------------------------


def _verbs(cause: str) -> list[str]:
    """``nox -s s3``: every verb; CI: 3, a different 3 per cause (11 causes x 3: every verb 3 times or more)."""
    start = 3 * list(CAUSES).index(cause)
    return VERBS if FULL else [VERBS[(start + k) % len(VERBS)] for k in range(3)]


def _paths(root: str, tmp_path) -> dict[str, str]:
    return {"root": root, "ckpt": str(ck.step_dir(root, 1)), "new": str(ck.step_dir(root, 2)), "out": str(tmp_path / "hf")}


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _auth(server, count: str) -> None:
    """moto's own switch: every request after ``count`` more must carry credentials of an IAM user."""
    request = urllib.request.Request(f"{server.endpoint}/moto-api/reset-auth", data=count.encode(), method="POST",
                                     headers={"Content-Type": "text/plain"})  # fmt: skip
    urllib.request.urlopen(request, timeout=30).close()  # noqa: S310 (our own server)


def _iam_key(server) -> str:
    import boto3

    iam = boto3.client("iam", endpoint_url=server.endpoint, aws_access_key_id="testing",
                       aws_secret_access_key="testing", region_name="us-east-1")  # fmt: skip
    iam.create_user(UserName="sb-user")
    return iam.create_access_key(UserName="sb-user")["AccessKey"]["AccessKeyId"]


def _with(server, **change) -> dict:
    conf = {**server.fsspec_conf(), **change}
    return {k: v for k, v in conf.items() if v is not None}


# cause: (how it is set up, what every verb's error must say)
CAUSES = {
    "no credentials": ("none", r"no valid credentials for the S3 server at http://127\.0\.0\.1:\d+ \(NoCredentialsError"),
    "unknown access key": ("auth", r"no valid credentials .*InvalidAccessKeyId|the credentials are wrong, or a bucket or IAM"),
    "wrong secret": ("secret", r"no valid credentials .*SignatureDoesNotMatch|the credentials are wrong, or a bucket or IAM"),
    "a bucket policy denies": ("policy", r"access denied \(AccessDenied|the credentials are wrong, or a bucket or IAM"),
    "endpoint unreachable": ("port", r"cannot connect to the S3 endpoint http://127\.0\.0\.1:\d+ \(EndpointConnectionError"),
    "bucket missing": ("bucket", r"the bucket 'sb-no-such-bucket' does not exist at http://127\.0\.0\.1:\d+ \(NoSuchBucket"),
    "s3 extra missing": ("extra", r"""needs fsspec's 's3' filesystem: pip install "s3fs>="""),
    "a misspelled setting": ("conf", r"config_kwargs key 'read_timout' of fsspec's S3 config .* \(did you mean 'read_timeout'\?\)"),
    "a setting of the wrong type": ("type", r"config_kwargs read_timeout='5' of fsspec's S3 config .* must be a number"),
    "a misspelled client setting": ("top", r"the S3 client settings are invalid .*'endpoint'.* \(did you mean 'endpoint_url'\?\)"),
    "FSSPEC_S3 not JSON": ("json", r"FSSPEC_S3='\{read_timeout: 5\}' is not a JSON object, so fsspec ignores it"),
}  # fmt: skip


@pytest.mark.parametrize("cause", list(CAUSES))
def test_each_cause_is_named_by_every_verb(s3_server, s3_root, tmp_path, monkeypatch, cause):
    """Before: ``ckpt verify`` itself said "cannot read checkpoint ...; it may be damaged: run `shardbridge
    ckpt verify`" for a bad setting and a missing extra, wrong credentials got "make it readable by this
    user", and ``latest`` of a missing bucket returned None (training silently starting from scratch)."""
    how, want = CAUSES[cause]
    paths = _paths(s3_root, tmp_path)
    ck.save(paths["ckpt"], model=fault_child.build(1.0, 1), step=1)
    bucket = s3_root.split("/")[2]
    if how == "bucket":
        paths = _paths("s3://sb-no-such-bucket/ckpt", tmp_path)
    conf = {
        "none": _with(s3_server, key=None, secret=None),
        "secret": _with(s3_server, key=_iam_key(s3_server) if how == "secret" else None, secret="wrong"),
        "port": _with(s3_server, client_kwargs={"endpoint_url": f"http://127.0.0.1:{_closed_port()}"},
                      config_kwargs={"retries": {"total_max_attempts": 1}}),  # refused at once: no backoff to wait
        "conf": _with(s3_server, config_kwargs={"read_timout": 5}),
        "type": _with(s3_server, config_kwargs={"read_timeout": "5"}),
        "top": _with(s3_server, endpoint=s3_server.endpoint),
    }.get(how)
    if conf is not None:
        monkeypatch.setitem(fsspec_conf, "s3", conf)
    if how == "none":
        for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE"):
            monkeypatch.delenv(name, raising=False)
        for name in ("AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE"):
            monkeypatch.setenv(name, "/nonexistent")
        monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    if how == "json":
        monkeypatch.setenv("FSSPEC_S3", "{read_timeout: 5}")
    if how == "policy":
        from test_s3 import _set_policy

        resource = [f"arn:aws:s3:::{bucket}", f"arn:aws:s3:::{bucket}/*"]
        _set_policy(s3_server, bucket, {"Version": "2012-10-17", "Statement": [
            {"Effect": "Deny", "Principal": "*", "Action": "s3:*", "Resource": resource}]})  # fmt: skip
    if how in ("auth", "secret"):
        _auth(s3_server, "0")
    try:
        if how == "extra":
            done = _run({"mode": "verbs", "root": s3_root, "verbs": _verbs(cause), "paths": paths, "block": ["s3fs"],
                         "s3_env": s3_server.client_env()})[0]["verbs"]  # fmt: skip
        else:
            model = fault_child.build(1.0, 1)
            table = fault_child.verbs(paths, model)
            done = {name: fault_child.outcome(name, table[name]) for name in _verbs(cause)}
    finally:
        if how in ("auth", "secret"):
            _auth(s3_server, "inf")
        if how == "policy":
            import boto3

            boto3.client("s3", endpoint_url=s3_server.endpoint, aws_access_key_id="testing",
                         aws_secret_access_key="testing", region_name="us-east-1").delete_bucket_policy(Bucket=bucket)  # fmt: skip
    test = "S3: each cause x each verb"
    for verb, result in done.items():
        error = result.get("error")
        assert error is not None, (cause, verb, result)  # silent: returned (latest -> None ...)
        assert re.search(want, error) and "damaged" not in error and "\n" not in error, (cause, verb, error)
        _record(test, "refused by name")
    _report(test)
    assert not os.path.exists(paths["out"])  # nothing exported


# -- a server that stops answering ---------------------------------------------------------------


def _stopped(s3_server, s3_root, tmp_path, verbs: list[str], env: dict[str, str]) -> dict:
    paths = _paths(s3_root, tmp_path)
    ck.save(paths["ckpt"], model=fault_child.build(1.0, 1), step=1)
    try:
        return _run({"mode": "verbs", "root": s3_root, "verbs": verbs, "paths": paths, "stop_server": True,
                     "stop_server_at": -1, "server_pid": s3_server.proc.pid, "s3_env": env},
                    timeout=len(verbs) * (DEFAULT_BOUND_S + 60))[0]["verbs"]  # fmt: skip
    finally:
        s3_server.resume()
        _settled(s3_root)


def _check_stopped(done: dict, bound: float) -> None:
    test = "S3: the server stopped at a verb's first request"
    for verb, result in done.items():
        error, seconds = result.get("error"), result["seconds"]
        assert error is not None and re.search(r"s3://\S+: the S3 server at http://127\.0\.0\.1:\d+ did not answer "
                                               r"\(ReadTimeoutError", error), (verb, result)  # fmt: skip
        assert "damaged" not in error and seconds <= bound + SLACK_S, (verb, seconds, bound, error)
        # the line a user sees while it waits ([Note: object-store client settings]): due at 5 s, before
        # every timeout here
        assert re.search(r"waiting for the S3 server at http://\S+ to answer \w+ s3://", result["stderr"]), result
        # the bound is waited out once per verb, not once per object (a load reads the manifest twice)
        assert result["stderr"].count("waiting for the S3 server") <= 1, (verb, result["stderr"])
        _record(test, f"{verb}: refused by name in {seconds:.0f} s (bound {bound:.0f} s)")
    _report(test)


def test_a_stopped_server_ends_every_verb_with_a_named_error_within_the_bound(s3_server, s3_root, tmp_path, monkeypatch):
    """SIGSTOP at each verb's first request, with the timeouts set where the docs say (fsspec's S3 config:
    10 s here): a one-line error naming the server and the bound, within the bound computed
    from the effective client config, and a line on stderr while it waits. Before: s3fs's and botocore's
    retries multiplied (a stopped server hung `ckpt verify` 330 s and more, in silence)."""
    env = s3_server.client_env(timeout_s=STOPPED_TIMEOUT_S)
    monkeypatch.setitem(fsspec_conf, "s3", json.loads(env["FSSPEC_S3"]))  # the child's settings, for the oracle
    bound = _bound(locate(s3_root).backend.fs)
    monkeypatch.undo()
    _check_stopped(_stopped(s3_server, s3_root, tmp_path, VERBS if FULL else ["cli verify"], env), bound)


@pytest.mark.skipif(not FULL, reason="about 50 s: SHARDBRIDGE_S3_FAULTS=all (nox -s s3)")
def test_a_stopped_server_ends_ckpt_verify_within_the_default_bound(s3_server, s3_root, tmp_path):
    """No override at all: what a user gets (63 s at most; about 48 s: 3 x 15 s read timeouts + backoff)."""
    env = s3_server.client_env()
    env["FSSPEC_S3"] = json.dumps({k: v for k, v in s3_server.fsspec_conf().items() if k != "config_kwargs"})
    done = _stopped(s3_server, s3_root, tmp_path, ["cli verify"], env)
    assert "about 63 s: 3 attempt(s) x (connect_timeout 5 s + read_timeout 15 s) + 3 s backoff" in done["cli verify"]["error"]
    _check_stopped(done, DEFAULT_BOUND_S)
