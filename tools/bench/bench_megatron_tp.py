"""Megatron-FSDP x TP: the full TP plan (row-parallel o_proj/down) vs the old column-only plan.

Until issue 12 the megatron adapter could not shard row-parallel (``Shard(1)``) parameters and
turned o_proj/down column-parallel instead (input ``Shard(-1) -> Replicate`` all-gather before
each, output ``Shard(-1) -> Replicate`` all-gather after) and kept the embedding replicated over
tp. This prints, in one run on 4 gloo ranks (dp_shard 2 x tp 2, optim_grads_params, fp32):

  * TP collectives per training step (forward + backward), counted by torch's
    ``CommDebugMode`` (DTensor redistributions, i.e. tensor parallelism only), and the bytes of
    the activations they move, from the shapes; Megatron-FSDP's own FSDP collectives are
    counted separately with ``count_collectives`` (they are the same for both plans up to
    the embedding, which the column-only plan does not shard over tp);
  * the step time (median of ``--steps`` steps, median over rounds in alternating order);
  * the loss after the steps (both plans compute the same function: equal up to rounding).

    OMP_NUM_THREADS=1 python3 tools/bench/bench_megatron_tp.py [--steps 6] [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from shardbridge import ParallelDims  # noqa: E402
from shardbridge._comm_stats import count_collectives  # noqa: E402
from shardbridge.fused import shard_fused  # noqa: E402
from shardbridge.models import Llama, LlamaConfig, synthetic_batch  # noqa: E402
from shardbridge.testing import run_distributed  # noqa: E402
from shardbridge.tp import check_tp_divides  # noqa: E402

BATCH, SEQ = 8, 64


def _column_only(model: Llama, tp_mesh) -> None:
    """The removed workaround, reconstructed as the baseline: every TP weight on dim 0."""
    from shardbridge.fused import FUSED_SPECS_ATTR
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    cfg = model.config
    check_tp_divides(
        {"num_kv_heads": cfg.num_kv_heads, "intermediate_size": cfg.intermediate_size}, tp_mesh.size(), owner="cfg."
    )
    plan = {"output": ColwiseParallel(output_layouts=Replicate())}
    for index, block in enumerate(model.layers):
        for linear in (block.attention.qkv, block.feed_forward.gate_up):
            spec = getattr(linear, FUSED_SPECS_ATTR)["weight"]
            linear.weight = torch.nn.Parameter(shard_fused(linear.weight.detach(), spec, tp_mesh))
        prefix = f"layers.{index}"
        plan[f"{prefix}.attention.qkv"] = ColwiseParallel()
        plan[f"{prefix}.feed_forward.gate_up"] = ColwiseParallel()
        for name in ("attention.o_proj", "feed_forward.down"):
            plan[f"{prefix}.{name}"] = ColwiseParallel(input_layouts=Shard(-1), output_layouts=Replicate())
    parallelize_module(model, tp_mesh, plan)


def _run(plan: str, steps: int) -> dict[str, object]:
    from shardbridge_megatron_fsdp import apply_llama_tp, shard_model
    from torch.distributed.tensor.debug import CommDebugMode

    cfg = LlamaConfig.tiny(dim=256, intermediate_size=512, num_kv_heads=4)
    pm = ParallelDims(dp_shard=2, tp=2).build_mesh("cpu")
    model = Llama(cfg, seed=0)
    if plan == "row":
        apply_llama_tp(model, pm["tp"])
    else:
        _column_only(model, pm["tp"])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = shard_model(model, opt, pm, strategy="optim_grads_params")
    times, tp_counts, fsdp_bytes, loss = [], {}, {}, 0.0
    for step in range(steps + 1):  # step 0 warms up
        tokens, labels = synthetic_batch(
            cfg, BATCH, SEQ, step=step, dp_rank=pm["dp"].get_local_rank(), dp_size=pm["dp"].size()
        )
        start = time.perf_counter()
        with CommDebugMode() as comm, count_collectives() as counts:
            out = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1).float(), labels.flatten())
            out.backward()
        opt.step()
        opt.zero_grad()
        if step:
            times.append(time.perf_counter() - start)
            # functional collectives = DTensor redistributions (TP); c10d ops = Megatron-FSDP's own
            tp_counts = {
                str(k).rsplit(".", 1)[-1]: v for k, v in comm.get_comm_counts().items() if "functional" in str(k)
            }
            fsdp_bytes = dict(counts.bytes)
            loss = out.item()
    return {"time": sorted(times)[len(times) // 2], "tp": tp_counts, "fsdp": fsdp_bytes, "loss": loss}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=2, help="rounds, alternating the order of the two runs")
    args = parser.parse_args()
    plans = ["row", "column_only"]
    runs: dict[str, list[dict]] = {p: [] for p in plans}
    for rnd in range(args.rounds):
        for plan in plans if rnd % 2 == 0 else plans[::-1]:
            runs[plan].append(run_distributed(_run, plan, args.steps, world_size=4, timeout=600)[0])
    t = {p: sorted(r["time"] for r in runs[p])[len(runs[p]) // 2] for p in plans}
    row, col = runs["row"][-1], runs["column_only"][-1]
    print(
        f"Megatron-FSDP dp_shard 2 x tp 2, optim_grads_params, fp32, 4 gloo ranks, Llama tiny (dim 256, "
        f"intermediate 512), batch {BATCH} x seq {SEQ}; median of {args.steps} steps, over {args.rounds} rounds"
    )
    print(f"{'per step (rank 0)':34}{'row (full plan)':>18}{'column-only':>14}{'row/column':>12}")
    for op in sorted(set(row["tp"]) | set(col["tp"])):
        a, b = row["tp"].get(op, 0), col["tp"].get(op, 0)
        print(f"{'TP ' + op + ' calls':34}{a:>18}{b:>14}{(a / b if b else float('nan')):>12.2f}")
    for kind in sorted(set(row["fsdp"]) | set(col["fsdp"])):
        a, b = row["fsdp"].get(kind, 0), col["fsdp"].get(kind, 0)
        print(f"{'FSDP ' + kind + ' bytes':34}{a:>18,}{b:>14,}{(a / b if b else float('nan')):>12.3f}")
    print(f"{'step time (s)':34}{t['row']:>18.4f}{t['column_only']:>14.4f}{t['row'] / t['column_only']:>12.3f}")
    print(f"{'loss after the last step':34}{row['loss']:>18.6f}{col['loss']:>14.6f}")


if __name__ == "__main__":
    main()
