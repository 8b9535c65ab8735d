"""Faults against a real S3-compatible server (moto's, over HTTP): kill -9 mid-upload, the server
stopped mid-save, at random points of save loops.

Every trial ends with the checks of ``test_faults.py``, for an object store ([Note: object-store
commit] in ``storage/_fsspec.py``): ``latest()`` returns the last good checkpoint (a save that
returned is never lost), it verifies and loads the values its manifest says, the failing
operation ended in an error naming what failed (or the death we caused) and never hung, and the
next saves succeed and leave nothing behind: every object under the root belongs to a committed
checkpoint (its manifest and the generation it names). Damaged, truncated, missing and foreign
objects and a bucket without write permission are in ``test_s3.py``.

The default suite runs a few trials; ``SHARDBRIDGE_S3_FAULTS=all`` (``nox -s s3``) the matrix.
Each test prints its outcome counts (``pytest -s``); docs/checkpoints.md (Reliability) quotes them.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import time

import pytest
from shardbridge import checkpoint as ck
from shardbridge.checkpoint.storage._location import locate, open_checkpoint
from test_faults import NEXT_STEP, _label_error, _loaded_value, _record, _report, _run, _save, _stop_zygote, _wait_for

FULL = os.environ.get("SHARDBRIDGE_S3_FAULTS") == "all"
STOPPED_TIMEOUT_S = 3.0
"""The client's timeouts where a test stops the server: an error in seconds (elsewhere the server's 60 s)."""
__all__ = ["_stop_zygote"]  # the zygote of test_faults.py, stopped after this module too


_LOCK = re.compile(r"^\.(?P<name>[^/]+)\.lock-(?P<generation>g-[0-9a-f]{16})$")


def _leftovers(root: str) -> tuple[list[str], list[str]]:
    """Objects under ``root`` that no committed checkpoint's manifest accounts for; and the generations
    of dead saves recovery keeps with their locks because they may be committed (they hold
    ``.metadata``: [Note: object-store commit] in ``storage/_fsspec.py``)."""
    where = locate(root)
    listed = where.backend.listing(where.path)
    locks = {name: "/".join(m.groups()) for name in listed if (m := _LOCK.match(name))}
    kept = sorted(g for g in locks.values() if f"{g}/.metadata" in listed)
    stray = []
    for name in sorted(listed):
        parts = name.split("/")
        if locks.get(name) in kept or "/".join(parts[:2]) in kept:
            continue
        if len(parts) >= 2 and parts[1] == "shardbridge.json":
            continue
        if len(parts) >= 3:
            try:
                stored, _ = open_checkpoint(where.child(parts[0]))
            except ValueError:
                stray.append(name)
                continue
            if stored.prefix == parts[1] + "/":
                continue
        stray.append(name)
    return stray, kept


def _check_root(root: str, allowed: dict[str, set[float]], *, at_least: float | None, overwrite_name: str | None) -> str:
    path = ck.latest(root)
    if path is None:
        assert at_least is None, f"a save that returned (value {at_least}) was lost"
        label = "no checkpoint yet"
    else:
        name = path.rsplit("/", 1)[1]
        assert name in allowed, path
        assert ck.verify(path).ok, ck.verify(path)
        value = _loaded_value(path)
        assert value in allowed[name], (path, value, allowed)
        if at_least is not None:
            assert value >= at_least, f"a save that returned (value {at_least}) was lost: latest has {value}"
        label = "latest is the last save" if at_least is None or value == max(allowed[name]) else "latest is an older save"
    left = _leftovers(root)[0]
    # The next saves succeed and clean every leftover (the next save of an overwritten checkpoint
    # deletes its own dead generations; any save deletes those of dead saves' locks), but a dead
    # save's generation that may be committed (kept with its lock, until its checkpoint commits again).
    if overwrite_name is not None:
        _save_uri(f"{root}/{overwrite_name}", 98.0, overwrite=True)
    _save_uri(ck.step_dir(root, NEXT_STEP), 99.0)
    stray, kept = _leftovers(root)
    assert stray == [], stray
    assert ck.latest(root) == ck.step_dir(root, NEXT_STEP)
    listed = _leftovers_listing(root)
    for child in locate(root).backend.children(locate(root).path):
        if f"{child}/shardbridge.json" in listed or child not in {g.split("/")[0] for g in kept}:
            assert ck.verify(f"{root}/{child}").ok, child  # a kept generation alone is no checkpoint
    label += "; leftovers cleaned by the next save" if left else "; nothing left over"
    return label + (f"; {len(kept)} generation(s) kept: may be committed" if kept else "")


def _save_uri(uri: str, value: float, **kwargs) -> None:
    from test_faults import _model

    ck.save(uri, model=_model(value), step=int(value), extra={"value": value}, **kwargs)


def _killer(delay: float, victims):
    def kill(procs, out):
        _wait_for(out / "ready")
        time.sleep(delay)
        for rank in victims(len(procs)):
            procs[rank].kill()

    return kill


_LOOPS = [(1, "sync"), (2, "sync"), (1, "async"), (2, "async")] if FULL else [(1, "sync")]


@pytest.mark.parametrize(("world", "mode"), _LOOPS, ids=[f"{w}-{m}" for w, m in _LOOPS])
def test_kill_9_at_random_points_of_an_s3_save_loop(s3_server, s3_root, world, mode):
    """SIGKILL one rank or every rank at a random time while saving to S3 again and again (new
    checkpoints, or overwriting one): uploads cut off mid-object, the manifest PUT never sent."""
    rng = random.Random(4321 + world + (10 if mode == "async" else 0))
    trials = 8 if FULL else 2
    test = f"S3: kill -9 at random points ({world} rank(s), {mode} saves)"
    for trial in range(trials):
        overwrite = trial % 2 == 1
        root = f"{s3_root}/t{trial}"
        which = rng.choice(["all", "rank 0", "rank 1"]) if world > 1 else "all"
        victims = {"all": lambda n: range(n), "rank 0": lambda n: [0], "rank 1": lambda n: [1]}[which]
        results = _run(
            {
                "mode": "loop",
                "root": root,
                "overwrite": overwrite,
                "pg_timeout": 15,
                "async": mode == "async",
                "s3_env": s3_server.client_env(),
            },
            world=world,
            kill=_killer(rng.uniform(0.5, 3.0), victims),
        )
        done = results[0].get("done")
        survivors = [_label_error(r) for r in results if r["exitcode"] not in (-9, None)]
        names = {"step-00000000"} if overwrite else {f"step-{v:08d}" for v in range(1, (done or 0) + 2)}
        values = {float(done), float(done + 1)} if overwrite and done else {1.0} if overwrite else set()
        allowed = {n: values or {float(n.split("-")[1])} for n in names}
        label = _check_root(root, allowed, at_least=None if done is None else float(done),
                            overwrite_name="step-00000000" if overwrite else None)  # fmt: skip
        if done is None:
            label = "killed before the first save returned; " + label
        if survivors:
            label += f"; survivors {sorted(set(survivors))}"
        _record(test, f"killed {which} ({'overwrite' if overwrite else 'new steps'}) -> {label}")
    _report(test)


def _stopped_at(s3_server, root: str, k: int, overwrite: bool) -> dict:
    path = ck.step_dir(root, 1 if overwrite else 2)
    try:
        return _run(
            {"mode": "once", "root": root, "path": path, "step": 2, "value": 2.0, "overwrite": overwrite,
             "s3_env": s3_server.client_env(timeout_s=STOPPED_TIMEOUT_S if k else None), "stop_server_at": k,
             "server_pid": s3_server.proc.pid},
            timeout=120,
        )[0]  # fmt: skip
    finally:
        s3_server.resume()
        _settled(root)


def _settled(root: str) -> None:
    """Wait until requests the stopped server had queued (a PUT the child gave up on) have landed."""
    where = locate(root)
    where.backend.fs.invalidate_cache()
    before, deadline = None, time.monotonic() + 10
    while time.monotonic() < deadline:
        time.sleep(0.3)
        listing = sorted(where.backend.fs.find(where.path, withdirs=True))
        where.backend.fs.invalidate_cache()
        if listing == before:
            return
        before = listing


@pytest.mark.parametrize("overwrite", [False, True] if FULL else [False], ids=["new step", "overwrite"][: 2 if FULL else 1])
@pytest.mark.timeout(2400 if FULL else 600)  # every request: 18-26 cases of 10-40 s (client timeouts, 3 saves)
def test_the_server_stopped_before_each_request_of_a_save(s3_server, s3_root, overwrite):
    """The server stops answering (SIGSTOP) just before the save's k-th request, for every k: each
    request that gets no answer (a GET, a listing, the lock's PUT, an upload, the manifest's
    conditional PUT) ends the save within the client's timeouts with an error naming an s3://
    object, or the save returned; a request after the commit (the lock's DELETE, an overwritten
    generation's) never fails the save; the last good checkpoint stays latest and loads.

    The first PUT hung forever before [Note: no 100-continue] (aiohttp waited for "100 Continue").
    CI stops the first PUT (the lock's); ``SHARDBRIDGE_S3_FAULTS=all`` (nox -s s3) every request.
    """
    test = f"S3: the server stopped before each request of a save ({'overwrite' if overwrite else 'new step'})"
    _save(f"{s3_root}/count", 1, 1.0)
    counted = _stopped_at(s3_server, f"{s3_root}/count", 0, overwrite)
    assert counted.get("ok"), counted
    requests = counted["trace"]
    assert not [r for r in requests if r.endswith(" Expect")], requests  # [Note: no 100-continue]
    puts = [k for k, r in enumerate(requests, 1) if r.startswith("PUT")]
    assert len(puts) >= 3 and requests[puts[-1] - 1] == "PUT shardbridge.json", requests
    for k in range(1, len(requests) + 1) if FULL else (puts[0],):  # CI: the lock's
        root = f"{s3_root}/k{k}"
        _save(root, 1, 1.0)
        result = _stopped_at(s3_server, root, k, overwrite)
        assert result["trace"][:k] == requests[:k], (k, result["trace"], requests)  # the same request stopped
        if k > puts[-1]:  # after the commit point: cleanup only, the save returns (a warning)
            assert result.get("ok"), (requests[k - 1], result)
        else:  # the server stays stopped until the child ends: the save cannot have returned
            assert not result.get("ok"), (requests[k - 1], result)
            assert "s3://" in result["error"], result
            if k == puts[0]:
                assert ".lock-" in result["error"], result  # the stopped PUT is the one named
        name = ck.step_dir(root, 1 if overwrite else 2).rsplit("/", 1)[1]
        allowed = {"step-00000001": {1.0}, name: {1.0, 2.0} if overwrite else {2.0}}  # overwrite: name is step 1
        label = _check_root(root, allowed, at_least=2.0 if result.get("ok") else 1.0,
                            overwrite_name=name if overwrite else None)  # fmt: skip
        _record(test, f"stopped before {requests[k - 1].split()[0]}: {_label_error(result)} -> {label}")
    _report(test)


@pytest.mark.skipif(not FULL, reason="random stop times: SHARDBRIDGE_S3_FAULTS=all (nox -s s3); CI stops before each request")
def test_the_server_stopped_mid_save(s3_server, s3_root):
    """The S3 server stops answering (SIGSTOP) at a random point of a save: the save fails within the
    client's timeout with an error naming the object it was writing (or, stopped after the commit,
    returned); once the server answers again the last good checkpoint is latest and loads."""
    rng = random.Random(99)
    trials = 8 if FULL else 1
    test = "S3: the server stopped mid-save (SIGSTOP, resumed after the save ended)"
    for trial in range(trials):
        root = f"{s3_root}/p{trial}"
        _save(root, 1, 1.0)
        overwrite = trial % 2 == 1
        path = ck.step_dir(root, 1 if overwrite else 2)
        delay = rng.uniform(0.0, 1.5)

        def stop(procs, out, delay=delay):
            _wait_for(out / "ready")
            time.sleep(delay)
            s3_server.pause()

        try:
            results = _run(
                {"mode": "once", "root": root, "path": path, "step": 2, "value": 2.0, "overwrite": overwrite,
                 "s3_env": s3_server.client_env(timeout_s=STOPPED_TIMEOUT_S)},
                kill=stop,
                timeout=120,
            )  # fmt: skip
        finally:
            s3_server.resume()
            _settled(root)
        result = results[0]
        outcome = _label_error(result)
        if not result.get("ok"):
            assert "s3://" in result["error"], result  # the object (or checkpoint) it failed on is named
        name = path.rsplit("/", 1)[1]
        allowed = {"step-00000001": {1.0}, name: {1.0, 2.0} if overwrite else {2.0}}  # overwrite: name is step 1
        label = _check_root(root, allowed, at_least=2.0 if result.get("ok") else 1.0,
                            overwrite_name=name if overwrite else None)  # fmt: skip
        _record(test, f"{'overwrite' if overwrite else 'new step'}: {outcome} -> {label}")
    _report(test)


@contextlib.contextmanager
def _stale_manifest(path: str, previous: bytes | None):
    """Every GET / HEAD of ``path``'s manifest answers ``previous`` (None: 404), as a lagging replica or a
    caching proxy would after a commit: at aiobotocore's HTTP session, where every S3 client sends."""
    from aiobotocore.httpsession import AIOHTTPSession

    where = locate(path)
    bucket, key = f"{where.path}/shardbridge.json".split("/", 1)
    copy = f"stale-copies/{key}"
    if previous is not None:
        where.backend.fs.pipe_file(f"{bucket}/{copy}", previous)
    real, served = AIOHTTPSession.send, []

    async def send(self, request):
        url, _, query = request.url.partition("?")
        if request.method in ("GET", "HEAD") and url.endswith(f"/{bucket}/{key}"):
            request.url = url[: -len(key)] + (copy if previous is not None else "no-such/" + key) + ("?" + query if query else "")
            served.append(request.method)
        return await real(self, request)

    AIOHTTPSession.send = send
    try:
        yield served
    finally:
        AIOHTTPSession.send = real


@pytest.mark.parametrize("overwrite", [False, True], ids=["new step", "overwrite"])
def test_a_stale_manifest_read_never_deletes_a_committed_checkpoint(s3_server, s3_root, overwrite):
    """Issue 42: a save killed right after its manifest PUT is committed (it loads) and leaves its lock.
    The next save's recovery reads that manifest while the store still answers the previous version
    (404 for a new step): the committed generation is kept (it holds .metadata: it may be committed),
    the checkpoint still loads bit-exact, and once reads are fresh it is cleaned: its lock goes, and an
    overwrite's replaced generation with the next commit of it. Before, recovery deleted the committed
    generation "unless the manifest names it", on that one stale read."""
    root = f"{s3_root}/stale"
    first = ck.step_dir(root, 1)
    _save_uri(first, 1.0)
    path = ck.step_dir(root, 1 if overwrite else 2)
    fs = locate(root).backend.fs
    previous = fs.cat_file(f"{locate(path).path}/shardbridge.json") if overwrite else None
    result = _run({"mode": "once", "root": root, "path": path, "step": 2, "value": 2.0, "overwrite": overwrite,
                   "s3_env": s3_server.client_env(), "exit_after": "PUT shardbridge.json"})[0]  # fmt: skip
    assert result["exitcode"] == 9 and "error" not in result, result  # killed right after its commit point
    committed = open_checkpoint(locate(path))[0].data
    assert _lock_of(root, committed), _leftovers(root)  # the dead save's lock is left
    with _stale_manifest(path, previous) as served:
        _save_uri(ck.step_dir(root, 3), 3.0)  # the next save: its recovery meets the dead lock
        assert served, "the recovery did not read the manifest"
        if overwrite:
            assert _loaded_value(path) == 1.0  # the stale replica: readers see the old checkpoint meanwhile
    assert _loaded_value(path) == 2.0  # bit-exact: every element is the saved value
    assert fs.ls(committed.split("://")[-1]), "the committed generation was deleted"
    _save_uri(ck.step_dir(root, 4), 4.0)  # reads are fresh now: the lock of the committed save goes
    assert not _lock_of(root, committed) and _loaded_value(path) == 2.0
    if overwrite:  # the generation it replaced goes with the next commit of that checkpoint
        _save_uri(path, 5.0, overwrite=True)
    assert _leftovers(root) == ([], []), _leftovers(root)
    assert _loaded_value(path) == (5.0 if overwrite else 2.0) and ck.verify(path).ok
    test = "S3: a stale manifest read after a save killed at its commit"
    _record(test, f"{'overwrite' if overwrite else 'new step'}: committed step kept, loads bit-exact; cleaned once reads are fresh")
    _report(test)


def _lock_of(root: str, generation_uri: str) -> bool:
    name, generation = generation_uri.rsplit("/", 2)[-2:]
    return f".{name}.lock-{generation}" in _leftovers_listing(root)


def _leftovers_listing(root: str) -> dict:
    where = locate(root)
    return where.backend.listing(where.path)
