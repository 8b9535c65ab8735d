"""FP8 recipes: bytes all-gathered and reduce-scattered per training step, against fp32 and bf16.

Every recipe of the torchao backend (``shardbridge.fp8``) on a transformers LlamaForCausalLM,
through the hf adapter's ``parallelize`` on 4 gloo ranks: dp_shard 2 x tp 2 (every recipe; mxfp8
through the core's local-shard TP styles) and FSDP dp 4 (mxfp8), each with fp32 and bf16 baselines
in the same layout. Bytes are counted exactly by the core's collective
counter (``shardbridge._comm_stats``: the output of every all-gather, the input of every
reduce-scatter) over one step after a warm-up step, on rank 0: FSDP2's traffic. (TP's and the
float8 amax all-reduces run through DTensor's functional collectives and are not counted.) Also
printed: the fraction of parameters each recipe leaves in high precision, by reason.

    python tools/bench/bench_fp8.py [--hidden 256] [--layers 4]

TE recipes need a GPU (TE's kernels); their bytes are not measured here.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

RECIPES_TP = ("tensorwise", "rowwise", "rowwise_with_gw_hp", "mxfp8")  # mxfp8 at tp 2: hidden % 64 (TP-local % 32)
RECIPES_DP = ("mxfp8",)


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


def _high_precision(model) -> dict[str, int]:
    """Elements left in high precision, by reason (global counts)."""
    from shardbridge import fp8

    converted = set()
    recipe = fp8.recipe_of(model)
    if recipe is not None:
        converted = set(_converted)
    out = {"embedding": 0, "output head (lm_head)": 0, "norms": 0, "other": 0, "fp8": 0}
    for name, p in model.named_parameters():
        owner = name.rpartition(".")[0]
        if owner in converted:
            out["fp8"] += p.numel()
        elif "embed" in name:
            out["embedding"] += p.numel()
        elif "lm_head" in name:
            out["output head (lm_head)"] += p.numel()
        elif "norm" in name:
            out["norms"] += p.numel()
        else:
            out["other"] += p.numel()
    return out


_converted: list[str] = []


def _run(cfg, dims: dict, precision: str, recipe: str | None) -> dict:
    import torch
    from shardbridge import ParallelDims, fp8
    from shardbridge._comm_stats import count_collectives
    from shardbridge_hf import FP8Config, HFConfig
    from shardbridge_hf._parallelize import parallelize
    from transformers import AutoModelForCausalLM

    pm = ParallelDims(**dims).build_mesh("cpu")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    names = {n for n, m in model.named_modules() if fp8.default_module_filter(m, n)} if recipe else set()
    _converted[:] = sorted(names)
    config = HFConfig(precision=precision, fp8=FP8Config(backend="torchao", recipe=recipe) if recipe else FP8Config())
    parallelize(model, pm, config, device=torch.device("cpu"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if recipe:
        fp8.install_step_hook(opt, model)
    mesh = pm["dp"]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (2 * mesh.size(), 128), generator=g)[mesh.get_local_rank() :: mesh.size()]

    def step():
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()

    step()  # warm-up (lazy state, first scales)
    with count_collectives() as counts:
        step()
    return {
        "all_gather": counts.bytes.get("all_gather", 0),
        "reduce_scatter": counts.bytes.get("reduce_scatter", 0),
        "ag_dtypes": sorted(str(d).replace("torch.", "") for d in counts.dtypes.get("all_gather", ())),
        "high_precision": _high_precision(model),
    }


def _bench(hidden: int, layers: int) -> dict:
    cfg = _config(hidden, layers)
    out = {}
    for layout, dims, recipes in (
        ("dp2 x tp2", {"dp_shard": 2, "tp": 2}, RECIPES_TP),
        ("dp4", {"dp_shard": 4}, RECIPES_DP),
    ):
        for precision, recipe in [("fp32", None), ("bf16", None)] + [(p, r) for r in recipes for p in ("fp32", "bf16")]:
            out[(layout, precision, recipe)] = _run(cfg, dims, precision, recipe)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from shardbridge.testing import run_distributed

    sys.modules.setdefault("bench_fp8", sys.modules[__name__])
    r = run_distributed(_bench, args.hidden, args.layers, world_size=4, timeout=1800)[0]
    print(
        f"LlamaForCausalLM hidden={args.hidden} layers={args.layers} vocab=2048, 4 gloo ranks, bytes per step on rank 0"
    )
    head = f"{'layout':<10}{'precision':<10}{'recipe':<20}{'all-gather B':>14}{'vs fp32':>9}{'vs bf16':>9}"
    head += f"{'reduce-scat B':>15}{'vs fp32':>9}  all-gather dtypes"
    print(head)
    for (layout, precision, recipe), v in r.items():
        base32, base16 = r[(layout, "fp32", None)], r[(layout, "bf16", None)]
        print(
            f"{layout:<10}{precision:<10}{recipe or '-':<20}{v['all_gather']:>14}"
            f"{v['all_gather'] / base32['all_gather']:>9.3f}{v['all_gather'] / base16['all_gather']:>9.3f}"
            f"{v['reduce_scatter']:>15}{v['reduce_scatter'] / base32['reduce_scatter']:>9.3f}"
            f"  {','.join(v['ag_dtypes'])}"
        )
    print("\nparameters left in high precision (global elements; fp8 = converted Linear weights)")
    for (layout, precision, recipe), v in r.items():
        if recipe is None or precision != "fp32":
            continue
        hp = v["high_precision"]
        total = sum(hp.values())
        parts = ", ".join(f"{k} {n / total:.2%}" for k, n in hp.items() if k != "fp8" and n)
        print(f"{layout:<10}{recipe:<20} high precision {1 - hp['fp8'] / total:.1%}: {parts}")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "packages" / "hf-adapter" / "tests"))
    main()
