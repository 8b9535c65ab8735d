"""shardbridge.testing: the multi-process gloo test harness every shardbridge package uses.

See [Note: worker pool] in ``_pool.py``.
"""

from shardbridge.testing._pool import DistributedTestFailure, WorkerPool, run_distributed, shutdown_pools

__all__ = ["DistributedTestFailure", "WorkerPool", "run_distributed", "shutdown_pools"]
