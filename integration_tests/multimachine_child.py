"""One rank of a multi-machine run of integration_tests/test_multimachine.py (not a test module).

Started by torchrun or as a SLURM task (``shardbridge.init_distributed`` reads either), or called
in a worker of the test's gloo pool (:func:`train`: the one-machine reference). Trains the
reference Llama under ``--dp-replicate`` x ``--dp-shard`` x ``--tp``, saves a checkpoint to each
``--save`` path (an error is recorded, not raised: a refused save is what one of them tests),
and writes this rank's report to ``<--report>/rank-<r>.json``: the launcher's environment, the
working directory (which "machine" started it), the ranks of each group, the losses, the saves.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from shardbridge import ParallelDims, checkpoint, init_distributed
from shardbridge.models import Llama, LlamaConfig, parallelize_llama, synthetic_batch

CONFIG = LlamaConfig.tiny()
GROUPS = ("dp_replicate", "dp_shard", "tp", "dp", "weight")
"""The axes whose members (global ranks) each rank reports."""


def train(dims: ParallelDims, steps: int) -> tuple[Any, torch.optim.Optimizer, dict[str, Any]]:
    """The run every launcher does: (model, optimizer, report of losses and groups)."""
    torch.set_num_threads(1)  # one summation order in every process: bit-identical runs
    pm = dims.build_mesh("cpu")
    model = parallelize_llama(Llama(CONFIG, seed=0), pm)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    dp_rank, dp_size = pm["dp"].get_local_rank(), pm.dims.degree("dp")
    losses = []
    for step in range(steps):
        tokens, labels = synthetic_batch(CONFIG, 8, 16, step=step, dp_rank=dp_rank, dp_size=dp_size)
        loss = F.cross_entropy(model(tokens).flatten(0, 1).float(), labels.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        total = loss.detach().clone()
        dist.all_reduce(total, group=pm["dp"].get_group())
        losses.append(total.item() / dp_size)
    groups = {axis: dist.get_process_group_ranks(pm[axis].get_group()) for axis in GROUPS}
    return model, optimizer, {"losses": losses, "groups": groups, "dims": str(pm.dims)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dp-replicate", type=int, default=2)
    p.add_argument("--dp-shard", type=int, default=1)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--save", action="append", default=[], help="save a checkpoint here (repeatable)")
    p.add_argument("--report", required=True, help="folder for rank-<r>.json")
    args = p.parse_args()

    env = init_distributed("gloo")
    dims = ParallelDims(dp_replicate=args.dp_replicate, dp_shard=args.dp_shard, tp=args.tp)
    model, optimizer, report = train(dims, args.steps)
    saves = {}
    for path in args.save:
        try:
            saves[path] = {"saved": str(checkpoint.save(path, model=model, optimizer=optimizer, step=args.steps))}
        except Exception as exc:  # noqa: BLE001 (recorded for the test; every rank raises the same)
            saves[path] = {"error": f"{type(exc).__name__}: {exc}"}
    report.update(
        env={k: getattr(env, k) for k in ("rank", "world_size", "local_rank", "node_rank", "source")},
        cwd=os.getcwd(),
        host=socket.gethostname(),
        saves=saves,
    )
    with open(os.path.join(args.report, f"rank-{dist.get_rank()}.json"), "w") as f:
        json.dump(report, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
