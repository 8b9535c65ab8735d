"""Context parallelism: activation memory, step time and communication at cp = 1, 2, 4.

One long sequence (default 8192 tokens) through the reference Llama, run at every cp degree
on ``cp`` gloo processes (cp=1: one process, plain causal SDPA), for cp > 1 with both of the
core's attentions (``comm="all_gather"`` and ``comm="ring"``). Printed side by side:

- activation memory per rank: bytes of the tensors autograd saves for backward (unique
  storages, parameters excluded), measured with ``torch.autograd.graph.saved_tensors_hooks``
  on a model whose attention spans cp and whose parameters are replicated (no FSDP), so what
  is counted is activations only; plus the peak RSS of each process (everything: torch,
  parameters, transient buffers; noisy);
- step time per rank (median after a warm-up step) of ``parallelize_llama`` (FSDP2 over
  dp_shard_cp = cp) + AdamW, forward, backward and optimizer step;
- the bytes cp attention moves per step and rank (``count_collectives``: all-gather OUTPUT
  bytes and reduce-scatter INPUT bytes, the core's convention), next to the theoretical
  all-gather volume and what a ring (p2p, torch's / TE's) would send.

torch's own ring attention (``torch.distributed.tensor.experimental.context_parallel``) is
tried on the same model at cp=2 and its result (or error) printed: on CPU/gloo in torch 2.13
it fails (pytorch#147793), so the comparison of the two needs a GPU.

    python tools/bench/bench_cp.py [--seq 8192] [--steps 3] [--cps 1,2,4] [--dim 64 --layers 2]

cp=4 runs 4 processes: on a 2-core machine they share cores, so step time does not fall
there; memory and bytes do not depend on cores.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time


def _config(seq: int, dim: int, layers: int):
    from shardbridge.models import LlamaConfig

    return LlamaConfig.tiny(dim=dim, num_layers=layers, num_heads=4, num_kv_heads=2, max_seq_len=seq)


def _saved_bytes(fn, exclude: set[int]) -> int:
    """Bytes of the unique storages autograd saves while ``fn`` runs (activations)."""
    import torch

    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in exclude:
            seen[ptr] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def _worker(cp: int, comm: str, seq: int, steps: int, dim: int, layers: int) -> dict:
    import torch
    import torch.distributed as dist
    from shardbridge import ParallelDims
    from shardbridge._comm_stats import count_collectives
    from shardbridge._cp import RING_BYTES_SENT
    from shardbridge.cp import cp_cross_entropy, cp_split
    from shardbridge.models import Llama, parallelize_llama, synthetic_batch

    torch.set_num_threads(1)
    cfg = _config(seq, dim, layers)
    pm = ParallelDims(dp_shard=1, cp=cp).build_mesh("cpu")
    tokens, labels = synthetic_batch(cfg, 1, seq)
    local_tokens, local_labels = cp_split(tokens, pm["cp"]), cp_split(labels, pm["cp"])
    out: dict = {"local_tokens": local_tokens.numel()}

    # 1. activation memory and cp bytes: params replicated, attention over cp, no FSDP.
    plain = Llama(cfg, seed=0)
    if cp > 1:
        plain.set_context_parallel(pm["cp"], comm=comm)
    params = {p.untyped_storage().data_ptr() for p in plain.parameters()}

    def forward() -> torch.Tensor:
        return cp_cross_entropy(plain(local_tokens), local_labels, pm)

    out["activation_bytes"] = _saved_bytes(forward, params)
    RING_BYTES_SENT[0] = 0
    with count_collectives() as counts:
        forward().backward()
    out["ring_bytes"] = RING_BYTES_SENT[0]
    out["all_gather_bytes"] = counts.bytes["all_gather"]
    out["reduce_scatter_bytes"] = counts.bytes["reduce_scatter"]
    out["all_reduce_bytes"] = counts.bytes["all_reduce"]
    plain = None  # free it before the timed model

    # 2. step time: parallelize_llama (FSDP2 over dp_shard_cp) + AdamW.
    model = parallelize_llama(Llama(cfg, seed=0), pm, cp_comm=comm)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    times, losses = [], []
    for _ in range(steps + 1):
        dist.barrier()
        start = time.perf_counter()
        loss = cp_cross_entropy(model(local_tokens), local_labels, pm)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    out["step_s"] = statistics.median(times[1:])
    out["first_loss"] = losses[0]
    out["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if cp == 2 and comm == "all_gather":
        out["torch_ring"] = _try_torch_ring(cfg, pm, tokens, labels)
    return out


def _try_torch_ring(cfg, pm, tokens, labels) -> str:
    """torch's context_parallel on the plain Llama (replicated params): its loss, or its error."""
    import torch.nn.functional as F
    from shardbridge.models import Llama

    try:
        from torch.distributed.tensor.experimental import context_parallel
    except ImportError as exc:  # pragma: no cover - older torch
        return f"not importable: {exc}"
    model = Llama(cfg, seed=0)  # max_seq_len == seq: the rope tables are sequence-long buffers
    tokens, labels = tokens.clone(), labels.clone()
    try:
        start = time.perf_counter()
        with context_parallel(
            pm["cp"],
            buffers=[tokens, labels, model.rope_cos, model.rope_sin],
            buffer_seq_dims=[1, 1, 0, 0],
        ):
            loss = F.cross_entropy(model(tokens).flatten(0, 1), labels.flatten())
            loss.backward()
        return f"ran: local loss {loss.item():.4f}, {time.perf_counter() - start:.2f} s"
    except Exception as exc:  # noqa: BLE001 - report whatever torch raises
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return f"FAILS on {pm.mesh.device_type}: {type(exc).__name__}: {first[:150]}"


