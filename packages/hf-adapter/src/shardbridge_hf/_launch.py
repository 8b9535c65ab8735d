"""``shardbridge-launch``: validate the shardbridge block, then hand over to ``accelerate launch``.

::

    shardbridge-launch --config_file cfg.yaml train.py --lr 1e-3      # same flags as accelerate launch
    shardbridge launch --config_file cfg.yaml train.py                # the same, from the core CLI

Steps: parse the arguments with Accelerate's own ``launch`` parser; read the config file with
Accelerate's own loader (so whatever it rejects is rejected the same way); validate the
``fsdp_config.shardbridge`` block and its consistency with the rest of the file (FSDP2, the
parallelism sizes, the process count, Accelerate's own ``fsdp_*`` keys) BEFORE any process
starts, with the command-line flags that restate a key of the file applied on top (as
``accelerate launch`` applies them); put the validated config in the environment
(:data:`~shardbridge_hf.ENV_VAR`, JSON); call Accelerate's ``launch_command``.
See [Note: where the block lives in the yaml] in ``_config.py`` and [Note: Accelerate's fsdp keys].

[Note: Accelerate's fsdp keys]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``accelerate launch`` exports a fixed list of ``fsdp_config`` keys as ``FSDP_*`` env, which
Accelerate's own FSDP plugin reads; ``ShardbridgeAccelerator`` builds its own plugin, so
none of them would take effect. Each key is therefore honoured, accepted, or refused here::

    honoured (-> block key)             fsdp_activation_checkpointing -> activation_checkpointing
                                        fsdp_reshard_after_forward    -> reshard_after_forward
                                        fsdp_sync_module_states       -> sync_module_states
    accepted: what shardbridge does     fsdp_version: 2, fsdp_state_dict_type: SHARDED_STATE_DICT,
                                        fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP,
                                        fsdp_use_orig_params: true, fsdp_offload_params: false,
                                        fsdp_cpu_ram_efficient_loading (read by transformers'
                                        from_pretrained in the workers; needs sync_module_states)
    refused, by name                    everything else (sharding strategy, wrap classes and
                                        sizes, prefetch, ignored modules, CPU offload, ...)

On CPU (``use_cpu: true``) Accelerate still starts the workers with torchrun (its FSDP
launcher); each worker's ``ShardbridgeAccelerator`` then initialises gloo.

[Note: a file for shardbridge launch only]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Plain ``accelerate launch`` cannot run a file's shardbridge block: it runs no third-party code
(no plugin entry points) and copies ``fsdp_config.shardbridge`` to an argument nothing reads, so
a script would train with Accelerate's own FSDP2 (GPUs) or die in ``ParallelismConfig``'s check
(CPU), the block dropped without a word. A file can refuse such a launch by name: the value of
``fsdp_auto_wrap_policy`` that starts with ``shardbridge`` (:data:`LAUNCH_GUARD`, in every example
file) is exported by ``accelerate launch`` as ``FSDP_AUTO_WRAP_POLICY``, and Accelerate's own
``FullyShardedDataParallelPlugin`` refuses it in every worker's ``Accelerator()``, printing it::

    ValueError: Invalid auto wrap policy: shardbridge: launch this file with `shardbridge launch`;
    accelerate launch drops fsdp_config.shardbridge. Must be one of [...]

``shardbridge launch`` accepts the value (it says what shardbridge does: wrap each decoder layer)
and does not export it (``_plugin.route_workers``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import sys
import textwrap
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from shardbridge import ParallelDims, fp8
from shardbridge.adapters import Verb, install_hint

from shardbridge_hf._compat import require_accelerate
from shardbridge_hf._config import BLOCK_KEY, ENV_VAR, HFConfig
from shardbridge_hf._keys import config_file_keys_problem, sections_problem, unknown_fsdp_key
from shardbridge_hf._noise import quiet_upstream_noise
from shardbridge_hf._plugin import route_workers

__all__ = [
    "LAUNCH_GUARD",
    "LaunchPlan",
    "cli_verb",
    "main",
    "read_config_file",
]

# Accelerate exports fp8_config keys as ACCELERATE_FP8_<KEY>; TERecipeKwargs reads other names
# for these two (upstream bug 7). We translate them into the block instead.
_ACCELERATE_FP8_ALIASES = {
    "amax_history_length": "amax_history_length",
    "amax_history_len": "amax_history_length",
    "amax_compute_algorithm": "amax_compute_algo",
    "amax_compute_algo": "amax_compute_algo",
    "fp8_format": "fp8_format",
    "margin": "margin",
}


# ``accelerate launch`` flags that restate a top-level key of the config file (the flag wins): the
# multi-machine ones too, which a launch on each machine usually gives on its command line.
_TOP_LEVEL_FLAGS = ("num_processes", "mixed_precision", "num_machines", "machine_rank", "main_process_port")

# See [Note: Accelerate's fsdp keys].
_FSDP_HONOURED = {
    "fsdp_activation_checkpointing": "activation_checkpointing",
    "fsdp_reshard_after_forward": "reshard_after_forward",
    "fsdp_sync_module_states": "sync_module_states",
    "fsdp_offload_params": "cpu_offload",
}
LAUNCH_GUARD = "shardbridge: launch this file with `shardbridge launch`; accelerate launch drops fsdp_config.shardbridge"
"""The ``fsdp_auto_wrap_policy`` value that makes plain ``accelerate launch`` refuse a file by name. See
[Note: a file for shardbridge launch only]; any value starting with ``shardbridge`` works the same."""


def _is_launch_guard(key: str, value: Any) -> bool:
    return key == "fsdp_auto_wrap_policy" and isinstance(value, str) and value.lower().startswith("shardbridge")


_FSDP_ACCEPTED = {  # key -> the values that say what shardbridge does anyway
    "fsdp_version": ("2",),  # checked first, with its own message
    "fsdp_state_dict_type": ("SHARDED_STATE_DICT",),
    "fsdp_auto_wrap_policy": ("TRANSFORMER_BASED_WRAP",),
    "fsdp_use_orig_params": ("true",),
    "fsdp_cpu_ram_efficient_loading": ("true", "false"),
}
_FSDP_WHY_REFUSED = {
    "fsdp_sharding_strategy": "it is FSDP1's; FSDP2 shards over parallelism_config_dp_shard_size and replicates "
    "over parallelism_config_dp_replicate_size",
    "fsdp_transformer_layer_cls_to_wrap": "shardbridge wraps the embeddings, each decoder layer and [norm, lm_head] "
    "itself",
    "fsdp_min_num_params": "shardbridge wraps the embeddings, each decoder layer and [norm, lm_head] itself",
    "fsdp_auto_wrap_policy": "shardbridge wraps each decoder layer (TRANSFORMER_BASED_WRAP) and nothing else",
    "fsdp_state_dict_type": "save_state always writes a sharded, reshardable checkpoint; export_pretrained (or "
    "`shardbridge ckpt export`) writes the full model",
    "fsdp_backward_prefetch": "FSDP2 prefetches one unit ahead by itself",
    "fsdp_forward_prefetch": "FSDP2 prefetches one unit ahead by itself",
    "fsdp_activation_checkpointing_offload": "offloading checkpointed activations is not supported; use "
    "fsdp_activation_checkpointing",
    "fsdp_use_orig_params": "FSDP2 always keeps the original parameters",
}


@dataclass(frozen=True, kw_only=True)
class LaunchPlan:
    """What a config file asks for, validated.

    Example:
        >>> plan = read_config_file("examples/hf/cpu_fsdp2_tp2.yaml")  # doctest: +SKIP
        >>> plan.dims.tp, plan.config.fp8.backend  # doctest: +SKIP
        (2, 'none')
    """

    config: HFConfig
    """The shardbridge block, with ``dims`` and ``use_cpu`` filled in."""
    dims: ParallelDims
    """The parallel degrees from ``parallelism_config`` (resolved against num_processes)."""
    num_processes: int
    """Total number of processes the file asks for."""


_AXES = ("dp_replicate", "dp_shard", "cp", "tp")
"""The parallelism_config axes shardbridge_hf runs (``parallelism_config_<axis>_size``)."""


@dataclass(frozen=True)
class _Check:
    """One rule of a config file: the value it reads, whether that value is acceptable, the error otherwise."""

    read: Callable[[Any], Any]
    """Reads the value from Accelerate's loaded config (the command-line flags applied)."""
    ok: Callable[[Any], bool]
    """Whether the value is acceptable."""
    message: Callable[[Any], str]
    """The error for an unacceptable value: the key, the value and the fix."""
    error: type[Exception] = ValueError


