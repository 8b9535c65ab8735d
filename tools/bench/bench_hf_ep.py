"""transformers' own expert parallelism vs shardbridge's, side by side on the same MoE model and data.

transformers 5.24 trains MoE models with ``from_pretrained(path, distributed_config=
DistributedConfig(dp_replicate_size=..., fsdp_size=..., tp_size=..., ep_size=..., ep_implementation=...))``
(its ``transformers/distributed/``; ``from_config`` cannot take a DistributedConfig, so a tiny random
model of ``--arch`` is first saved to a folder); shardbridge with ``ShardbridgeAccelerator`` and
``fsdp_config.shardbridge.ep_size``. In ONE run of 4 gloo processes, per layout, both contenders are
built from the same folder (their initial weights are checked equal to it, ``torch.equal``), train
on the same rows of the same global batches (8 x 16 tokens per step; each data-parallel rank its
share), AdamW lr 1e-3, fp32, and their steps are interleaved (the order alternates every step, so
both see the same machine load). The oracle is one process on the global batch (``hf_sweep.reference``:
its fp32 run, and its float64 run for the noise floor). Printed per layout and contender:

- the loss of every step, and the largest relative difference to one process;
- step 1's gradients: the largest per-parameter error ``||g - g_ref|| / ||g_ref||`` (``full_tensor()``;
  ``hf_sweep.compare_step1``'s rule) beside the one-process run's own fp32 error (the noise floor);
- the largest ``|p - p_ref|`` after the last step;
- the bytes of parameter shards each rank stores (experts / all);
- the peak of live tensor bytes on a rank during one training step (torch's
  ``torch.distributed._tools.mem_tracker.MemTracker``: parameters and what FSDP2 gathers,
  gradients, optimizer state, activations and temporaries of that step, the largest rank), with
  parameter shards counted by their own bytes: on CPU transformers' shards are views into a
  copy-on-write mmap of the ``.safetensors`` file, which MemTracker would count whole (the bytes
  left out are printed);
- the step time (forward + backward + optimizer on the slowest rank; the median over steps 2.. of
  the compared steps and ``--timing-steps`` more, which are only timed);
- shardbridge / transformers ratios of the last three (step time: the median of the per-step
  ratios, each step of one contender run right after or before the same step of the other).

Then the checkpoints: each contender saves after the first layout (transformers:
``save_pretrained(distributed_checkpoint=True)`` + ``save_optimizer_distributed``; shardbridge:
``save_state``), loads into ``--reshard-to`` (a fresh model; transformers: ``from_pretrained(ckpt,
distributed_config=...)`` + ``load_optimizer_distributed``; shardbridge: ``load_state``), and the
parameters and AdamW state are compared with the saved ones (``torch.equal``); both are turned into
a plain ``from_pretrained`` folder (transformers: ``consolidate_distributed_checkpoint``;
shardbridge: ``export_pretrained``) and loaded in one process.

    python tools/bench/bench_hf_ep.py [--arch qwen3_moe,gpt_oss] [--steps 5] [--timing-steps 10]
        [--layouts ...] [--reshard-to dp2_tp2_ep2] [--ep-implementation all_to_all]

Layouts (4 ranks; a contender that cannot run one says why): ``dp4_ep4`` (fsdp 4, ep 4: each expert
whole on one rank), ``dp2_tp2_ep2`` (fsdp 2 x tp 2, ep 2: experts FSDP-sharded over 2 ranks),
``hsdp2x2_ep2`` (2 replicas x fsdp 2, ep 2), ``tp4_ep2`` (tp 4, ep 2) and ``dp2_cp2_ep2`` (fsdp 2 x
cp 2, ep 2). The load-balancing loss is left off (``output_router_logits=False``, the configs'
default): both sides compute transformers' per-process one when it is on. The 2-core machine runs
4 processes: step times are relative; bytes are exact.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "packages" / "hf-adapter" / "tests"))

ROWS = 8  # global batch rows per step (x 16 tokens)
LR = 1e-3


@dataclasses.dataclass(frozen=True)
class Layout:
    """Degrees on 4 ranks; ``ep`` re-partitions the others (adds no ranks) on both sides."""

    replicate: int = 1
    fsdp: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1

    @property
    def dp(self) -> int:
        return self.replicate * self.fsdp


LAYOUTS = {
    "dp4_ep4": Layout(fsdp=4, ep=4),
    "dp2_tp2_ep2": Layout(fsdp=2, tp=2, ep=2),
    "hsdp2x2_ep2": Layout(replicate=2, fsdp=2, ep=2),
    "tp4_ep2": Layout(tp=4, ep=2),
    "dp2_cp2_ep2": Layout(fsdp=2, cp=2, ep=2),
}


def _rows(step: int, dp_rank: int, dp_size: int):
    """Data-parallel rank ``dp_rank``'s rows of step ``step``'s global batch (``ROWS`` x 16 tokens)."""
    import hf_helpers as H

    share = ROWS // dp_size
    return H.global_batch(step, ROWS // H.BATCH_PER_DP)[dp_rank * share : (dp_rank + 1) * share]


class Refused(Exception):
    """A contender cannot run a layout (the message says why)."""


# -- the two contenders --------------------------------------------------------------------------


class Transformers:
    """transformers' own: ``from_pretrained(path, distributed_config=DistributedConfig(...))``."""

    name = "transformers"

    def __init__(self, path: str, layout: Layout, impl: str) -> None:
        import torch
        import torch.distributed as dist
        from transformers import AutoModelForCausalLM

        self.layout, self.impl = layout, impl
        self.model = AutoModelForCausalLM.from_pretrained(path, distributed_config=self.config(), dtype=torch.float32)
        self.model.train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=LR)
        # its dense mesh is (pp, dp_replicate, fsdp, tp): tp innermost, the tp ranks share a batch
        self.dp_rank, self.dp_size = dist.get_rank() // layout.tp, layout.dp

    def config(self):
        from transformers import DistributedConfig

        sizes = sorted(f for f in DistributedConfig.__dataclass_fields__ if f.endswith("_size"))
        if self.layout.cp > 1 and not any(f.startswith(("cp", "context")) for f in sizes):
            raise Refused(f"DistributedConfig has no context-parallel size (its sizes: {', '.join(sizes)})")
        try:
            return DistributedConfig(
                dp_replicate_size=self.layout.replicate,
                fsdp_size=self.layout.fsdp,
                tp_size=self.layout.tp,
                ep_size=self.layout.ep,
                ep_implementation=self.impl,
            )
        except ValueError as exc:
            raise Refused(f"DistributedConfig: {exc}") from None

    def forward_backward(self, step: int):
        ids = _rows(step, self.dp_rank, self.dp_size)
        loss = self.model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        return loss

    def mean_loss(self, loss) -> float:
        import torch.distributed as dist

        out = loss.detach().clone()
        dist.all_reduce(out)  # the tp ranks of a dp rank hold its loss: sum / world = the dp mean
        return out.item() / dist.get_world_size()

    def save(self, path: str) -> None:
        from transformers.distributed.checkpoint import save_optimizer_distributed

        self.model.save_pretrained(path, distributed_checkpoint=True)
        save_optimizer_distributed(self.model, self.opt, f"{path}/optimizer")

    @classmethod
    def load(cls, folder: str, path: str, layout: Layout, impl: str) -> Transformers:
        from transformers.distributed.checkpoint import load_optimizer_distributed

        run = cls(path, layout, impl)  # from_pretrained reads the distributed checkpoint itself
        load_optimizer_distributed(run.model, run.opt, f"{path}/optimizer")
        return run

    @staticmethod
    def to_pretrained(path: str, out: str) -> None:
        """One process: the distributed checkpoint's shard files consolidated into one, beside its config."""
        import shutil

        from transformers.distributed.checkpoint import consolidate_distributed_checkpoint

        consolidate_distributed_checkpoint(path, out)
        shutil.copy(f"{path}/config.json", f"{out}/config.json")