def _mb(n: float) -> str:
    return f"{n / 2**20:.1f}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=8192, help="tokens in the sequence (default 8192)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per cp (default 3, after 1 warm-up)")
    parser.add_argument("--cps", default="1,2,4", help="cp degrees to run (default 1,2,4)")
    parser.add_argument("--dim", type=int, default=64, help="model width (default 64: LlamaConfig.tiny)")
    parser.add_argument("--layers", type=int, default=2, help="transformer blocks (default 2)")
    args = parser.parse_args(argv)
    cps = [int(c) for c in args.cps.split(",")]
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    from shardbridge.cp import check_cp_seq_len
    from shardbridge.testing import WorkerPool

    for cp in cps:
        check_cp_seq_len(args.seq, cp)
    cfg = _config(args.seq, args.dim, args.layers)
    runs = [(cp, "all_gather") for cp in cps] + [(cp, "ring") for cp in cps if cp > 1]
    runs.sort()
    results = {}
    for cp, comm in runs:  # a fresh pool per run: peak RSS is per run
        pool = WorkerPool(cp)
        try:
            results[cp, comm] = pool.run(_worker, (cp, comm, args.seq, args.steps, args.dim, args.layers), {}, 1800)
        finally:
            pool.close()

    kv_bytes = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4 * args.seq  # K+V, all layers, fp32
    print(
        f"context parallelism, reference Llama (dim {cfg.dim}, {cfg.num_layers} layers, {cfg.num_heads} q / "
        f"{cfg.num_kv_heads} kv heads), one sequence of {args.seq} tokens, fp32, gloo on CPU"
    )
    names = {
        (cp, comm): f"cp={cp}" + ("" if cp == 1 else " ag" if comm == "all_gather" else " ring") for cp, comm in runs
    }

    def header(title: str) -> None:
        print(f"\n{title:<46}" + "".join(f"{names[r]:>12}" for r in runs))

    def row(name: str, fn) -> None:
        print(f"{name:<46}" + "".join(f"{fn(r, results[r]):>12}" for r in runs))

    base = results[runs[0]]
    base_step = max(x["step_s"] for x in base)
    header("per rank (ag = all-gather KV, ring = p2p)")
    row("tokens", lambda r, res: res[0]["local_tokens"])
    row("activation memory, MB (saved for backward)", lambda r, res: _mb(res[0]["activation_bytes"]))
    row(
        f"  ratio to {names[runs[0]]}", lambda r, res: f"{res[0]['activation_bytes'] / base[0]['activation_bytes']:.3f}"
    )
    row("  ideal 1/cp", lambda r, res: f"{runs[0][0] / r[0]:.3f}")
    row("peak RSS, MB (max over ranks)", lambda r, res: _mb(max(x["peak_rss"] for x in res)))
    row("step time, ms (median, max over ranks)", lambda r, res: f"{max(x['step_s'] for x in res) * 1e3:.0f}")
    row(f"  ratio to {names[runs[0]]}", lambda r, res: f"{max(x['step_s'] for x in res) / base_step:.3f}")
    row("first loss (global, every rank)", lambda r, res: f"{res[0]['first_loss']:.5f}")

    header("cp attention bytes per step and rank, MB")
    row("all-gather output (measured: K, V, positions)", lambda r, res: _mb(res[0]["all_gather_bytes"]))
    row("  theory: K+V of the whole sequence", lambda r, res: _mb(kv_bytes if r[0] > 1 and r[1] == "all_gather" else 0))
    row(
        "  theory: received, (cp-1)/cp of it",
        lambda r, res: _mb(kv_bytes * (r[0] - 1) / r[0] if r[1] == "all_gather" else 0),
    )
    row("reduce-scatter input (measured: dK, dV)", lambda r, res: _mb(res[0]["reduce_scatter_bytes"]))
    row("ring p2p sent (measured: K, V, dK, dV)", lambda r, res: _mb(res[0]["ring_bytes"]))
    row(
        "  theory: (cp-1) KV fwd + (cp-1) KV, cp dKV bwd",
        lambda r, res: _mb(kv_bytes / r[0] * (3 * r[0] - 2) if r[1] == "ring" else 0),
    )
    row("all-reduce, bytes (loss and token count)", lambda r, res: res[0]["all_reduce_bytes"])
    if (2, "all_gather") in results:
        print(f"\ntorch context_parallel (ring over SDPA) at cp=2: {results[2, 'all_gather'][0]['torch_ring']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
