"""shardbridge demo: the whole life of a sharded training run, on local gloo processes.

  1. train the reference Llama with FSDP2 x TP (layout A) on synthetic data;
  2. save a DCP checkpoint (atomic, portable, fused params stored as components);
  3. reload it into layout B and into a single process, with freshly initialised models;
  4. check every model and optimizer tensor bit-exact against the trained model AND against
     torch's own ``dcp_to_torch_save`` of the checkpoint (an independent reader);
  5. export Hugging Face-style safetensors and check them too;
  6. print losses, step time, bytes all-gathered per step, checkpoint size and throughput,
     and the layout picture of one weight (``--png FILE``: also as an image).

Exit code 0 = every check passed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["add_arguments", "run_demo"]

_MODELS = ("tiny", "small")
_DEFAULT_COLLECTIVE_TIMEOUT_S = 600.0
# Written first into --out; only a directory holding it is ever cleaned. See [Note: demo output].
_MARKER = ".shardbridge-demo"
# What the demo writes into --out: the only entries a rerun removes.
_OUTPUTS = ("checkpoints", "hf", "reference.pt", "dcp_to_torch_save.pt", "dcp_copy")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``shardbridge demo``."""
    a = parser.add_argument_group("training layout (A)")
    a.add_argument("--dp-replicate", type=int, default=1, help="HSDP replicas (default 1)")
    a.add_argument("--dp-shard", type=int, default=2, help="FSDP shard degree (default 2)")
    a.add_argument("--tp", type=int, default=2, help="tensor-parallel degree (default 2)")
    a.add_argument(
        "--cp",
        type=int,
        default=1,
        help="context-parallel degree: sequence split (default 1); the demo starts dp_replicate x dp_shard x cp x tp "
        "processes, so --cp 2 with the defaults is 8: lower --dp-shard or --tp to keep 4",
    )
    b = parser.add_argument_group("reload layout (B)")
    b.add_argument("--reload-dp-replicate", type=int, default=1, help="default 1")
    b.add_argument("--reload-dp-shard", type=int, default=4, help="default 4")
    b.add_argument("--reload-tp", type=int, default=1, help="default 1")
    b.add_argument("--reload-cp", type=int, default=1, help="default 1")
    m = parser.add_argument_group("model and data")
    m.add_argument("--model", choices=_MODELS, default="tiny", help="reference model size (default tiny)")
    m.add_argument(
        "--vocab-size", type=int, default=None, help="override the vocab size, e.g. 250 (does not divide tp*dp)"
    )
    m.add_argument("--intermediate-size", type=int, default=None, help="override the SwiGLU width")
    m.add_argument("--steps", type=int, default=30, help="training steps (default 30)")
    m.add_argument("--batch-size", type=int, default=8, help="global batch size (default 8)")
    m.add_argument("--seq-len", type=int, default=32, help="tokens per sample (default 32)")
    m.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default 3e-3)")
    m.add_argument("--seed", type=int, default=0, help="init and data seed (default 0)")
    parser.add_argument(
        "--out",
        default="shardbridge-demo",
        help="output directory (default ./shardbridge-demo): new, empty, or a previous demo's output "
        f"(marked by {_MARKER}); any other non-empty directory is refused",
    )
    parser.add_argument(
        "--keep", action="store_true", help="keep a previous demo output's files instead of replacing them"
    )
    parser.add_argument(
        "--png",
        metavar="FILE",
        default=None,
        help="also draw the layout of one weight in layout A as an image (needs matplotlib: the plot extra)",
    )
    parser.add_argument(
        "--checkpoint-dir",
        default=None,
        help="where checkpoints go: a path or a URI such as s3://bucket/demo (default OUT/checkpoints); "
        "it must hold no checkpoint of the demo's step yet",
    )
    parser.add_argument(
        "--collective-timeout",
        type=float,
        default=_DEFAULT_COLLECTIVE_TIMEOUT_S,
        metavar="SECONDS",
        help="process-group timeout: a collective that waits longer fails instead of hanging "
        f"(default {_DEFAULT_COLLECTIVE_TIMEOUT_S:.0f})",
    )
    parser.set_defaults(func=run_demo)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DemoConfig:
    """Everything a demo phase needs, picklable for the worker processes."""

    layout: dict[str, int]
    reload_layout: dict[str, int]
    model: str
    model_overrides: dict[str, int]
    steps: int
    batch_size: int
    seq_len: int
    lr: float
    seed: int
    out: str
    collective_timeout: float = _DEFAULT_COLLECTIVE_TIMEOUT_S
    checkpoint_dir: str | None = None
    """Where checkpoints go (a path or URI); None = ``out/checkpoints``."""

    @property
    def world_size(self) -> int:
        return _world(self.layout)

    @property
    def reload_world_size(self) -> int:
        return _world(self.reload_layout)

    @property
    def checkpoint_root(self) -> str:
        return self.checkpoint_dir or os.path.join(self.out, "checkpoints")

    def llama_config(self):
        from shardbridge.models import LlamaConfig

        # 8 query heads over 4 kv heads: grouped-query attention that tp=1, 2 and 4 all split.
        defaults = {"tiny": {"num_heads": 8, "num_kv_heads": 4}, "small": {}}[self.model]
        return getattr(LlamaConfig, self.model)(**{**defaults, **self.model_overrides})


