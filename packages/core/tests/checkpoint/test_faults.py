"""Fault injection: crashes, full and read-only disks, damaged files, racing jobs.

Every test checks the same four things after the fault ([Note: atomic commit] in
``storage/_local.py``, [Note: checkpoint integrity] in ``storage/_integrity.py``):

1. the last good checkpoint is intact and ``latest()`` returns it (a save that returned is
   never lost);
2. the failing operation ended in a clear error (an exception with a message, or a
   process death we caused), never a hang;
3. nothing is silently wrong: what ``latest()`` returns verifies and loads the values the
   manifest says (every parameter equals the saved ``value``);
4. nothing is left that breaks the next save, and that save cleans every leftover.

Saves run in children forked from a zygote process with torch preloaded (``fault_child.py``).
Each test prints its outcome counts (``pytest -s``); docs/checkpoints.md (Reliability)
quotes them. ``SHARDBRIDGE_FAULT_TRIALS=N`` multiplies the random-kill trials (``nox -s
faults`` runs x10).
"""

from __future__ import annotations

import collections
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from shardbridge import checkpoint as ck
from shardbridge.checkpoint.storage._local import LOCAL
from shardbridge.checkpoint.storage._manifest import MANIFEST_NAME
from shardbridge.checkpoint.storage._manifest import read_manifest as _read_manifest
from torch import nn

CHILD = str(Path(__file__).with_name("fault_child.py"))
SCALE = int(os.environ.get("SHARDBRIDGE_FAULT_TRIALS", "1"))
_TIMEOUT_S = 60.0
COUNTS: dict[str, collections.Counter] = {}


# --- helpers --------------------------------------------------------------------------------


def _model(value: float, width: int = 16) -> nn.Module:
    model = nn.Sequential(nn.Linear(width, width), nn.Linear(width, 4))
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    return model


NEXT_STEP = 10**7
"""The step of the "next save still works" check: beyond any step a save loop reaches (it wrote
past step 99 in a few seconds on an idle machine, and step 99 then already existed)."""


def _save(root: Path, step: int, value: float, **kwargs) -> Path:
    return ck.save(ck.step_dir(root, step), model=_model(value), step=step, extra={"value": value}, **kwargs)


def _loaded_value(path: Path, width: int = 16) -> float:
    """Load ``path`` (verify=True) and return the one value every parameter holds."""
    model = _model(-1.0, width)
    state = ck.load(path, model=model, rng=False)
    values = torch.cat([p.detach().flatten() for p in model.parameters()]).unique()
    assert len(values) == 1 and values.item() == state.extra["value"], (path, values, state.extra)
    return values.item()


def _hidden(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("."))


class _Child:
    def __init__(self, pid: int, exit_file: Path) -> None:
        self.pid, self.exit_file = pid, exit_file

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def stacks(self, out: Path, rank: int) -> str:
        """Every thread's Python stack of a hung child (faulthandler on SIGUSR1, see fault_child.py)."""
        path = out / f"stacks-{rank}"
        try:
            os.kill(self.pid, signal.SIGUSR1)
        except ProcessLookupError:
            return ""
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not (path.exists() and "File" in path.read_text()):
            time.sleep(0.05)
        time.sleep(0.2)  # the other threads' stacks
        return path.read_text() if path.exists() else ""

    @property
    def exitcode(self) -> int | None:
        return int(self.exit_file.read_text()) if self.exit_file.exists() else None


_ZYGOTE: list[subprocess.Popen] = []