class Shardbridge:
    """shardbridge's: ``ShardbridgeAccelerator`` with ``HFConfig(ep_size=...)`` on ``from_pretrained`` weights."""

    name = "shardbridge"

    def __init__(self, path: str, layout: Layout, impl: str) -> None:
        import hf_helpers as H
        import torch
        from shardbridge import ParallelDims
        from shardbridge_hf import HFConfig
        from transformers import AutoModelForCausalLM

        dims = ParallelDims(dp_replicate=layout.replicate, dp_shard=layout.fsdp, cp=layout.cp, tp=layout.tp)
        try:
            self.acc = H.sb_accelerator(dims, config=HFConfig(ep_size=layout.ep, ep_implementation=impl))
        except ValueError as exc:
            raise Refused(str(exc)) from None
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).train()
        self.model, self.opt = self.acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=LR))
        pm = self.acc.parallel_mesh
        self.dp_rank, self.dp_size = pm["dp"].get_local_rank(), pm.dims.degree("dp")

    def forward_backward(self, step: int):
        ids = _rows(step, self.dp_rank, self.dp_size)
        loss = self.model(**self.acc.cp_batch({"input_ids": ids, "labels": ids}), use_cache=False).loss
        self.acc.backward(loss)
        return loss

    def mean_loss(self, loss) -> float:
        return self.acc.reduce_loss(loss).item()

    def save(self, path: str) -> None:
        self.acc.save_state(path)
        self.acc.export_pretrained(path, f"{path}-export")

    @classmethod
    def load(cls, folder: str, path: str, layout: Layout, impl: str) -> Shardbridge:
        run = cls(folder, layout, impl)
        run.acc.load_state(path)
        return run

    @staticmethod
    def to_pretrained(path: str, out: str) -> None:
        """Written by ``save`` on the workers (``export_pretrained``)."""
        import shutil

        shutil.copytree(f"{path}-export", out)


