"""transformers' own expert parallelism vs shardbridge's, on the same MoE model and data.

transformers 5.24 trains MoE models with ``from_pretrained(path, distributed_config=
DistributedConfig(fsdp_size=..., tp_size=..., ep_size=..., ep_implementation=...))`` (its
``transformers/distributed/``); shardbridge with ``ShardbridgeAccelerator`` and
``fsdp_config.shardbridge.ep_size``. Both run here on 4 gloo processes from the same
``save_pretrained`` folder (a tiny model of ``--arch``, built from a config in code), on the same
batches (each data-parallel rank its rows of one global batch), AdamW, fp32, and one process runs
the global batch as the oracle. Printed side by side: the losses of every step, their largest
relative difference to one process, the largest parameter difference after the last step, the
parameter bytes each rank stores (experts and all), and the median step time (the contenders'
order alternates between layouts; the shared 2-core machine makes times noisy).

    python tools/bench/bench_hf_ep.py [--arch qwen3_moe] [--steps 4] [--layouts dp4_ep4,dp2_tp2_ep2]

Layouts: ``dp4_ep4`` = fsdp 4 x ep 4; ``dp2_tp2_ep2`` = fsdp 2 x tp 2 x ep 2 (transformers:
``fsdp_size=2, tp_size=2, ep_size=2``). transformers' load-balancing loss is per process
(``output_router_logits`` is left off here, as in transformers' own defaults), so the losses are
the language-model loss alone.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "packages" / "hf-adapter" / "tests"))

LAYOUTS = {
    "dp4_ep4": {"fsdp": 4, "tp": 1, "ep": 4},
    "dp2_tp2_ep2": {"fsdp": 2, "tp": 2, "ep": 2},
}


def _batch(step: int, dp_rank: int, dp_size: int):
    """Data-parallel rank ``dp_rank``'s rows of step ``step``'s global batch (8 x 16 tokens)."""
    import hf_helpers as H

    rows = 8 // dp_size
    return H.global_batch(step, 4)[dp_rank * rows : (dp_rank + 1) * rows]


def _local_bytes(model, experts_only: bool) -> int:
    """Bytes of the parameter shards this rank stores (FSDP2's sharded parameters)."""
    from shardbridge._compat import local_tensor

    total = 0
    for name, p in model.named_parameters():
        if experts_only and ".experts." not in name:
            continue
        local = p
        while hasattr(local, "placements"):
            local = local_tensor(local)
        total += local.numel() * local.element_size()
    return total


def _train(model, opt, dp_rank: int, dp_size: int, steps: int, group=None):
    import torch.distributed as dist

    losses, times = [], []
    for step in range(1, steps + 1):
        ids = _batch(step, dp_rank, dp_size)
        dist.barrier()
        start = time.perf_counter()
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - start)
        mean = loss.detach().clone()
        dist.all_reduce(mean)  # every rank of a tp group holds its dp rank's loss: sum / world = dp mean
        losses.append(mean.item() / dist.get_world_size())
    return losses, statistics.median(times[1:] or times)


def _full(model) -> dict:
    from torch.distributed.tensor import DTensor

    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}


def _native(path: str, layout: dict, steps: int, impl: str) -> dict:
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, DistributedConfig

    config = DistributedConfig(
        fsdp_size=layout["fsdp"], tp_size=layout["tp"], ep_size=layout["ep"], ep_implementation=impl
    )
    model = AutoModelForCausalLM.from_pretrained(path, distributed_config=config, dtype=torch.float32).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dp_rank = dist.get_rank() // layout["tp"]  # transformers' mesh: (pp, fsdp, tp), tp innermost
    losses, step_s = _train(model, opt, dp_rank, layout["fsdp"], steps)
    return {
        "losses": losses,
        "step_s": step_s,
        "expert_bytes": _local_bytes(model, True),
        "param_bytes": _local_bytes(model, False),
        "params": _full(model),
    }


def _shardbridge(path: str, layout: dict, steps: int, impl: str) -> dict:
    import hf_helpers as H
    import torch
    from shardbridge import ParallelDims
    from shardbridge_hf import HFConfig
    from transformers import AutoModelForCausalLM

    acc = H.sb_accelerator(
        ParallelDims(dp_shard=layout["fsdp"], tp=layout["tp"]),
        config=HFConfig(ep_size=layout["ep"], ep_implementation=impl),
    )
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, opt)
    dp_rank = acc.parallel_mesh["dp"].get_local_rank()
    losses, step_s = _train(model, opt, dp_rank, layout["fsdp"], steps)
    return {
        "losses": losses,
        "step_s": step_s,
        "expert_bytes": _local_bytes(model, True),
        "param_bytes": _local_bytes(model, False),
        "params": _full(model),
    }


def _worker(path: str, layouts: list[str], steps: int, impl: str) -> dict:
    import torch

    torch.set_num_threads(1)
    out = {}
    for index, name in enumerate(layouts):
        order = (("transformers", _native), ("shardbridge", _shardbridge))
        for contender, fn in order if index % 2 == 0 else order[::-1]:
            try:
                out[name, contender] = fn(path, LAYOUTS[name], steps, impl)
            except Exception as exc:  # noqa: BLE001 - printed as the result
                out[name, contender] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}
    return out


def _reference(path: str, steps: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(1, steps + 1):
        ids = _batch(step, 0, 1)
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="qwen3_moe", help="transformers model_type (default qwen3_moe)")
    parser.add_argument("--steps", type=int, default=4, help="AdamW steps (default 4)")
    parser.add_argument("--layouts", default="dp4_ep4,dp2_tp2_ep2", help=f"of {list(LAYOUTS)}")
    parser.add_argument("--ep-implementation", default="all_to_all", help="both sides' ep_implementation")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import hf_sweep as S
    from shardbridge.testing import WorkerPool

    layouts = args.layouts.split(",")
    with tempfile.TemporaryDirectory() as root:
        S.build(args.arch, seed=0).save_pretrained(root)
        ref = _reference(root, args.steps)
        pool = WorkerPool(4)
        try:
            results = pool.run(_worker, (root, layouts, args.steps, args.ep_implementation), {}, 3600)
        finally:
            pool.close()
    print(
        f"{args.arch} (tiny: hidden 64, 2 layers, 4 experts top-2), 4 gloo processes, fp32, AdamW lr 1e-3, "
        f"global batch 8 x 16, ep_implementation={args.ep_implementation}"
    )
    print(f"one process losses: {', '.join(f'{x:.6f}' for x in ref['losses'])}")
    for name in layouts:
        for contender in ("transformers", "shardbridge"):
            r = results[0][name, contender]
            if "error" in r:
                print(f"\n{name} {contender}: FAILS: {r['error']}")
                continue
            rel = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], ref["losses"]))
            pdiff = max(float((r["params"][n] - p).abs().max()) for n, p in ref["params"].items() if n in r["params"])
            missing = sorted(set(ref["params"]) - set(r["params"]))
            print(f"\n{name} {contender}")
            print(f"  losses                 {', '.join(f'{x:.6f}' for x in r['losses'])}")
            print(f"  max loss rel diff      {rel:.1e}   (vs one process)")
            print(f"  max |param diff|       {pdiff:.1e}   after step {args.steps}" + (f" MISSING {missing}" if missing else ""))
            print(f"  expert bytes / rank    {max(x[name, contender]['expert_bytes'] for x in results)}")
            print(f"  param bytes / rank     {max(x[name, contender]['param_bytes'] for x in results)}")
            print(f"  median step            {max(x[name, contender]['step_s'] for x in results) * 1e3:.0f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
