"""One rank of test_distributed.py's exit test (not a test module): a gloo worker late at exit.

``RANK`` / ``WORLD_SIZE`` (2) / ``MASTER_ADDR`` / ``MASTER_PORT`` in the environment; argument
``wait`` (both ranks import shardbridge, which registers its exit wait: [Note: gloo threads at
exit] in ``shardbridge/_distributed.py``) or ``no-wait`` (the same job without shardbridge: the
control). Rank 1 only answers the collective and exits; its worker can be late too on a loaded
machine (it was: SIGABRT in a control run at load average 38), which is why it waits as well.

Rank 0 ends with its gloo worker waiting for the GIL, and the interpreter then finalizing with the
GIL released until the worker has taken it; every step is made certain rather than timed:

1. an all-gather whose input's Python object it dropped, so that the worker's drop of the input
   releases that object, which takes the GIL; rank 1 joins the all-gather only after rank 0 has
   dropped its references to the work and its input (a file rank 0 creates, ``GLOO_EXIT_DROPPED``).
   Without that the all-gather could be done before rank 0's ``del``, the worker's drop was not
   the last, and the control passed (1 run in 10);
2. a busy loop in Python under a 600 s switch interval (the main thread keeps the GIL, as it does
   in the last milliseconds of a real script; a thread that waits for the GIL that long asks for
   it, which would let the worker finish before the interpreter finalizes: this step and the next
   must take less) until the worker is seen waiting for the GIL: asleep in
   the kernel on a futex of the GIL's, whose address a probe thread showed at the start (the
   ``/proc/self/task`` files are read through ``ctypes.PyDLL``, which keeps the GIL, where Python's
   own reads release it), not for a fixed time;
3. the end of the script with nothing that blocks, and, while the interpreter finalizes, a
   ``__del__`` that releases the GIL (sleeps), as finalizers of real scripts do, for as long as
   that worker still waits for it or runs (woken, it may find the GIL taken again and wait once
   more): until it has taken it (the process aborts then) or was idle already.

Without a wait at exit the worker takes the GIL while the interpreter finalizes: std::terminate,
SIGABRT ("terminate called without an active exception"). Exit code 3 (rank 1): rank 0 did not
drop its references within 60 s; 4 (rank 0): a step was not seen within 60 s, named on stderr.
"""

from __future__ import annotations

import sys

sys.setswitchinterval(600.0)  # before anything starts a thread

import _thread  # noqa: E402
import atexit  # noqa: E402
import ctypes  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

LIBC = ctypes.PyDLL(None)  # PyDLL: calls keep the GIL
LIBC.open.argtypes = [ctypes.c_char_p, ctypes.c_int]
LIBC.read.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]
FUTEX = {"x86_64": "202", "aarch64": "98"}[platform.machine()]  # the futex system call's number
DROPPED = os.environ["GLOO_EXIT_DROPPED"]  # a path: rank 0 creates it, rank 1 waits for it
FUTEX_WAIT_NEAR = 256  # the GIL's condition variables and mutexes lie within this many bytes of each other


# The helpers below bind what they use as default arguments: the finalizer calls them while the
# interpreter clears __main__'s globals.


def _proc(path: str, libc=LIBC, rdonly=os.O_RDONLY, buffer=ctypes.create_string_buffer) -> str:
    """A /proc file's text, read without releasing the GIL."""
    fd = libc.open(path.encode(), rdonly)
    if fd < 0:
        return ""
    buf = buffer(4096)
    n = libc.read(fd, buf, 4096)
    libc.close(fd)
    return buf.raw[: max(n, 0)].decode()


def _futex_wait(tid: int, proc=_proc, futex=FUTEX) -> int | None:
    """The futex address thread ``tid`` sleeps on, or None when it is not asleep in a futex wait."""
    state = proc(f"/proc/self/task/{tid}/stat").rpartition(")")[2].split()[:1]
    call = proc(f"/proc/self/task/{tid}/syscall").split()
    if state != ["S"] or len(call) < 2 or call[0] != futex:
        return None
    return int(call[1], 16)


