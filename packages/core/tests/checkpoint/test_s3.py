"""Checkpoints on an object store: a real S3-compatible server (moto's, over HTTP), s3fs as the client.

The representative slice of the default suite; ``nox -s s3`` adds the fault matrix
(``test_s3_faults.py``). Oracles: the source model's ``full_tensor()`` (``full_state``) and plain
DCP's own ``FsspecReader`` reading the stored generation. See [Note: object-store commit] in
``storage/_fsspec.py``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading

import pytest
import torch
import torch.distributed as dist
from ckpt_helpers import LAYOUTS, Mlp, assert_equal_states, build, full_state, save_losing_a_file_of_rank_1
from safetensors.torch import load as safetensors_load
from shardbridge import ParallelDims
from shardbridge import checkpoint as ck
from shardbridge.checkpoint import _async, _load
from shardbridge.checkpoint._verify import hash_share
from shardbridge.checkpoint.storage import _fsspec
from shardbridge.checkpoint.storage._location import locate, open_checkpoint
from shardbridge.testing import run_distributed
from shardbridge.testing._s3 import use_server
from torch import nn


def _fs(uri: str):
    return locate(uri).backend.fs


def _objects(uri: str) -> list[str]:
    where = locate(uri)
    return sorted(where.backend.listing(where.path))


def _generation(uri: str) -> str:
    stored, _ = open_checkpoint(locate(uri))
    return stored.backend.uri(stored.data)


def _plain_dcp(uri: str) -> dict[str, torch.Tensor]:
    """Plain DCP's FsspecReader reading the checkpoint's generation: every stored tensor, full."""
    import torch.distributed.checkpoint as dcp
    from shardbridge._compat import dcp_fsspec_classes
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    info = ck.inspect(uri)
    state = {t.name: torch.empty(t.shape, dtype=getattr(torch, t.dtype)) for t in info.tensors}
    dcp.load(
        state,
        storage_reader=dcp_fsspec_classes()[1](_generation(uri)),
        planner=DefaultLoadPlanner(allow_partial_load=True),
        no_dist=True,
    )
    return state


# -- round trips -----------------------------------------------------------------------------


def _save_4(env: dict[str, str], uri: str):
    use_server(env)
    model, opt = build(LAYOUTS["fsdp2_tp2"], fused=True)
    path = ck.save(uri, model=model, optimizer=opt, step=3, extra={"on": "s3"})
    assert path == uri
    state = full_state(model, opt)  # a collective: every rank
    return state if dist.get_rank() == 0 else None


def _load_4(env: dict[str, str], uri: str, layout: str):
    use_server(env)
    model, opt = build(LAYOUTS[layout], fused=True, seed=7, lr=0.5)
    state = ck.load(uri, model=model, optimizer=opt, rng=False)
    got = full_state(model, opt)
    return (got, state) if dist.get_rank() == 0 else None


def test_four_ranks_save_to_s3_and_reshard_bit_exact(s3_server, s3_root):
    """FSDP 2 x TP 2 (fused SwiGLU, AdamW) saved by 4 ranks to S3, loaded into FSDP 4 and into one
    process: bit-exact against the trained model, and what plain DCP's FsspecReader reads."""
    uri = ck.step_dir(s3_root, 3)
    env = s3_server.client_env()
    want = run_distributed(_save_4, env, uri, world_size=4)[0]
    got, state = run_distributed(_load_4, env, uri, "fsdp4", world_size=4)[0]
    assert_equal_states(got, want)
    assert (state.step, state.extra, state.path, state.world_size) == (3, {"on": "s3"}, uri, 4)
    model, opt = build(None, fused=True, seed=9, lr=0.5)
    ck.load(uri, model=model, optimizer=opt)
    assert_equal_states(full_state(model, opt), want)
    plain = _plain_dcp(uri)
    assert all(torch.equal(plain[k], want[k]) for k in want), [k for k in want if not torch.equal(plain[k], want[k])]
    gen = _generation(uri).removeprefix(uri + "/")
    names = _objects(uri)
    assert "shardbridge.json" in names and all(n == "shardbridge.json" or n.startswith(gen + "/") for n in names)
    assert ck.latest(s3_root) == uri and ck.verify(uri).ok


