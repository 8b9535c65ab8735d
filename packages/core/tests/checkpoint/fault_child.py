"""The process that test_faults.py injects faults into (not a test module).

``python fault_child.py`` is a zygote: it imports torch, DCP and shardbridge once, then for
each JSON line on stdin forks a child that runs :func:`main` with that dict as ``ARGS`` and
answers the child's pid (children cost milliseconds instead of ~1 s of imports each). When a
child ends, the zygote writes its exit code (negative: killed by that signal) to
``ARGS["out"]/exit-<rank>``. The child reports through files under ``ARGS["out"]``:

- ``ready``: written once torch, the process group and the model are set up;
- ``done``: the last value whose save returned (``loop`` mode);
- ``in-flight-<rank>``: the value whose async save this rank has started (``loop`` mode, async);
- ``result.json``: ``{"ok": bool, "error": "Type: first line", "trace": [calls]}``.

Modes (``ARGS["mode"]``):

- ``destroy``: save value 1, start an async save of value 2, ``destroy_process_group()`` at
  once, then wait for it (``width``: the model's width, so that the writer is still busy).
- ``loop``: save values 1, 2, 3 ... until killed; ``overwrite`` saves all into step 0's
  directory, else each into its own ``step_dir``. ``async``: each save is
  ``save(..., async_=True)``, the model is changed at once, then the save is waited for.
- ``once``: one save of ``value``; optional faults: ``stop_server_at`` = k (SIGSTOP the S3
  server ``server_pid`` just before this process's k-th request; 0 = count only), ``exit_after`` =
  "METHOD name" (exit with code 9, as if killed, once that S3 request was answered: e.g. "PUT
  shardbridge.json", the commit), ``crash_at`` = k (the k-th call of an
  instrumented file-system function, counted from the start of the save, exits the
  process with ``how="exit"`` or raises ``OSError`` with ``how="raise"``; 0 = count only),
  ``fsize`` (RLIMIT_FSIZE in bytes), ``pause`` (wait for the file ``go`` before committing).

- ``verbs``: each of ``verbs`` (:func:`verbs`: the API's and the CLI's) on ``paths``, its
  :func:`outcome` in ``result["verbs"]``; ``stop_server``: the S3 server stopped (SIGSTOP) at the
  verb's first request, resumed after it (``seconds`` counted from the stop); ``block``: modules
  made uninstalled (a missing extra).

A model's every parameter equals the saved ``value`` (also in ``extra``), so the parent can
tell which save it loaded and that the bytes are right.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import faulthandler
import io
import json
import os
import re
import shutil
import signal
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

_FAULTS = {"count": 0, "trace": [], "installed": []}


def _write_json(path: str, data: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def build(value: float, world: int, width: int = 16) -> nn.Module:
    model = nn.Sequential(nn.Linear(width, width), nn.Linear(width, 4))
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    return model


def set_value(model: nn.Module, value: float) -> None:
    torch.manual_seed(
        int(value) * 10 + dist.get_rank() if dist.is_initialized() else int(value) * 10
    )  # RNG files differ
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)


def _is_write(args, kwargs) -> bool:
    mode = kwargs.get("mode", args[1] if len(args) > 1 else "r")
    return isinstance(mode, str) and any(c in mode for c in "wax+")


def _install_faults(crash_at: int, how: str) -> None:
    """Count (and at ``crash_at`` fail) every call that changes the file system."""

    def wrap(owner, attr, label, counts=lambda a, k: True):
        real = getattr(owner, attr)

        def wrapper(*a, **k):
            if counts(a, k):
                _FAULTS["count"] += 1
                _FAULTS["trace"].append(f"{label} {os.path.basename(str(a[0])) if a else ''}")
                if _FAULTS["count"] == crash_at:
                    if how == "exit":
                        os._exit(77)
                    raise OSError(errno.EIO, f"injected fault at call {crash_at} ({label})")
            return real(*a, **k)

        _FAULTS["installed"].append((owner, attr, real))
        setattr(owner, attr, wrapper)

    wrap(builtins, "open", "open-w", _is_write)
    wrap(io, "open", "open-w", _is_write)  # pathlib's Path.open (DCP's data files)
    wrap(os, "open", "os.open-creat", lambda a, k: bool((a[1] if len(a) > 1 else k.get("flags", 0)) & os.O_CREAT))
    for attr in ("fsync", "rename", "replace", "mkdir", "rmdir", "unlink"):
        wrap(os, attr, f"os.{attr}")
    wrap(shutil, "rmtree", "shutil.rmtree")


def _stop_server_at(k: int, server_pid: int) -> None:
    """SIGSTOP the S3 server just before this process sends its k-th request (0: count only).

    At aiobotocore's HTTP session class: every S3 client of the process sends through it. The
    trace says, per request, whether it still carried ``Expect: 100-continue``.
    """
    from aiobotocore.httpsession import AIOHTTPSession

    real = AIOHTTPSession.send

    async def send(self, request):
        _FAULTS["count"] += 1
        name = re.sub(r"g-[0-9a-f]{16}", "g-*", request.url.split("?")[0].rsplit("/", 1)[-1])  # one per save
        expect = " Expect" if "expect" in {k.lower() for k in request.headers} else ""
        _FAULTS["trace"].append(f"{request.method} {name}{expect}")
        if _FAULTS["count"] == _FAULTS.get("stop_at", k):
            _FAULTS["stopped"] = time.monotonic()
            os.kill(server_pid, signal.SIGSTOP)
        return await real(self, request)

    AIOHTTPSession.send = send


def _exit_after(label: str) -> None:
    """Exit at once (code 9, no cleanup: as if killed) when the S3 request ``label`` was answered."""
    from aiobotocore.httpsession import AIOHTTPSession

    real = AIOHTTPSession.send

    async def send(self, request):
        response = await real(self, request)
        if f"{request.method} {request.url.split('?')[0].rsplit('/', 1)[-1]}" == label:
            os._exit(9)
        return response

    AIOHTTPSession.send = send


def _fresh_clients() -> None:
    """Forget every fsspec filesystem and backend of this process (a backend fails fast for a while after a
    request got no answer: [Note: object-store client settings])."""
    from shardbridge.checkpoint.storage import _location

    _location._BACKENDS.clear()
    if sys.modules.get("s3fs") is not None:
        sys.modules["s3fs"].S3FileSystem.clear_instance_cache()


def verbs(paths: dict[str, str], model: nn.Module) -> dict[str, Any]:
    """Every verb a user runs on a checkpoint (the API's and the CLI's) on ``paths``: ``root`` holding
    ``ckpt``, ``new`` a checkpoint to save, ``out`` an export folder (test_s3_errors.py)."""
    from shardbridge import checkpoint as ck
    from shardbridge.cli._main import main

    return {
        "save": lambda: ck.save(paths["new"], model=model, step=9),
        "load": lambda: ck.load(paths["ckpt"], model=model),
        "load_latest": lambda: ck.load_latest(paths["root"], model=model),
        "latest": lambda: ck.latest(paths["root"]),
        "verify": lambda: ck.verify(paths["ckpt"]),
        "inspect": lambda: ck.inspect(paths["ckpt"]),
        "export": lambda: ck.export_safetensors(paths["ckpt"], paths["out"], progress=False),
        "cli verify": lambda: main(["ckpt", "verify", paths["root"]]),
        "cli inspect": lambda: main(["ckpt", "inspect", paths["root"]]),
        "cli export": lambda: main(["ckpt", "export", paths["root"], paths["out"], "--no-progress"]),
    }


def outcome(name: str, call: Any) -> dict[str, Any]:
    """Run one verb: ``error`` (its one line: the exception's, or the CLI's last line on stderr) or
    ``returned``, what it wrote on stderr, and its seconds."""
    err, start = io.StringIO(), time.monotonic()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            value = call()
        result = {"returned": repr(value)}
        if name.startswith("cli ") and value != 0:
            result = {"error": (err.getvalue().strip().splitlines() or [f"exit code {value}"])[-1]}
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        result = {"error": f"{type(exc).__name__}: {' '.join(str(exc).split())}"}
    return {**result, "stderr": err.getvalue(), "seconds": time.monotonic() - start}


def main(ARGS: dict) -> None:  # noqa: N803 (the name runpy gives it)
    out = ARGS["out"]
    rank, world = ARGS.get("rank", 0), ARGS.get("world", 1)
    # a hung child's stacks, for the parent's report (test_faults._Child.stacks)
    faulthandler.register(signal.SIGUSR1, file=open(os.path.join(out, f"stacks-{rank}"), "w"), all_threads=True)  # noqa: SIM115
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{ARGS['init']}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=ARGS.get("pg_timeout", 15)),
        )
    from shardbridge import checkpoint as ck
    from shardbridge.checkpoint.storage import _local

    if ARGS.get("s3_env"):  # an S3 server's endpoint, credentials and short timeouts (test_s3_faults.py)
        from shardbridge.testing._s3 import use_server

        use_server(ARGS["s3_env"])
        if ARGS.get("stop_server_at") is not None:
            _stop_server_at(ARGS["stop_server_at"], ARGS["server_pid"])
        if ARGS.get("exit_after"):
            _exit_after(ARGS["exit_after"])

    root = ARGS["root"]
    model = build(ARGS.get("value", 1.0), world, ARGS.get("width", 16))
    set_value(model, ARGS.get("value", 1.0))
    result: dict = {"ok": False}
    if rank == 0:
        open(os.path.join(out, "ready"), "w").close()
    try:
        if ARGS["mode"] == "verbs":  # each verb; ``stop_server``: the server stopped at its first request
            for name in ARGS.get("block", []):  # a module "not installed" (a missing extra)
                sys.modules[name] = None
            table, result["verbs"] = verbs(ARGS["paths"], model), {}
            for name in ARGS["verbs"]:
                _fresh_clients()  # as in a process of its own: no backend remembers the last verb's unanswered request
                _FAULTS.update(count=0, stop_at=1 if ARGS.get("stop_server") else -1, stopped=None)
                result["verbs"][name] = done = outcome(name, table[name])
                if _FAULTS["stopped"] is not None:
                    done["seconds"] = time.monotonic() - _FAULTS["stopped"]  # since the server stopped
                    os.kill(ARGS["server_pid"], signal.SIGCONT)
            result["ok"] = True
        elif ARGS["mode"] == "destroy":
            # An async save in flight when the script destroys the process group (without wait()).
            ck.save(ck.step_dir(root, 1), model=model, step=1, extra={"value": 1.0})
            set_value(model, 2.0)
            pending = ck.save(ck.step_dir(root, 2), model=model, step=2, extra={"value": 2.0}, async_=True)
            dist.destroy_process_group()
            pending.wait()
            result["ok"] = True
        else:
            if ARGS["mode"] == "loop":
                value = ARGS.get("start", 1)
                while True:
                    set_value(model, float(value))
                    path = ck.step_dir(root, 0 if ARGS["overwrite"] else value)
                    pending = ck.save(
                        path,
                        model=model,
                        step=value,
                        extra={"value": value},
                        overwrite=ARGS["overwrite"],
                        async_=ARGS.get("async", False),
                    )
                    if ARGS.get("async", False):
                        # this rank's save of `value` is in flight (its writer runs until wait())
                        _write_json(os.path.join(out, f"in-flight-{rank}"), {"value": value})
                        set_value(model, -7.0)  # training changes the model while the writer runs
                        pending.wait()
                    if rank == 0:
                        _write_json(os.path.join(out, "done"), {"value": value})
                    value += 1
            if ARGS.get("fsize") is not None:
                import resource

                signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
                resource.setrlimit(resource.RLIMIT_FSIZE, (ARGS["fsize"], resource.RLIM_INFINITY))
            if ARGS.get("pause"):
                real_commit = _local.commit

                def paused_commit(*a, **k):
                    open(os.path.join(out, "paused"), "w").close()
                    while not os.path.exists(os.path.join(out, "go")):
                        time.sleep(0.01)
                    return real_commit(*a, **k)

                _local.commit = paused_commit
            if ARGS.get("crash_at") is not None and rank == ARGS.get("crash_rank", 0):
                _install_faults(ARGS["crash_at"], ARGS.get("how", "exit"))
            value = ARGS["value"]
            ck.save(
                ARGS.get("path") or ck.step_dir(root, ARGS["step"]),
                model=model,
                step=ARGS["step"],
                extra={"value": value},
                overwrite=ARGS.get("overwrite", False),
            )
            result["ok"] = True
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        lines = str(exc).strip().splitlines() or [""]
        result["error"] = f"{type(exc).__name__}: {lines[0]}"
    finally:
        for owner, attr, real in _FAULTS["installed"]:
            setattr(owner, attr, real)
        result["trace"] = _FAULTS["trace"]
        _write_json(os.path.join(out, f"result-{rank}.json"), result)
    sys.stdout.flush()
    os._exit(0 if result["ok"] else 1)  # no process-group teardown: a peer may be dead


def zygote() -> None:
    import shardbridge.checkpoint  # noqa: F401
    import torch._dynamo  # noqa: F401 (torch's get_state_dict pulls it in; ~0.5 s)
    import torch.distributed.checkpoint.state_dict  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401

    try:
        import s3fs  # noqa: F401 (test_s3_faults.py: the S3 client, imported once here too)
    except ImportError:
        pass

    exits: dict[int, str] = {}

    def reap(*_):
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            path = exits.pop(pid, None)
            if path is not None:
                try:
                    with open(path + ".tmp", "w") as f:
                        f.write(str(os.waitstatus_to_exitcode(status)))
                    os.replace(path + ".tmp", path)
                except FileNotFoundError:  # the parent gave up on this child and removed its folder
                    pass

    signal.signal(signal.SIGCHLD, reap)
    print("ready", flush=True)
    for line in sys.stdin:
        args = json.loads(line)
        signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGCHLD])
        pid = os.fork()
        if pid == 0:
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGCHLD])
            try:
                main(args)
            finally:
                os._exit(70)
        exits[pid] = os.path.join(args["out"], f"exit-{args['rank']}")
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGCHLD])
        reap()
        print(json.dumps({"pid": pid}), flush=True)


if __name__ == "__main__":
    zygote()