def _mixed_precision(cluster: Any) -> Any:
    return cluster.mixed_precision or "no"


def _parallelism(cluster: Any) -> dict[str, Any]:
    return dict(cluster.parallelism_config or {})


def _unknown_axes(cluster: Any) -> list[tuple[str, Any]]:
    """``parallelism_config_*_size`` keys of axes shardbridge_hf does not run, with a size other than 1."""
    pc = _parallelism(cluster)
    return [
        (key, pc[key])
        for key in sorted(pc)
        if key.endswith("_size") and key.removeprefix("parallelism_config_").removesuffix("_size") not in _AXES
        and pc[key] != 1
    ]  # fmt: skip


def _bad_sizes(cluster: Any) -> list[tuple[str, Any]]:
    pc = _parallelism(cluster)
    sizes = [(f"parallelism_config_{axis}_size", pc.get(f"parallelism_config_{axis}_size", 1)) for axis in _AXES]
    return [(key, v) for key, v in sizes if isinstance(v, bool) or not isinstance(v, int) or v < 1]


def _is_int_at_least_1(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _fsdp(cluster: Any) -> dict[str, Any]:
    return dict(cluster.fsdp_config or {})


def _is_mapping_or_none(value: Any) -> bool:
    return value is None or isinstance(value, dict)


_FP8_MIXED = (
    "mixed_precision: fp8 runs Accelerate's own FP8 path, which breaks under FSDP2 x TP; set mixed_precision: 'no' "
    f"(or bf16) and {BLOCK_KEY}.fp8.backend: torchao (or te)"
)
_BOOL_MIXED = (
    "YAML reads an unquoted no / yes as a boolean, which Accelerate's launcher cannot take; write mixed_precision: "
    "'no' (quoted) or 'bf16'"
)

# The rules of read_config_file, in the order they are checked (the first broken one is the
# error): what each reads from Accelerate's loaded config, what it accepts, the message otherwise.
# The fsdp_* and fp8_config keys are checked after these, by _merge_accelerate_fsdp / _fp8.
# fmt: off
_CHECKS: tuple[_Check, ...] = (
    *(_Check(lambda c, k=key: getattr(c, k, None), _is_mapping_or_none, lambda v, k=key: f"{k} must be a mapping, got {v!r}")
      for key in ("fsdp_config", "parallelism_config", "fp8_config")),
    _Check(lambda c: _fsdp(c).get("shardbridge"), _is_mapping_or_none, lambda v: f"{BLOCK_KEY} must be a mapping, got {v!r}"),
    _Check(lambda c: c.use_cpu, lambda v: isinstance(v, bool), lambda v: f"use_cpu={v!r} must be true or false"),
    _Check(lambda c: getattr(c.distributed_type, "value", c.distributed_type), lambda v: v == "FSDP",
           lambda v: f"distributed_type={v!r}; set distributed_type: FSDP"),
    _Check(lambda c: _fsdp(c).get("fsdp_version"), lambda v: str(v if v is not None else "1") == "2",
           lambda v: f"fsdp_config.fsdp_version={v!r}; set fsdp_version: 2"),
    _Check(lambda c: c.mixed_precision, lambda v: not isinstance(v, bool), lambda v: f"mixed_precision={v!r}: {_BOOL_MIXED}"),
    _Check(_mixed_precision, lambda v: v != "fp8", lambda v: _FP8_MIXED),
    _Check(_mixed_precision, lambda v: v != "fp16", lambda v: "mixed_precision: fp16 is not supported under FSDP2 here; use bf16"),
    _Check(_mixed_precision, lambda v: v in ("no", "bf16"), lambda v: f"mixed_precision={v!r} is not allowed; use 'no' or 'bf16'"),
    _Check(lambda c: (_mixed_precision(c), (_fsdp(c).get("shardbridge") or {}).get("precision")),
           lambda v: v != ("bf16", "fp32"),
           lambda v: f"mixed_precision: bf16 but {BLOCK_KEY}.precision: fp32; make them agree (the shardbridge block "
                     "wins when mixed_precision is 'no')"),
    _Check(lambda c: c.num_processes, _is_int_at_least_1,
           lambda v: f"num_processes={v!r} must be an int >= 1, the total process count"
                     + (" (it is not set: add num_processes: N)" if v == -1 else "")),
    _Check(lambda c: getattr(c, "num_machines", 1), _is_int_at_least_1,
           lambda v: f"num_machines={v!r} must be an int >= 1, the number of machines (1: this one)"),
    _Check(lambda c: (getattr(c, "machine_rank", 0), getattr(c, "num_machines", 1)),
           lambda v: type(v[0]) is int and 0 <= v[0] < v[1],
           lambda v: f"machine_rank={v[0]!r} must be an int in 0..num_machines-1 = 0..{v[1] - 1} (this machine's index)"),
    _Check(lambda c: (c.num_processes, getattr(c, "num_machines", 1)), lambda v: v[0] % v[1] == 0,
           lambda v: f"num_processes={v[0]} is not divisible by num_machines={v[1]}: num_processes is the total over "
                     "all machines, the same number on each"),
    _Check(lambda c: getattr(c, "main_process_port", None), lambda v: v is None or (type(v) is int and 0 <= v <= 65535),
           lambda v: f"main_process_port={v!r} must be a TCP port in 1..65535, or 0 for a free one (unset: Accelerate's "
                     "default 29500)"),
    _Check(lambda c: _parallelism(c).get("parallelism_config_ep_size", 1), lambda v: v == 1,
           lambda v: f"parallelism_config_ep_size={v!r}: Accelerate's parallelism_config has no ep; write "
                     f"{BLOCK_KEY}.ep_size: {v!r} instead"),
    # every key of parallelism_config, fp8_config, dynamo_config, ... read or refused: [Note: what accelerate launch
    # does with a config file's keys] in _keys.py
    _Check(sections_problem, lambda v: v is None, lambda v: v),
    _Check(_unknown_axes, lambda v: not v,
           lambda v: f"{v[0][0]}={v[0][1]!r}: shardbridge_hf runs dp_replicate, dp_shard, cp and tp; remove the key",
           NotImplementedError),
    _Check(_bad_sizes, lambda v: not v, lambda v: f"{v[0][0]}={v[0][1]!r} must be an int >= 1"),
)
# fmt: on


def read_config_file(path: str | os.PathLike[str], *, overrides: Mapping[str, Any] | None = None) -> LaunchPlan:
    """Read and validate an Accelerate config file with a shardbridge block.

    Args:
        path: the Accelerate config file (yaml or json).
        overrides: ``accelerate launch`` flags that restate a key of the file, by argument
            name (``num_processes``, ``mixed_precision``, ``fsdp_*``, ``parallelism_config_*``);
            they win over the file, as in ``accelerate launch``.

    Raises:
        ValueError: naming the yaml key (or flag) and the fix: not FSDP2, ``mixed_precision:
            fp8``, sizes that do not multiply to ``num_processes``, a bad shardbridge key, an
            Accelerate ``fsdp_*`` key shardbridge cannot honour.
        NotImplementedError: a ``parallelism_config_*_size`` axis other than dp_replicate,
            dp_shard, cp and tp.

    Example:
        >>> read_config_file("cfg.yaml", overrides={"num_processes": 8}).num_processes  # doctest: +SKIP
        8
    """
    require_accelerate()
    overrides = dict(overrides or {})
    where = f"config file {str(path)!r}"
    cluster = _load_cluster_config(path, where)
    if overrides:
        where += " with " + " ".join(f"--{k} {v}" for k, v in sorted(overrides.items()))
        _apply_overrides(cluster, overrides)
    for check in _CHECKS:  # in order: the first broken rule is the error
        value = check.read(cluster)
        if not check.ok(value):
            raise check.error(f"{where}: {check.message(value)}")
    block = dict(_fsdp(cluster).get("shardbridge") or {})
    if _mixed_precision(cluster) == "bf16":
        block.setdefault("precision", "bf16")
    _merge_accelerate_fp8(cluster.fp8_config or {}, block, where)
    _merge_accelerate_fsdp(_fsdp(cluster), block, where)
    dims = _dims(cluster, where)
    try:
        config = HFConfig.from_block(block, dims=dims, use_cpu=bool(cluster.use_cpu))
    except ValueError as e:  # the block's own checks name the key; say which file it is in
        raise ValueError(f"{where}: {e}") from None
    return LaunchPlan(config=config, dims=config.parallel_dims(dims), num_processes=cluster.num_processes)


def _dims(cluster: Any, where: str) -> ParallelDims:
    """The parallel degrees of ``parallelism_config`` (sizes checked by ``_CHECKS``), resolved against num_processes.

    A misfit names the yaml keys and offers only what can fit (``ParallelDims.degrees_that_fit``).
    """
    pc = _parallelism(cluster)
    dims = ParallelDims(**{axis: pc.get(f"parallelism_config_{axis}_size", 1) for axis in _AXES})
    if "parallelism_config_dp_shard_size" not in pc:
        dims = dataclasses.replace(dims, dp_shard=-1)
    n = cluster.num_processes
    try:
        return dims.resolve(n)
    except ValueError:
        pass
    key = "parallelism_config_{}_size".format
    others = dims.dp_replicate * dims.cp * dims.tp
    named = [a for a in _AXES if (a == "dp_shard" and dims.is_resolved) or (a != "dp_shard" and getattr(dims, a) > 1)]
    sizes = " * ".join(f"{key(a)}({getattr(dims, a)})" for a in named)
    misfit = f"{sizes} = {others * dims.dp_shard} != {n}" if dims.is_resolved else f"{sizes} does not divide {n}"
    if n % others == 0:
        fix = f"set {key('dp_shard')}: {n // others} (or remove it: dp_shard takes the rest)"
    else:
        fits = [
            f"{key(a)} to one of {fit}"
            for a in ("tp", "cp", "dp_replicate")
            if getattr(dims, a) > 1 and (fit := dims.degrees_that_fit(a, n))
        ]
        fix = f"no dp_shard fits: set {' or '.join(fits) + ', or ' if fits else ''}num_processes to a multiple of {others}"
        if dims.tp > 1:
            fix += " (tp must also divide the model's attention heads and MLP width, checked when it is prepared)"
    raise ValueError(f"{where}: parallelism_config sizes do not fit num_processes={n}: {misfit}; {fix}")


def check_runtime(plan: LaunchPlan, where: str) -> None:
    """What the workers will import, imported here first: one line before any process starts.

    Raises:
        ValueError: the FP8 backend's library does not import on this machine (e.g. ``backend:
            te`` without TransformerEngine), naming the yaml key and the install hint.
    """
    recipe = plan.config.fp8.to_recipe()
    if recipe is None:
        return
    try:
        fp8.get_backend(recipe.backend).require_runtime()
    except ImportError as e:
        raise ValueError(
            f"{where}: {BLOCK_KEY}.fp8.backend={recipe.backend!r} cannot run here: {' '.join(str(e).split())}"
        ) from None


def _one_line_usage_error(prog: str) -> Any:
    """argparse's ``error`` as one line naming the fix, exit 2 (see [Note: CLI errors] in the core)."""

    def error(message: str) -> NoReturn:
        print(f"{prog}: error: {' '.join(message.split())}; see `{prog} --help`", file=sys.stderr)
        sys.exit(2)

    return error


def _load_cluster_config(path: str | os.PathLike[str], where: str) -> Any:
    """Accelerate's own loader, after checks that turn its crashes on bad files into ValueErrors."""
    import json

    import yaml
    from accelerate.commands.config.config_args import load_config_from_file

    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise ValueError(
            f"{where} cannot be read ({exc.strerror or exc}); pass an existing Accelerate config file"
        ) from None
    except UnicodeDecodeError as exc:
        raise ValueError(
            f"{where} is not UTF-8 text (byte {exc.start}: {exc.reason}); pass the Accelerate yaml/json config file"
        ) from None
    is_json = str(path).endswith(".json")
    try:
        data = json.loads(text) if is_json else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as exc:
        detail = " ".join(str(exc).split())
        raise ValueError(f"{where} is not valid {'JSON' if is_json else 'YAML'} ({detail}); fix its syntax") from None
    if not isinstance(data, dict) or not data:
        raise ValueError(
            f"{where} is empty or not a mapping of keys (got {type(data).__name__}); write an Accelerate config, "
            "e.g. examples/hf/cpu_fsdp2_tp2.yaml"
        )
    problem = config_file_keys_problem(data)
    if problem:
        raise ValueError(f"{where}: {problem}")
    try:
        return load_config_from_file(str(path))
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        # Accelerate's own message (unknown keys, a bad enum value) or its crash on a wrong type.
        detail = " ".join(str(exc).split())
        raise ValueError(f"{where}: Accelerate cannot read it: {type(exc).__name__}: {detail}") from None


def _apply_overrides(cluster: Any, overrides: Mapping[str, Any]) -> None:
    """Command-line flags over the file, where ``accelerate launch`` puts them."""
    for name, value in overrides.items():
        if name.startswith("fsdp_"):
            cluster.fsdp_config = {**(cluster.fsdp_config or {}), name: value}
        elif name.startswith("parallelism_config_"):
            cluster.parallelism_config = {**(cluster.parallelism_config or {}), name: value}
        else:
            setattr(cluster, name, value)


def _merge_accelerate_fsdp(fsdp: Mapping[str, Any], block: dict[str, Any], where: str) -> None:
    """Accelerate's own ``fsdp_config`` keys: honour, accept or refuse each. See [Note: Accelerate's fsdp keys]."""
    for raw_key, value in fsdp.items():
        if raw_key == "shardbridge":
            continue
        # accelerate launch copies fsdp_config.x to args.fsdp_x (keys without the prefix too).
        key = raw_key if raw_key.startswith("fsdp") else f"fsdp_{raw_key}"
        text = str(value).lower() if isinstance(value, bool) else str(value)
        if key in _FSDP_HONOURED:
            ours = _FSDP_HONOURED[key]
            flag = _flag(f"fsdp_config.{raw_key}", value, where)
            if ours in block and block[ours] not in ("default", flag):
                raise ValueError(
                    f"{where}: fsdp_config.{raw_key}={value!r} and {BLOCK_KEY}.{ours}={block[ours]!r} disagree; "
                    "keep one"
                )
            block[ours] = flag
        elif key in _FSDP_ACCEPTED and text.upper() in {v.upper() for v in _FSDP_ACCEPTED[key]}:
            continue
        elif _is_launch_guard(key, value):  # [Note: a file for shardbridge launch only]
            continue
        elif unknown_fsdp_key(raw_key):
            raise ValueError(f"{where}: {unknown_fsdp_key(raw_key)}")
        else:
            why = _FSDP_WHY_REFUSED.get(key, "shardbridge_hf does not honour this key")
            raise ValueError(
                f"{where}: fsdp_config.{raw_key}={value!r} cannot take effect under shardbridge ({why}); remove it"
            )
    if str(fsdp.get("fsdp_cpu_ram_efficient_loading", "false")).lower() == "true" and not block.get(
        "sync_module_states", True
    ):
        raise ValueError(
            f"{where}: fsdp_cpu_ram_efficient_loading: true loads real weights on rank 0 only, which needs "
            f"{BLOCK_KEY}.sync_module_states: true"
        )


def _flag(key: str, value: Any, where: str) -> bool:
    if isinstance(value, bool):
        return value
    if str(value).lower() in ("true", "false"):
        return str(value).lower() == "true"
    raise ValueError(f"{where}: {key}={value!r} must be true or false")


def _merge_accelerate_fp8(fp8_config: dict[str, Any], block: dict[str, Any], where: str) -> None:
    known = {k: v for k, v in fp8_config.items() if k in _ACCELERATE_FP8_ALIASES}
    if not known:
        return
    fp8 = dict(block.get("fp8") or {})
    for key, value in known.items():
        ours = _ACCELERATE_FP8_ALIASES[key]
        if ours in fp8 and fp8[ours] != value:
            raise ValueError(
                f"{where}: fp8_config.{key}={value!r} and {BLOCK_KEY}.fp8.{ours}={fp8[ours]!r} disagree; keep one"
            )
        fp8[ours] = value
    moves = ", ".join(f"fp8_config.{key} -> {BLOCK_KEY}.fp8.{_ACCELERATE_FP8_ALIASES[key]}" for key in known)
    warnings.warn(
        f"{where}: {moves}: read into the shardbridge block (Accelerate exports fp8_config keys under names its "
        "TERecipeKwargs never reads); move them there",
        UserWarning,
        stacklevel=3,
    )
    block["fp8"] = fp8


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``shardbridge-launch`` (and of ``shardbridge launch``).

    Args:
        argv: ``accelerate launch`` arguments (``--config_file`` required), then the script
            and its arguments. None = ``sys.argv[1:]``.

    Returns:
        0 on success (Accelerate raises on a failed run). Bad configs exit with status 2
        and the validation message, before any process starts.

    Example:
        >>> main(["--config_file", "examples/hf/cpu_fsdp2_tp2.yaml", "examples/hf/train.py"])  # doctest: +SKIP
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    quiet_upstream_noise()
    try:
        require_accelerate()
        from accelerate.commands.launch import launch_command, launch_command_parser
    except ImportError as e:  # the hf extra is missing: one line, not a traceback
        print(f"shardbridge-launch: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    parser = launch_command_parser()
    parser.prog = "shardbridge-launch"
    parser.error = _one_line_usage_error(parser.prog)  # not Accelerate's 100-line usage dump
    accelerate_help = parser.format_help
    parser.format_help = lambda: shardbridge_help() + "\n" + accelerate_help()  # ours first, then Accelerate's
    with _argv_for_help(parser.prog, argv):
        args = parser.parse_args(argv)
    if args.config_file is None:
        parser.error("--config_file is required: the shardbridge block lives in the Accelerate config file")
    try:
        plan = read_config_file(args.config_file, overrides=_command_line_overrides(args))
        check_runtime(plan, str(args.config_file))
    except (ValueError, NotImplementedError, FileNotFoundError) as e:
        print(f"shardbridge-launch: {e}", file=sys.stderr)
        return 2
    try:
        route_workers(args)  # [Note: the Accelerate plugin]
    except ValueError as e:
        print(f"shardbridge-launch: {e}", file=sys.stderr)
        return 2
    os.environ[ENV_VAR] = plan.config.to_json()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if plan.config.use_cpu:
        # transformers' TrainingArguments sets up its process state from this (Accelerate's CPU launcher
        # exports it; its FSDP launcher, which starts these workers, does not): without it a Trainer's
        # arguments would say "one process, not distributed" on every rank.
        os.environ["ACCELERATE_USE_CPU"] = "true"
    if not plan.config.sync_module_states:
        # accelerate launch exports FSDP_CPU_RAM_EFFICIENT_LOADING=true by default, and transformers'
        # from_pretrained then loads real weights on rank 0 only; without the rank-0 broadcast the
        # other ranks would train from meta tensors. (A file asking for it was refused above.)
        args.fsdp_cpu_ram_efficient_loading = "false"
    try:
        launch_command(args)
    except (ValueError, NotImplementedError) as e:  # Accelerate refused an argument
        print(f"shardbridge-launch: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 (the workers failed; their tracebacks are above)
        print(
            f"shardbridge-launch: the launch failed ({type(e).__name__}: {' '.join(str(e).split())[:300]}); the "
            "workers' output, if any, is above (none: the error came from Accelerate's launcher itself)",
            file=sys.stderr,
        )
        return 1
    return 0


def shardbridge_help() -> str:
    """The top of ``shardbridge launch --help``: what the launcher adds, and every key of the block.

    The keys, defaults and one-line meanings are read from the config dataclasses
    (:class:`~shardbridge_hf.HFConfig`, ``FP8Config``, ``CheckpointConfig``), so the list cannot
    drift from what the launcher accepts.
    """
    from shardbridge_hf._config import CheckpointConfig, FP8Config

    lines = [
        "usage: shardbridge launch --config_file CONFIG.yaml [accelerate launch options] SCRIPT [SCRIPT ARGS]",
        "",
        f"Validates the Accelerate config file's {BLOCK_KEY} block and its fit with the rest of the file",
        "(FSDP2, parallelism sizes, process count, Accelerate's own fsdp_* keys) before any process starts, then",
        "runs `accelerate launch` (docs/hf.md). A bad file exits 2 with one line naming the key and the fix.",
        "",
        "shardbridge options:",
        "  --config_file FILE    required: the Accelerate config file holding the shardbridge block",
        "  flags that restate a key of the file (--num_processes, --mixed_precision, --fsdp_*,",
        "  --parallelism_config_*) win over the file, as in accelerate launch, and are validated with it",
        "",
        f"{BLOCK_KEY} keys (default, meaning; docs/hf.md, The yaml reference):",
    ]
    for prefix, cls in (("", HFConfig), ("fp8.", FP8Config), ("checkpoint.", CheckpointConfig)):
        docs = _field_docs(cls)
        for f in dataclasses.fields(cls):
            if f.name in ("dims", "use_cpu") or (not prefix and f.name in ("fp8", "checkpoint")):
                continue  # filled from parallelism_config / use_cpu; sub-blocks listed key by key
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]
            head = f"  {prefix + f.name:<26} {_yaml_value(default):<10} "
            lines += textwrap.wrap(
                docs.get(f.name, ""), width=110, initial_indent=head, subsequent_indent=" " * len(head)
            ) or [head.rstrip()]
    lines += ["", "Accelerate's own options (accelerate launch --help) follow.", ""]
    return "\n".join(lines)


def _yaml_value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, Mapping):
        return "{}" if not value else str(dict(value))
    return str(value)


def _field_docs(cls: type) -> dict[str, str]:
    """The first sentence of each field's docstring (the string literal under it), from the source."""
    import ast
    import inspect

    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):  # no source (frozen / zipped install): keys and defaults only
        return {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    out = {}
    for node, after in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            text = re.sub(r":\w+:`([^`]*)`", r"\1", " ".join(after.value.value.split())).replace("``", "")
            out[node.target.id] = re.split(r"(?<!e\.g)(?<!i\.e)\.\s", text)[0].rstrip(".")
    return out


def _command_line_overrides(args: Any) -> dict[str, Any]:
    """The flags given on the command line that restate a key of the config file."""
    given = getattr(args, "nondefault", set())  # Accelerate's parser records the flags actually given
    return {
        name: getattr(args, name)
        for name in sorted(given)
        if name in _TOP_LEVEL_FLAGS or name.startswith(("fsdp_", "parallelism_config_"))
    }


@contextlib.contextmanager
def _argv_for_help(prog: str, argv: list[str]) -> Iterator[None]:
    """``sys.argv`` as ``accelerate launch`` would see it, while the parser may print help.

    Accelerate's ``CustomHelpFormatter`` reads ``sys.argv`` (not the parsed arguments) and hides
    every option group when it holds more than one word besides ``accelerate launch`` -- as
    ``shardbridge launch --help`` does. With ``[prog, *argv]`` it shows what
    ``accelerate launch --help`` shows.
    """
    saved = sys.argv
    sys.argv = [prog, *argv]
    try:
        yield
    finally:
        sys.argv = saved


if __name__ == "__main__":
    sys.exit(main())


cli_verb = Verb(
    help="validate an Accelerate config's fsdp_config.shardbridge block, then accelerate launch (docs/hf.md)",
    main=main,
    install_hint=install_hint("hf"),
)
"""``shardbridge launch``: registered in the ``shardbridge.cli`` entry-point group (pyproject.toml)."""
