"""The expert-parallel sweep (not a test module): every MoE ``*ForCausalLM`` of the TP sweep, on the ep axis.

The architectures come from the TP sweep's generator (``hf_sweep.sweep_archs()``: every
``*ForCausalLM`` of the installed transformers with a TP or an EP plan); those whose config declares
``base_model_ep_plan`` run here with ``fsdp_config.shardbridge.ep_size`` (tiny configs of
``hf_sweep.tiny_config``), the MoE ones without an EP plan must be refused by name. Used by
``test_hf_ep.py``, and as a script for the table of docs/hf.md::

    OMP_NUM_THREADS=1 .venv/bin/python packages/hf-adapter/tests/hf_ep_sweep.py [--layouts-only] [--timeout S] [model_type ...]

Checks per architecture, 4 gloo ranks through ``ShardbridgeAccelerator`` (fp32, every rank built
with a different seed: rank 0's weights must win):

    dp4_ep4        dp_shard=4, ep=4 (each rank holds a quarter of the experts whole): losses of
                   3 AdamW steps and every step-1 gradient equal one process on the global batch
                   and the total gradient norm (hf_sweep.compare_step1: losses allclose rtol 1e-4
                   / atol 1e-5, per gradient ||g - g_ref|| <= 1e-4 max(||g_ref||, 1e-3 ||G_ref||))
    dp2_tp2_ep2    dp_shard=2 x tp=2, ep=2 (the TP plan for the dense modules, tokens split over
                   tp inside the experts): the same
    reshard        the dp4_ep4 checkpoint loaded into dp_shard=2 x tp=2 with the TP plan (ep=1,
                   experts sharded by moe_tp_experts) and back into dp2_tp2_ep2: torch.equal weights
    export         export_pretrained -> from_pretrained: logits equal the sharded model's

An architecture with an EP plan and no TP plan (transformers 5.24: zaya) cannot run tp > 1 (its
dense modules have no TP rules; transformers refuses ``tp_size > 1`` for it too): dp2_tp2_ep2 must be
refused by name (:data:`REFUSED_NO_TP`), and instead

    dp4_ep2        dp_shard=4, ep=2 (each expert FSDP-sharded over the 2 ranks holding it): as dp4_ep4
    reshard        the dp4_ep4 checkpoint loaded into dp_shard=4 (ep=1: plain FSDP) and dp4_ep2
"""

from __future__ import annotations

import math
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

import hf_helpers as H  # noqa: E402
import hf_sweep as S  # noqa: E402

LAYOUTS = {"dp4_ep4": {"dp_shard": 4, "ep": 4}, "dp2_tp2_ep2": {"dp_shard": 2, "tp": 2, "ep": 2}}
CHECKS = (*LAYOUTS, "reshard", "export")
EP_ONLY_LAYOUT = {"dp4_ep2": {"dp_shard": 4, "ep": 2}}
"""The layout an architecture without a TP plan trains at in place of dp2_tp2_ep2."""
REFUSED_NO_TP = "refused by name: declares no TP plan"
"""dp2_tp2_ep2's expected result for an architecture with an EP plan and no TP plan."""

# CI (budget): qwen3_moe at dp_shard x tp x ep (CI_CHECKS); every check of every architecture with
# SHARDBRIDGE_MOE_MATRIX=all (nox -s moe).
CI_ARCHS = ("qwen3_moe",)
CI_CHECKS = ("dp2_tp2_ep2",)

# Documented exceptions: {model_type: reason} (docs/hf.md, "Expert parallelism").
KNOWN: dict[str, str] = {
    "phimoe": "sparsemixer routing draws random jitter in training: the match cannot hold across processes",
}


def ep_archs() -> dict[str, bool]:
    """``{model_type: has an EP plan}`` for every MoE architecture of the TP sweep.

    MoE = the config declares an EP plan, or its TP plan names an experts module or parameter.
    """
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    out = {}
    for model_type in S.sweep_archs():
        cfg = getattr(transformers, CONFIG_MAPPING_NAMES[model_type])
        if getattr(cfg, "base_model_ep_plan", None):
            out[model_type] = True
        elif any("expert" in k for k in (cfg.base_model_tp_plan or {})):
            out[model_type] = False
    return out


def has_tp_plan(model_type: str) -> bool:
    """Does the config class of ``model_type`` declare a TP plan (else it has only an EP plan)?"""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return bool(getattr(transformers, CONFIG_MAPPING_NAMES[model_type]).base_model_tp_plan)


def checks_for(model_type: str) -> tuple[str, ...]:
    """:data:`CHECKS`, plus dp4_ep2 for an architecture without a TP plan (module docstring)."""
    return CHECKS if has_tp_plan(model_type) else (*CHECKS[:2], *EP_ONLY_LAYOUT, *CHECKS[2:])