class _Requests:
    """The requests this process sends to the object store inside the block, counted at the backend:
    each call below is one request on S3 (``stream``: one GET however long; ``listing``: one LIST
    per 1,000 objects). ``sent``: (method, object, first byte, end) per call."""

    _METHODS = ("stream", "read_into", "read_bytes", "stat", "kind", "listing", "children")

    def __init__(self) -> None:
        self.sent: list[tuple[str, str, int, int]] = []
        self._real = {name: getattr(_fsspec.FsspecBackend, name) for name in self._METHODS}

    def __enter__(self) -> _Requests:
        for name, real in self._real.items():

            def counted(backend, path, *args, _name=name, _real=real):
                start = args[0] if args else 0
                end = args[1] if _name == "stream" else start + len(args[1]) if _name == "read_into" else -1
                self.sent.append((_name, path, start, end))
                return _real(backend, path, *args)

            setattr(_fsspec.FsspecBackend, name, counted)
        return self

    def __exit__(self, *exc: object) -> None:
        for name, real in self._real.items():
            setattr(_fsspec.FsspecBackend, name, real)

    def data_reads(self) -> list[tuple[str, str, int, int]]:
        return [r for r in self.sent if r[0] in ("stream", "read_into", "read_bytes") and r[1].endswith(".distcp")]


def _count_reads(env: dict[str, str], uri: str):
    """Load a 8192 x 512 weight saved by one process into 4 FSDP ranks, counting the requests."""
    use_server(env)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = nn.Linear(512, 8192, bias=False)
    fully_shard(model, mesh=init_device_mesh("cpu", (4,)))
    with _Requests() as requests:
        ck.load(uri, model=model, rng=False, verify=False)
    reads = requests.data_reads()
    return len(reads), sum(end - start for _, _, start, end in reads), model.weight.full_tensor()


def test_a_derived_load_on_s3_uses_the_derivation_and_reads_metadata_once(s3_server, s3_root, caplog):
    """[Note: derived loads]: rank 0 renders ``.metadata`` from the manifest and compares it with the
    object. The comparison once read one byte past the object's end to find it; S3 answers that with
    416, and every object-store load fell back to unpickling ``.metadata`` (a warning, one GET more)."""
    torch.manual_seed(0)
    source = nn.Linear(64, 256, bias=False)
    uri = ck.save(ck.step_dir(s3_root, 1), model=source)
    target = nn.Linear(64, 256, bias=False)
    before = len(s3_server.requests())
    with caplog.at_level("WARNING", logger="shardbridge.checkpoint"):
        ck.load(uri, model=target, rng=False, verify=False)  # verify=True: its hashing rank reads it whole too
    assert "does not give" not in caplog.text, caplog.text
    assert torch.equal(target.weight, source.weight)
    served = s3_server.requests()[before:]
    assert sum(r.startswith("GET ") and r.endswith("/.metadata") for r in served) == 1, served


def test_a_reshard_fetches_the_rows_each_rank_needs(s3_server, s3_root):
    """Bounded bytes and requests: each of 4 ranks fetches its quarter of the 16 MiB record, its zip
    head, and at most ``REMOTE_GAP`` bytes it does not need (a gap cheaper to read through than to
    ask for again), in at most 2 GETs (the head, the rows); never the whole object. The server's
    log agrees: as many GETs of the object as the ranks counted."""
    from shardbridge.checkpoint.storage._reader import REMOTE_GAP

    torch.manual_seed(0)
    source = nn.Linear(512, 8192, bias=False)
    uri = ck.save(ck.step_dir(s3_root, 1), model=source)
    record = 8192 * 512 * 4
    before = len(s3_server.requests())
    results = run_distributed(_count_reads, s3_server.client_env(), uri, world_size=4)
    for gets, fetched, weight in results:
        assert gets <= 2 and record // 4 <= fetched <= record // 4 + REMOTE_GAP + (4 << 10), (gets, fetched)
        assert torch.equal(weight, source.weight.detach())
    assert sum(fetched for _, fetched, _ in results) < 2 * record
    served = [r for r in s3_server.requests()[before:] if r.startswith("GET ") and r.endswith(".distcp")]
    assert len(served) == sum(gets for gets, _, _ in results), served