def _world(layout: dict[str, int]) -> int:
    return layout["dp_replicate"] * layout["dp_shard"] * layout.get("cp", 1) * layout["tp"]


def _config_from_args(args: argparse.Namespace) -> DemoConfig:
    from shardbridge import ParallelDims

    layout = {"dp_replicate": args.dp_replicate, "dp_shard": args.dp_shard, "cp": args.cp, "tp": args.tp}
    reload_layout = {
        "dp_replicate": args.reload_dp_replicate,
        "dp_shard": args.reload_dp_shard,
        "cp": args.reload_cp,
        "tp": args.reload_tp,
    }
    for prefix, lay in (("--", layout), ("--reload-", reload_layout)):
        for key, value in lay.items():
            if value < 1:
                raise ValueError(f"{prefix}{key.replace('_', '-')}={value} must be >= 1")
        ParallelDims(**lay)  # validates the degrees
    for name in ("steps", "batch_size", "seq_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    dp = layout["dp_replicate"] * layout["dp_shard"]
    if args.batch_size % dp:
        raise ValueError(
            f"--batch-size={args.batch_size} does not divide over dp_replicate*dp_shard={dp}; use a multiple of {dp}"
        )
    if args.cp > 1 and args.seq_len % (2 * args.cp):
        raise ValueError(
            f"--seq-len={args.seq_len} is not divisible by 2 * --cp = {2 * args.cp} (the load-balanced sequence "
            f"split cuts it into 2 * cp chunks); use a multiple of {2 * args.cp}"
        )
    if not math.isfinite(args.lr) or args.lr <= 0:
        raise ValueError(f"--lr={args.lr} must be a finite number > 0, e.g. 3e-3")
    if not math.isfinite(args.collective_timeout) or args.collective_timeout <= 0:
        raise ValueError(f"--collective-timeout={args.collective_timeout} must be a number of seconds > 0, e.g. 600")
    for name in ("vocab_size", "intermediate_size"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1 (or left out)")
    overrides = {
        k: v
        for k, v in (("vocab_size", args.vocab_size), ("intermediate_size", args.intermediate_size))
        if v is not None
    }
    cfg = DemoConfig(
        layout=layout,
        reload_layout=reload_layout,
        model=args.model,
        model_overrides=overrides,
        steps=args.steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        lr=args.lr,
        seed=args.seed,
        out=os.path.abspath(args.out),
        collective_timeout=args.collective_timeout,
        checkpoint_dir=args.checkpoint_dir,
    )
    _check_model_fits(cfg, args)  # before any process starts
    if _world(layout) > 8 or _world(reload_layout) > 8:
        print("note: more than 8 gloo processes on a small machine is slow", file=sys.stderr)
    return cfg


def _check_model_fits(cfg: DemoConfig, args: argparse.Namespace) -> None:
    """ValueError naming the flag when the model cannot run in a layout (checked before any process starts)."""
    try:
        llama = cfg.llama_config()
    except ValueError as exc:
        raise ValueError(f"--model {cfg.model} with --vocab-size / --intermediate-size: {exc}") from None
    for flag, tp in (("--tp", cfg.layout["tp"]), ("--reload-tp", cfg.reload_layout["tp"])):
        for name, value in (("num_kv_heads", llama.num_kv_heads), ("intermediate_size", llama.intermediate_size)):
            if value % tp:
                fits = [d for d in range(1, value + 1) if value % d == 0 and d <= 8]
                raise ValueError(
                    f"{flag}={tp} does not divide the {cfg.model} model's {name}({value}): tensor parallelism "
                    f"splits whole kv heads and SwiGLU rows; use {flag} in {fits}"
                )
    if args.seq_len > llama.max_seq_len:
        raise ValueError(f"--seq-len={args.seq_len} exceeds the {cfg.model} model's max_seq_len({llama.max_seq_len})")


def run_demo(args: argparse.Namespace) -> int:
    """Run the demo; return 0 when every check passed, 1 otherwise."""
    from shardbridge.testing import WorkerPool

    cfg = _config_from_args(args)
    png = getattr(args, "png", None)
    if png is not None:
        if not os.path.isdir(os.path.dirname(os.path.abspath(png))):
            raise ValueError(f"--png {png!r}: its folder does not exist; create it or pass another file")
        from shardbridge.layout._picture import _require_matplotlib

        try:  # before any process starts, not after minutes of training
            _require_matplotlib()
        except ImportError as err:
            raise ValueError(f"--png needs matplotlib, which is not importable: {' '.join(str(err).split())}") from None
    prepare_out(Path(cfg.out), keep=args.keep)

    print(f"shardbridge demo: {cfg.model} Llama, layout A {_fmt(cfg.layout)} -> layout B {_fmt(cfg.reload_layout)}")
    print(f"  starting {cfg.world_size} gloo processes ...", flush=True)
    pools: dict[int, WorkerPool] = {}

    def pool(world: int) -> WorkerPool:
        if world not in pools:
            pools[world] = WorkerPool(world, pg_timeout=cfg.collective_timeout)
        return pools[world]

    try:
        train = pool(cfg.world_size).run(_train_phase, (cfg,), {}, timeout=3600)[0]
        _print_training(cfg, train)
        print(f"  reloading into layout B {_fmt(cfg.reload_layout)} on {cfg.reload_world_size} processes ...")
        reload_b = pool(cfg.reload_world_size).run(_reload_phase, (cfg, cfg.reload_layout), {}, timeout=3600)[0]
        print("  reloading into a single process ...")
        single = pool(1).run(_reload_phase, (cfg, {"dp_replicate": 1, "dp_shard": 1, "tp": 1}), {}, timeout=3600)[0]
    finally:
        for p in pools.values():
            p.close()
    export = _export_phase(cfg, train["checkpoint"])
    code = _print_summary(cfg, train, reload_b, single, export)
    if png is not None and train["layout"] is not None:
        from shardbridge.layout import save_layout_png

        shape, mesh_shape, placements, names, fqn = train["layout"]
        save_layout_png(png, shape, mesh_shape, placements, mesh_dim_names=names, title=f"{fqn} in layout A")
        print(f"layout picture: {png}")
    return code


# [Note: demo output]
# ~~~~~~~~~~~~~~~~~~~
# No command deletes what it did not create. ``--out`` must be new, empty, or a previous
# demo's output, which the demo marks with a ``.shardbridge-demo`` file before writing
# anything else. A rerun removes only the demo's own entries (``_OUTPUTS``) from a marked
# directory; any other non-empty directory (``--out .`` in a project, a home directory) is
# refused with exit code 2, its files untouched.


def prepare_out(out: Path, *, keep: bool) -> None:
    """Make ``out`` ready for a demo run, or ValueError (see [Note: demo output])."""
    from shardbridge.checkpoint.storage._destination import check_destination, write_file

    # --out or its marker a link: refused, never written through ([Note: writer destinations]).
    check_destination(out, [_MARKER], overwrite=True, flag=None)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {str(out)!r} is a file; pass a new or empty directory")
    if out.is_dir() and any(out.iterdir()) and not (out / _MARKER).is_file():
        raise ValueError(
            f"--out {str(out)!r} is not empty and is not a previous shardbridge demo output (no {_MARKER}); "
            f"nothing was deleted: pass a new or empty directory, e.g. --out {str(out / 'shardbridge-demo')!r}"
        )
    try:
        out.mkdir(parents=True, exist_ok=True)
        write_file(out / _MARKER, b"written by shardbridge demo; a rerun replaces the demo's outputs here\n")
    except OSError as exc:
        raise ValueError(
            f"--out {str(out)!r} is not writable ({exc.strerror or exc}); choose another directory"
        ) from None
    if keep:
        return
    for name in _OUTPUTS:
        entry = out / name
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        elif entry.exists() or entry.is_symlink():
            entry.unlink()


# ------------------------------------------------------------------ phases (run on every rank)


def _quiet() -> None:
    """Silence a torch message the demo triggers on purpose, known to be harmless here.

    DTensor logs that ``full_tensor()`` of a ``(_StridedShard, Shard)`` weight needs two
    all-gathers; the demo calls ``full_tensor()`` only to build its oracle. (FSDP2's "returned a
    view tensor" warning has no cause any more: [Note: TP outputs are not views] in ``_tp.py``.)
    """
    import logging

    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


def _build(cfg: DemoConfig, layout: dict[str, int], seed: int):
    import torch

    from shardbridge import ParallelDims, PrecisionPolicy
    from shardbridge.models import Llama, parallelize_llama

    _quiet()
    pm = ParallelDims(**layout).build_mesh("cpu")
    model = Llama(cfg.llama_config(), seed=seed)
    parallelize_llama(model, pm, PrecisionPolicy.fp32())
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01)
    return pm, model, optimizer


def _train_phase(cfg: DemoConfig) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from shardbridge import checkpoint
    from shardbridge._comm_stats import count_collectives
    from shardbridge.cp import cp_cross_entropy, cp_split
    from shardbridge.models import hf_llama_export_record, synthetic_batch

    pm, model, optimizer = _build(cfg, cfg.layout, seed=cfg.seed)
    llama = cfg.llama_config()
    dp_rank, dp_size = pm["dp"].get_local_rank(), pm.dims.degree("dp")
    losses, step_times, gathered, scattered = [], [], [], []
    for step in range(cfg.steps):
        tokens, labels = synthetic_batch(
            llama, cfg.batch_size, cfg.seq_len, seed=cfg.seed, step=step, dp_rank=dp_rank, dp_size=dp_size
        )
        dist.barrier()
        start = time.perf_counter()
        with count_collectives() as counts:
            if pm.dims.cp > 1:  # this rank's head-tail part of every sequence; loss over dp_cp
                logits = model(cp_split(tokens, pm["cp"]))
                loss = cp_cross_entropy(logits, cp_split(labels, pm["cp"]), pm)  # global on every rank
            else:
                logits = model(tokens)
                loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        step_times.append(time.perf_counter() - start)
        gathered.append(counts.bytes["all_gather"])
        scattered.append(counts.bytes["reduce_scatter"])
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss, group=pm["dp"].get_group())
        losses.append(global_loss.item() / dp_size)

    ckpt_path = str(checkpoint.step_dir(cfg.checkpoint_root, cfg.steps))
    dist.barrier()
    start = time.perf_counter()
    # Asynchronous: returns once the state is staged in host memory; written and committed
    # in the background while the reference below is computed.
    pending = checkpoint.save(
        ckpt_path,
        model=model,
        optimizer=optimizer,
        step=cfg.steps,
        # `shardbridge ckpt export` of this checkpoint writes a folder from_pretrained loads
        extra={"demo": True, "export": hf_llama_export_record(llama)},
        parallel_dims=pm.dims,
        async_=True,
    )
    save_blocked_s = time.perf_counter() - start

    reference = _full_components(model, optimizer, pm.dims.tp)
    picture = _layout_picture(model, pm)
    if dist.get_rank() == 0:
        torch.save(reference, os.path.join(cfg.out, "reference.pt"))
    pending.wait()
    dist.barrier()
    save_s = time.perf_counter() - start
    return {
        "save_blocked_s": save_blocked_s,
        "losses": losses,
        "step_times": step_times,
        "all_gather_bytes": gathered,
        "reduce_scatter_bytes": scattered,
        "save_s": save_s,
        "checkpoint": ckpt_path,
        "picture": picture[0],
        "layout": picture[1],
        "num_params": sum(p.numel() for p in model.parameters()),
    }