CONTENDERS = (Transformers, Shardbridge)


# -- measuring one rank ---------------------------------------------------------------------------


def _full(t):
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _full_params(model) -> dict:
    return {n: _full(p) for n, p in model.named_parameters()}


def _full_grads(model) -> dict:
    return {n: _full(p.grad) for n, p in model.named_parameters() if p.grad is not None}


def _full_adam(model, opt) -> dict:
    """AdamW's state per parameter name (``exp_avg``, ``exp_avg_sq``, ``step``), full tensors."""
    return {
        f"{n}.{key}": _full(value)
        for n, p in model.named_parameters()
        for key, value in sorted(opt.state.get(p, {}).items())
    }


def _stored_bytes(model) -> tuple[int, int]:
    """Bytes of the parameter shards this rank stores: (routed experts, all)."""
    from torch.distributed.tensor import DTensor

    experts = total = 0
    for name, p in model.named_parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        size = local.numel() * local.element_size()
        total += size
        experts += size if ".experts." in name else 0
    return experts, total


def _beyond_shards(model) -> int:
    """Bytes of the storages behind this rank's parameter shards, beyond the shards themselves.

    MemTracker counts a tensor by its whole storage. transformers on CPU loads each shard as a view
    into a copy-on-write mmap of the ``.safetensors`` file (its ``shard_tensor`` slices the mapped
    tensor and ``.to("cpu")`` copies nothing), so a shard's storage is the full tensor's bytes of the
    file, of which only the pages the rank writes become its own memory. Subtracted from the peak.
    """
    from torch.distributed.tensor import DTensor

    storages, shards = {}, 0
    for p in model.parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        storages[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
        shards += local.numel() * local.element_size()
    return max(sum(storages.values()) - shards, 0)


def _peak_bytes(model, opt, forward_backward) -> int | str:
    """Peak live tensor bytes on this rank during one training step (torch's MemTracker: parameters
    with what FSDP2 gathers, gradients, optimizer state, activations, temporaries), parameter
    shards counted by their own bytes (:func:`_beyond_shards`)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(model, opt)
    try:
        with tracker:
            forward_backward()
            opt.step()
            opt.zero_grad()
    except Exception as exc:  # noqa: BLE001 - printed in the table
        return f"MemTracker: {type(exc).__name__}"
    total = sum(v["Total"] for v in tracker.get_tracker_snapshot("peak").values())
    return int(total) - _beyond_shards(model)


def _equal(got: dict, want: dict) -> list[str]:
    """Names whose tensors differ (or are missing) between ``got`` and ``want``."""
    import torch

    return sorted(n for n in want if n not in got or not torch.equal(got[n], want[n]))


def _train(runs: dict, steps: int, timing_steps: int, rank0: bool) -> dict:
    """Interleaved steps of every contender: losses, step-1 gradients and parameters after ``steps``
    steps, then ``timing_steps`` more steps that are only timed (every step's time is kept).

    A contender that raises stops there (``{"fails": ...}``); the other goes on.
    """
    import torch.distributed as dist

    out = {name: {"losses": [], "times": []} for name in runs}
    for step in range(1, steps + timing_steps + 1):
        order = [(n, r) for n, r in runs.items() if "fails" not in out[n]]
        for name, run in order if step % 2 else order[::-1]:
            try:
                dist.barrier()
                start = time.perf_counter()
                loss = run.forward_backward(step)
                elapsed = time.perf_counter() - start
                if step == 1:
                    grads = _full_grads(run.model)  # a collective: outside the timed part
                    out[name]["grads"] = grads if rank0 else None
                start = time.perf_counter()
                run.opt.step()
                run.opt.zero_grad()
                out[name]["times"].append(elapsed + time.perf_counter() - start)
                if step <= steps:
                    out[name]["losses"].append(run.mean_loss(loss))
                if step == steps:
                    params = _full_params(run.model)
                    out[name]["params"] = params if rank0 else None
            except Exception as exc:  # noqa: BLE001 - printed in the table
                out[name] = {"fails": f"step {step}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
    for name, run in runs.items():
        if "fails" in out[name]:
            continue
        out[name]["stored"] = _stored_bytes(run.model)
        out[name]["beyond"] = _beyond_shards(run.model)
        last = steps + timing_steps + 1
        out[name]["peak"] = _peak_bytes(run.model, run.opt, functools.partial(run.forward_backward, last))
    return out


def _worker(folder: str, names: list[str], steps: int, timing_steps: int, impl: str, ckpt: str, reshard_to: str) -> dict:
    """Every layout of ``names``, then the checkpoint round trip; tensors on rank 0 only."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank0 = dist.get_rank() == 0
    out: dict = {}
    saved: dict = {}
    for index, name in enumerate(names):
        layout, runs = LAYOUTS[name], {}
        for cls in CONTENDERS:
            try:
                runs[cls.name] = cls(folder, layout, impl)
            except Refused as exc:
                out[name, cls.name] = {"refused": str(exc).splitlines()[0]}
            except Exception as exc:  # noqa: BLE001 - printed in the table (every rank raises alike)
                out[name, cls.name] = {"fails": f"build: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
        initial = {c: _full_params(run.model) for c, run in runs.items()}
        for contender, result in _train(runs, steps, timing_steps, rank0).items():
            out[name, contender] = {**result, "initial": initial[contender] if rank0 else None}
        if index == 0:  # the checkpoint every contender reloads below
            for contender, run in runs.items():
                run.save(f"{ckpt}/{contender}")
                params = _full_params(run.model)
                saved[contender] = (params, _full_adam(run.model, run.opt))
        del runs
    for cls in CONTENDERS:
        if cls.name not in saved:
            continue
        try:
            run = cls.load(folder, f"{ckpt}/{cls.name}", LAYOUTS[reshard_to], impl)
        except Refused as exc:
            out["reshard", cls.name] = f"refused: {exc}"
            continue
        params, adam = _full_params(run.model), _full_adam(run.model, run.opt)
        if rank0:
            want_params, want_adam = saved[cls.name]
            differ = _equal(params, want_params) + _equal(adam, want_adam)
            count = len(want_params) + len(want_adam)
            out["reshard", cls.name] = f"{count} tensors bit-exact" if not differ else f"{len(differ)} differ: {differ[:3]}"
            out["saved", cls.name] = want_params
    return out


# -- main: one process, the pool, the table -------------------------------------------------------


def _one_process(folder: str, steps: int, model_type: str) -> dict:
    """The oracle (``hf_sweep.reference`` on the bench's batches), and one process's own numbers."""
    import hf_helpers as H
    import hf_sweep as S
    import torch
    from transformers import AutoModelForCausalLM

    ref = S.reference(model_type, steps=steps, dp=ROWS // H.BATCH_PER_DP)  # global_batch(step, dp): ROWS rows
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).train()
    ref["initial"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=LR)

    def forward_backward(step: int) -> None:
        ids = _rows(step, 0, 1)
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()

    times = []
    for step in range(1, steps + 1):
        start = time.perf_counter()
        forward_backward(step)
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - start)
    ref["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    ref["step_s"] = statistics.median(times[1:])
    ref["stored"] = _stored_bytes(model)
    ref["peak"] = _peak_bytes(model, opt, functools.partial(forward_backward, steps + 1))
    return ref


def _describe(model_type: str) -> str:
    import hf_sweep as S

    c = S.tiny_config(model_type)
    experts = next(getattr(c, k) for k in ("num_experts", "num_local_experts", "n_routed_experts") if hasattr(c, k))
    return (
        f"{model_type} (tiny: hidden {c.hidden_size}, {c.num_hidden_layers} layers, {experts} experts "
        f"top-{c.num_experts_per_tok})"
    )


def _fmt_bytes(n) -> str:
    return n if isinstance(n, str) else f"{n / 1024:.1f} KiB"


def _ratio(a, b) -> str:
    return "-" if isinstance(a, str) or isinstance(b, str) or not b else f"{a / b:.2f}"


def _report(model_type: str, names: list[str], steps: int, ref: dict, results: list[dict], impl: str, reshard_to: str):
    import hf_sweep as S
    import torch

    print(f"\n## {_describe(model_type)}")
    print(
        f"4 gloo processes, fp32, AdamW lr {LR}, {steps} steps of a global batch {ROWS} x 16 tokens, "
        f"ep_implementation={impl}; torch {torch.__version__}"
    )
    ref_peak = _fmt_bytes(ref["peak"])
    print(
        f"one process: losses {', '.join(f'{x:.6f}' for x in ref['losses'])}; stored "
        f"{_fmt_bytes(ref['stored'][0])} experts / {_fmt_bytes(ref['stored'][1])} all; peak {ref_peak}; "
        f"step {ref['step_s'] * 1e3:.0f} ms"
    )
    rank0 = results[0]
    header = "| layout | contender | loss rel diff | grad rel err (noise) | max abs param diff | experts / all stored per rank | peak per rank | step ms |"
    print("\n" + header)
    print("|" + "---|" * (header.count("|") - 1))
    ratios = []
    for name in names:
        row = {}
        for cls in CONTENDERS:
            r = rank0[name, cls.name]
            if "refused" in r or "fails" in r:
                why = f"refused: {r['refused']}" if "refused" in r else f"fails at {r['fails']}"
                print(f"| {name} | {cls.name} | {why[:200]} | | | | | |")
                continue
            initial_differ = _equal(r["initial"], ref["initial"])
            losses = r["losses"]
            loss_rel = max(abs(a - b) / abs(b) for a, b in zip(losses, ref["losses"]))
            norm = math.sqrt(sum(float(g.norm()) ** 2 for g in r["grads"].values()))
            match = S.compare_step1({"losses": losses[:1], "grads": r["grads"], "norm": norm}, ref)
            pdiff = max(float((r["params"][n] - p).abs().max()) for n, p in ref["params"].items())
            stored = max((x[name, cls.name]["stored"] for x in results), key=lambda s: s[1])
            peaks = [x[name, cls.name]["peak"] for x in results]
            peak = next((p for p in peaks if isinstance(p, str)), None) or max(peaks)
            slowest = _slowest_rank_times(results, name, cls.name)
            step_s = statistics.median(slowest[1:])
            row[cls.name] = (stored[1], peak, slowest)
            flag = "" if not initial_differ else f" INITIAL WEIGHTS DIFFER {initial_differ[:2]}"
            verdict = "" if match.verdict() == "pass" else f" ({match.verdict()[:120]})"
            print(
                f"| {name} | {cls.name}{flag} | {loss_rel:.1e} | {match.max_rel:.1e} ({match.noise:.1e}){verdict} | "
                f"{pdiff:.1e} | {_fmt_bytes(stored[0])} / {_fmt_bytes(stored[1])} | {_fmt_bytes(peak)} | "
                f"{step_s * 1e3:.0f} |"
            )
        if len(row) == 2:
            (s_tf, p_tf, t_tf), (s_sb, p_sb, t_sb) = row["transformers"], row["shardbridge"]
            # per step (the two ran back to back, under the same load), then the median: steps 2..
            step_ratio = statistics.median(b / a for a, b in zip(t_tf[1:], t_sb[1:]))
            ratios.append(f"| {name} | {_ratio(s_sb, s_tf)} | {_ratio(p_sb, p_tf)} | {step_ratio:.2f} |")
    beyond = {
        f"{cls.name} at {name}": max(x[name, cls.name]["beyond"] for x in results)
        for name in names
        for cls in CONTENDERS
        if "beyond" in rank0[name, cls.name]
    }
    if any(beyond.values()):
        print(
            "\nstorage behind the parameter shards beyond their own bytes (views into the copy-on-write mmap of "
            "model.safetensors; not counted in the peak): "
            + ", ".join(f"{k} {_fmt_bytes(v)}" for k, v in beyond.items() if v)
        )
    if ratios:
        print("\nshardbridge / transformers (step time: the median of the per-step ratios)\n")
        print("| layout | stored | peak | step time |\n|---|---|---|---|")
        print("\n".join(ratios))
    print(f"\ncheckpoint saved at {names[0]}, loaded at {reshard_to} (parameters + AdamW state, torch.equal):")
    for cls in CONTENDERS:
        print(f"  {cls.name:13s} {rank0.get(('reshard', cls.name), 'not run')}")


def _slowest_rank_times(results: list[dict], layout: str, contender: str) -> list[float]:
    """Every step's time on the slowest rank."""
    return [max(step) for step in zip(*(x[layout, contender]["times"] for x in results))]


def _to_one_process(ckpt: str, saved: dict) -> dict:
    """Each contender's checkpoint as a plain from_pretrained folder, loaded in one process."""
    import torch
    from transformers import AutoModelForCausalLM

    out = {}
    for cls in CONTENDERS:
        if cls.name not in saved:
            continue
        try:
            cls.to_pretrained(f"{ckpt}/{cls.name}", f"{ckpt}/{cls.name}-hf")
            model = AutoModelForCausalLM.from_pretrained(f"{ckpt}/{cls.name}-hf", dtype=torch.float32)
        except Exception as exc:  # noqa: BLE001 - printed as the result
            out[cls.name] = f"fails: {type(exc).__name__}: {str(exc).splitlines()[0][:150]}"
            continue
        params = {n: p.detach() for n, p in model.named_parameters()}
        want = {n: t for n, t in saved[cls.name].items() if n in params}
        differ = _equal(params, want)
        out[cls.name] = f"{len(want)} parameters bit-exact" if not differ and want else f"differ: {differ[:3]}"
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="qwen3_moe", help="transformers model_types, comma-separated (default qwen3_moe)")
    parser.add_argument("--steps", type=int, default=5, help="AdamW steps compared (default 5; step 1 is not timed)")
    parser.add_argument("--timing-steps", type=int, default=10, help="further steps, only timed (default 10)")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, of {list(LAYOUTS)}")
    parser.add_argument("--reshard-to", default="dp2_tp2_ep2", help="the layout the first layout's checkpoints load into")
    parser.add_argument("--ep-implementation", default="all_to_all", help="both sides' ep_implementation (all_to_all)")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import hf_sweep as S
    import torch
    import transformers
    from shardbridge.testing import WorkerPool

    names = args.layouts.split(",")
    unknown = [n for n in [*names, args.reshard_to] if n not in LAYOUTS]
    if unknown:
        parser.error(f"unknown layouts {unknown}; choose from {list(LAYOUTS)}")
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    for model_type in args.arch.split(","):
        start = time.perf_counter()
        with tempfile.TemporaryDirectory() as root:
            folder, ckpt = f"{root}/hf", f"{root}/ckpt"
            S.build(model_type, seed=0).save_pretrained(folder)
            ref = _one_process(folder, args.steps, model_type)
            pool = WorkerPool(4)
            try:
                work = (folder, names, args.steps, args.timing_steps, args.ep_implementation, ckpt, args.reshard_to)
                results = pool.run(_worker, work, {}, 3600)
            finally:
                pool.close()
            _report(model_type, names, args.steps, ref, results, args.ep_implementation, args.reshard_to)
            saved = {c.name: results[0][("saved", c.name)] for c in CONTENDERS if ("saved", c.name) in results[0]}
            for contender, verdict in _to_one_process(ckpt, saved).items():
                print(f"  {contender:13s} as a from_pretrained folder in one process: {verdict}")
        print(f"({time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