def _zygote() -> subprocess.Popen:
    if not _ZYGOTE or _ZYGOTE[0].poll() is not None:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.Popen(
            [sys.executable, CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
        )
        assert proc.stdout.readline().strip() == "ready"
        _ZYGOTE[:] = [proc]
    return _ZYGOTE[0]


@pytest.fixture(scope="module", autouse=True)
def _stop_zygote():
    yield
    for proc in _ZYGOTE:
        proc.stdin.close()
        proc.wait(timeout=30)
    _ZYGOTE.clear()


def _run(args: dict, *, world: int = 1, kill=None, timeout: float = _TIMEOUT_S) -> list[dict]:
    """Run fault_child.py on ``world`` ranks; ``kill(procs, out)`` may kill some. Results per rank."""
    out = Path(tempfile.mkdtemp(prefix="sb-fault-"))  # not under root: that disk may be full
    zygote = _zygote()
    procs = []
    for rank in range(world):
        child_args = {**args, "out": str(out), "rank": rank, "world": world, "init": str(out / "init")}
        zygote.stdin.write(json.dumps(child_args) + "\n")
        zygote.stdin.flush()
        procs.append(_Child(json.loads(zygote.stdout.readline())["pid"], out / f"exit-{rank}"))
    if kill is not None:
        kill(procs, out)
    deadline = time.monotonic() + timeout
    hung, stacks = [], []
    for rank, proc in enumerate(procs):
        while proc.exitcode is None and time.monotonic() < deadline:
            time.sleep(0.005)
        if proc.exitcode is None:
            hung.append(proc)
            stacks.append(f"rank {rank}:\n{proc.stacks(out, rank)}")  # every hung rank's, before any is killed
    for proc in hung:
        proc.kill()
    results = []
    for rank, proc in enumerate(procs):
        path = out / f"result-{rank}.json"
        result = json.loads(path.read_text()) if path.exists() else {}
        result.update(exitcode=proc.exitcode, hung=proc in hung)
        if (out / "done").exists():
            result["done"] = json.loads((out / "done").read_text())["value"]
        results.append(result)
    for proc in hung:  # the zygote records its exit code before out/ goes
        end = time.monotonic() + 10
        while proc.exitcode is None and time.monotonic() < end:
            time.sleep(0.01)
    shutil.rmtree(out, ignore_errors=True)
    assert not hung, f"{len(hung)} rank(s) hung past {timeout} s: {results}\n" + "\n".join(stacks)
    return results


def _wait_for(path: Path, timeout: float = _TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.005)


def _check_root(root: Path, allowed: dict[str, set[float]], *, at_least: float | None = None, width: int = 16) -> str:
    """Invariants 1, 3 and 4 after a fault; a label for the counts.

    ``allowed``: final directory name -> values it may hold now. ``at_least``: the value of
    the last save that returned (must not be lost).
    """
    hidden = _hidden(root)
    missing = [name for name in allowed if not (root / name).exists()]
    path = ck.latest(root)
    assert path is not None, (hidden, sorted(os.listdir(root)))
    assert path.name in allowed, path
    report = ck.verify(path)
    assert report.ok, report
    value = _loaded_value(path, width)
    assert value in allowed[path.name], (path, value, allowed)
    if at_least is not None:
        assert value >= at_least, f"a save that returned (value {at_least}) was lost: latest has {value}"
    restored = path.name in missing
    # The next save succeeds and leaves no hidden entry behind; everything committed verifies.
    _save(root, NEXT_STEP, 99.0)
    assert _hidden(root) == [], _hidden(root)
    assert ck.latest(root) == ck.step_dir(root, NEXT_STEP)
    for child in root.iterdir():
        assert ck.verify(child).ok, child
    if restored:
        return "restored by recovery"
    return "leftovers cleaned by the next save" if hidden else "nothing left over"


def _record(test: str, label: str) -> None:
    COUNTS.setdefault(test, collections.Counter())[label] += 1


def _report(test: str) -> None:
    counts = COUNTS.get(test, {})
    total = sum(counts.values())
    print(f"\n[faults] {test}: {total} trials: " + ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())))
    path = os.environ.get("SHARDBRIDGE_FAULT_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"test": test, "trials": total, "outcomes": dict(counts)}) + "\n")


def _label_error(result: dict) -> str:
    if result.get("ok"):
        return "save returned"
    error = result.get("error", "")
    assert error and ":" in error, result  # an exception with a message, not a silent exit
    return f"raised {error.split(':')[0]}"


# --- 1. a deterministic crash at every file-system call of save + commit ----------------------

_SCENARIOS = {
    # name: (existing {step: value}, step saved, value saved, overwrite, allowed after a crash)
    "first": ({1: 1.0}, 2, 2.0, False, {"step-00000001": {1.0}, "step-00000002": {2.0}}),
    "overwrite": ({1: 1.0, 2: 2.0}, 2, 3.0, True, {"step-00000002": {2.0, 3.0}}),
}


def _phase_root(tmp_path: Path, existing: dict[int, float], name: str) -> Path:
    root = tmp_path / name / "ckpt"
    root.mkdir(parents=True)
    for step, value in existing.items():
        _save(root, step, value)
    return root


@pytest.mark.parametrize(
    ("scenario", "how", "world"),
    [("first", "exit", 1), ("overwrite", "exit", 1), ("overwrite", "raise", 1), ("overwrite", "exit", 2)],
)
def test_crash_at_every_file_system_call_of_a_save(tmp_path, scenario, how, world):
    """os._exit (kill) or OSError before the k-th mkdir/open-for-write/fsync/rename/replace/
    unlink/rmdir/rmtree of one save, for EVERY k: DCP's writes, the RNG files, hashing, the
    lock, the manifest, each rename of the commit, the deletion of the old copy. With 2 ranks
    rank 0 (the one that commits) is the one that dies."""
    existing, step, value, overwrite, allowed = _SCENARIOS[scenario]
    args = {"mode": "once", "step": step, "value": value, "overwrite": overwrite, "how": how}
    root = _phase_root(tmp_path, existing, "count")
    counted = _run({**args, "root": str(root), "crash_at": 0}, world=world)
    assert all(r["ok"] for r in counted), counted
    trace = counted[0]["trace"]
    assert any("rename" in t for t in trace) and any("shardbridge.json" in t for t in trace), trace
    test = f"crash at each call ({scenario}, {how}, {world} rank(s))"
    for k in range(1, len(trace) + 1):
        root = _phase_root(tmp_path, existing, f"k{k}")
        results = _run({**args, "root": str(root), "crash_at": k}, world=world)
        if how == "exit":
            assert results[0]["exitcode"] == 77, (k, trace[k - 1], results)
            outcome = "killed"
        else:
            outcome = _label_error(results[0])
        for other in results[1:]:  # the surviving rank: a clear error, no hang
            outcome += f"; rank 1 {_label_error(other)}"
        label = _check_root(root, allowed)
        _record(test, f"{outcome} -> {label}")
        shutil.rmtree(root.parent)
    _report(test)
    print(f"[faults] calls enumerated ({len(trace)}): {trace}")


# --- 2. kill -9 at random points of a save loop ---------------------------------------------


def _killer(delay: float, victims):
    def kill(procs, out):
        _wait_for(out / "ready")
        time.sleep(delay)
        for rank in victims(len(procs)):
            procs[rank].kill()

    return kill


def _in_flight_killer(delay: float, victims, landed: list[bool]):
    """Kill once an async save is in flight on some rank; ``landed`` records whether, at the kill,
    rank 0 had not yet seen that save return (its ``done`` value below the in-flight one)."""

    def kill(procs, out):
        _wait_for(out / "ready")
        flights = [out / f"in-flight-{rank}" for rank in range(len(procs))]
        deadline = time.monotonic() + _TIMEOUT_S
        while not any(f.exists() for f in flights):
            assert time.monotonic() < deadline, "no async save started"
            time.sleep(0.002)
        time.sleep(delay)
        started = max((_read_value(f) for f in flights), default=0.0)
        done = _read_value(out / "done")
        for rank in victims(len(procs)):
            procs[rank].kill()
        landed.append(started > done)

    return kill


def _read_value(path: Path) -> float:
    try:
        return float(json.loads(path.read_text())["value"])
    except (OSError, ValueError, KeyError):  # absent, or caught mid-write
        return 0.0


# 2 ranks, async saves: the survivor of a kill -9 once hung (1 in ~100 trials under load) inside
# gloo's connect while creating the writer's group; it is now bounded ([Note: a bounded writer
# group] in _async.py) and the case runs in the default suite again.
@pytest.mark.parametrize(
    ("world", "mode"),
    [
        pytest.param(1, "sync", id="1-sync"),
        pytest.param(2, "sync", id="2-sync"),
        pytest.param(1, "async", id="1-async"),
        pytest.param(2, "async", id="2-async"),
        pytest.param(3, "async", id="3-async"),
    ],
)
def test_kill_at_random_points_of_a_save_loop(tmp_path, world, mode):
    """SIGKILL one rank or every rank at a random time while saving again and again
    (new step directories, or overwriting one); survivors must fail with an error.
    ``async``: every save is ``async_=True`` and the model changes while its writer runs, so a
    kill mostly lands in the writer thread ([Note: async save] in ``_async.py``)."""
    rng = random.Random(1234 + world + (10 if mode == "async" else 0))
    trials = ((8 if world == 1 else 6) if mode == "sync" else (6 if world == 1 else 3)) * SCALE
    # 3 ranks: kill -9 of ONE rank (any of them) with async saves in flight on every rank.
    test = f"kill -9 at random points ({world} rank(s), {mode} saves)"
    landed: list[bool] = []
    for trial in range(trials):
        overwrite = trial % 2 == 1
        root = tmp_path / f"t{trial}" / "ckpt"
        root.mkdir(parents=True)
        choices = ["all", "rank 0", "rank 1"] if world == 2 else [f"rank {r}" for r in range(world)]
        which = rng.choice(choices) if world > 1 else "all"
        victim = None if which == "all" else int(which.split()[1])
        victims = (lambda n: range(n)) if victim is None else (lambda n, r=victim: [r])
        # 3 ranks: the kill waits until an async save is in flight, so the case the test is for happens
        kill = _in_flight_killer(rng.uniform(0.0, 0.05), victims, landed) if world == 3 else _killer(
            rng.uniform(0.0, 0.8), victims
        )
        results = _run(
            {"mode": "loop", "root": str(root), "overwrite": overwrite, "pg_timeout": 15, "async": mode == "async"},
            world=world,
            kill=kill,
        )
        done = results[0].get("done")
        survivors = [_label_error(r) for r in results if r["exitcode"] not in (-9, None)]
        if done is None:
            label = "killed before the first save returned"
            assert ck.latest(root) is None or ck.verify(ck.latest(root)).ok
            _save(root, NEXT_STEP, 99.0)
            assert _hidden(root) == []
        else:
            names = {"step-00000000"} if overwrite else {ck.step_dir(root, v).name for v in range(1, done + 2)}
            values = {float(done), float(done + 1)} if overwrite else set()
            allowed = {n: values or {float(n.split("-")[1])} for n in names}
            label = _check_root(root, allowed, at_least=float(done))
        if survivors:
            label += f"; survivors {sorted(set(survivors))}"
        if world == 3 and landed[-1]:
            label += "; an async save was in flight"
        _record(test, f"killed {which} ({'overwrite' if overwrite else 'new steps'}) -> {label}")
        shutil.rmtree(root.parent)
    if world == 3:
        assert any(landed), f"no kill landed while an async save was in flight: {landed}"
    _report(test)


def test_destroy_process_group_with_an_async_save_in_flight(tmp_path):
    """A script that destroys the process group without ``checkpoint.wait()``: the writers' collectives
    fail (rank and world were fixed when they started), nothing half-written commits, ``latest()``
    is the previous checkpoint; or, if the writers had finished, the new one, whole."""
    test = "destroy_process_group with an async save in flight (2 ranks)"
    in_flight = 0
    for trial in range(3):
        root = tmp_path / f"t{trial}" / "ckpt"
        root.mkdir(parents=True)
        results = _run({"mode": "destroy", "root": str(root), "width": 384}, world=2)
        outcomes = []
        for r in results:
            if r.get("ok"):
                outcomes.append("committed")
            else:
                # The writer's collectives fail once the group is gone; or a rank that was still
                # creating the writer's group sees its peer leave (the peer destroyed it first).
                assert (
                    "process group was destroyed while it was in flight" in r["error"]
                    or "destroyed its process group meanwhile" in r["error"]
                ), r
                outcomes.append("refused")
        allowed = {"step-00000001": {1.0}, "step-00000002": {2.0}}
        in_flight += "refused" in outcomes
        label = _check_root(root, allowed, at_least=1.0, width=384)
        _record(test, f"{'/'.join(outcomes)} -> {label}")
        shutil.rmtree(root.parent)
    _report(test)
    assert in_flight > 0, COUNTS[test]  # the case the test is about happened


# --- 3. full disk ----------------------------------------------------------------------------


@pytest.mark.parametrize("limit", [512, 1500, 3000, 6000, 100_000])
def test_full_disk_rlimit_fsize(tmp_path, limit):
    """RLIMIT_FSIZE: every write past ``limit`` bytes fails with EFBIG, wherever it falls
    (data file, .metadata, RNG file, manifest); 100 kB fits everything."""
    root = tmp_path / "ckpt"
    root.mkdir()
    _save(root, 1, 1.0)
    result = _run({"mode": "once", "root": str(root), "step": 2, "value": 2.0, "fsize": limit})[0]
    label = _label_error(result)
    if not result["ok"] and ("too large" in result["error"].lower() or "errno 27" in result["error"]):
        label += " naming EFBIG"
    allowed = {"step-00000001": {1.0}, "step-00000002": {2.0}}
    _record("full disk (RLIMIT_FSIZE)", f"limit {limit} B: {label} -> {_check_root(root, allowed)}")
    if limit == 100_000:
        _report("full disk (RLIMIT_FSIZE)")


def _mount(args: list[str]) -> bool:
    if os.geteuid() != 0:
        return False
    return subprocess.run(["mount", *args], capture_output=True).returncode == 0


def test_full_disk_tmpfs(tmp_path):
    """A real ENOSPC: a 1 MiB tmpfs filled to leave 0.. 64 KiB free (needs root and mount)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if not _mount(["-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)]):
        pytest.skip("cannot mount a tmpfs here (needs root); test_full_disk_rlimit_fsize covers EFBIG")
    try:
        for free in (0, 4096, 12288, 24576, 65536):
            root = mnt / "ckpt"
            root.mkdir()
            _save(root, 1, 1.0)
            ballast = mnt / "ballast"
            st = os.statvfs(mnt)
            try:
                with open(ballast, "wb") as f:
                    f.write(b"\0" * max(0, st.f_bavail * st.f_frsize - free))
            except OSError:
                pass  # full already
            result = _run({"mode": "once", "root": str(root), "step": 2, "value": 2.0})[0]
            label = _label_error(result)
            if not result["ok"] and ("space" in result["error"].lower() or "errno 28" in result["error"]):
                label += " naming ENOSPC"
            ballast.unlink()
            allowed = {"step-00000001": {1.0}, "step-00000002": {2.0}}
            _record("full disk (tmpfs)", f"{free} B free: {label} -> {_check_root(root, allowed)}")
            shutil.rmtree(root)
    finally:
        subprocess.run(["umount", str(mnt)], check=True)
    _report("full disk (tmpfs)")


# --- 4. read-only target ---------------------------------------------------------------------


def _make_read_only(root: Path) -> bool:
    if os.geteuid() != 0:
        root.chmod(0o555)
        return True
    return _mount(["--bind", str(root), str(root)]) and _mount(["-o", "remount,bind,ro", str(root)])


def _make_writable(root: Path) -> None:
    if os.geteuid() != 0:
        root.chmod(0o755)
    else:
        subprocess.run(["umount", str(root)], check=True)


def test_read_only_target(tmp_path):
    """Saving into a read-only root raises a clear error; latest() on a read-only root with a
    copy hidden by a crash returns that copy (it cannot rename it back) and it loads."""
    root = tmp_path / "ckpt"
    root.mkdir()
    _save(root, 1, 1.0)
    _save(root, 2, 2.0)
    # A crash between the two renames of an overwrite: step 2 only exists as .old.
    os.rename(root / "step-00000002", root / ".step-00000002.old-0123456789ab")
    (root / ".step-00000002.lock-0123456789ab").write_text("host 1\n")
    if not _make_read_only(root):
        pytest.skip("cannot make a directory read-only here")
    try:
        result = _run({"mode": "once", "root": str(root), "step": 3, "value": 3.0})[0]
        label = _label_error(result)
        assert not result["ok"] and ("read-only" in result["error"].lower() or "permission" in result["error"].lower())
        hidden = ck.latest(root)
        assert hidden is not None and hidden.name == ".step-00000002.old-0123456789ab"
        assert _loaded_value(hidden) == 2.0
    finally:
        _make_writable(root)
    assert _check_root(root, {"step-00000002": {2.0}}) == "restored by recovery"
    _record("read-only target", f"{label}; latest() returned the hidden copy, then restored")
    _report("read-only target")


# --- 5. damaged files ------------------------------------------------------------------------

_KINDS = [".metadata", "__0_0.distcp", "__1_0.distcp", "rng/rank-00001.pt", MANIFEST_NAME]


def _save_two_ranks(root: Path) -> None:
    """Steps 1 and 2 (values 1, 2) saved by 2 ranks, so there are two data and RNG files."""
    for step in (1, 2):
        _run({"mode": "once", "root": str(root), "step": step, "value": float(step)}, world=2)


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory):
    """Two committed steps to damage copies of; the damage tests' outcome counts are printed at teardown.

    The report belongs to the fixture, not to a test: it prints whatever the tests that used the
    fixture recorded (all of them or a ``-k`` selection), in any order they ran.
    """
    root = tmp_path_factory.mktemp("damage") / "ckpt"
    root.mkdir()
    _save_two_ranks(root)
    yield root
    _report("damaged files")


def _damage(path: Path, kind: str, how: str, other: Path) -> None:
    target = path / kind
    if how == "flip":
        data = bytearray(target.read_bytes())
        data[len(data) // 2] ^= 0x01
        target.write_bytes(data)
    elif how == "truncate":
        target.write_bytes(target.read_bytes()[: target.stat().st_size // 2])
    elif how == "missing":
        target.unlink()
    elif how == "foreign":  # the same file of another step of the same run
        shutil.copyfile(other / kind, target)
    elif how == "extra":  # a file copied in next to this one
        shutil.copyfile(other / kind, target.with_name("copy-" + target.name))


@pytest.mark.parametrize("how", ["flip", "truncate", "missing", "foreign", "extra"])
@pytest.mark.parametrize("kind", _KINDS)
def test_damaged_file_is_detected(tmp_path, two_steps, kind, how, caplog):
    """Each kind of damage to each kind of file: verify names the file, load refuses,
    load_latest falls back to step 1, latest skips it when the sizes tell, the next save works."""
    root = tmp_path / "ckpt"
    shutil.copytree(two_steps, root)
    step2 = root / "step-00000002"
    _damage(step2, kind, how, root / "step-00000001")
    if kind == MANIFEST_NAME and how != "extra":
        # The manifest's own checksum (or JSON) fails: not a checkpoint any more.
        if how == "foreign":
            assert _read_manifest(LOCAL, str(step2)).step == 1  # a whole valid manifest of step 1 ...
            with pytest.raises(ValueError, match="checksum mismatch"):  # ... whose records do not fit
                _loaded_value(step2)
        else:
            with pytest.raises(ValueError, match=MANIFEST_NAME):
                ck.verify(step2)
    else:
        report = ck.verify(step2)
        assert not report.ok
        names = [p.name for p in report.problems]
        assert (kind if how != "extra" else str(Path(kind).with_name("copy-" + Path(kind).name))) in names, report
        with pytest.raises(ValueError, match="damaged"):
            _loaded_value(step2)
    with caplog.at_level("WARNING", logger="shardbridge.checkpoint"):
        state = ck.load_latest(root, model=_model(-1.0), rng=False)
    assert state is not None and state.step == 1
    assert "skipping" in caplog.text or (kind, how) == (MANIFEST_NAME, "missing")  # no manifest: not a checkpoint
    # latest() compares sizes, not checksums: a same-size flip or foreign file is caught by
    # load's checksums instead (and load_latest falls back, as above).
    same_size = how == "foreign" or (how == "flip" and kind != MANIFEST_NAME)
    assert ck.latest(root) == (step2 if same_size else root / "step-00000001")
    _save(root, 3, 3.0)
    assert ck.latest(root) == ck.step_dir(root, 3) and _hidden(root) == []
    _record("damaged files", f"{how} -> detected by {'checksum' if same_size else 'size/listing/manifest'}")


def test_a_flip_that_makes_metadata_unparseable_is_damage(tmp_path, two_steps):
    """A flipped byte inside a string of .metadata makes it fail to unpickle before any checksum
    was computed (on torch 2.15 the middle byte the test above flips lands in one): load names the
    checksum mismatch and load_latest falls back to step 1 (before: the parse error was raised and
    load_latest stopped there)."""
    import pickletools

    root = tmp_path / "ckpt"
    shutil.copytree(two_steps, root)
    target = root / "step-00000002" / ".metadata"
    data = bytearray(target.read_bytes())
    at = next(pos for op, arg, pos in pickletools.genops(bytes(data)) if op.name == "BINUNICODE" and len(arg) > 4)
    data[at + 5] = 0xFF  # not UTF-8
    target.write_bytes(data)
    with pytest.raises(ValueError, match=r"\.metadata.*checksum mismatch"):
        _loaded_value(root / "step-00000002")
    state = ck.load_latest(root, model=_model(-1.0), rng=False)
    assert state is not None and state.step == 1


@pytest.mark.parametrize("how", ["flip", "truncate"])
def test_load_latest_refuses_when_every_checkpoint_is_damaged(tmp_path, two_steps, how):
    """Returning None would restart training from scratch beside the user's checkpoints."""
    root = tmp_path / "ckpt"
    shutil.copytree(two_steps, root)
    for step in (1, 2):
        _damage(ck.step_dir(root, step), "__1_0.distcp", how, ck.step_dir(root, 3 - step))
    with pytest.raises(ValueError, match=r"every checkpoint under .* is damaged \(step-00000001, step-00000002\); "
                       r"nothing was loaded\. See what is wrong with `shardbridge ckpt verify"):  # fmt: skip
        ck.load_latest(root, model=_model(-1.0), rng=False)


def test_old_code_loaded_a_flipped_byte_silently(tmp_path):
    """Format 2 (no records): the same flip loads wrong values (why format 3 exists)."""
    root = tmp_path / "ckpt"
    path = _save(root, 1, 1.0)
    manifest = json.loads((path / MANIFEST_NAME).read_text())
    manifest = {k: v for k, v in manifest.items() if k not in ("files", "manifest_xxh3_128")}
    (path / MANIFEST_NAME).write_text(json.dumps({**manifest, "format_version": 2}))
    data = bytearray((path / "__0_0.distcp").read_bytes())
    offset = data.find(torch.tensor([1.0]).numpy().tobytes())
    data[offset + 3] ^= 0x01  # 1.0 -> another float
    (path / "__0_0.distcp").write_bytes(data)
    model = _model(-1.0)
    ck.load(path, model=model, rng=False)  # no error: nothing recorded to compare with
    assert not all(bool((p == 1.0).all()) for p in model.parameters())


# --- 6. two jobs racing into one root --------------------------------------------------------


@pytest.mark.parametrize("world", [1, 2], ids=["1-rank-jobs", "2-rank-jobs"])
@pytest.mark.parametrize("same_name", [False, True], ids=["other-step", "same-step"])
def test_two_jobs_racing_into_one_root(tmp_path, same_name, world):
    """Job A pauses between writing its files and committing; job B (a new process group, started
    after A's temporary directory was last modified) saves into the same root, which runs
    recovery. A's directory is left alone; A then commits (different names), or fails with a
    clear error because B created its name first (same name). ``world=2``: each job is 2 ranks."""
    root = tmp_path / "ckpt"
    root.mkdir()
    _save(root, 1, 1.0)
    result_a: dict = {}

    def run_b(procs, out):
        _wait_for(out / "paused")
        time.sleep(0.05)
        step_b = 2 if same_name else 3
        results_b = _run({"mode": "once", "root": str(root), "step": step_b, "value": 3.0}, world=world)
        assert all(r["ok"] for r in results_b), results_b
        (out / "go").touch()
        result_a["b"] = results_b

    # A's rank 1 waits in a collective while A's rank 0 is paused and all of job B runs: no gloo
    # timeout that a loaded machine could reach there (the pause itself is gated on files).
    args = {"mode": "once", "root": str(root), "step": 2, "value": 2.0, "pause": True, "pg_timeout": 300}
    results = _run(args, kill=run_b, world=world)
    if same_name:
        assert not results[0]["ok"] and "created by another process" in results[0]["error"], results
        assert all(not r["ok"] and r.get("error") for r in results), results  # every rank of A: a clear error
        allowed = {"step-00000002": {3.0}}
        label = "A raised FileExistsError, B's checkpoint kept"
    else:
        assert all(r["ok"] for r in results), results
        assert ck.verify(ck.step_dir(root, 2)).ok and _loaded_value(ck.step_dir(root, 2)) == 2.0
        allowed = {"step-00000003": {3.0}}
        label = "both committed"
    assert _hidden(root) == []
    assert _check_root(root, allowed) == "nothing left over"
    _record(f"two jobs in one root ({world} rank(s) each)", label)
    _report(f"two jobs in one root ({world} rank(s) each)")
