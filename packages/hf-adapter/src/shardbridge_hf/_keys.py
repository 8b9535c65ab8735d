"""Every key of an Accelerate config file outside the shardbridge block: honoured, accepted, or refused by name.

[Note: what accelerate launch does with a config file's keys]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Accelerate 1.15's loader refuses an unknown TOP-LEVEL key ("had unknown keys", naming no near
key). Its mapping sections are not checked at all: ``accelerate launch`` copies each of their
keys onto its parsed arguments, and only the names its own parser defines are ever read::

    fsdp_config.x        -> args.fsdp_x (x gets the prefix)   -> FSDP_* env
    fp8_config.x         -> args.fp8_x                        -> ACCELERATE_FP8_* env (mixed_precision fp8 only)
    dynamo_config.x      -> args.dynamo_x                     -> ACCELERATE_DYNAMO_* env
    parallelism_config.x -> args.x, as written                -> PARALLELISM_CONFIG_* env (the parser's keys only)
    deepspeed_config.x, megatron_lm_config.x, mpirun_config.x -> args.x (read by their own launchers only)

A key the parser does not define becomes an attribute nothing reads. Measured (accelerate
1.15): ``parallelism_config_tp_sise: 2`` with no dp_shard key trained dp_shard=4 without TP and
exited 0. So ``shardbridge launch`` checks every key against the parser of the installed
accelerate (``launch_command_parser``: what this version reads, not a list typed here), and
refuses, by name and with the nearest known key, every key that would be dropped:

    top level            unknown: refused with did-you-mean (before Accelerate's own message);
                         TPU-only keys with a non-default value: refused (no effect under FSDP)
    parallelism_config   unknown: refused with did-you-mean; sizes of axes other than
                         dp_replicate, dp_shard, cp, tp: refused (``_launch``); the other keys:
                         accepted at the value shardbridge runs (cp_comm_strategy: allgather),
                         refused otherwise
    fsdp_config          ``_launch`` ([Note: Accelerate's fsdp keys]); unknown: did-you-mean
    fp8_config           the amax keys: moved into the block (``_launch``, upstream bug 7); every
                         other key: refused (Accelerate's FP8 path never runs under shardbridge)
    dynamo_config        refused unless dynamo_backend is NO (ShardbridgeAccelerator does not
                         compile the model)
    deepspeed_config,    refused when not empty (read only by their own launchers; distributed_type
    megatron_lm_config,  is FSDP)
    mpirun_config
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

from shardbridge.adapters import did_you_mean

from shardbridge_hf._config import BLOCK_KEY, HFConfig

__all__ = ["config_file_keys_problem", "unknown_fsdp_key", "launch_args", "sections_problem"]

#: fp8_config keys read into the shardbridge block (``_launch._ACCELERATE_FP8_ALIASES``' keys).
FP8_MOVED = ("amax_history_length", "amax_history_len", "amax_compute_algorithm", "amax_compute_algo", "fp8_format", "margin")

# parallelism_config keys that are not sizes: value(s) shardbridge runs -> why others are refused.
_PARALLELISM_OTHER: dict[str, tuple[tuple[Any, ...], str]] = {
    "parallelism_config_cp_backend": (("torch",), "shardbridge's context parallel is its own (torch) implementation"),
    "parallelism_config_cp_comm_strategy": (
        ("allgather",),
        "shardbridge's context-parallel attention all-gathers K/V (shardbridge.cp.cp_attention)",
    ),
    "parallelism_config_sp_backend": (("deepspeed",), "sequence parallelism (sp) is not run by shardbridge"),
    "parallelism_config_sp_seq_length": ((None,), "sequence parallelism (sp) is not run by shardbridge"),
    "parallelism_config_sp_seq_length_is_variable": ((True,), "sequence parallelism (sp) is not run by shardbridge"),
    "parallelism_config_sp_attn_implementation": (("sdpa",), "sequence parallelism (sp) is not run by shardbridge"),
}

# Top-level keys only Accelerate's TPU launcher reads: set to anything but "off" they have no effect under FSDP.
# `accelerate config` writes some of them off in every file (downcast_bf16: 'no', tpu_env: []).
_TPU_ONLY = (
    "downcast_bf16",
    "tpu_name",
    "tpu_zone",
    "tpu_use_cluster",
    "tpu_use_sudo",
    "command_file",
    "commands",
    "tpu_vm",
    "tpu_env",
)

_SECTIONS_FOR_OTHER_LAUNCHERS = ("deepspeed_config", "megatron_lm_config", "mpirun_config")

# process_config turns these legacy top-level keys into new ones before its own check.
_LEGACY_TOP_LEVEL = ("fp16", "dynamo_backend")


@functools.cache
def launch_args() -> frozenset[str]:
    """The argument names ``accelerate launch`` of the installed accelerate defines (what it reads)."""
    from accelerate.commands.launch import launch_command_parser

    # Every argument with its default: the parser's own list of what it defines.
    return frozenset(vars(launch_command_parser().parse_args(["script.py"])))


def _top_level_keys() -> set[str]:
    from accelerate.commands.config.config_args import ClusterConfig

    return {f.name for f in dataclasses.fields(ClusterConfig)} | set(_LEGACY_TOP_LEVEL)


def config_file_keys_problem(data: Mapping[Any, Any]) -> str | None:
    """The first top-level key of a loaded config file that Accelerate refuses or never reads; None if all are fine.

    Checked before Accelerate's own loader, whose message names no near key.
    """
    known = _top_level_keys()
    for key in data:
        if key not in known:
            return (
                f"{key}: not a key of an Accelerate config file{did_you_mean(key, known)} (Accelerate refuses unknown "
                "top-level keys); fix or remove it"
            )
    for key in _TPU_ONLY:
        if key in data and not _off(data[key]):
            return (
                f"{key}={data[key]!r} has no effect: only Accelerate's TPU launcher reads it (distributed_type is FSDP); "
                "remove it"
            )
    return None


def _off(value: Any) -> bool:
    """A value that leaves a TPU-only key off: null, false, 'no', an empty string or container."""
    return value is None or value is False or (isinstance(value, (str, list, dict)) and str(value).lower() in ("", "no", "false", "[]", "{}"))


def sections_problem(cluster: Any) -> str | None:
    """The first key of a mapping section (parallelism_config, fp8_config, dynamo_config, ...) that would be dropped."""
    for check in (_parallelism_key, _fp8_key, _dynamo_key, _other_launchers):
        problem = check(cluster)
        if problem:
            return problem
    return None


def _mapping(cluster: Any, name: str) -> Mapping[Any, Any]:
    value = getattr(cluster, name, None)
    return value if isinstance(value, Mapping) else {}


def _parallelism_key(cluster: Any) -> str | None:
    section = _mapping(cluster, "parallelism_config")
    known = sorted(k for k in launch_args() if k.startswith("parallelism_config_"))
    for key, value in section.items():
        if key == "parallelism_config_ep_size":
            continue  # its own rule in _launch: ep lives in the shardbridge block
        if key not in known:
            near = did_you_mean(key, known) or did_you_mean(f"parallelism_config_{key}", known)
            return (
                f"parallelism_config.{key}: not a key Accelerate reads, it would be dropped without effect"
                + (near or f" (keys: {', '.join(known)})")
            )
        if key in _PARALLELISM_OTHER:
            allowed, why = _PARALLELISM_OTHER[key]
            if value not in allowed:
                return (
                    f"parallelism_config.{key}={value!r} cannot take effect under shardbridge ({why}); "
                    f"remove it{'' if allowed == (None,) else f' or set {allowed[0]!r}'}"
                )
    return None


def _fp8_key(cluster: Any) -> str | None:
    section = _mapping(cluster, "fp8_config")
    accelerate_keys = {k.removeprefix("fp8_") for k in launch_args() if k.startswith("fp8_")} | set(FP8_MOVED)
    for key, value in section.items():
        if key in FP8_MOVED:
            continue
        if (key if str(key).startswith("fp8") else f"fp8_{key}") not in launch_args():
            return (
                f"fp8_config.{key}: not a key Accelerate reads{did_you_mean(key, accelerate_keys)}; FP8 is set in "
                "fsdp_config.shardbridge.fp8 (docs/hf.md)"
            )
        return (
            f"fp8_config.{key}={value!r} cannot take effect under shardbridge (Accelerate's own FP8 path is off: "
            "mixed_precision is 'no' or 'bf16'); set FP8 in fsdp_config.shardbridge.fp8 (backend, recipe, ...) and "
            "remove it"
        )
    return None


def _dynamo_key(cluster: Any) -> str | None:
    section = _mapping(cluster, "dynamo_config")
    known = sorted(k for k in launch_args() if k.startswith("dynamo_"))
    for key in section:
        name = key if str(key).startswith("dynamo_") else f"dynamo_{key}"
        if name not in known:
            near = did_you_mean(key, {*known, *(k.removeprefix("dynamo_") for k in known)})
            return f"dynamo_config.{key}: not a key Accelerate reads, it would be dropped without effect" + (
                near or f" (keys: {', '.join(known)})"
            )
    backend = str(section.get("dynamo_backend", section.get("backend", "NO"))).upper()
    if backend != "NO":
        return (
            f"dynamo_config={dict(section)!r} cannot take effect under shardbridge (ShardbridgeAccelerator does not "
            "torch.compile the model); remove dynamo_config"
        )
    return None


def _other_launchers(cluster: Any) -> str | None:
    for name in _SECTIONS_FOR_OTHER_LAUNCHERS:
        section = _mapping(cluster, name)
        if section:
            return (
                f"{name} ({', '.join(map(str, section))}) has no effect: only Accelerate's "
                f"{name.removesuffix('_config').replace('_lm', '-LM')} launcher reads it and distributed_type is FSDP; "
                "remove it"
            )
    return None


def unknown_fsdp_key(raw_key: Any) -> str | None:
    """The error for an ``fsdp_config`` key Accelerate does not read (with the key meant), or None for a key it reads."""
    keys = [k for k in launch_args() if k.startswith("fsdp_")]
    # accelerate prefixes a key written without fsdp_ (fsdp_config.x -> fsdp_x)
    if raw_key == "shardbridge" or (raw_key if str(raw_key).startswith("fsdp") else f"fsdp_{raw_key}") in keys:
        return None
    if raw_key in {f.name for f in dataclasses.fields(HFConfig)}:
        near = f"; {raw_key} is a key of the shardbridge block: move it to {BLOCK_KEY}.{raw_key}"
    else:
        near = did_you_mean(raw_key, {*keys, *(k.removeprefix("fsdp_") for k in keys), "shardbridge"})
    return f"fsdp_config.{raw_key}: not a key Accelerate reads, it would be dropped without effect{near}"
