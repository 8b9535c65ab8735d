"""HF adapter: step time vs the same model parallelized by hand, and all-gathered bytes per step.

Both models (a transformers LlamaForCausalLM built from a config) live in the same 4 gloo
processes and their steps alternate (A B A B ...), so machine noise hits both alike. The
adapter path is ``ShardbridgeAccelerator.prepare``; the by-hand path uses torch's public APIs
only (``parallelize_module`` with the model's plan, ``fully_shard`` per decoder layer, root
last). Bytes come from the core's collective counter over one step, fp32 vs torchao float8.

    python tools/bench/bench_hf.py [--steps 10] [--hidden 256] [--layers 4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "packages" / "hf-adapter" / "tests"))


def _config(hidden: int, layers: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=2048,
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )


def _by_hand(cfg, pm):
    import torch
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    plan = {
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
    }
    for i in range(cfg.num_hidden_layers):
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[f"model.layers.{i}.{name}"] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[f"model.layers.{i}.{name}"] = RowwiseParallel()
    parallelize_module(model, pm["tp"], plan)
    fully_shard(model.model.embed_tokens, mesh=pm.fsdp_mesh)
    for layer in model.model.layers:
        fully_shard(layer, mesh=pm.fsdp_mesh)
    fully_shard([model.model.norm, model.lm_head], mesh=pm.fsdp_mesh, reshard_after_forward=False)
    fully_shard(model, mesh=pm.fsdp_mesh)
    return model


def _adapter(cfg, dims, fp8: bool):
    import hf_helpers
    import torch
    from shardbridge_hf import FP8Config, HFConfig
    from transformers import LlamaForCausalLM

    config = HFConfig(fp8=FP8Config(backend="torchao" if fp8 else "none"))
    acc = hf_helpers.sb_accelerator(dims, config)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, opt = acc.prepare(model, opt)
    return acc, model, opt


def _step(model, opt, ids) -> None:
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()


def _bench(steps: int, hidden: int, layers: int) -> dict:
    import torch
    from shardbridge import ParallelDims
    from shardbridge._comm_stats import count_collectives

    dims = ParallelDims(dp_shard=2, tp=2)
    cfg = _config(hidden, layers)
    acc, adapter, adapter_opt = _adapter(cfg, dims, fp8=False)
    hand = _by_hand(cfg, acc.parallel_mesh)
    hand_opt = torch.optim.AdamW(hand.parameters(), lr=1e-4)
    dp_rank = acc.parallel_mesh["dp"].get_local_rank()
    gen = torch.Generator().manual_seed(dp_rank)
    ids = torch.randint(0, cfg.vocab_size, (2, 128), generator=gen)
    times = {"adapter": [], "hand": []}
    for i in range(steps + 2):
        for name, (model, opt) in (("adapter", (adapter, adapter_opt)), ("hand", (hand, hand_opt))):
            start = time.perf_counter()
            _step(model, opt, ids)
            if i >= 2:  # warm-up
                times[name].append(time.perf_counter() - start)
    with count_collectives() as fp32_counts:
        _step(adapter, adapter_opt, ids)
    out = {name: statistics.median(t) for name, t in times.items()}
    out["fp32_all_gather"] = fp32_counts.bytes.get("all_gather", 0) + fp32_counts.bytes.get("all_gather_into_tensor", 0)
    del adapter, adapter_opt
    try:
        _, fp8_model, fp8_opt = _adapter(cfg, dims, fp8=True)
        _step(fp8_model, fp8_opt, ids)
        with count_collectives() as fp8_counts:
            _step(fp8_model, fp8_opt, ids)
        out["fp8_all_gather"] = fp8_counts.bytes.get("all_gather", 0) + fp8_counts.bytes.get(
            "all_gather_into_tensor", 0
        )
    except ImportError as e:
        out["fp8_all_gather"] = f"n/a ({e})"
    out["all_gather_kinds"] = sorted(fp32_counts.bytes)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from shardbridge.testing import run_distributed

    sys.modules.setdefault("bench_hf", sys.modules[__name__])
    results = run_distributed(_bench, args.steps, args.hidden, args.layers, world_size=4, timeout=900)
    r = results[0]
    print(f"LlamaForCausalLM hidden={args.hidden} layers={args.layers}, dp_shard=2 x tp=2, 4 gloo ranks, rank 0")
    print(f"{'path':<28}{'median step (ms)':>18}{'ratio':>10}")
    print(f"{'adapter (prepare)':<28}{r['adapter'] * 1e3:>18.1f}{r['adapter'] / r['hand']:>10.3f}")
    print(f"{'by hand (torch APIs)':<28}{r['hand'] * 1e3:>18.1f}{1.0:>10.3f}")
    print(f"\nall-gathered bytes per step (rank 0; kinds {r['all_gather_kinds']})")
    print(f"{'fp32':<28}{r['fp32_all_gather']:>18}")
    fp8 = r["fp8_all_gather"]
    ratio = f"{fp8 / r['fp32_all_gather']:>10.3f}" if isinstance(fp8, int) and r["fp32_all_gather"] else ""
    print(f"{'torchao float8':<28}{fp8!s:>18}{ratio}")


if __name__ == "__main__":
    main()
