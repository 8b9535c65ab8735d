"""Tier 3: the gloo worker pool itself (results, rank-tagged failures, hangs, rebuilds)."""

import time

import pytest
import torch
import torch.distributed as dist
from shardbridge.testing import DistributedTestFailure, run_distributed


def _rank_times(x):
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return dist.get_rank() * x, t.item(), torch.get_num_threads(), dist.get_backend()


def _fail_on_rank(bad_rank):
    if dist.get_rank() == bad_rank:
        raise ValueError(f"boom on {bad_rank}")
    return dist.get_rank()


def _hang_on_rank(bad_rank):
    if dist.get_rank() != bad_rank:
        dist.all_reduce(torch.ones(1))  # bad_rank never joins
    return dist.get_rank()


def _sleep(seconds):
    time.sleep(seconds)


def _pid():
    import os

    return os.getpid()


def test_results_are_per_rank_and_collectives_work():
    out = run_distributed(_rank_times, 10, world_size=4)
    assert [o[0] for o in out] == [0, 10, 20, 30]
    assert all(o[1] == 1 + 2 + 3 + 4 for o in out)
    assert all(o[2] == 1 for o in out)
    assert all(o[3] == "gloo" for o in out)


def test_pool_is_persistent():
    first = run_distributed(_pid, world_size=2)
    assert run_distributed(_pid, world_size=2) == first
    assert len(set(first)) == 2


def test_failure_names_rank_and_pool_is_rebuilt():
    before = run_distributed(_pid, world_size=2)
    with pytest.raises(DistributedTestFailure, match=r"(?s)failed on 1 of 2 ranks.*rank 1 ---.*boom on 1"):
        run_distributed(_fail_on_rank, 1, world_size=2)
    after = run_distributed(_pid, world_size=2)
    assert set(after).isdisjoint(before)


def test_mismatched_collective_becomes_an_error_not_a_hang():
    # The process-group timeout (10 s here, 30 s by default) fails the stuck rank: its own error
    # ("rank 1 ---" and gloo's message); the call's timeout (300 s) would name no rank's error, only
    # "did not answer". Not 3 s: the timeout also bounds the new pool's rendezvous, which two
    # workers starting on a loaded machine can miss.
    with pytest.raises(DistributedTestFailure, match=r"(?s)rank 1 ---.*(Timed out|timeout|Connection closed)"):
        run_distributed(_hang_on_rank, 0, world_size=2, timeout=300, pg_timeout=10)
    assert run_distributed(_rank_times, 1, world_size=2, pg_timeout=10)[1][0] == 1


def _rank0_alone(seconds):
    if dist.get_rank() == 0:
        time.sleep(seconds)  # an oracle computed on rank 0 only, while the others wait for the task's end
    return dist.get_rank()


def test_one_ranks_longer_task_is_not_a_collective_timeout():
    # The barrier after a task waits for the slowest rank beyond the pool's collective timeout (10 s:
    # the pool of the test above); before, ranks 1.. raised "Timed out" in it.
    assert run_distributed(_rank0_alone, 11, world_size=2, pg_timeout=10) == [0, 1]


def test_call_timeout():
    with pytest.raises(DistributedTestFailure, match=r"did not answer within 1 s"):
        run_distributed(_sleep, 5, world_size=2, timeout=1)


def test_rejects_local_functions():
    def local():
        return 1

    with pytest.raises(ValueError, match="module-level function"):
        run_distributed(local, world_size=2)


def _build_meshes(n):
    import os

    from shardbridge import ParallelDims

    for _ in range(n):
        ParallelDims(dp_shard=2, tp=2).build_mesh("cpu")
    return os.getpid(), len(dist.distributed_c10d._world.pg_map)


def test_pool_is_rebuilt_before_process_groups_pile_up():
    # Every mesh adds gloo groups (threads, sockets) that live as long as the worker; a pool past
    # _MAX_GROUPS is replaced before the next task instead of slowing every later test.
    from shardbridge.testing._pool import _MAX_GROUPS

    first = run_distributed(_build_meshes, 1, world_size=4)
    pids, groups = {first[0][0]}, [first[0][1]]
    while groups[-1] <= _MAX_GROUPS:
        out = run_distributed(_build_meshes, 5, world_size=4)
        assert out[0][0] in pids, "rebuilt before the limit"
        groups.append(out[0][1])
    assert groups == sorted(groups)  # one worker, groups only pile up
    after = run_distributed(_build_meshes, 1, world_size=4)
    assert after[0][0] not in pids  # a fresh worker ...
    assert after[0][1] < groups[0] + 10  # ... with only the new mesh's groups