def expected(model_type: str, checks: tuple[str, ...]) -> dict[str, str]:
    """What :func:`run_arch` must return: "pass", and for dp2_tp2_ep2 without a TP plan the refusal."""
    return {c: REFUSED_NO_TP if c == "dp2_tp2_ep2" and not has_tp_plan(model_type) else "pass" for c in checks}


def _prepared(model_type: str, dims: dict, seed: int):
    from shardbridge import ParallelDims
    from shardbridge_hf import HFConfig

    dims = dict(dims)
    ep = dims.pop("ep", 1)
    acc = H.sb_accelerator(ParallelDims(**dims), config=HFConfig(ep_size=ep))
    model = S.build(model_type, seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=S.LR)
    model, opt = acc.prepare(model, opt)
    return acc, model, opt


def train(model_type: str, dims: dict, root: str | None) -> dict | None:
    """3 steps at ``dims``: dp-mean losses, step-1 gradients (rank 0); saves and exports into ``root``."""
    import torch.distributed as dist

    acc, model, opt = _prepared(model_type, dims, seed=dist.get_rank())
    losses, grads, norm = [], None, None
    for step in range(1, S.STEPS + 1):
        loss = S._step(acc, model, opt, step)
        if step == 1:
            grads, norm = S._grads_and_norm(acc, model)
        opt.step()
        opt.zero_grad()
        losses.append(acc.reduce_loss(loss).item())
    out = {"losses": losses, "grads": grads, "norm": norm, "params": H.full_params(model)}
    if root is not None:
        acc.save_state(f"{root}/ckpt")
        with torch.no_grad():
            out["logits"] = model(input_ids=S.probe_ids(), use_cache=False).logits.detach().clone()
        acc.export_pretrained(f"{root}/ckpt", f"{root}/hf")
    return out if dist.get_rank() == 0 else None


def load(model_type: str, dims: dict, root: str) -> dict | None:
    import torch.distributed as dist

    acc, model, _ = _prepared(model_type, dims, seed=321)
    acc.load_state(f"{root}/ckpt")
    params = H.full_params(model)
    return params if dist.get_rank() == 0 else None


def refused(model_type: str, dims: dict | None = None) -> str:
    """The error a run at ``dims`` raises (default dp_shard=4 x ep=2: a MoE without an EP plan; every rank the same)."""
    try:
        _prepared(model_type, dims or {"dp_shard": 4, "ep": 2}, seed=0)
    except (ValueError, NotImplementedError) as exc:
        return str(exc)
    return "not refused"