def _until(seen, what: str):
    """Spin (keeping the GIL) until ``seen()`` is truthy; exit 4 after 60 s."""
    deadline = time.monotonic() + 60.0
    while not (value := seen()):
        if time.monotonic() > deadline:
            print(f"gloo_exit_child: {what} not seen in 60 s", file=sys.stderr)
            sys.exit(4)
    return value


dist.init_process_group("gloo")  # first: a rank that exits early below leaves no peer in the rendezvous

# The GIL's futex: a thread that waits for the GIL, which this thread holds, sleeps on it. The probe
# first blocks on a lock (its futex is the lock's), then, woken, asks for the GIL: a new address.
gate, ended, probe_tid = _thread.allocate_lock(), _thread.allocate_lock(), []
gate.acquire()
ended.acquire()


def _probe() -> None:
    probe_tid.append(threading.get_native_id())
    with gate:  # blocks until the main thread opens the gate, then asks for the GIL
        pass
    ended.release()


_thread.start_new_thread(_probe, ())
while not probe_tid:
    time.sleep(0.001)  # releases the GIL: the probe runs until it blocks on the gate
LOCK_FUTEX = _until(lambda: _futex_wait(probe_tid[0]), "the probe thread waiting for the gate")
gate.release()  # the probe wakes and asks for the GIL, which this thread keeps while it looks
GIL_FUTEX = _until(lambda: (f := _futex_wait(probe_tid[0])) != LOCK_FUTEX and f, "the probe waiting for the GIL")
with ended:  # releases the GIL until the probe has taken it and ended
    pass

# torch's exit handlers release the GIL here and there; on a loaded machine the waiting worker can
# take it in one of them and drop its object before the interpreter finalizes, and the control
# would pass by luck. Without them the modes differ in shardbridge's handler only (its import
# registers it).
atexit._clear()
if sys.argv[1] == "wait":
    import shardbridge  # noqa: F401

outputs = [torch.zeros(256) for _ in range(2)]
if dist.get_rank() == 1:
    mine = torch.full((256,), 2.0)
    deadline = time.monotonic() + 60.0
    while not os.path.exists(DROPPED):  # rank 0 dropped its references to the work and its input
        if time.monotonic() > deadline:
            sys.exit(3)
        time.sleep(0.001)
    dist.all_gather(outputs, mine)
    sys.exit(0)


views = [o.numpy() for o in outputs]  # read without a torch call (a torch op may release the GIL)
TIDS = [int(t) for t in os.listdir("/proc/self/task")]  # before the collective: the worker threads exist
work = dist.all_gather(outputs, torch.full((256,), 1.0), async_op=True)
del work  # the input's only owner is now the work, which the worker drops when the all-gather is done
open(DROPPED, "w").close()  # rank 1 joins the all-gather only now: the worker cannot be done before the del
_until(lambda: views[1][0] == 2.0, "rank 1's output")  # busy in Python: the GIL stays with this thread


def _on_the_gil(tid: int, gil=GIL_FUTEX, near=FUTEX_WAIT_NEAR, futex_wait=_futex_wait) -> bool:
    """Whether thread ``tid`` sleeps on the GIL's futex."""
    return (f := futex_wait(tid)) is not None and abs(f - gil) < near


WORKER = _until(lambda: next((t for t in TIDS if _on_the_gil(t)), None), "a gloo worker waiting for the GIL")


def _waits_or_runs(tid=WORKER, on_the_gil=_on_the_gil, proc=_proc) -> bool:
    """Whether the worker still waits for the GIL, or runs (woken, before it took the GIL)."""
    return proc(f"/proc/self/task/{tid}/stat").rpartition(")")[2].split()[:1] == ["R"] or on_the_gil(tid)


class _ReleaseWhileFinalizing:
    """Releases the GIL while the interpreter finalizes (``__main__``'s globals are cleared then)
    until the worker has taken it: the process aborts then (without shardbridge), or the worker
    was idle already (shardbridge's exit wait let it finish before the interpreter finalized)."""

    def __del__(self, _sleep=time.sleep, _busy=_waits_or_runs, _clock=time.monotonic):
        deadline = _clock() + 60.0
        while _busy() and _clock() < deadline:
            _sleep(0.001)


_finalizer = _ReleaseWhileFinalizing()
