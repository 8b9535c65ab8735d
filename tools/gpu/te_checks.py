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
                       (H100: block scaling yes, MXFP8 no - recorded as unsupported with TE's reason);
  grouped-experts      TE GroupedLinear experts (Megatron-Core's TEGroupedMLP shape) on the ep axis
                       (shardbridge_te.shard_grouped_experts; ep = world for world 2/4/8, else 1)
                       through shardbridge.ep.run_experts with TE's REAL grouped GEMM: outputs, input
                       and expert-weight gradients vs the same experts in plain torch on the full
                       weights (rel. diff, TF32 tolerance); saved with ExpertStateDicts, loaded at
                       ep=1 into zeroed experts: every weight{g} equal to the saved expert g;
  fp8-ckpt             (only with --only fp8-ckpt; stage te-fp8-ckpt) per recipe (current, delayed, block-scaled, mxfp8, nvfp4; skipped where TE says
                       the GPU lacks it) the structural test_te_fp8_checkpoint_structural.py round trip
                       with TE's REAL kernels: quantized_model_init te.Linear (column), parallelize,
                       save; rank 0 reads the checkpoint in a subprocess that cannot import TE / torchao
                       (dcp_to_torch_save + weights_only) and compares with dequantize() (torch.equal);
                       load into the same recipe at another layout (world 4: tp4; world 1: a fresh
                       model) -> dequantize() equal to the saved values (current scaling: within
                       2**-21 relative, its fp32 scale_inv is recomputed); load into a non-FP8
                       te.Linear -> equal.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import tempfile
import time
import traceback

CHECKS = (
    "linear-vs-torch",
    "current-params",
    "delayed-extra-state",
    "block-scaled",
    "mxfp8",
    "grouped-experts",
    "fp8-ckpt",
)
TORCH_ALONE = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("transformer_engine", "transformer_engine_torch", "torchao", "shardbridge_te"):
            raise ImportError("blocked: " + name)
sys.meta_path.insert(0, Block())
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
dcp_to_torch_save(sys.argv[1], sys.argv[2])
sd = torch.load(sys.argv[2], weights_only=True)
flat = sd.get("model", sd)
torch.save({k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}, sys.argv[3])
"""
HIDDEN, FFN, HEADS, SEQ, BATCH = 256, 1024, 8, 128, 2


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--backend", choices=["nccl", "gloo"], default="nccl")
    p.add_argument("--json", default=None)
    p.add_argument("--only", default=None, help="comma-separated subset of " + ",".join(CHECKS))
    # fp8-ckpt runs only when named (its own stage, te-fp8-ckpt): the other stages keep their time.
    p.add_argument("--dry-run", action="store_true", help="print the checks and exit (no GPU, no TE)")
    args = p.parse_args()
    only = args.only.split(",") if args.only else [c for c in CHECKS if c != "fp8-ckpt"]
    if args.dry_run:
        print("\n".join(c for c in CHECKS if c in only))
        return

    import shardbridge.checkpoint as ckpt
    import shardbridge_te
    import torch
    import torch.distributed as dist
    import transformer_engine.pytorch as te
    from shardbridge import ParallelDims, PrecisionPolicy
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
        shardbridge_te.parallelize(model, pm, PrecisionPolicy.fp32())
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
        shardbridge_te.parallelize(model, pm, PrecisionPolicy.bf16())
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
        shardbridge_te.parallelize(model, pm, PrecisionPolicy.bf16())
        losses = train(model, recipe)
        first = next(m for m in model.modules() if hasattr(m, "fp8_meta") and m.fp8_meta.get("scaling_fwd") is not None)
        saved = first.fp8_meta["scaling_fwd"].scale.detach().float().clone()
        dist.broadcast(saved, src=0)
        path = os.path.join(tempfile.gettempdir(), f"sb-te-checks-delayed-w{world}")
        ckpt.save(path, model=model, step=3, overwrite=True)
        dims2 = {"dp_shard": 1, "tp": 4} if world == 4 else {"dp_shard": -1}
        pm2 = ParallelDims(**dims2).build_mesh("cuda")
        other = layers(pm2.dims.tp, recipe)
        shardbridge_te.parallelize(other, pm2, PrecisionPolicy.bf16())
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
            shardbridge_te.parallelize(model, pm, PrecisionPolicy.bf16())
            out["compute_only_losses"] = train(model, recipe)
            model = layers(tp, recipe)
            shardbridge_te.parallelize(model, pm, PrecisionPolicy.bf16())
            out["fp8_params_losses"] = train(model, recipe)
            out["ok"] = all(v == v for v in out["compute_only_losses"] + out["fp8_params_losses"])
            return out

        return run

    def fp8_ckpt():
        import subprocess
        import sys

        probes = {
            "current": ("Float8CurrentScaling", "is_fp8_available"),
            "delayed": ("DelayedScaling", "is_fp8_available"),
            "block-scaled": ("Float8BlockScaling", "is_fp8_block_scaling_available"),
            "mxfp8": ("MXFP8BlockScaling", "is_mxfp8_available"),
            "nvfp4": ("NVFP4BlockScaling", "is_nvfp4_available"),
        }
        dims2 = {"dp_shard": 1, "tp": 4} if world == 4 else {"dp_shard": -1}
        pm2 = ParallelDims(**dims2).build_mesh("cuda")

        def linear(mesh, recipe):  # on meta: parallelize's materialize quantizes each local shard
            ctx = te.quantized_model_init(enabled=True, recipe=recipe) if recipe else contextlib.nullcontext()
            with torch.device("meta"), ctx:
                m = te.Linear(HIDDEN, FFN, bias=True, parallel_mode="column", tp_size=mesh.dims.tp,
                              params_dtype=torch.bfloat16, device="meta")  # fmt: skip
            holder = torch.nn.Sequential(m)
            shardbridge_te.parallelize(holder, mesh, PrecisionPolicy.bf16(), units=[m])
            return holder

        def values(holder):
            out = {}
            for name, prm in holder.named_parameters():
                local = prm.to_local() if isinstance(prm, DTensor) else prm
                plain = local.dequantize() if hasattr(local, "dequantize") else local.detach()
                if isinstance(prm, DTensor):
                    plain = DTensor.from_local(plain, prm.device_mesh, prm.placements, run_check=False,
                                               shape=prm.shape, stride=prm.stride()).full_tensor()  # fmt: skip
                out[name] = plain.detach().cpu().clone()
            return out, sorted(
                {type(p.to_local() if isinstance(p, DTensor) else p).__name__ for p in holder.parameters()}
            )

        def same(got, want, bound):
            worst = max(((got[k].float() - want[k].float()).abs() / want[k].float().abs().clamp_min(1e-30)).max().item()
                        for k in want)  # fmt: skip
            return (all(torch.equal(got[k], want[k]) for k in want) if bound == 0 else worst <= bound), worst

        out, ok = {}, True
        for name, (cls_name, probe_name) in probes.items():
            probe = getattr(te, probe_name, None)
            try:
                avail = probe(return_reason=True) if probe else (False, "no probe")
            except TypeError:
                avail = (probe(), "")
            avail, reason = avail if isinstance(avail, tuple) else (avail, "")
            if not avail or getattr(R, cls_name, None) is None:
                out[name] = {"supported": False, "reason": str(reason)}
                continue
            try:
                recipe = getattr(R, cls_name)()
                path = os.path.join(tempfile.gettempdir(), f"sb-te-fp8-ckpt-{name}-w{world}")
                model = linear(pm, recipe)
                saved, types = values(model)
                ckpt.save(path, model=model, step=1, overwrite=True)
                disk_ok = True
                if rank == 0:
                    tmp = tempfile.mkdtemp()
                    proc = subprocess.run([sys.executable, "-c", TORCH_ALONE, path, f"{tmp}/full.pt", f"{tmp}/plain.pt"],
                                          capture_output=True, text=True, check=False)  # fmt: skip
                    disk = torch.load(f"{tmp}/plain.pt", weights_only=True) if proc.returncode == 0 else {}
                    disk = {k: disk[k] for k in saved if k in disk}
                    disk_ok = proc.returncode == 0 and disk.keys() == saved.keys() and same(disk, saved, 0)[0]
                bound = 2.0**-21 if name == "current" else 0
                other = linear(pm2, recipe)
                ckpt.load(path, model=other)
                reloaded, types2 = values(other)
                fp8_ok, worst = same(reloaded, saved, bound)
                plain = linear(pm2, None)
                ckpt.load(path, model=plain)
                plain_ok = same(values(plain)[0], saved, 0)[0]
                good = disk_ok and fp8_ok and plain_ok
                out[name] = {"supported": True, "ok": good, "types": types, "types_after_load": types2,
                             "disk_equals_dequantize": disk_ok, "fp8_load_ok": fp8_ok, "fp8_load_worst_rel": worst,
                             "non_fp8_load_ok": plain_ok}  # fmt: skip
                ok &= good
            except Exception as e:  # noqa: BLE001
                out[name] = {"supported": True, "ok": False, "error": f"{type(e).__name__}: {e}"}
                ok = False
        return {"ok": ok, "recipes": out, "loaded_at": str(pm2.dims)}

    def grouped_experts():
        # The structural tier runs this with a reference GEMM (test_te_experts_structural.py); here
        # TE's own grouped GEMM computes. E experts of width INTER, top-2 routing, T tokens per rank.
        from shardbridge.ep import run_experts

        num, inter, tokens, top_k = 8, 128, 256, 2
        ep = world if world in (2, 4, 8) else 1
        epm = ParallelDims(dp_shard=-1, ep=ep).build_mesh("cuda")
        local, first = num // ep, epm["ep"].get_local_rank() * (num // ep)
        torch.manual_seed(0)  # the same global weights, tokens and routing on every rank
        w1 = torch.randn(num, 2 * inter, HIDDEN, device="cuda") * 0.05
        w2 = torch.randn(num, HIDDEN, inter, device="cuda") * 0.05
        x_all = torch.randn(world * tokens, HIDDEN, device="cuda")
        probs = torch.randn(world * tokens, num, device="cuda").softmax(-1)
        weights_all, ids_all = probs.topk(top_k, dim=-1)

        class Experts(torch.nn.Module):  # Megatron-Core's TEGroupedMLP: linear_fc1 [2I, D], linear_fc2 [D, I]
            def __init__(self, n):
                super().__init__()
                self.linear_fc1 = te.GroupedLinear(n, HIDDEN, 2 * inter, bias=False, params_dtype=torch.float32)
                self.linear_fc2 = te.GroupedLinear(n, inter, HIDDEN, bias=False, params_dtype=torch.float32)

            def forward(self, x, counts):
                gate, up = self.linear_fc1(x, counts).chunk(2, dim=-1)
                return self.linear_fc2(torch.nn.functional.silu(gate) * up, counts)

        def experts_at(mesh, n, start, fill):
            experts = Experts(n)
            with torch.no_grad():
                for i in range(n):
                    getattr(experts.linear_fc1, f"weight{i}").copy_(fill(w1[start + i]))
                    getattr(experts.linear_fc2, f"weight{i}").copy_(fill(w2[start + i]))
            return shardbridge_te.shard_grouped_experts(experts, mesh, num_experts=num)

        experts = experts_at(epm, local, first, lambda w: w)
        rows = slice(rank * tokens, (rank + 1) * tokens)
        x = x_all[rows].clone().requires_grad_()
        out = run_experts(x, ids_all[rows], weights_all[rows], experts, num_experts=num, mesh=epm)
        out.pow(2).sum().backward()  # the global loss is the sum over ranks
        # plain torch on the full weights, every rank's tokens
        r1, r2 = w1.clone().requires_grad_(), w2.clone().requires_grad_()
        xr = x_all.clone().requires_grad_()
        ref = torch.zeros_like(x_all)
        for slot in range(top_k):
            for e in range(num):
                sel = ids_all[:, slot] == e
                gate, up = (xr[sel] @ r1[e].T).chunk(2, dim=-1)
                y = (torch.nn.functional.silu(gate) * up) @ r2[e].T
                ref = ref.index_add(0, sel.nonzero().flatten(), weights_all[sel, slot, None] * y)
        ref.pow(2).sum().backward()

        def rel(a, b):
            return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()

        dp_cp = epm.dims.degree("dp_cp")  # FSDP2 averages expert gradients over dp_cp (docs/concepts/moe.md)
        d_w = max(
            rel(full(getattr(experts.linear_fc1, f"weight{i}").grad) * dp_cp, r1.grad[first + i]) for i in range(local)
        )
        d_out, d_x = rel(out.detach(), ref.detach()[rows]), rel(x.grad, xr.grad[rows])
        # checkpoint: [E, ...] expert tensors, loaded at ep=1 into zeroed experts
        path = os.path.join(tempfile.gettempdir(), f"sb-te-grouped-experts-w{world}")
        ckpt.save(path, model=experts, step=1, overwrite=True, state_dicts=shardbridge_te.ExpertStateDicts())
        one = ParallelDims(dp_shard=-1, ep=1).build_mesh("cuda")
        loaded = experts_at(one, num, 0, torch.zeros_like)
        ckpt.load(path, model=loaded, state_dicts=shardbridge_te.ExpertStateDicts(), rng=False)
        exact = all(
            torch.equal(full(getattr(loaded.linear_fc1, f"weight{g}")), w1[g])
            and torch.equal(full(getattr(loaded.linear_fc2, f"weight{g}")), w2[g])
            for g in range(num)
        )
        tol = 2e-2  # TF32 GEMMs
        return {
            "ok": d_out <= tol and d_x <= tol and d_w <= tol and exact,
            "ep": ep,
            "rel_out": d_out,
            "rel_input_grad": d_x,
            "rel_weight_grad": d_w,
            "checkpoint_ep_to_ep1_exact": exact,
            "tolerance": tol,
        }

    check("linear-vs-torch", linear_vs_torch)
    check("current-params", current_params)
    check("delayed-extra-state", delayed_extra_state)
    check("block-scaled", scaled("Float8BlockScaling", "is_fp8_block_scaling_available"))
    check("mxfp8", scaled("MXFP8BlockScaling", "is_mxfp8_available"))
    check("grouped-experts", grouped_experts)
    check("fp8-ckpt", fp8_ckpt)
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
