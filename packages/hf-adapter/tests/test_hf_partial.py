"""The partial-gradient rule (``shardbridge_hf._styles``): which replicated parameters' gradients are all-reduced over tp, read from the data flow.

One block holds the three cases of [Note: partial gradients over tp] side by side (a per-head
norm on a colwise layer's local heads; a norm between a replicated projection and a colwise
layer, as MLA's ``kv_a_layernorm``; a norm on a replicated input whose output meets the local
heads, as dots3's ``k_rope_only_layernorm``). Oracle: the same block in one process, every
parameter's gradient; and the decision each cell took.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
pytest.importorskip("transformers")

from shardbridge import ParallelDims  # noqa: E402
from shardbridge.testing import run_distributed  # noqa: E402
from shardbridge_hf._tp import apply_tp, resolve_tp_plan  # noqa: E402

HIDDEN, HEADS, HEAD_DIM, LATENT = 16, 4, 4, 8


class Norm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim) + 0.1 * torch.randn(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class Block(nn.Module):
    """Local heads from q_proj and kv_b; a replicated latent + rope part from kv_a (MLA-like)."""

    def __init__(self) -> None:
        super().__init__()
        self.config = SimpleNamespace(qk_rope_head_dim=HEAD_DIM)  # read by the mla_kv_a_proj lowering
        self.q_proj = nn.Linear(HIDDEN, HEADS * HEAD_DIM)
        self.q_norm = Norm(HEAD_DIM)  # local heads in: partial
        self.kv_a = nn.Linear(HIDDEN, LATENT + HEAD_DIM)
        self.kv_norm = Norm(LATENT)  # replicated in, into a colwise layer: complete
        self.rope_norm = Norm(HEAD_DIM)  # replicated in, output meets the local heads: partial
        self.kv_b = nn.Linear(LATENT, HEADS * HEAD_DIM)
        self.o_proj = nn.Linear(HEADS * HEAD_DIM, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, s, -1, HEAD_DIM))
        latent, rope = self.kv_a(x).split([LATENT, HEAD_DIM], dim=-1)
        k = self.kv_b(self.kv_norm(latent)).view(b, s, -1, HEAD_DIM)
        k = k * self.rope_norm(rope)[:, :, None, :]  # broadcast over this rank's heads
        return self.o_proj(torch.tanh(q * k).reshape(b, s, -1))


PLAN = {"q_proj": "colwise", "kv_b": "colwise", "o_proj": "rowwise", "kv_a": "mla_kv_a_proj"}
NORMS = ("q_norm", "kv_norm", "rope_norm")
EXPECTED_PARTIAL = {"q_norm.weight": True, "kv_norm.weight": False, "rope_norm.weight": True}


def _block_and_batch() -> tuple[Block, torch.Tensor]:
    torch.manual_seed(0)
    return Block(), torch.randn(2, 5, HIDDEN)


def _sharded() -> dict:
    pm = ParallelDims(dp_shard=2, tp=2).build_mesh("cpu")
    block, x = _block_and_batch()
    plan = resolve_tp_plan(block, PLAN)
    torch_plan = apply_tp(block, pm["tp"], plan)
    cells = [c for n in NORMS for c in torch_plan[n].cells]
    undecided = [c.partial for c in cells]
    block(x).pow(2).sum().backward()
    grads = {
        n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad) for n, p in block.named_parameters()
    }
    return {
        "plan": {k: v for k, v in plan.items() if isinstance(v, str)},
        "grads": grads,
        "undecided": undecided,
        "partial": {c.name: c.partial for c in cells},
    }


def test_replicated_gradients_are_reduced_exactly_when_partial():
    ref_block, x = _block_and_batch()
    ref_block(x).pow(2).sum().backward()
    for r in run_distributed(_sharded, world_size=4, timeout=120):
        # The norms are unplanned: resolve_tp_plan gives them the data-flow rule.
        assert {n: r["plan"][n] for n in NORMS} == dict.fromkeys(NORMS, "replicated_with_grad_allreduce")
        assert r["undecided"] == [None] * 3  # decided by the first forward's graph, not at apply time
        assert r["partial"] == EXPECTED_PARTIAL
        for name, p in ref_block.named_parameters():
            torch.testing.assert_close(r["grads"][name], p.grad, rtol=1e-5, atol=1e-5, msg=name)


def test_unplanned_modules_in_a_tp_block_get_the_rule_in_any_plan():
    block, _ = _block_and_batch()
    plan = resolve_tp_plan(block, PLAN)
    assert all(plan[n] == "replicated_with_grad_allreduce" for n in NORMS)
    assert "kv_a" not in [n for n in plan if plan[n] == "replicated_with_grad_allreduce"]  # planned
