"""[Note: symmetric errors]: a failure on some ranks raises on every rank, never hangs."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from shardbridge.checkpoint import _dist
from shardbridge.testing import run_distributed


def _fail_on(bad_rank: int, only_rank0: bool):
    def fn():
        if dist.get_rank() == bad_rank:
            raise ValueError(f"bad thing on {bad_rank}")
        return dist.get_rank()

    try:
        result = _dist.on_all_ranks(fn, only_rank0=only_rank0)
    except ValueError as exc:
        return f"ValueError: {exc}"
    # The next collective still lines up on every rank.
    return result, _dist.broadcast_from_rank0(dist.get_rank() * 10)


def test_error_on_one_rank_raises_on_all():
    results = run_distributed(_fail_on, 2, False, world_size=4)
    assert results[2] == "ValueError: bad thing on 2"
    for r in (0, 1, 3):
        assert results[r] == "ValueError: bad thing on 2 [raised on rank 2; 1 rank(s) failed]"


def test_only_rank0_runs_and_shares_success():
    assert run_distributed(_fail_on, 3, True, world_size=4) == [(0, 0), (None, 0), (None, 0), (None, 0)]
    results = run_distributed(_fail_on, 0, True, world_size=4)
    assert all(r.startswith("ValueError: bad thing on 0") for r in results)


def test_without_process_group_errors_pass_through():
    assert _dist.rank() == 0 and _dist.world_size() == 1 and not _dist.is_distributed()
    with pytest.raises(KeyError):
        _dist.on_all_ranks(lambda: {}["x"])
    assert _dist.broadcast_from_rank0(5) == 5
