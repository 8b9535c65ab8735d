"""Pretrained weights: shard-on-read (``accelerator.load_pretrained``) vs ``from_pretrained`` on every rank.

One run, both paths, side by side, on 4 gloo ranks (dp_shard=2 x tp=2) of one machine. A
transformers Llama of ``--mb`` megabytes (fp32) is written once with ``save_pretrained`` (sharded
safetensors + index). Then, each path in FRESH processes (so one path's peak cannot hide the
other's), alternating ``--rounds`` times:

- shard-on-read: model built under ``torch.device("meta")`` (allocates nothing),
  ``prepare`` (TP + FSDP2 on meta, shards allocated), ``load_pretrained(folder)``: each rank
  reads its slices;
- baseline: ``AutoModelForCausalLM.from_pretrained(folder)`` on every rank (what users do today),
  ``prepare`` (TP + FSDP2, rank 0's weights broadcast so all ranks agree).

Per rank: peak resident memory above the process's resident memory after imports and process-group
setup and a first model construction on meta (transformers' lazy imports, ~130 MB whatever the
model size) (``VmHWM - VmRSS`` from /proc: anonymous memory plus the touched pages of
memory-mapped files), and the wall time from model construction to a sharded, loaded model. Both paths must
give the same local shards (checked: the sum of every local shard).

    python tools/bench/bench_pretrained.py [--mb 200] [--rounds 2]

Keep ``--mb`` small enough for the machine: the baseline holds ~2-3 x the model per rank.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "packages" / "hf-adapter" / "tests"))

WORLD = 4


def _config(mb: int):
    from transformers import LlamaConfig

    # ~4 bytes x params; hidden 768, vocab 16384; layers scale the size (~25 MB each).
    hidden, vocab, inter = 768, 16384, 2048
    per_layer = (2 * hidden * hidden + 2 * hidden * 256 + 3 * hidden * inter + 2 * hidden) * 4
    fixed = 2 * vocab * hidden * 4
    layers = max(1, round((mb * 2**20 - fixed) / per_layer))
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=12,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _worker(rank: int, path: str, folder: str, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD))
    import torch

    torch.set_num_threads(1)
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    import hf_helpers
    from shardbridge import ParallelDims
    from torch.distributed.tensor import DTensor
    from transformers import AutoConfig, AutoModelForCausalLM

    acc = hf_helpers.sb_accelerator(ParallelDims(dp_shard=2, tp=2))
    # transformers imports the model's modules on first use (~130 MB, any model size): pay it before rss0.
    with torch.device("meta"):
        AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    dist.barrier()
    rss0 = _status("VmRSS")
    start = time.perf_counter()
    if path == "shard_on_read":
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
        model, _ = acc.prepare(model, torch.optim.AdamW(model.parameters()))
        acc.load_pretrained(folder)
    else:
        model = AutoModelForCausalLM.from_pretrained(folder)
        model, _ = acc.prepare(model, torch.optim.AdamW(model.parameters()))
    seconds = time.perf_counter() - start
    peak = _status("VmHWM") - rss0
    with torch.no_grad():
        checksum = sum(
            float((p.to_local() if isinstance(p, DTensor) else p).double().sum()) for p in model.parameters()
        )
    dist.barrier()
    Path(out, f"{rank}.json").write_text(json.dumps({"seconds": seconds, "peak": peak, "checksum": checksum}))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(path: str, folder: str) -> list[dict]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_worker, args=(path, folder, _free_port(), out), nprocs=WORLD, join=True)
        return [json.loads(Path(out, f"{r}.json").read_text()) for r in range(WORLD)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--mb", type=int, default=150, help="model size in MB (fp32); the baseline holds ~2 x it per rank"
    )
    parser.add_argument("--rounds", type=int, default=2, help="alternating runs of each path")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    import torch
    from transformers import AutoModelForCausalLM

    cfg = _config(args.mb)
    with tempfile.TemporaryDirectory() as tmp:
        folder = str(Path(tmp, "model"))
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg)
        model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        model.save_pretrained(folder, max_shard_size="50MB")
        del model
        files = len(list(Path(folder).glob("*.safetensors")))
        print(
            f"LlamaForCausalLM, {cfg.num_hidden_layers} layers, {model_bytes / 2**20:.0f} MB fp32 in {files} safetensors "
            f"files; {WORLD} gloo ranks, dp_shard=2 x tp=2"
        )
        results: dict[str, list[list[dict]]] = {"shard_on_read": [], "from_pretrained": []}
        for _ in range(args.rounds):
            for path in results:
                results[path].append(_run(path, folder))

    sums = {p: {round(r["checksum"], 3) for run in runs for r in run} for p, runs in results.items()}
    same = all(
        [r["checksum"] for r in results["shard_on_read"][0]] == [r["checksum"] for r in run]
        for runs in results.values()
        for run in runs
    )
    print(f"\nsame local shards on every rank in both paths: {same} ({len(sums['shard_on_read'])} distinct rank sums)")
    print(f"\n{'path':<18}{'peak RSS / rank (MB)':>24}{'x model':>10}{'time (s)':>12}")
    medians = {}
    for path, runs in results.items():
        peaks = [max(r["peak"] for r in run) for run in runs]
        secs = [max(r["seconds"] for r in run) for run in runs]
        medians[path] = (statistics.median(peaks), statistics.median(secs))
        print(
            f"{path:<18}{statistics.median(peaks) / 2**20:>24.0f}{statistics.median(peaks) / model_bytes:>10.2f}"
            f"{statistics.median(secs):>12.2f}"
            f"   (runs: {', '.join(f'{p / 2**20:.0f} MB / {s:.1f} s' for p, s in zip(peaks, secs))})"
        )
    (p_new, t_new), (p_old, t_old) = medians["shard_on_read"], medians["from_pretrained"]
    print(f"\nshard-on-read / from_pretrained: peak RSS {p_new / p_old:.2f}, time {t_new / t_old:.2f}")
    print(f"ideal peak per rank = model / world = {model_bytes / WORLD / 2**20:.0f} MB")


if __name__ == "__main__":
    main()
