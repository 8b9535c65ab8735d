"""The scale model of the checkpoint path (tools/bench/bench_scale.py) at tiny sizes.

Two things it must not fake: the ``.metadata`` it simulates from the layout algebra is what a
real 4-rank gloo save writes for the same layout (an independent oracle), and the collective
rounds and bytes it counts are those the checkpoint code really calls (counted, not modelled).
The full curve is ``nox -s scale`` (docs/benchmarks.md, "Scale").
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from shardbridge.checkpoint import save
from shardbridge.checkpoint.storage._trust import read_metadata
from shardbridge.testing import run_distributed

_PATH = Path(__file__).resolve().parents[4] / "tools" / "bench" / "bench_scale.py"


def _bench():
    name = "shardbridge_bench_scale"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, _PATH)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _tiny():
    # vocab 50 over tp 2 x dp_shard 2: uneven FSDP chunks (13 + 12 rows)
    return _bench().LlamaShape(hidden=16, layers=2, heads=4, kv_heads=2, ffn=24, vocab=50, tp=2, max_shard=2)


_LAYOUTS = {"fsdp2_tp2": (1, 2, 2), "hsdp2_tp2": (2, 1, 2), "fsdp4": (1, 4, 1)}


def _summary(metadata) -> dict:
    """Every key's size, dtype and boxes, and which rank's file holds each box."""
    out = {}
    for key, md in metadata.state_dict_metadata.items():
        if hasattr(md, "chunks"):
            out[key] = (tuple(md.size), str(md.properties.dtype), sorted((tuple(c.offsets), tuple(c.sizes)) for c in md.chunks))
        else:
            out[key] = "bytes"
    files = {}
    for index, info in metadata.storage_data.items():
        files[(index.fqn, tuple(index.offset or ()))] = info.relative_path
    return {"keys": out, "files": dict(sorted(files.items()))}


def _real_save(root: str, layout: tuple[int, int, int]) -> dict | None:
    bench = _bench()
    torch.manual_seed(0)
    model = bench.parallelize(bench.build_module(_tiny()), bench.Layout(dp_replicate=layout[0], dp_shard=layout[1], tp=layout[2]))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    path = save(Path(root) / "ckpt", model=model, optimizer=opt)
    if torch.distributed.get_rank() != 0:
        return None
    return _summary(read_metadata(path))


@pytest.mark.parametrize("name", sorted(_LAYOUTS))
def test_simulated_metadata_is_what_a_real_save_writes(tmp_path, name):
    bench = _bench()
    layout = bench.Layout(dp_replicate=_LAYOUTS[name][0], dp_shard=_LAYOUTS[name][1], tp=_LAYOUTS[name][2])
    real = run_distributed(_real_save, str(tmp_path / "real"), _LAYOUTS[name], world_size=4)[0]
    model = bench.Model(bench.tensors(_tiny()), layout, param_dtype=torch.float32)
    with bench.fake_world(4):
        bench.shardbridge_save(model, tmp_path / "sim")
    simulated = _summary(read_metadata(tmp_path / "sim" / "sb", data_files=False))
    assert simulated["keys"] == real["keys"]
    # A box several ranks hold (AdamW's 0-d steps, the pickled param_groups, and under HSDP every
    # box: dp_replicate copies) is written by one of them, which DCP's dedup picks by the plan sizes
    # so far; the simulation need not pick the same holder. A box one rank holds must be in its file.
    replicated = {k for k, v in real["keys"].items() if v == "bytes" or v[0] == () or _LAYOUTS[name][0] > 1}
    assert {k: f for k, f in simulated["files"].items() if k[0] not in replicated} == {
        k: f for k, f in real["files"].items() if k[0] not in replicated
    }
    assert set(simulated["files"]) == set(real["files"])
    assert set(simulated["files"].values()) <= set(real["files"].values())


def test_rounds_are_constant_and_a_load_moves_no_metadata(tmp_path):
    bench = _bench()
    shape = bench.LlamaShape(hidden=16, layers=2, heads=4, kv_heads=2, ffn=24, vocab=64, tp=2, max_shard=4)
    results = {}
    for world in (8, 64):
        model = bench.Model(bench.tensors(shape), bench.layout_for(shape, world))
        with bench.fake_world(world):
            sb = bench.shardbridge_save(model, tmp_path / str(world))
            meta = (tmp_path / str(world) / "sb" / ".metadata").read_bytes()
            load = bench.shardbridge_load(model, tmp_path / str(world) / "sb")
            dcp = bench.dcp_save(model, tmp_path / str(world))
            # a default group without a CPU backend (NCCL's): the same collectives, on the side group
            nccl = bench.shardbridge_save(model, tmp_path / str(world) / "nccl", backend="nccl")
            nccl_load = bench.shardbridge_load(model, tmp_path / str(world) / "nccl" / "sb", backend="nccl")
        assert nccl.counts.calls == sb.counts.calls and nccl_load.counts.calls == load.counts.calls
        results[world] = (sb, load, dcp, len(meta))
    for i in range(3):  # the same collectives at 8 and 64 ranks, for shardbridge and for DCP
        assert [c[0] for c in results[8][i].counts.calls] == [c[0] for c in results[64][i].counts.calls]
    for world, (_, load, _, metadata) in results.items():
        # every rank derives the records ([Note: derived loads]): two all-reduces of a few int64s, no .metadata
        assert [c[0] for c in load.counts.calls] == ["all_reduce", "all_reduce"], (world, load.counts.calls)
        assert load.counts.rank0_bytes == load.counts.other_bytes < 256 < metadata, (world, load.counts.calls)
    for i in range(2):  # bytes a rank other than 0 moves: the same at 64 ranks as at 8 (within pickling noise)
        small, large = results[8][i].counts, results[64][i].counts
        assert large.other_bytes <= 1.25 * small.other_bytes, (small.calls, large.calls)
