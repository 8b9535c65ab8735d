"""Per-rank RNG states: restored exactly at the same world size, rank 0's (with a warning) otherwise."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from shardbridge import checkpoint as ck
from shardbridge.checkpoint.state._rng import restore_rng
from shardbridge.testing import run_distributed
from torch import nn


def _rng_round_trip(root: str):
    torch.manual_seed(100 + dist.get_rank())
    model = nn.Linear(2, 2)
    ck.save(f"{root}/c", model=model)
    after_save = torch.rand(3)
    torch.manual_seed(0)  # scramble
    ck.load(f"{root}/c", model=model)
    return after_save, torch.rand(3)


def test_each_rank_restores_its_own_rng_state(tmp_path):
    results = run_distributed(_rng_round_trip, str(tmp_path), world_size=4)
    for after_save, after_load in results:
        assert torch.equal(after_save, after_load)
    assert not torch.equal(results[0][0], results[1][0])  # ranks had different streams
    assert (tmp_path / "c" / "rng" / "rank-00003.pt").exists()

    # Another world size (this one process): rank 0's state, with a warning.
    torch.manual_seed(0)
    with pytest.warns(UserWarning, match="saved by 4 ranks, this run has 1: every rank restores rank 0's"):
        ck.load(tmp_path / "c", model=nn.Linear(2, 2))
    assert torch.equal(torch.rand(3), results[0][0])
    states = torch.load(tmp_path / "c" / "rng" / "rank-00000.pt", weights_only=True)
    assert states["cpu"].dtype == torch.uint8


def test_rng_can_be_left_alone(tmp_path):
    torch.manual_seed(1)
    ck.save(tmp_path / "c", model=nn.Linear(2, 2))
    target = nn.Linear(2, 2)
    torch.manual_seed(2)
    expected = torch.rand(2)
    torch.manual_seed(2)
    ck.load(tmp_path / "c", model=target, rng=False)
    assert torch.equal(torch.rand(2), expected)


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (b"garbage", r"rank-00000.pt"),  # refused by the trusted reader (or: cannot be read)
        ({"gpu": torch.zeros(4, dtype=torch.uint8)}, r"holds \['gpu'\], expected a dict with keys"),
        ([1, 2], r"holds list, expected a dict"),
        ({"cpu": torch.zeros(4)}, r"'cpu' is a torch.float32 tensor of shape \(4,\), expected a 1-D uint8 tensor"),
        ({"cpu": torch.zeros(4, dtype=torch.uint8)}, "holds an invalid CPU generator state"),
    ],
    ids=["garbage", "wrong-keys", "not-a-dict", "wrong-dtype", "wrong-size"],
)
def test_bad_rng_file_is_a_value_error_naming_it(tmp_path, content, match):
    ck.save(tmp_path / "c", model=nn.Linear(2, 2))
    rng_path = tmp_path / "c" / "rng" / "rank-00000.pt"
    if isinstance(content, bytes):
        rng_path.write_bytes(content)
    else:
        torch.save(content, rng_path)
    # restore_rng itself: load's integrity checks may refuse the file earlier (sizes, checksums).
    with pytest.raises(ValueError, match=match) as info:
        restore_rng(tmp_path / "c", 0, 1, 1)
    assert str(rng_path) in str(info.value)
    assert "rng=False" in str(info.value) or "nothing from it was executed" in str(info.value)
