"""One rank of test_distributed.py's exit test (not a test module): a gloo worker late at exit.

``RANK`` / ``WORLD_SIZE`` (2) / ``MASTER_ADDR`` / ``MASTER_PORT`` in the environment; argument
``wait`` (both ranks import shardbridge, which registers its exit wait: [Note: gloo threads at
exit] in ``shardbridge/_distributed.py``) or ``no-wait`` (the same job without shardbridge: the
control). Rank 1 only answers the collective and exits; its worker can be late too on a loaded
machine (it was: SIGABRT in a control run at load average 38), which is why it waits as well.

Rank 0 ends with its gloo worker waiting for the GIL: an all-gather whose input's Python object it
dropped (so the worker's drop of the input releases that object, which takes the GIL), then a
busy loop in Python under a 30 s switch interval (the worker gets the GIL only when the main
thread blocks or sleeps: the main thread held it, as it does in the last milliseconds of a real
script), seeing the outputs arrive, and the end of the script with nothing that blocks. Without a
wait at exit the worker takes the GIL while the interpreter finalizes: std::terminate, SIGABRT
("terminate called without an active exception"). Exit code 3: the collective did not complete.
"""

from __future__ import annotations

import sys

sys.setswitchinterval(30.0)  # before anything starts a thread

import atexit  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

dist.init_process_group("gloo")
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
    dist.all_gather(outputs, mine)
    sys.exit(0)
views = [o.numpy() for o in outputs]  # read without a torch call (a torch op may release the GIL)
work = dist.all_gather(outputs, torch.full((256,), 1.0), async_op=True)
del work  # the input's only owner is now the work, which the worker drops when the all-gather is done
deadline = time.monotonic() + 60.0
while views[1][0] != 2.0:  # busy in Python: the GIL stays with this thread
    if time.monotonic() > deadline:
        sys.exit(3)
until = time.monotonic() + 1.0  # the worker marks the work done, then drops it: let it ask for the GIL
while time.monotonic() < until:
    pass
