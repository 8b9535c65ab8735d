"""Megatron-FSDP through shardbridge: gradient-communication bytes and step time, side by side.

Prints, in one run on 4 gloo ranks (CPU; the ratios are what matter, not the absolute times):
  1. grad_comm_dtype fp32 vs bf16 (Megatron-FSDP, optim_grads_params): reduce-scatter bytes
     per step, step time, and the bf16/fp32 ratios;
  2. Megatron-FSDP vs torch FSDP2 (core parallelize_llama) on the same model: step time ratio.

    OMP_NUM_THREADS=1 python3 tools/bench/bench_megatron_fsdp.py [--small] [--steps 6] [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from shardbridge import ParallelDims, PrecisionPolicy  # noqa: E402
from shardbridge._comm_stats import count_collectives  # noqa: E402
from shardbridge.models import Llama, LlamaConfig, parallelize_llama, synthetic_batch  # noqa: E402
from shardbridge.testing import run_distributed  # noqa: E402


def _steps(model, opt, cfg, pm, steps: int, seq: int) -> tuple[float, dict[str, int]]:
    times = []
    grad_bytes: dict[str, int] = {}
    for step in range(steps + 1):  # step 0 warms up
        tokens, labels = synthetic_batch(
            cfg, 8, seq, step=step, dp_rank=pm["dp"].get_local_rank(), dp_size=pm["dp"].size()
        )
        start = time.perf_counter()
        with count_collectives() as counts:
            loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1).float(), labels.flatten())
            loss.backward()
        opt.step()
        opt.zero_grad()
        if step:
            times.append(time.perf_counter() - start)
            grad_bytes = dict(counts.bytes)
    return sorted(times)[len(times) // 2], grad_bytes


def _run(kind: str, small: bool, steps: int) -> tuple[float, dict[str, int]]:
    from shardbridge_megatron_fsdp import shard_model

    cfg = (
        LlamaConfig.small(num_layers=2, vocab_size=4096) if small else LlamaConfig.tiny(dim=256, intermediate_size=512)
    )
    seq = 64
    pm = ParallelDims(dp_shard=-1).build_mesh("cpu")
    model = Llama(cfg, seed=0)
    if kind == "fsdp2":
        model = parallelize_llama(model, pm, PrecisionPolicy.fp32())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    else:
        policy = PrecisionPolicy.fp32()
        if kind == "mfsdp_bf16comm":
            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                policy = PrecisionPolicy(grad_comm_dtype=torch.bfloat16)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, opt = shard_model(model, opt, pm, policy, strategy="optim_grads_params")
    return _steps(model, opt, cfg, pm, steps, seq)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--small", action="store_true", help="LlamaConfig.small (2 layers) instead of a tiny model")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=2, help="rounds, alternating the order of the three runs")
    args = parser.parse_args()
    kinds = ["mfsdp_fp32comm", "mfsdp_bf16comm", "fsdp2"]
    times: dict[str, list[float]] = {k: [] for k in kinds}
    grad_bytes: dict[str, dict[str, int]] = {}
    for rnd in range(args.rounds):
        # Alternate the order so slow drift of a shared machine does not favour one run.
        for k in kinds if rnd % 2 == 0 else kinds[::-1]:
            t, b = run_distributed(_run, k, args.small, args.steps, world_size=4, timeout=600)[0]
            times[k].append(t)
            grad_bytes[k] = b
    res = {k: (sorted(times[k])[len(times[k]) // 2], grad_bytes[k]) for k in kinds}
    (t32, b32), (t16, b16), (tf, _) = res["mfsdp_fp32comm"], res["mfsdp_bf16comm"], res["fsdp2"]
    rs32, rs16 = b32.get("reduce_scatter", 0), b16.get("reduce_scatter", 0)
    print(
        f"Megatron-FSDP optim_grads_params, 4 gloo ranks, per step (median of {args.steps} steps; "
        f"median over {args.rounds} rounds in alternating order)"
    )
    print(f"{'':24}{'fp32 comm':>14}{'bf16 comm':>14}{'bf16/fp32':>11}")
    print(f"{'reduce-scatter bytes':24}{rs32:>14,}{rs16:>14,}{rs16 / max(rs32, 1):>11.3f}")
    print(
        f"{'all-gather bytes':24}{b32.get('all_gather', 0):>14,}{b16.get('all_gather', 0):>14,}"
        f"{b16.get('all_gather', 0) / max(b32.get('all_gather', 0), 1):>11.3f}"
    )
    print(f"{'step time (s)':24}{t32:>14.4f}{t16:>14.4f}{t16 / t32:>11.3f}")
    print()
    print(f"{'':24}{'Megatron-FSDP':>14}{'torch FSDP2':>14}{'MFSDP/FSDP2':>12}")
    print(f"{'step time (s), fp32':24}{t32:>14.4f}{tf:>14.4f}{t32 / tf:>12.3f}")


if __name__ == "__main__":
    main()
