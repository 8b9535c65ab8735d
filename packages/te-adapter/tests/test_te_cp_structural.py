"""STRUCTURAL TIER: ``shardbridge_te.set_context_parallel`` on TE 2.20.2's real attention modules.

What it checks: every TE attention inside DotProductAttention / MultiheadAttention /
TransformerLayer gets the cp group of the ParallelMesh, the global ranks, the comm type and
(a2a+p2p) the hierarchical [a2a, p2p] groups whose TE cp rank equals the rank on ``pm["cp"]``.
No kernel runs: numerics of TE's context-parallel attention need a GPU (tier 5). 4 gloo ranks.
"""

from __future__ import annotations

import pytest
from _te_models import build
from shardbridge import ParallelDims
from shardbridge.testing import run_distributed

TIMEOUT = 480  # first use in a fresh pool imports TE in 4 workers (see test_te_structural.py)


def _cp_state(kind: str, dims: dict, comm: str, a2a_size: int | None) -> dict:
    import shardbridge_te
    import torch.distributed as dist

    pm = ParallelDims(**dims).build_mesh("cpu")
    model = build(kind, None, 1)
    done = shardbridge_te.set_context_parallel(model, pm, cp_comm_type=comm, a2a_size=a2a_size)
    out = {"done": done, "cp_ranks": dist.get_process_group_ranks(pm["cp"].get_group()), "attn": [], "mha": []}
    for fqn, m in model.named_modules():
        name = type(m).__name__
        if name == "DotProductAttention":
            groups = m.cp_group if isinstance(m.cp_group, list) else [m.cp_group]
            out["attn"].append(
                (fqn, [dist.get_process_group_ranks(g) for g in groups], list(m.cp_global_ranks), m.cp_comm_type)
            )
        elif name == "MultiheadAttention":
            out["mha"].append((m.cp_size, m.cp_rank))
    out["cp_rank"] = pm["cp"].get_local_rank()
    return out


# Each kind once, each comm type once (the setter stores the type; the kinds differ in recursion).
@pytest.mark.parametrize(
    ("kind", "comm"),
    [("DotProductAttention", "p2p"), ("MultiheadAttention", "all_gather"), ("TransformerLayer", "a2a")],
)
def test_cp_group_reaches_every_te_attention(kind, comm):
    for r in run_distributed(_cp_state, kind, dict(dp_shard=2, cp=2), comm, None, world_size=4, timeout=TIMEOUT):
        assert r["done"] == ["te"]  # the outermost TE module; it recursed
        assert r["attn"], "no DotProductAttention found"
        for _fqn, groups, global_ranks, comm_type in r["attn"]:
            assert groups == [r["cp_ranks"]] and global_ranks == r["cp_ranks"] and comm_type == comm
        assert len(r["cp_ranks"]) == 2
        assert all(mha == (2, r["cp_rank"]) for mha in r["mha"])


def test_a2a_p2p_hierarchical_groups_keep_the_cp_rank():
    for r in run_distributed(
        _cp_state, "MultiheadAttention", dict(dp_shard=1, cp=4), "a2a+p2p", 2, world_size=4, timeout=TIMEOUT
    ):
        ((_, (a2a, p2p), global_ranks, comm),) = r["attn"]
        assert comm == "a2a+p2p" and global_ranks == [0, 1, 2, 3]
        assert len(a2a) == 2 and len(p2p) == 2 and a2a == sorted(a2a) and a2a[1] - a2a[0] == 1  # a2a inner
        assert r["mha"] == [(4, r["cp_rank"])]  # TE's cp rank a2a_size * p2p_rank + a2a_rank == rank on cp


def _bad_arguments() -> bool:
    import shardbridge_te
    from torch import nn

    pm = ParallelDims(dp_shard=1, cp=4).build_mesh("cpu")
    model = build("DotProductAttention", None, 1)
    with pytest.raises(ValueError, match=r"cp_comm_type='ring' is not a TE context-parallel type"):
        shardbridge_te.set_context_parallel(model, pm, cp_comm_type="ring")
    with pytest.raises(ValueError, match=r"a2a\+p2p' with cp=4 needs a2a_size dividing cp"):
        shardbridge_te.set_context_parallel(model, pm, cp_comm_type="a2a+p2p", a2a_size=3)
    with pytest.raises(ValueError, match="holds no TE DotProductAttention"):
        shardbridge_te.set_context_parallel(nn.Linear(2, 2), pm)
    return True


def test_bad_cp_arguments_are_refused():
    assert all(run_distributed(_bad_arguments, world_size=4, timeout=TIMEOUT))
