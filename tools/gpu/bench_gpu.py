"""GPU tier benchmarks (one process; `--device cpu --tiny` runs the same code on CPU in seconds).

    torchrun --standalone --nproc-per-node 1 tools/gpu/bench_gpu.py llama [--json out.json]
    torchrun --standalone --nproc-per-node 1 tools/gpu/bench_gpu.py te
    torchrun --standalone --nproc-per-node 1 tools/gpu/bench_gpu.py ckpt
    torchrun --standalone --nproc-per-node 1 tools/gpu/bench_gpu.py llama --device cpu --tiny

llama: reference Llama (~1.1B: dim 2048, 16 layers, vocab 32000) in bf16 through
  parallelize_llama vs plain torch fully_shard (per block, [norm, output], root), and torchao
  float8 (tensorwise, rowwise) vs bf16 - median step time, tokens/s, MFU, peak memory.
te: TE TransformerLayer stack (hidden 4096, ffn 16384, 4 layers) through shardbridge_te in bf16
  vs FP8 recipes (current, delayed, block scaling where supported; MXFP8 where supported).
ckpt: shardbridge checkpoint save/load of model + AdamW state held in GPU memory vs torch.save /
  torch.load of the same local tensors and plain DCP (helpers of tools/bench/bench_checkpoint.py).
MFU = model FLOPs (6 x params x tokens + attention) / step time / 989 TFLOP/s (H100 bf16 dense).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
PEAK = 989e12


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _peak_reset(device):
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _peak_gib(device):
    return round(torch.cuda.max_memory_allocated() / 2**30, 2) if device.type == "cuda" else None


def _time_steps(step, device, warmup, steps):
    times, losses = [], []
    for i in range(warmup + steps):
        _sync(device)
        t0 = time.perf_counter()
        loss = step(i)
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        losses.append(loss)
    return statistics.median(times), losses


def _row(name, sec, tokens, flops_per_token, device, losses, **extra):
    mfu = flops_per_token * tokens / sec / PEAK if device.type == "cuda" else None
    return {
        "name": name,
        "step_s": round(sec, 4),
        "tokens_per_s": round(tokens / sec, 1),
        "mfu": None if mfu is None else round(mfu, 4),
        "peak_gib": _peak_gib(device),
        "losses": [round(x, 4) for x in losses],
        **extra,
    }


# ----------------------------------------------------------------------------- llama


def bench_llama(args, device):
    from shardbridge import ParallelDims, PrecisionPolicy
    from shardbridge.models import Llama, LlamaConfig, parallelize_llama, synthetic_batch
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
    from torch.distributed.fsdp import fully_shard

    if args.tiny:
        cfg, batch, seq = LlamaConfig.tiny(dim=64, intermediate_size=128), 2, 32
    else:
        cfg = LlamaConfig(
            vocab_size=32000,
            dim=2048,
            num_layers=16,
            num_heads=16,
            num_kv_heads=8,
            intermediate_size=5632,
            max_seq_len=2048,
        )
        batch, seq = args.batch, args.seq
    pm = ParallelDims(dp_shard=-1).build_mesh(device.type)

    def build():
        with torch.device("meta"):
            model = Llama(cfg)
        model.to_empty(device=device)
        model.init_weights(seed=0)
        return model

    def plain(model):
        mp = TorchMP(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        mesh = pm["dp_shard"] if "dp_shard" in pm.mesh.mesh_dim_names else pm.mesh
        for block in model.layers:
            fully_shard(block, mesh=mesh, mp_policy=mp)
        fully_shard([model.norm, model.output], mesh=mesh, mp_policy=mp, reshard_after_forward=False)
        fully_shard(model.tok_embeddings, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        return model

    def float8(recipe):
        def make(model):
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training

            convert_to_float8_training(
                model,
                config=Float8LinearConfig.from_recipe_name(recipe),
                module_filter_fn=lambda m, fqn: fqn != "output",
            )
            return parallelize_llama(model, pm, PrecisionPolicy.bf16(), compile=args.compile)

        return make

    contenders = {
        "shardbridge parallelize_llama bf16": lambda m: parallelize_llama(
            m, pm, PrecisionPolicy.bf16(), compile=args.compile
        ),
        "plain fully_shard bf16": plain,
        "torchao float8 tensorwise": float8("tensorwise"),
        "torchao float8 rowwise": float8("rowwise"),
    }
    rows = []
    for name, wrap in contenders.items():
        if args.only and name not in args.only:
            continue
        try:
            _peak_reset(device)
            model = build()
            n_params = sum(p.numel() for p in model.parameters())
            flops_per_token = 6 * (n_params - cfg.vocab_size * cfg.dim) + 6 * cfg.num_layers * seq * cfg.dim
            model = wrap(model)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")

            def step(i, model=model, opt=opt):
                tokens, labels = synthetic_batch(cfg, batch, seq, step=i)
                loss = F.cross_entropy(model(tokens.to(device)).flatten(0, 1).float(), labels.to(device).flatten())
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                return loss.item()

            sec, losses = _time_steps(step, device, args.warmup, args.steps)
            rows.append(_row(name, sec, batch * seq, flops_per_token, device, losses, params=n_params))
            del model, opt
        except Exception as e:  # noqa: BLE001 - the next contender still runs
            rows.append({"name": name, "error": f"{type(e).__name__}: {e}"[:1000]})
        print(json.dumps(rows[-1]), flush=True)
    return {"model": str(cfg), "batch": batch, "seq": seq, "compile": args.compile, "rows": rows}


# ----------------------------------------------------------------------------- te


def bench_te(args, device):
    import shardbridge_te
    import transformer_engine.pytorch as te
    from shardbridge import ParallelDims, PrecisionPolicy
    from transformer_engine.common import recipe as R

    h, ffn, heads, nl, seq, batch = (4096, 16384, 32, 4, args.seq, 2) if not args.tiny else (256, 1024, 8, 2, 128, 2)
    pm = ParallelDims(dp_shard=-1).build_mesh("cuda")
    recipes = {"bf16": None, "current": R.Float8CurrentScaling(), "delayed": R.DelayedScaling()}
    if te.is_fp8_block_scaling_available():
        recipes["block"] = R.Float8BlockScaling()
    if te.is_mxfp8_available():
        recipes["mxfp8"] = R.MXFP8BlockScaling()
    layer_params = 4 * h * h + 2 * h * ffn
    flops_per_token = 6 * layer_params * nl + 6 * seq * h * nl  # causal attention: half of 12*s*h
    rows = []
    for name, recipe in recipes.items():
        for fp8_params in (False, True) if recipe is not None else (False,):
            label = f"{name}{' +fp8 params' if fp8_params else ''}"
            try:
                _peak_reset(device)
                ctx = te.quantized_model_init(enabled=True, recipe=recipe) if fp8_params else contextlib.nullcontext()
                with torch.device("meta"), ctx:
                    model = torch.nn.Sequential(
                        *[
                            te.TransformerLayer(
                                h, ffn, heads, params_dtype=torch.bfloat16, hidden_dropout=0.0, attention_dropout=0.0
                            )
                            for _ in range(nl)
                        ]
                    )
                shardbridge_te.parallelize(model, pm, PrecisionPolicy.bf16())
                opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
                x = torch.randn(seq, batch, h, device=device, dtype=torch.bfloat16)

                def step(i, model=model, opt=opt, recipe=recipe, x=x):
                    with te.autocast(enabled=recipe is not None, recipe=recipe):
                        loss = model(x).float().pow(2).mean()
                    loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    return loss.item()

                sec, losses = _time_steps(step, device, args.warmup, args.steps)
                rows.append(_row(label, sec, batch * seq, flops_per_token, device, losses))
                del model, opt
            except Exception as e:  # noqa: BLE001
                rows.append({"name": label, "error": f"{type(e).__name__}: {e}"[:1000]})
            print(json.dumps(rows[-1]), flush=True)
    return {
        "hidden": h,
        "ffn": ffn,
        "layers": nl,
        "seq": seq,
        "batch": batch,
        "rows": rows,
        "mxfp8_available": str(te.is_mxfp8_available(return_reason=True)),
    }


# ----------------------------------------------------------------------------- ckpt


def bench_ckpt(args, device):
    import bench_checkpoint as bc  # tools/bench/bench_checkpoint.py: same helpers as the CPU benchmark
    import torch.distributed.checkpoint as dcp
    from shardbridge import ParallelDims, checkpoint
    from shardbridge.models import Llama, LlamaConfig, parallelize_llama, synthetic_batch

    cfg = (
        LlamaConfig.tiny()
        if args.tiny
        else LlamaConfig(
            vocab_size=32000, dim=1536, num_layers=12, num_heads=12, num_kv_heads=4, intermediate_size=4096
        )
    )
    pm = ParallelDims(dp_shard=-1).build_mesh(device.type)

    def build():
        with torch.device("meta"):
            model = Llama(cfg)
        model.to_empty(device=device)
        model.init_weights(seed=0)
        model = parallelize_llama(model, pm)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        tokens, labels = synthetic_batch(cfg, 2, 16)
        F.cross_entropy(model(tokens.to(device)).flatten(0, 1), labels.to(device).flatten()).backward()
        opt.step()
        opt.zero_grad()
        return model, opt

    model, opt = build()
    model_b, opt_b = build()
    root = Path(args.dir or tempfile.mkdtemp(prefix="sb-gpu-ckpt-"))
    times = {k: [] for k in ("save", "torch.save", "dcp.save", "load", "torch.load", "dcp.load")}
    size = 0
    for r in range(args.rounds):
        ck, raw, dd = root / f"sb-{r}", root / f"raw-{r}.pt", root / f"dcp-{r}"
        local = bc._local_state(model, opt)
        ops = [
            ("save", lambda ck=ck, r=r: checkpoint.save(ck, model=model, optimizer=opt, step=r)),
            ("torch.save", lambda local=local, raw=raw: torch.save(local, raw)),
            ("dcp.save", lambda dd=dd: dcp.save(bc._dcp_state(model, opt), checkpoint_id=str(dd))),
        ]
        for name, fn in ops if r % 2 == 0 else ops[::-1]:
            _sync(device)
            times[name].append(bc._timed(fn))
        loads = [
            ("load", lambda ck=ck: checkpoint.load(ck, model=model_b, optimizer=opt_b)),
            ("torch.load", lambda raw=raw: torch.load(raw, weights_only=True)),
            ("dcp.load", lambda dd=dd: bc._dcp_load(model_b, opt_b, str(dd))),
        ]
        for name, fn in loads if r % 2 == 0 else loads[::-1]:
            _sync(device)
            times[name].append(bc._timed(lambda fn=fn: (fn(), _sync(device))))
        size = bc._dir_bytes(ck)
        for pth in (ck, dd):
            shutil.rmtree(pth, ignore_errors=True)
        raw.unlink(missing_ok=True)
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    rows = [{"name": k, "seconds": round(v, 4), "GB_per_s": round(size / v / 1e9, 3)} for k, v in med.items()]
    return {
        "model": str(cfg),
        "checkpoint_bytes": size,
        "rounds": args.rounds,
        "rows": rows,
        "save_vs_torch_save": round(med["save"] / med["torch.save"], 3),
        "load_vs_torch_load": round(med["load"] / med["torch.load"], 3),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["llama", "te", "ckpt"])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny model (CPU smoke test)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--compile", action="store_true", help="torch.compile each block (llama)")
    p.add_argument("--only", action="append", help="llama: run only these contenders")
    p.add_argument("--dir", default=None, help="ckpt: where to write (default: a temp dir)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            os.environ.update(
                RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000)
            )
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(0)
    t0 = time.time()
    result = {"llama": bench_llama, "te": bench_te, "ckpt": bench_ckpt}[args.what](args, device)
    result["seconds"] = round(time.time() - t0, 1)
    rows = result.get("rows", [])
    result["failed"] = [r["name"] for r in rows if "error" in r]
    result["summary"] = "; ".join(
        f"{r['name']}: "
        + (
            f"{r['tokens_per_s']} tok/s mfu {r['mfu']}"
            if "tokens_per_s" in r
            else f"{r['GB_per_s']} GB/s"
            if "GB_per_s" in r
            else "ERROR"
        )
        for r in rows
    )
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))
    dist.destroy_process_group()
    return 1 if result["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
