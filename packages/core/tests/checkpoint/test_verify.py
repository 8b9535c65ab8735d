"""Which files each rank hashes in a load's verification (``_verify.hash_share``), at any world size.

Every rank of every ``load(verify=True)`` (the default) and ``load_latest`` computes the whole
assignment in the load's first round, so its cost is per rank: it must not grow with files x
world (docs/benchmarks.md, "Scale").
"""

from __future__ import annotations

import math
import random
import time

import pytest
from shardbridge.checkpoint._verify import hash_share


def _share(files, rank, world_size):
    return list(hash_share(files, rank, world_size))


def _least_loaded(files: dict[str, dict], world_size: int) -> list[list[str]]:
    """The oracle: a data file ``__<w>_<n>.distcp`` to rank ``w % world_size``; every other file largest
    first, each to the least loaded rank, ties to the lowest (a pass over every rank)."""
    load, shares = [0] * world_size, [[] for _ in range(world_size)]
    others = []
    for name in files:
        if name.startswith("__") and name.endswith(".distcp"):
            w = int(name[2:].split("_")[0]) % world_size
            load[w] += files[name]["size"]
            shares[w].append(name)
        else:
            others.append(name)
    for name in sorted(others, key=lambda n: (-files[n]["size"], n)):
        target = min(range(world_size), key=lambda r: (load[r], r))
        load[target] += files[name]["size"]
        shares[target].append(name)
    return [sorted(share) for share in shares]


def _checkpoint_files(world: int, writers: int) -> dict[str, dict]:
    """A checkpoint of ``world`` ranks: one data file per writing rank (sizes differ by a few
    percent, as uneven shards do), one RNG file per rank, ``.metadata``."""
    rng = random.Random(world)
    files = {f"__{w}_0.distcp": {"size": 250_000_000 + rng.randrange(8_000_000)} for w in range(writers)}
    files.update({f"rng/rank-{r:05d}.pt": {"size": 9000} for r in range(world)})
    files[".metadata"] = {"size": 272_000_000}
    return files


@pytest.mark.parametrize("world", [1, 2, 3, 7, 16, 40])
def test_share_is_the_least_loaded_assignment_and_splits_the_files(world):
    rng = random.Random(world)
    # equal sizes, empty files and fewer files than ranks included
    files = {f"f{i:03d}": {"size": rng.choice([0, 5, 5, 9000, rng.randrange(1 << 20)])} for i in range(rng.randrange(1, 60))}
    files.update({f"__{w}_0.distcp": {"size": rng.randrange(1 << 20)} for w in range(rng.randrange(0, 2 * world))})
    shares = [_share(files, rank, world) for rank in range(world)]
    assert shares == _least_loaded(files, world)
    assert sorted(n for share in shares for n in share) == sorted(files)


class _TooMuchWork(Exception):
    pass


def _counted_sizes(limit: int) -> tuple[type, list[int]]:
    """An int whose comparisons are counted (raising past ``limit``: quadratic code stops early)."""
    count = [0]

    def compare(op):
        def method(self, other):
            count[0] += 1
            if count[0] > limit:
                raise _TooMuchWork(f"more than {limit} comparisons of rank loads")
            return op(int(self), int(other))

        return method

    class Size(int):
        __lt__, __le__ = compare(int.__lt__), compare(int.__le__)
        __gt__, __ge__ = compare(int.__gt__), compare(int.__ge__)
        __eq__, __ne__ = compare(int.__eq__), compare(int.__ne__)
        __hash__ = int.__hash__

        def __add__(self, other):
            return Size(int(self) + int(other))

        __radd__ = __add__

    return Size, count


def test_verify_assignment_at_16384_ranks_is_not_quadratic():
    world = 16384
    # work: the rank loads compared per rank stay O(files log world) (a pass over every rank:
    # files x world, stopped once past the bound)
    small = dict(list(_checkpoint_files(world, writers=2048).items())[:4096])
    Size, count = _counted_sizes(limit := 10 * len(small) * math.ceil(math.log2(world)))
    counted = {name: {"size": Size(record["size"])} for name, record in small.items()}
    assert _share(counted, 0, world) == _share(small, 0, world)
    assert 0 < count[0] <= limit
    # time: a rank's share of 405B's checkpoint at 16 x 128 x 8 (one data file per rank, one RNG
    # file per rank). A pass over every rank per file took 44 s per rank on this machine.
    files = _checkpoint_files(world, writers=world)
    start = time.perf_counter()
    mine = _share(files, world - 1, world)
    seconds = time.perf_counter() - start
    assert mine and seconds < 10, seconds


@pytest.mark.parametrize("listing", [True, False])
def test_a_file_that_cannot_be_stated_is_reported_not_raised(tmp_path, monkeypatch, listing):
    """``check_files`` stats a recorded file the listing lacks (a walk skips a directory it cannot
    read); an OSError there is that file "cannot be read", as every other read failure, never raised."""
    from shardbridge.checkpoint.storage._backend import Stored
    from shardbridge.checkpoint.storage._integrity import check_files
    from shardbridge.checkpoint.storage._local import LOCAL, LocalBackend
    from shardbridge.checkpoint.storage._manifest import Manifest

    (tmp_path / "a").write_bytes(b"xy")
    hidden = str(tmp_path / "rng" / "rank-00000.pt")
    files = {"a": {"size": 2, "xxh3_128": "0" * 32}, "rng/rank-00000.pt": {"size": 1, "xxh3_128": "0" * 32}}
    stat = LocalBackend.stat

    def denied(self, path):
        if path == hidden:
            raise PermissionError(13, "Permission denied", path)
        return stat(self, path)

    monkeypatch.setattr(LocalBackend, "stat", denied)
    manifest = Manifest(step=1, world_size=1, has_optimizer=False, files=files)
    problems = check_files(Stored(LOCAL, str(tmp_path), str(tmp_path)), manifest, checksums=False, listing=listing)
    assert [str(p) for p in problems] == [f"rng/rank-00000.pt: cannot be read (PermissionError: [Errno 13] Permission denied: '{hidden}')"]
