"""GPU tier, TE adapter checks that examples/te/gpu_tier.py does not make (needs a GPU and TE 2.x).

    torchrun --standalone --nproc-per-node 1 tools/gpu/te_checks.py                    # world 1, NCCL
    torchrun --standalone --nproc-per-node 4 tools/gpu/te_checks.py --backend gloo     # dp2 x tp2 on cuda:0
    python tools/gpu/te_checks.py --dry-run                                            # list the checks (CPU)

Checks (each recorded, the next runs even when one fails):
  linear-vs-torch      column->row te.Linear pair (no FP8), forward output and weight gradients vs
                       torch nn.Linear on the same full weights (rel. diff, TF32 tolerance);
  current-params       Float8CurrentScaling FP8 parameters (quantized_model_init): trains, weights
                       are FP8, every module's amax group AND the quantizer's group after an FSDP
                       all-gather = the `weight` mesh's ranks;
  delayed-extra-state  DelayedScaling: train, save, load at another layout (world 4: tp4; world 1:
                       a fresh model), fp8_meta scale / amax history rebuilt from `_extra_state`;
  block-scaled, mxfp8  Float8BlockScaling / MXFP8BlockScaling where TE says the GPU supports them
                       (H100: block scaling yes, MXFP8 no - recorded as unsupported with TE's reason).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import tempfile
import time
import traceback

CHECKS = ("linear-vs-torch", "current-params", "delayed-extra-state", "block-scaled", "mxfp8")
HIDDEN, FFN, HEADS, SEQ, BATCH = 256, 1024, 8, 128, 2


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--backend", choices=["nccl", "gloo"], default="nccl")
    p.add_argument("--json", default=None)
    p.add_argument("--only", default=None, help="comma-separated subset of " + ",".join(CHECKS))
    p.add_argument("--dry-run", action="store_true", help="print the checks and exit (no GPU, no TE)")
    args = p.parse_args()
    only = args.only.split(",") if args.only else list(CHECKS)
    if args.dry_run:
        print("\n".join(c for c in CHECKS if c in only))
        return

    import shardbridge.checkpoint as ckpt
    import shardbridge_te
    import torch
    import torch.distributed as dist
    import transformer_engine.pytorch as te
    from shardbridge import MixedPrecisionPolicy, ParallelDims
    from torch.distributed.tensor import DTensor
    from transformer_engine.common import recipe as R

    dist.init_process_group(args.backend)
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    world, rank = dist.get_world_size(), dist.get_rank()
    dims = {"dp_shard": 2, "tp": 2} if world == 4 else {"dp_shard": -1}
    pm = ParallelDims(**dims).build_mesh("cuda")
    tp = pm.dims.tp
    res: dict = {"world": world, "backend": args.backend, "layout": str(pm.dims), "checks": {}, "failed": []}

    def full(t):
        t = t.full_tensor() if isinstance(t, DTensor) else t
        return (t.dequantize() if hasattr(t, "dequantize") else t).float()

    def layers(tp_size, recipe=None, n=2):
        ctx = te.quantized_model_init(enabled=True, recipe=recipe) if recipe is not None else contextlib.nullcontext()
        with torch.device("meta"), ctx:
            return torch.nn.Sequential(
                *[
                    te.TransformerLayer(
                        HIDDEN,
                        FFN,
                        HEADS,
                        tp_size=tp_size,
                        set_parallel_mode=tp_size > 1,
                        params_dtype=torch.bfloat16,
                        hidden_dropout=0.0,
                        attention_dropout=0.0,
                    )
                    for _ in range(n)
                ]
            )

    def train(model, recipe, steps=3, seed=0):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        torch.manual_seed(seed)
        losses = []
        for _ in range(steps):
            x = torch.randn(SEQ, BATCH, HIDDEN, device="cuda", dtype=torch.bfloat16)
            with te.autocast(enabled=recipe is not None, recipe=recipe):
                loss = model(x).float().pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    def check(name, fn):
        if name not in only:
            return
        t0 = time.time()
        try:
            value = fn()
            ok = value.pop("ok")
        except Exception as e:  # noqa: BLE001
            value, ok = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]}, False
        value["seconds"] = round(time.time() - t0, 2)
        res["checks"][name] = {"ok": ok, **value}
        if not ok:
            res["failed"].append(name)
        if rank == 0:
            print(name, "OK" if ok else "FAILED", json.dumps(value, default=str)[:1500], flush=True)
        dist.barrier()

    def linear_vs_torch():
        with torch.device("meta"):
            model = torch.nn.Sequential(
                te.Linear(HIDDEN, FFN, tp_size=tp, parallel_mode="column", params_dtype=torch.float32),
                te.Linear(FFN, HIDDEN, tp_size=tp, parallel_mode="row", params_dtype=torch.float32),
            )
        shardbridge_te.parallelize(model, pm, MixedPrecisionPolicy.fp32())
        ref = torch.nn.Sequential(torch.nn.Linear(HIDDEN, FFN), torch.nn.Linear(FFN, HIDDEN)).cuda()
        with torch.no_grad():
            for i in range(2):
                ref[i].weight.copy_(full(model[i].weight))
                ref[i].bias.copy_(full(model[i].bias))
        torch.manual_seed(1)
        x = torch.randn(SEQ * BATCH, HIDDEN, device="cuda")
        out, out_ref = model(x), ref(x)
        out.float().pow(2).mean().backward()
        out_ref.pow(2).mean().backward()

        def rel(a, b):
            return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()

        d_out = rel(out.float(), out_ref)
        d_grad = max(rel(full(model[i].weight.grad), ref[i].weight.grad) for i in range(2))
        tol = 2e-2  # TF32 GEMMs
        return {"ok": d_out <= tol and d_grad <= tol, "rel_out": d_out, "rel_weight_grad": d_grad, "tolerance": tol}

    def current_params():
        recipe = R.Float8CurrentScaling()
        model = layers(tp, recipe)
        shardbridge_te.parallelize(model, pm, MixedPrecisionPolicy.bf16())
        losses = train(model, recipe)
        want = sorted(dist.get_process_group_ranks(pm["weight"].get_group()))
        groups, quantizer_groups, fp8_types = {}, {}, set()
        for fqn, m in model.named_modules():
            g = getattr(m, "_shardbridge_amax_group", None)
            if g is not None:
                groups[fqn] = sorted(dist.get_process_group_ranks(g))
        for fqn, prm in model.named_parameters():
            local = prm.to_local() if isinstance(prm, DTensor) else prm
            fp8_types.add(type(local).__name__)
            q = getattr(local, "_quantizer", None)
            qg = getattr(q, "amax_reduction_group", None)
            if qg is not None:
                quantizer_groups[fqn] = sorted(dist.get_process_group_ranks(qg))
        bad = {k: v for k, v in {**groups, **quantizer_groups}.items() if v != want}
        finite = all(map(lambda v: v == v and abs(v) < 1e30, losses))
        return {
            "ok": finite and bool(groups) and not bad and "Float8Tensor" in fp8_types,
            "losses": losses,
            "weight_mesh_ranks": want,
            "modules_with_group": len(groups),
            "quantizers_with_group": len(quantizer_groups),
            "wrong_groups": bad,
            "local_param_types": sorted(fp8_types),
        }

    def delayed_extra_state():
        recipe = R.DelayedScaling()
        model = layers(tp, recipe)
        shardbridge_te.parallelize(model, pm, MixedPrecisionPolicy.bf16())
        losses = train(model, recipe)
        first = next(m for m in model.modules() if hasattr(m, "fp8_meta") and m.fp8_meta.get("scaling_fwd") is not None)
        saved = first.fp8_meta["scaling_fwd"].scale.detach().float().clone()
        dist.broadcast(saved, src=0)
        path = os.path.join(tempfile.gettempdir(), f"sb-te-checks-delayed-w{world}")
        ckpt.save(path, model=model, step=3, overwrite=True)
        dims2 = {"dp_shard": 1, "tp": 4} if world == 4 else {"dp_shard": -1}
        pm2 = ParallelDims(**dims2).build_mesh("cuda")
        other = layers(pm2.dims.tp, recipe)
        shardbridge_te.parallelize(other, pm2, MixedPrecisionPolicy.bf16())
        ckpt.load(path, model=other)
        first2 = next(
            m for m in other.modules() if hasattr(m, "fp8_meta") and m.fp8_meta.get("scaling_fwd") is not None
        )
        got = first2.fp8_meta["scaling_fwd"].scale.detach().float()
        diff = (got - saved).abs().max().item()
        after = train(other, recipe, steps=1, seed=7)
        return {
            "ok": diff == 0.0 and after[0] == after[0],
            "losses": losses,
            "scale_max_diff": diff,
            "scale_rank0": saved.tolist()[:6],
            "loaded_at": str(pm2.dims),
            "loss_after_load": after,
        }

    def scaled(recipe_name, probe_name):
        def run():
            cls = getattr(R, recipe_name, None)
            probe = getattr(te, probe_name, None)
            if cls is None or probe is None:
                return {"ok": True, "supported": False, "reason": f"TE has no {recipe_name}/{probe_name}"}
            try:
                avail = probe(return_reason=True)
            except TypeError:
                avail = (probe(), "")
            avail, reason = avail if isinstance(avail, tuple) else (avail, "")
            if not avail:
                return {"ok": True, "supported": False, "reason": str(reason)}
            recipe = cls()
            out = {"supported": True}
            model = layers(tp, None)
            shardbridge_te.parallelize(model, pm, MixedPrecisionPolicy.bf16())
            out["compute_only_losses"] = train(model, recipe)
            model = layers(tp, recipe)
            shardbridge_te.parallelize(model, pm, MixedPrecisionPolicy.bf16())
            out["fp8_params_losses"] = train(model, recipe)
            out["ok"] = all(v == v for v in out["compute_only_losses"] + out["fp8_params_losses"])
            return out

        return run

    check("linear-vs-torch", linear_vs_torch)
    check("current-params", current_params)
    check("delayed-extra-state", delayed_extra_state)
    check("block-scaled", scaled("Float8BlockScaling", "is_fp8_block_scaling_available"))
    check("mxfp8", scaled("MXFP8BlockScaling", "is_mxfp8_available"))
    res["summary"] = f"{len(res['checks']) - len(res['failed'])}/{len(res['checks'])} ok" + (
        f"; failed {res['failed']}" if res["failed"] else ""
    )
    if rank == 0 and args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1, default=str)
    dist.destroy_process_group()
    raise SystemExit(1 if res["failed"] else 0)


if __name__ == "__main__":
    main()
