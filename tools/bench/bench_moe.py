"""Expert parallelism: token dispatch bytes, per-rank expert memory and step time at ep = 1, 2, 4.

The reference MoE (``shardbridge.models.MoELlama``) on 4 gloo processes, dp_shard=4, at every ep
(ep=1: every rank holds 1/4 of every expert, FSDP over all 4; ep=2: experts split in two
halves, each FSDP-sharded over 2 ranks; ep=4: each rank holds a quarter of the experts whole),
for ep > 1 with both dispatches (``all_to_all`` and ``all_gather``). All the layouts' models live
in the same 4 processes and their steps are interleaved round by round, so every layout sees the
same machine load; printed side by side with the theory:

- dispatch bytes per step and rank that cross the network: the all-to-all output rows that come
  from other ranks (``count_collectives``' ``all_to_all_remote``; data and the count exchange)
  against ``4 * layers * T * k * (ep-1)/ep * D * 4`` (dispatch + combine, forward + backward,
  uniform routing) plus the counts; for ``all_gather`` the ``(ep-1)/ep`` of the all-gathered /
  reduce-scattered lists against ``4 * layers * T * D * (ep-1) * 4`` plus routing ids and weights;
- expert memory per rank: the expert parameters it stores (sharded; theory ``total / 4`` at every
  ep) and what FSDP2 all-gathers for one layer's forward (theory ``layer / ep``);
- FSDP all-gather bytes per step (dense and experts);
- step time per step (median over rounds, the slowest rank) and its ratio to ep=1.

    python tools/bench/bench_moe.py [--rounds 6] [--dim 256] [--experts 16] [--top-k 2] [--seq 256]

The 2-core machine runs 4 processes on 2 cores: step times are relative, bytes and memory exact.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

LAYOUTS = [(1, "all_to_all"), (2, "all_to_all"), (2, "all_gather"), (4, "all_to_all"), (4, "all_gather")]


def _config(args):
    from shardbridge.models import MoEConfig

    return MoEConfig.tiny(
        vocab_size=2048,
        dim=args.dim,
        num_layers=args.layers,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=args.dim,
        num_experts=args.experts,
        top_k=args.top_k,
        max_seq_len=args.seq,
    )


def _worker(args) -> dict:
    import torch
    import torch.distributed as dist
    from shardbridge import ParallelDims
    from shardbridge._comm_stats import count_collectives
    from shardbridge.cp import cp_cross_entropy
    from shardbridge.models import MoELlama, parallelize_moe, synthetic_batch

    torch.set_num_threads(1)
    cfg = _config(args)
    models = {}
    for ep, dispatch in LAYOUTS:
        pm = ParallelDims(dp_shard=4, ep=ep).build_mesh("cpu")
        model = parallelize_moe(MoELlama(cfg, seed=0), pm, dispatch=dispatch)
        models[ep, dispatch] = (model, torch.optim.AdamW(model.parameters(), lr=1e-4), pm)
    out: dict = {}
    dp_rank = models[LAYOUTS[0]][2]["dp"].get_local_rank()

    def step(key, index):
        model, opt, pm = models[key]
        tokens, labels = synthetic_batch(cfg, 4 * args.batch, args.seq, step=index, dp_rank=dp_rank, dp_size=4)
        loss = cp_cross_entropy(model(tokens), labels, pm) + cfg.router_aux_loss_coef * model.aux_loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    for key in models:  # warm-up; bytes and memory of one counted step
        model = models[key][0]
        step(key, 0)
        gathered: list[int] = []

        def record(module, args, gathered=gathered):  # after FSDP2's unshard (its hook is prepended)
            gathered.append(_local_bytes(module))

        hooks = [experts.register_forward_pre_hook(record) for experts in model.expert_modules()]
        with count_collectives() as counts:
            loss = step(key, 1)
        for hook in hooks:
            hook.remove()
        out[key] = {
            "loss": loss,
            "bytes": dict(counts.bytes),
            "stored": sum(_local_bytes(e, sharded=True) for e in model.expert_modules()),
            "gathered_layer": max(gathered),
            "tokens": args.batch * args.seq,
            "times": [],
        }
    for index in range(args.rounds):  # interleaved: the same load for every layout
        for key in models:
            dist.barrier()
            start = time.perf_counter()
            step(key, 2 + index)
            out[key]["times"].append(time.perf_counter() - start)
    for key in out:
        out[key]["step_s"] = statistics.median(out[key].pop("times"))
    return out


def _local_bytes(experts, sharded: bool = False) -> int:
    """Bytes of the expert parameters this rank holds now (sharded: FSDP's stored shards)."""
    from shardbridge._compat import local_tensor

    total = 0
    for param in experts.parameters(recurse=False):
        local = local_tensor(param) if hasattr(param, "placements") else param
        while hasattr(local, "placements"):  # FSDP2's unsharded param is a DTensor on ep
            local = local_tensor(local)
        total += local.numel() * local.element_size()
    return total


def _theory(cfg, tokens: int, ep: int, dispatch: str) -> int:
    """Bytes per step and rank that cross the network for the dispatch (uniform routing)."""
    d, k, layers, e = cfg.dim, cfg.top_k, cfg.num_layers, cfg.num_experts
    if ep == 1:
        return 0
    if dispatch == "all_to_all":
        rows = tokens * k * (ep - 1) / ep
        counts = e * 8 * (ep - 1) / ep  # the int64 count exchange, forward only
        return int(layers * (4 * rows * d * 4 + counts))
    # all_gather: x and (backward) its gradient, the partial outputs and their gradient: 4 * T*D,
    # plus routing weights (fp32) and ids (int64) in forward and the weights' gradient backward
    per_peer = 4 * tokens * d * 4 + tokens * k * (4 + 8 + 4) + 8
    return int(layers * per_peer * (ep - 1))


def _mb(n: float) -> str:
    return f"{n / 2**20:.2f}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=6, help="timed steps per layout, interleaved (default 6)")
    parser.add_argument("--dim", type=int, default=256, help="model width = expert width (default 256)")
    parser.add_argument("--layers", type=int, default=2, help="transformer blocks (default 2)")
    parser.add_argument("--experts", type=int, default=16, help="routed experts per layer (default 16)")
    parser.add_argument("--top-k", type=int, default=2, help="experts per token (default 2)")
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank (default 2)")
    parser.add_argument("--seq", type=int, default=256, help="tokens per sequence (default 256)")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    from shardbridge.testing import WorkerPool

    pool = WorkerPool(4)
    try:
        results = pool.run(_worker, (args,), {}, 3600)
    finally:
        pool.close()
    cfg = _config(args)
    layer_experts = 3 * cfg.num_experts * cfg.intermediate_size * cfg.dim * 4  # gate, up, down; fp32
    print(
        f"expert parallelism, reference MoE (dim {cfg.dim}, {cfg.num_layers} layers, {cfg.num_experts} experts of "
        f"width {cfg.intermediate_size}, top-{cfg.top_k}), 4 gloo ranks dp_shard=4, {args.batch} x {args.seq} "
        f"tokens per rank, fp32; {args.rounds} interleaved rounds"
    )
    names = [f"ep={ep}" + ("" if ep == 1 else " a2a" if d == "all_to_all" else " ag") for ep, d in LAYOUTS]
    print(f"\n{'per rank, per step':<44}" + "".join(f"{n:>12}" for n in names))

    def row(title: str, fn) -> None:
        print(f"{title:<44}" + "".join(f"{fn(key):>12}" for key in LAYOUTS))

    def r0(key):
        return results[0][key]

    def dispatch_bytes(key):
        b = r0(key)["bytes"]
        if key[1] == "all_to_all":
            return b.get("all_to_all_remote", 0)
        ep = key[0]
        return (b.get("all_gather_list", 0) + b.get("reduce_scatter_list", 0)) * (ep - 1) / ep

    row("loss at the counted step", lambda k: f"{r0(k)['loss']:.4f}")
    row("dispatch bytes crossing, MB (measured)", lambda k: _mb(dispatch_bytes(k)))
    row("  theory (uniform routing), MB", lambda k: _mb(_theory(cfg, r0(k)["tokens"], *k)))
    row("expert params stored, MB", lambda k: _mb(r0(k)["stored"]))
    row("  theory total/4, MB", lambda k: _mb(cfg.num_layers * layer_experts / 4))
    row("expert params gathered for a layer, MB", lambda k: _mb(r0(k)["gathered_layer"]))
    row("  theory layer/ep, MB", lambda k: _mb(layer_experts / k[0]))
    row("FSDP all-gather bytes (all params), MB", lambda k: _mb(r0(k)["bytes"].get("all_gather", 0)))
    base = max(results[rank][LAYOUTS[0]]["step_s"] for rank in range(4))
    row("step time, ms (median, slowest rank)", lambda k: f"{max(results[r][k]['step_s'] for r in range(4)) * 1e3:.0f}")
    row("  ratio to ep=1", lambda k: f"{max(results[r][k]['step_s'] for r in range(4)) / base:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