def _match(got: dict, ref: dict, numbers: dict | None = None) -> str:
    """Losses of every step, every step-1 gradient and the total norm against one process (hf_sweep's rule).

    ``numbers`` (if given) receives what the docs table prints: ``loss_rel`` (largest relative
    loss difference to the one-process fp32 run over the steps), ``grad_rel`` / ``noise``
    (``hf_sweep.GradMatch.max_rel`` / ``.noise``) and ``norm_rel``.
    """
    match = S.compare_step1(got, ref)
    if numbers is not None:
        numbers.update(
            loss_rel=max(abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"])),
            grad_rel=match.max_rel,
            noise=match.noise,
            norm_rel=match.norm_rel,
        )
    return match.verdict()


def run_arch(
    model_type: str, *, checks: tuple[str, ...] = CHECKS, timeout: float = 300, numbers: dict | None = None
) -> dict[str, str]:
    """The ``checks`` of the module docstring for one architecture: ``{check: "pass" | reason}``.

    reshard and export read the dp4_ep4 run's checkpoint (which then runs whatever ``checks`` says).
    ``numbers`` (if given) receives ``{layout: {loss_rel, grad_rel, noise, norm_rel}}`` (:func:`_match`).
    """
    numbers = {} if numbers is None else numbers
    from shardbridge.testing import run_distributed

    saved = "reshard" in checks or "export" in checks
    tp = has_tp_plan(model_type)
    result: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as root:
        try:
            if "dp4_ep4" in checks or saved:
                ep_run = run_distributed(
                    train, model_type, LAYOUTS["dp4_ep4"], root if saved else None, world_size=4, timeout=timeout
                )[0]
                result["dp4_ep4"] = _match(ep_run, S.reference(model_type, dp=4), numbers.setdefault("dp4_ep4", {}))
            if "dp2_tp2_ep2" in checks and tp:
                tp_run = run_distributed(train, model_type, LAYOUTS["dp2_tp2_ep2"], None, world_size=4, timeout=timeout)
                ref = S.reference(model_type, dp=2)
                result["dp2_tp2_ep2"] = _match(tp_run[0], ref, numbers.setdefault("dp2_tp2_ep2", {}))
            elif "dp2_tp2_ep2" in checks:  # no TP plan: tp > 1 must be refused by name, on every rank alike
                messages = set(
                    run_distributed(refused, model_type, LAYOUTS["dp2_tp2_ep2"], world_size=4, timeout=timeout)
                )
                ok = len(messages) == 1 and "declares no TP plan" in next(iter(messages))
                result["dp2_tp2_ep2"] = REFUSED_NO_TP if ok else f"not refused by name: {sorted(messages)[:2]}"
            if "dp4_ep2" in checks:
                run = run_distributed(train, model_type, EP_ONLY_LAYOUT["dp4_ep2"], None, world_size=4, timeout=timeout)
                ref = S.reference(model_type, dp=4)
                result["dp4_ep2"] = _match(run[0], ref, numbers.setdefault("dp4_ep2", {}))
        except Exception as exc:  # noqa: BLE001 - reported in the table
            reason = S._reason(exc)
            return {c: result.get(c, reason) for c in checks}
        if not saved:
            return {c: result[c] for c in checks}
        diffs = []
        targets = ({"dp_shard": 2, "tp": 2}, LAYOUTS["dp2_tp2_ep2"]) if tp else ({"dp_shard": 4}, EP_ONLY_LAYOUT["dp4_ep2"])
        for dims in targets:
            try:
                got = run_distributed(load, model_type, dims, root, world_size=4, timeout=timeout)[0]
                diffs += [n for n, p in ep_run["params"].items() if not torch.equal(got[n], p)]
            except Exception as exc:  # noqa: BLE001
                diffs.append(S._reason(exc))
        result["reshard"] = "pass" if not diffs else f"differs: {diffs[:2]}"
        from transformers import AutoModelForCausalLM

        exported = AutoModelForCausalLM.from_pretrained(f"{root}/hf", dtype=torch.float32).eval()
        with torch.no_grad():
            logits = exported(input_ids=S.probe_ids(), use_cache=False).logits
        ok = S._close(logits, ep_run["logits"])
        result["export"] = "pass" if ok else f"logits max rel diff {S._max_rel(logits, ep_run['logits']):.1e}"
    return {c: result[c] for c in checks}


def _numbers_cells(numbers: dict) -> list[str]:
    """The table's number columns: loss rel diff per layout, worst gradient rel err / noise floor."""
    second = "dp4_ep2" if "dp4_ep2" in numbers else "dp2_tp2_ep2"  # an architecture without a TP plan: dp4_ep2
    loss = " / ".join(f"{numbers[k]['loss_rel']:.1e}" if k in numbers else "-" for k in ("dp4_ep4", second))
    grads = [v["grad_rel"] for v in numbers.values()]
    noises = [v["noise"] for v in numbers.values() if v.get("noise") is not None]
    grad = (f"{max(grads):.1e} / " + (f"{max(noises):.1e}" if noises else "-")) if grads else "-"
    return [loss, grad]


def main(argv: list[str]) -> None:
    """Run the sweep's checks and print the docs/hf.md table (markdown), one row per architecture."""
    import argparse

    from shardbridge.testing import run_distributed

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("archs", nargs="*", help="model types (default: every MoE architecture of the TP sweep)")
    parser.add_argument("--layouts-only", action="store_true", help="only the layouts (no reshard / export)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per distributed run")
    args = parser.parse_args(argv)
    layouts = (*LAYOUTS, *EP_ONLY_LAYOUT)
    table = ep_archs()
    archs = args.archs or sorted(table)
    print(
        "| architecture | " + " | ".join(CHECKS) + " | loss rel diff vs 1 process (dp4_ep4 / dp2_tp2_ep2, or dp4_ep2 without a TP plan) "
        "| gradient rel err / noise floor | s |"
    )
    print("|" + "---|" * (len(CHECKS) + 4))
    for model_type in archs:
        start = time.perf_counter()
        if not table.get(model_type, True):
            reason = run_distributed(refused, model_type, world_size=4, timeout=args.timeout)[0].replace("|", "/")
            print(f"| {model_type} | refused: {reason[:150]} |" + " - |" * (len(CHECKS) + 2), flush=True)
            continue
        numbers: dict = {}
        try:
            checks = tuple(c for c in checks_for(model_type) if c in layouts or not args.layouts_only)
            result = run_arch(model_type, checks=checks, timeout=args.timeout, numbers=numbers)
        except Exception:  # noqa: BLE001
            result = {c: S._reason(RuntimeError(traceback.format_exc())) for c in CHECKS}
        if "dp4_ep2" in result:  # no TP plan: the refusal, and the layout run instead
            result["dp2_tp2_ep2"] = f"{result['dp2_tp2_ep2']}; dp4_ep2: {result.pop('dp4_ep2')}"
        cells = [result.get(c, "-").replace("|", "/") for c in CHECKS] + _numbers_cells(numbers)
        print(f"| {model_type} | " + " | ".join(cells) + f" | {math.ceil(time.perf_counter() - start)} |", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(sys.argv[1:])