def _many_records(layout: dict[str, int]):
    """32 Linear(16, 16) with AdamW state under FSDP: ~190 records per rank's file."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(32)])
    fully_shard(model, mesh=ParallelDims(**layout).build_mesh("cpu").fsdp_mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    return model, opt


def _save_many(env: dict[str, str], uri: str):
    use_server(env)
    model, opt = _many_records({"dp_shard": 4})
    ck.save(uri, model=model, optimizer=opt)
    state = full_state(model, opt)
    return state if dist.get_rank() == 0 else None


def _load_many(env: dict[str, str], uri: str, layout: dict[str, int]):
    use_server(env)
    from shardbridge.checkpoint.storage import _reader

    model, opt = _many_records(layout)
    items, wanted = [], {}
    real = _reader.TrustedReader.read_data

    def read_data(self, plan, planner):
        items.extend(plan.items)
        for item in plan.items:  # the records the plan reads, each once: (file, offset) -> length
            info = self.storage_data[item.storage_index]
            wanted[(info.relative_path, info.offset)] = info.length
        return real(self, plan, planner)

    _reader.TrustedReader.read_data = read_data
    try:
        with _Requests() as requests:
            ck.load(uri, model=model, optimizer=opt, rng=False)
    finally:
        _reader.TrustedReader.read_data = real
    per_file = {}
    for (name, _), length in wanted.items():
        per_file[name] = per_file.get(name, 0) + length
    return requests.sent, len(items), full_state(model, opt), per_file


@pytest.mark.parametrize("layout", [{"dp_shard": 4}, {"dp_replicate": 2, "dp_shard": 2}], ids=["same", "hsdp"])
def test_a_load_reads_each_object_in_one_request(s3_server, s3_root, layout):
    """The request bound: a rank reading ~200 records (its own file's, hashing it whole, and the
    scalars every rank holds from the other ranks' files) sends one GET per data object it reads
    and a constant few more requests (the manifest, a listing, the small files it hashes), never
    one per record; the server's log counts the same GETs. Into the same layout and into HSDP
    2 x 2 (ranks 0 and 1 then read two ranks' boxes each, and ranks 2 and 3, their replicas, read
    no data object: [Note: reading once under replication]), bit-exact on every rank. The bytes
    too: from a data object a rank does not hash it fetches exactly the bytes of the records its
    plan reads (the scalars every rank reads lie side by side, not among another rank's shards:
    [Note: derived file layout]); and each rank reads the manifest twice (the first round's
    read, and the check that no commit replaced the checkpoint meanwhile)."""
    uri = ck.step_dir(s3_root, 1)
    env = s3_server.client_env()
    want = run_distributed(_save_many, env, uri, world_size=4)[0]
    before = len(s3_server.requests())
    results = run_distributed(_load_many, env, uri, layout, world_size=4)
    use_server(env)
    files = open_checkpoint(locate(uri))[1].files
    readers = 2 if "dp_replicate" in layout else 4
    for rank, (sent, records, state, wanted) in enumerate(results):
        data = [path for method, path, _, _ in sent if method in ("stream", "read_into") and path.endswith(".distcp")]
        assert sum(1 for _, p, _, _ in sent if p.endswith("/shardbridge.json")) == 2, sent
        hashed = hash_share(files, rank, readers) if rank < readers else {}
        for path in data:
            name = path.rsplit("/", 1)[-1]
            fetched = sum(b - a for m, p, a, b in sent if p == path)
            assert fetched == (files[name]["size"] if name in hashed else wanted[name]), (rank, name, fetched, wanted)
        assert_equal_states(state, want)
        if "dp_replicate" in layout and rank >= 2:
            assert records == 0 and data == [], (records, data)
            continue
        assert records >= 150, records  # what a request per record would cost
        assert len(data) == len(set(data)) <= 4 and any(p.endswith(f"/__{rank}_0.distcp") for p in data), data
        # (a reader of HSDP hashes its replica's share of the small files too: two more)
        assert len(sent) <= len(data) + (10 if "dp_replicate" in layout else 8), sent
    served = [r for r in s3_server.requests()[before:] if r.startswith("GET ") and r.endswith(".distcp")]
    assert len(served) == sum(
        1 for sent, _, _, _ in results for m, p, _, _ in sent if m in ("stream", "read_into") and p.endswith(".distcp")
    )


@pytest.mark.parametrize("how", ["missing", "short"])
def test_an_object_rank_0_does_not_see_is_refused_and_nothing_is_committed(s3_server, s3_root, how):
    """The object-store side of [Note: one directory for every rank]: one namespace for every
    machine, so only a lost or cut upload gets here; the commit's listing refuses it by name."""
    results = run_distributed(save_losing_a_file_of_rank_1, s3_server.client_env(), s3_root, "dcp", how,
                              world_size=2)  # fmt: skip
    seen = r"is missing \(its upload did not complete\)" if how == "missing" else r"has \d+ bytes, \d+ recorded"
    for outcome, _, latest, listing in results:  # every rank raises; no manifest, no generation left
        assert re.match(rf"OSError: \[Errno 5\] {re.escape(s3_root)}/step-00000001/g-[0-9a-f]{{16}}/__1_0\.distcp {seen}; nothing "
                        r"was committed", outcome), outcome  # fmt: skip
        assert latest is None and listing == []


def test_latest_verify_inspect_export_and_the_cli_take_uris(s3_server, s3_root, tmp_path, capsys):
    model = Mlp()
    first = ck.save(ck.step_dir(s3_root, 1), model=model, step=1)
    with torch.no_grad():
        model.up.weight.add_(1)
    second = ck.save(ck.step_dir(s3_root, 2), model=model, step=2)
    assert (first, second) == (f"{s3_root}/step-00000001", f"{s3_root}/step-00000002")
    assert ck.latest(s3_root) == second
    report = ck.verify(second)
    assert report.ok and report.path == second and report.num_files == 3
    info = ck.inspect(second)
    assert info.path == second and info.step == 2 and {t.name for t in info.tensors} >= {"model.up.weight"}
    index = ck.export_safetensors(second, s3_root + "-hf", progress=False)
    assert index == s3_root + "-hf/model.safetensors.index.json"
    shard = json.loads(_fs(index).cat_file(index))["weight_map"]["up.weight"]
    exported = safetensors_load(_fs(index).cat_file(f"{s3_root}-hf/{shard}"))
    assert torch.equal(exported["up.weight"], model.up.weight.detach())
    state = ck.load_latest(s3_root, model=Mlp())
    assert state.path == second
    # `shardbridge ckpt verify` in a fresh process without a process group, as a user runs it.
    command = [sys.executable, "-m", "shardbridge.cli._main", "ckpt", "verify", s3_root]
    env = {**os.environ, **s3_server.client_env()}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert f"{first}: 3 files" in done.stdout and f"{second}: 3 files" in done.stdout
    from shardbridge.cli._main import main

    assert main(["ckpt", "inspect", s3_root]) == 0
    assert capsys.readouterr().out.startswith(f"checkpoint {second}\n")
    assert main(["ckpt", "export", second, str(tmp_path / "hf"), "--no-progress"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "hf" / "model.safetensors.index.json")


# -- commit -----------------------------------------------------------------------------------


def test_overwrite_keeps_the_old_checkpoint_loadable_until_the_new_one_commits(s3_root, monkeypatch):
    """An overwrite whose manifest PUT is held back: the old checkpoint loads, whole, meanwhile; after
    the commit the new one loads and the old generation is gone."""
    uri = ck.step_dir(s3_root, 0)
    old = Mlp()
    ck.save(uri, model=old, step=1)
    old_generation = _generation(uri)
    go, waiting = threading.Event(), threading.Event()
    real = _fsspec.FsspecBackend._put_manifest

    def held(self, target, data):
        waiting.set()
        assert go.wait(60)
        return real(self, target, data)

    monkeypatch.setattr(_fsspec.FsspecBackend, "_put_manifest", held)
    new = Mlp()
    with torch.no_grad():
        for p in new.parameters():
            p.fill_(3.0)
    pending = ck.save(uri, model=new, step=2, overwrite=True, async_=True)
    assert waiting.wait(60)  # every new object is uploaded; the manifest is not written yet
    reader = Mlp()
    with monkeypatch.context() as other_job:  # a load of this process waits for its own save: read as another job
        other_job.setattr(_async, "settle", lambda: None)
        other_job.setattr(_load, "settle", lambda: None)
        assert ck.load(uri, model=reader, rng=False).step == 1
        assert all(torch.equal(a, b) for a, b in zip(reader.parameters(), old.parameters()))
        assert ck.latest(s3_root) == uri and ck.verify(uri).ok
    go.set()
    assert pending.wait() == uri
    assert ck.load(uri, model=reader, rng=False).step == 2
    assert all(torch.equal(p, torch.full_like(p, 3.0)) for p in reader.parameters())
    assert not any(n.startswith(old_generation.rsplit("/", 1)[1]) for n in _objects(uri))


def test_a_load_during_an_overwrite_by_another_job_reads_the_old_version(s3_root):
    """Another job's overwrite in progress (its generation uploaded, no manifest yet): loads and
    latest see the old checkpoint only; the new generation never mixes in."""
    uri = ck.step_dir(s3_root, 0)
    model = Mlp()
    ck.save(uri, model=model, step=1)
    where = locate(uri)
    target = where.backend.begin(where.path, overwrite=True)  # "job B", stopped before its commit
    where.backend.write_bytes(where.backend.join(target.data, "__0_0.distcp"), b"partial upload")
    got = Mlp()
    assert ck.load(uri, model=got).step == 1
    assert all(torch.equal(a, b) for a, b in zip(got.parameters(), model.parameters()))
    assert ck.verify(uri).ok and ck.latest(s3_root) == uri


def test_a_save_over_a_damaged_manifest_is_refused_before_any_rank_writes(s3_server, s3_root):
    """begin's first reads go at once: a damaged manifest found there still refuses the save at
    once, naming the damage (overwrite=True) or the checkpoint there (overwrite=False), instead of
    uploading every rank's files and failing at the commit."""
    use_server(s3_server.client_env())
    uri = ck.step_dir(s3_root, 1)
    where = locate(uri)
    _fs(uri).pipe(f"{where.path}/shardbridge.json", b"{ not json")
    with pytest.raises(ValueError, match="shardbridge.json is not valid JSON"):
        where.backend.begin(where.path, overwrite=True)
    with pytest.raises(ValueError, match="already exists"):
        where.backend.begin(where.path, overwrite=False)
    assert _objects(uri) == ["shardbridge.json"]  # no generation written, and no lock beside it:
    assert not [n for n in _fs(uri).ls(s3_root.removeprefix("s3://")) if ".lock-" in n]


def test_two_jobs_under_one_prefix_cannot_commit_a_mix(s3_root):
    """Job A begins a save of a new checkpoint; job B saves the same name and commits first: A's
    commit is refused (conditional PUT), A's generation is deleted, B's checkpoint is whole."""
    import dataclasses

    from shardbridge.checkpoint.storage._manifest import Manifest

    uri = ck.step_dir(s3_root, 5)
    where = locate(uri)
    backend = where.backend
    job_a = backend.begin(where.path, overwrite=False)
    backend.write_bytes(backend.join(job_a.data, ".metadata"), b"A")
    b_model = Mlp()
    ck.save(uri, model=b_model, step=5)
    manifest = Manifest(step=5, world_size=1, has_optimizer=False, files={".metadata": {"size": 1, "xxh3_128": "0" * 32}})
    with pytest.raises(FileExistsError, match="was committed by another process while this save was running"):
        backend.commit(job_a, dataclasses.replace(manifest))
    backend.abandon(job_a)
    assert not any(n.startswith(job_a.ident) for n in _objects(uri))
    got = Mlp()
    ck.load(uri, model=got)
    assert all(torch.equal(a, b) for a, b in zip(got.parameters(), b_model.parameters()))
    # An object another writer put into this save's generation is refused at the commit, by name.
    job_c = backend.begin(where.path, overwrite=True)
    backend.write_bytes(backend.join(job_c.data, "__9_0.distcp"), b"foreign")
    with pytest.raises(ValueError, match=rf"{job_c.ident}/__9_0.distcp was not written by this save"):
        backend.commit(job_c, dataclasses.replace(manifest, files={}))
    backend.abandon(job_c)
    assert ck.verify(uri).ok


# -- damage and permissions --------------------------------------------------------------------


def _damage(uri: str, how: str) -> str:
    """Damage the checkpoint's first data object; the name a problem carries."""
    stored, manifest = open_checkpoint(locate(uri))
    fs = stored.backend.fs
    gen = stored.prefix
    obj = stored.file("__0_0.distcp")
    data = fs.cat_file(obj)
    if how == "flip":
        fs.pipe_file(obj, data[:100] + bytes([data[100] ^ 1]) + data[101:])
    elif how == "truncate":
        fs.pipe_file(obj, data[:-7])
    elif how == "missing":
        fs.rm_file(obj)
    elif how == "foreign":
        fs.pipe_file(stored.file("__7_0.distcp"), data)
        return gen + "__7_0.distcp"
    elif how == "stray":
        fs.pipe_file(stored.backend.join(stored.path, "notes.txt"), b"x")
        return "notes.txt"
    return gen + "__0_0.distcp"


@pytest.mark.parametrize("how", ["flip", "truncate", "missing", "foreign", "stray"])
def test_a_damaged_object_is_named_and_the_last_good_checkpoint_loads(s3_root, how, capsys):
    good, bad = ck.step_dir(s3_root, 1), ck.step_dir(s3_root, 2)
    ck.save(good, model=Mlp(), step=1)
    ck.save(bad, model=Mlp(), step=2)
    name = _damage(bad, how)
    obj = f"{bad}/{name}"
    report = ck.verify(bad)
    assert not report.ok and [p.name for p in report.problems] == [name], report
    with pytest.raises(ValueError, match="is damaged") as info:
        ck.load(bad, model=Mlp())
    assert obj in str(info.value) and "\n" not in str(info.value)
    assert ck.load_latest(s3_root, model=Mlp()).path == good  # skipped (sizes) or failed its checksum
    assert ck.latest(s3_root) == (bad if how == "flip" else good)  # latest reads sizes, not checksums
    from shardbridge.cli._main import main

    assert main(["ckpt", "verify", bad]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and obj in err[0], err


def test_a_bucket_without_write_permission_names_the_object(s3_server, s3_root):
    """A bucket policy denies every PUT (moto enforces bucket policies: 403): the save raises one
    line naming the object; the previous checkpoint still loads; nothing new is visible."""
    bucket = s3_root.split("/")[2]
    good = ck.save(ck.step_dir(s3_root, 1), model=Mlp(), step=1)
    policy = {
        "Version": "2012-10-17",
        "Statement": [{"Effect": "Deny", "Principal": "*", "Action": "s3:PutObject", "Resource": f"arn:aws:s3:::{bucket}/*"}],
    }
    _set_policy(s3_server, bucket, policy)
    with pytest.raises(PermissionError) as info:
        ck.save(ck.step_dir(s3_root, 2), model=Mlp(), step=2)
    message = str(info.value)  # the first object the save writes: its lock, beside the checkpoint
    assert re.fullmatch(rf"{s3_root}/\.step-00000002\.lock-g-[0-9a-f]{{16}}: the S3 server at .* refused access "
                        r"\(403: Forbidden\): the credentials are wrong, or a bucket or IAM policy denies them this "
                        r"object; check both", message), message  # fmt: skip
    assert ck.latest(s3_root) == good
    assert ck.load(good, model=Mlp()).step == 1


def _set_policy(server, bucket: str, policy: dict) -> None:
    import boto3

    client = boto3.client("s3", **{k: v for k, v in _boto_kwargs(server).items()})
    client.put_bucket_policy(Bucket=bucket, Policy=json.dumps(policy))


def _boto_kwargs(server) -> dict:
    return {
        "endpoint_url": server.endpoint,
        "aws_access_key_id": "testing",
        "aws_secret_access_key": "testing",
        "region_name": "us-east-1",
    }


def test_async_save_uploads_in_the_background_and_its_error_names_the_object(s3_server, s3_root, monkeypatch):
    """``save(async_=True)`` returns while the upload is held back (training is blocked only for
    staging); a denied upload surfaces at ``wait()`` naming the object; the previous one stays."""
    bucket = s3_root.split("/")[2]
    good = ck.save(ck.step_dir(s3_root, 1), model=Mlp(), step=1)
    go = threading.Event()
    real = _fsspec.FsspecBackend.writing

    def held(self, path):
        assert go.wait(60)
        return real(self, path)

    monkeypatch.setattr(_fsspec.FsspecBackend, "writing", held)
    pending = ck.save(ck.step_dir(s3_root, 2), model=Mlp(), step=2, async_=True)
    assert not pending.done()  # returned with the upload still to run
    policy = {
        "Version": "2012-10-17",
        "Statement": [
            {"Effect": "Deny", "Principal": "*", "Action": "s3:PutObject", "Resource": f"arn:aws:s3:::{bucket}/*.distcp"}
        ],
    }
    _set_policy(s3_server, bucket, policy)
    go.set()
    with pytest.raises(OSError, match=r"writing 's3://.*/step-00000002/g-[0-9a-f]{16}/__0_0\.distcp'") as info:
        pending.wait()
    assert "Nothing was committed" in str(info.value)
    assert ck.latest(s3_root) == good and ck.wait() is None