def _reload_phase(cfg: DemoConfig, layout: dict[str, int]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from shardbridge import checkpoint

    # A different seed: values that survive the load can only have come from the checkpoint.
    pm, model, optimizer = _build(cfg, layout, seed=cfg.seed + 1)
    path = checkpoint.latest(cfg.checkpoint_root)
    dist.barrier()
    start = time.perf_counter()
    # Per-rank RNG states restore exactly only into the same world size.
    same_world = _world(layout) == cfg.world_size
    state = checkpoint.load(path, model=model, optimizer=optimizer, rng=same_world)
    dist.barrier()
    load_s = time.perf_counter() - start

    got = _full_components(model, optimizer, pm.dims.tp)
    result: dict[str, Any] = {"load_s": load_s, "step": state.step, "layout": layout}
    if dist.get_rank() == 0:
        reference = torch.load(os.path.join(cfg.out, "reference.pt"), weights_only=True)
        oracle = _dcp_oracle(cfg, str(path))
        result["vs_trained"] = _compare(reference, got)
        result["vs_dcp_to_torch_save"] = _compare(oracle, {k: v for k, v in got.items() if k in oracle})
        result["oracle_keys_missing"] = sorted(set(got) - set(oracle))[:5]
    return result


def _dcp_oracle(cfg: DemoConfig, path: str) -> dict[str, Any]:
    """torch's own reader: ``dcp_to_torch_save`` of the checkpoint, flattened to our keys."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = os.path.join(cfg.out, "dcp_to_torch_save.pt")
    if not os.path.exists(target):
        dcp_to_torch_save(_local_copy(cfg, path), target)
    return _flatten(torch.load(target, weights_only=True))


def _local_copy(cfg: DemoConfig, path: str) -> str:
    """``path``, or for a checkpoint on an object store a local copy of its DCP files (torch's reader is local)."""
    from shardbridge.checkpoint.storage._location import is_uri, locate, open_checkpoint

    if not is_uri(path):
        return path
    stored, _ = open_checkpoint(locate(path))
    copy = os.path.join(cfg.out, "dcp_copy")
    stored.backend.fs.get(stored.data, copy, recursive=True)
    return copy


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {}
    if isinstance(tree, dict):
        for key, value in tree.items():
            out.update(_flatten(value, f"{prefix}{key}."))
    elif isinstance(tree, torch.Tensor):
        out[prefix[:-1]] = tree
    return out


def _full_components(model, optimizer, tp_size: int) -> dict[str, Any]:
    """Every model and optimizer tensor as a full tensor, fused params split into components.

    The oracle side of the demo: built from ``DTensor.full_tensor()`` and ``split_fused``,
    independent of the checkpoint's chunk machinery. Keys: ``model.<fqn>`` and
    ``optim.state.<fqn>.<state>`` with fused FQNs replaced by their components'.
    """
    import torch
    from torch.distributed.tensor import DTensor

    from shardbridge.checkpoint.state._state import component_fqn
    from shardbridge.fused import fused_params, split_fused

    fused = fused_params(model)

    def components(fqn: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        tensor = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor.detach().clone()
        spec = fused.get(fqn)
        if spec is None:
            return [(fqn, tensor)]
        if tensor.dim() == 0:  # e.g. Adam's step: every component has the same one
            return [(component_fqn(fqn, name), tensor) for name in spec.names]
        return [(component_fqn(fqn, name), piece.clone()) for name, piece in split_fused(tensor, spec, tp_size).items()]

    out: dict[str, Any] = {}
    names = {param: fqn for fqn, param in model.named_parameters()}
    for fqn, param in model.named_parameters():
        out.update((f"model.{key}", t) for key, t in components(fqn, param.detach()))
    for param, state in optimizer.state.items():
        for state_name, value in state.items():
            if isinstance(value, torch.Tensor):
                out.update((f"optim.state.{key}.{state_name}", t) for key, t in components(names[param], value))
    return out


def _compare(expected: dict[str, Any], got: dict[str, Any]) -> dict[str, Any]:
    import torch

    missing = sorted(set(expected) - set(got))
    different = sorted(k for k in set(expected) & set(got) if not torch.equal(expected[k], got[k]))
    return {"checked": len(set(expected) & set(got)), "missing": missing[:5], "different": different[:5]}


def _layout_picture(model, pm) -> tuple[str, tuple | None]:
    """The ASCII picture of one sharded weight, and its layout (shape, mesh, placements, names, fqn) for --png."""
    from torch.distributed.tensor import DTensor

    from shardbridge.layout import render_layout

    for fqn, param in model.named_parameters():
        if isinstance(param, DTensor) and fqn.endswith("feed_forward.gate_up.weight"):
            mesh = param.device_mesh
            layout = (tuple(param.shape), tuple(mesh.shape), tuple(param.placements), mesh.mesh_dim_names, fqn)
            header = f"{fqn}: global {tuple(param.shape)}, placements {tuple(param.placements)}"
            return header + "\n" + render_layout(*layout[:3], mesh_dim_names=layout[3]), layout
    return "(no sharded gate_up weight in this layout)", None


# ------------------------------------------------------------------ export (this process)


def _export_phase(cfg: DemoConfig, ckpt_path: str) -> dict[str, Any]:
    import torch
    from safetensors import safe_open

    from shardbridge.models import export_hf_llama, hf_llama_name

    out_dir = os.path.join(cfg.out, "hf")
    start = time.perf_counter()
    # The demo's own output folder (see [Note: demo output]); --keep leaves a previous export there.
    export_hf_llama(ckpt_path, out_dir, cfg.llama_config(), progress=False, overwrite=True)
    export_s = time.perf_counter() - start
    reference = torch.load(os.path.join(cfg.out, "reference.pt"), weights_only=True)
    index = json.loads(Path(out_dir, "model.safetensors.index.json").read_text())
    exported: dict[str, Any] = {}
    for file in sorted(set(index["weight_map"].values())):
        with safe_open(os.path.join(out_dir, file), "pt") as f:
            for key in f.keys():
                exported[key] = f.get_tensor(key)
    model_ref = {hf_llama_name(k.removeprefix("model.")): v for k, v in reference.items() if k.startswith("model.")}
    return {
        "export_s": export_s,
        "files": len(set(index["weight_map"].values())),
        "check": _compare(model_ref, exported),
    }


# ------------------------------------------------------------------ report


def _fmt(layout: dict[str, int]) -> str:
    return " x ".join(f"{k}={v}" for k, v in layout.items() if v > 1) or "single process"


def _print_training(cfg: DemoConfig, train: dict[str, Any]) -> None:
    losses = train["losses"]
    print(f"  trained {cfg.steps} steps ({train['num_params']:,} parameters on rank 0)")
    per_line = 10
    for i in range(0, len(losses), per_line):
        chunk = " ".join(f"{x:.4f}" for x in losses[i : i + per_line])
        print(f"    loss[{i:3d}:] {chunk}")


def _dir_bytes(path: str) -> int:
    from shardbridge.checkpoint.storage._location import locate

    where = locate(path)
    return sum(entry.size for entry in where.backend.listing(where.path).values())


def _print_summary(cfg, train, reload_b, single, export) -> int:
    size = _dir_bytes(train["checkpoint"])
    steady = train["step_times"][1:] or train["step_times"]
    mb = size / 1e6
    rows = [
        ("loss first -> last", f"{train['losses'][0]:.4f} -> {train['losses'][-1]:.4f}"),
        ("step time (median, after step 0)", f"{statistics.median(steady) * 1e3:.1f} ms"),
        ("all-gathered per step (rank 0)", f"{statistics.median(train['all_gather_bytes']) / 1e6:.3f} MB"),
        ("reduce-scattered per step (rank 0)", f"{statistics.median(train['reduce_scatter_bytes']) / 1e6:.3f} MB"),
        ("checkpoint size", f"{mb:.2f} MB  ({train['checkpoint']})"),
        (
            "save",
            f"{train['save_s']:.2f} s  ({mb / train['save_s']:.1f} MB/s; async: training blocked "
            f"{train['save_blocked_s']:.2f} s)",
        ),
        (f"load into {_fmt(reload_b['layout'])}", f"{reload_b['load_s']:.2f} s  ({mb / reload_b['load_s']:.1f} MB/s)"),
        ("load into single process", f"{single['load_s']:.2f} s  ({mb / single['load_s']:.1f} MB/s)"),
        ("export safetensors", f"{export['export_s']:.2f} s, {export['files']} file(s)"),
    ]
    print("\nsummary")
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"  {key:<{width}}  {value}")

    print("\nchecks (bit-exact, torch.equal)")
    ok = True
    checks = [
        (f"layout B {_fmt(reload_b['layout'])} vs trained model", reload_b["vs_trained"]),
        (f"layout B {_fmt(reload_b['layout'])} vs dcp_to_torch_save", reload_b["vs_dcp_to_torch_save"]),
        ("single process vs trained model", single["vs_trained"]),
        ("single process vs dcp_to_torch_save", single["vs_dcp_to_torch_save"]),
        ("exported safetensors vs trained model", export["check"]),
    ]
    for name, check in checks:
        good = not check["missing"] and not check["different"] and check["checked"] > 0
        ok &= good
        detail = "" if good else f"  missing={check['missing']} different={check['different']}"
        print(f"  [{'ok' if good else 'FAIL'}] {name}: {check['checked']} tensors{detail}")
    for name, result in (("layout B", reload_b), ("single process", single)):
        if result["step"] != cfg.steps:
            ok = False
            print(f"  [FAIL] {name} restored step {result['step']} != {cfg.steps}")
        if result["oracle_keys_missing"]:
            ok = False
            print(f"  [FAIL] {name}: dcp_to_torch_save lacks {result['oracle_keys_missing']}")

    print(f"\nlayout of one weight in layout A ({_fmt(cfg.layout)}):")
    print(train["picture"])
    print(f"\n{'all checks passed' if ok else 'SOME CHECKS FAILED'}; outputs in {cfg.out}")
    return 0 if ok else 1
