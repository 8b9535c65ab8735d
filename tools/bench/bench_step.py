"""Training step time: shardbridge's parallelize_llama vs the same model parallelized by hand.

Both models live in the same gloo processes and their steps alternate (A B A B ...), so machine
noise hits both alike; the table reports the median step time of each and their ratio
(target: shardbridge / by-hand <= 1.02). The by-hand path uses torch's public APIs only:
DTensor.from_local for the fused TP weights, parallelize_module, fully_shard per block, root last.

    python tools/bench/bench_step.py [--layout dp_shard=2,tp=2] [--steps 20] [--model small-ish]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

LAYOUTS = {
    "dp_shard=2,tp=2": {"dp_shard": 2, "tp": 2},
    "dp_shard=4": {"dp_shard": 4, "tp": 1},
    "tp=4": {"dp_shard": 1, "tp": 4},
}


def _model_config():
    from shardbridge.models import LlamaConfig

    return LlamaConfig.tiny(
        vocab_size=2048, dim=256, num_layers=4, num_heads=8, num_kv_heads=4, intermediate_size=704, max_seq_len=256
    )


def _by_hand(model, dp_shard: int, tp: int):
    """torch FSDP2 + TP with no shardbridge code (the fused split written out here)."""
    import torch
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (dp_shard, tp), mesh_dim_names=("dp", "tp"))
    tp_mesh, tp_rank = mesh["tp"], mesh["tp"].get_local_rank()
    cfg = model.config
    hd = cfg.head_dim
    if tp > 1:
        plan = {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
            "output": ColwiseParallel(output_layouts=Replicate()),
        }
        for i, block in enumerate(model.layers):
            q, k, v = block.attention.qkv.weight.detach().split(
                [cfg.num_heads * hd, cfg.num_kv_heads * hd, cfg.num_kv_heads * hd]
            )
            gate, up = block.feed_forward.gate_up.weight.detach().chunk(2)
            for linear, parts in ((block.attention.qkv, (q, k, v)), (block.feed_forward.gate_up, (gate, up))):
                local = torch.cat([p.chunk(tp)[tp_rank] for p in parts])
                full_shape = linear.weight.shape
                dt = DTensor.from_local(local, tp_mesh, [Shard(0)], shape=full_shape, stride=(full_shape[1], 1))
                linear.weight = nn.Parameter(dt)
            plan[f"layers.{i}.attention.qkv"] = ColwiseParallel()
            plan[f"layers.{i}.attention.o_proj"] = RowwiseParallel()
            plan[f"layers.{i}.feed_forward.gate_up"] = ColwiseParallel()
            plan[f"layers.{i}.feed_forward.down"] = RowwiseParallel()
        parallelize_module(model, tp_mesh, plan)
    if dp_shard > 1:
        dp_mesh = mesh["dp"]
        fully_shard(model.tok_embeddings, mesh=dp_mesh)
        for block in model.layers:
            fully_shard(block, mesh=dp_mesh)
        fully_shard([model.norm, model.output], mesh=dp_mesh, reshard_after_forward=False)
        fully_shard(model, mesh=dp_mesh)
    return model, mesh["dp"].get_local_rank()


def _worker(layout: dict[str, int], steps: int, batch: int, seq: int) -> dict[str, list[float]]:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from shardbridge import ParallelDims
    from shardbridge.models import Llama, parallelize_llama, synthetic_batch

    cfg = _model_config()
    pm = ParallelDims(dp_shard=layout["dp_shard"], tp=layout["tp"]).build_mesh("cpu")
    ours = parallelize_llama(Llama(cfg, seed=0), pm)
    hand, hand_dp_rank = _by_hand(Llama(cfg, seed=0), layout["dp_shard"], layout["tp"])
    assert hand_dp_rank == pm["dp"].get_local_rank()
    runs = {
        "shardbridge": (ours, torch.optim.AdamW(ours.parameters(), lr=1e-3)),
        "by hand": (hand, torch.optim.AdamW(hand.parameters(), lr=1e-3)),
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    losses: dict[str, list[float]] = {name: [] for name in runs}
    warmup = 2
    for step in range(warmup + steps):
        tokens, labels = synthetic_batch(
            cfg, batch, seq, step=step, dp_rank=pm["dp"].get_local_rank(), dp_size=layout["dp_shard"]
        )
        order = list(runs) if step % 2 == 0 else list(reversed(runs))
        for name in order:
            model, opt = runs[name]
            dist.barrier()
            start = time.perf_counter()
            loss = F.cross_entropy(model(tokens).flatten(0, 1), labels.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            dist.barrier()
            if step >= warmup:
                times[name].append(time.perf_counter() - start)
                losses[name].append(loss.item())
    return {"times": times, "losses": losses}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layout", choices=sorted(LAYOUTS), action="append", help="repeatable; default: all")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    from shardbridge.testing import WorkerPool

    print(
        f"model: {_model_config()}\nbatch {args.batch_size} x seq {args.seq_len}, {args.steps} timed steps each, alternating\n"
    )
    rows = []
    pool = WorkerPool(4)
    try:
        for name in args.layout or list(LAYOUTS):
            result = pool.run(_worker, (LAYOUTS[name], args.steps, args.batch_size, args.seq_len), {}, timeout=3600)[0]
            ours = statistics.median(result["times"]["shardbridge"])
            hand = statistics.median(result["times"]["by hand"])
            same = result["losses"]["shardbridge"] == result["losses"]["by hand"]
            rows.append((name, ours * 1e3, hand * 1e3, ours / hand, "identical" if same else "DIFFER"))
    finally:
        pool.close()
    print(f"{'layout (4 gloo ranks)':<22} {'shardbridge ms':>15} {'by hand ms':>11} {'ratio':>7}  losses")
    for name, ours, hand, ratio, same in rows:
        print(f"{name:<22} {ours:>15.1f} {hand:>11.1f} {ratio:>7.3f}  {same}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.exit(main())
