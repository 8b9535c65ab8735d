"""Accelerate's ``save_state`` / ``load_state`` on the core checkpoint; export to and load from a HF folder.

``load_pretrained`` reads a ``from_pretrained`` folder shard-on-read, each rank its slices.

Names: ``save_pretrained`` of transformers 5 writes the model's own parameter names for
dense models; the core's strict checks name any missing / unexpected key.

[Note: checkpoints transformers converts while loading]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Hub MoE folders (and transformers' own ``save_pretrained``) store experts one by one
(``mlp.experts.3.gate_proj.weight``; Mixtral ``block_sparse_moe.experts.3.w1.weight``), which
transformers 5 renames and merges into the model's fused ``mlp.experts.gate_up_proj`` while
loading (``conversion_mapping.py``: ``WeightRenaming`` + ``WeightConverter`` with
``MergeModulelist(dim=0)`` and ``Concatenate(dim=1)``). Every checkpoint key is run through
transformers' own rules (``rename_source_key``, the function ``from_pretrained`` uses, so no
hand-written list): a renamed key becomes a ``name_map`` entry; keys a converter merges become a
core ``StackedSource`` (expert = the number the converter's ``*`` matched, component = the order
of its source patterns), which the core reads shard-on-read, each rank only its experts' slices
(docs/hf.md "Pretrained weights"). Converters doing anything else (interleaving, chunking,
transposing, quantized blocks) are refused by name, naming the key and the operations.

[Note: what a save_state checkpoint holds]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
One :func:`shardbridge.checkpoint.save` directory (atomic, portable, reshardable):

    model.<fqn>, optim.state.<fqn>.<state>   DCP tensors (transformers' own FQNs)
    rng/rank-*.pt                            each rank's torch RNG (core)
    manifest extra["hf"]                     {"step": optimizer steps taken, "accelerate_step":
                                              Accelerator.step, "schedulers": [state_dict...],
                                              "python_rng": ..., "numpy_rng": ..., "model_config": {...}}
    manifest extra["export"]                 {"files": {"config.json": {...}}}: what the core's
                                              `shardbridge ckpt export` writes beside the weights

Accelerate's own format (``pytorch_model_fsdp_0/``, ``optimizer_0/``, pickled scheduler and
RNG files) is not written: it pickles Python objects and cannot change layout for TP. The
scheduler state is stored as JSON, which every torch LR scheduler's ``state_dict`` is (lambda
functions are stored as None by torch itself). Python's and numpy's RNG are rank 0's.
"""

from __future__ import annotations

import json
import math
import os
import random
from pathlib import Path
from typing import Any, NamedTuple

import torch
from shardbridge import checkpoint
from shardbridge.adapters import check_destination, write_file
from shardbridge.pretrained import PretrainedReport, StackedSource, read_index
from shardbridge.pretrained import load_pretrained as core_load_pretrained
from torch import nn

from shardbridge_hf._compat import rename_checkpoint_keys
from shardbridge_hf._parallelize import release_guard

__all__ = ["converted_names", "export_pretrained", "load_pretrained", "load_state", "save_state"]

_EXTRA_KEY = "hf"


class LoadedSteps(NamedTuple):
    """The steps a :func:`save_state` checkpoint recorded."""

    optimizer_steps: int
    """Optimizer steps the saving run had taken (the checkpoint's step)."""
    accelerate_step: int
    """Accelerate's ``Accelerator.step`` (micro-batches inside ``accumulate()``)."""


def save_state(
    path: str | os.PathLike[str],
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    schedulers: list[Any],
    step: int,
    accelerate_step: int = 0,
    on_bad_layout: str = "repair",
    parallel_dims: Any = None,
    overwrite: bool = False,
    async_: bool = False,
) -> Path | checkpoint.AsyncSave:
    """Save model, optimizer, schedulers, RNG and step. Call on every rank.

    ``async_=True`` returns once the state is staged in host memory (scheduler, Python and
    numpy RNG states are captured at the call); the checkpoint is written and committed in
    the background: ``shardbridge.checkpoint.save``'s ``async_``. Returns its handle.

    Raises:
        ValueError: a scheduler whose state is not JSON (the message names it).
    """
    scheduler_states = []
    for index, scheduler in enumerate(schedulers):
        state = scheduler.state_dict()
        try:
            json.dumps(state)
        except TypeError as e:
            raise ValueError(
                f"scheduler {index} ({type(scheduler).__name__}) has a state_dict that is not JSON ({e}); shardbridge "
                "checkpoints store scheduler state as JSON so they load without pickle: use a torch LR scheduler"
            ) from None
        scheduler_states.append(state)
    import numpy as np

    np_state = np.random.get_state()
    config = getattr(model, "config", None)
    extra = {
        _EXTRA_KEY: {
            "step": step,
            "accelerate_step": accelerate_step,
            "schedulers": scheduler_states,
            "python_rng": _jsonable(random.getstate()),
            "numpy_rng": [np_state[0], np_state[1].tolist(), *[_jsonable(x) for x in np_state[2:]]],
            # See [Note: non-finite config values].
            "model_config": None if config is None else _config_record(config),
        }
    }
    if config is not None:
        # For `shardbridge ckpt export` (the core CLI, no adapter import): the config.json that
        # save_pretrained would write. See [Note: export recorded in a checkpoint] in the core CLI.
        # The checkpoint's FQNs are transformers' own, so no name map is needed.
        extra["export"] = {"files": {"config.json": _config_record(config)}}
    if torch.distributed.is_initialized():
        # The manifest holds rank 0's RNG and scheduler state (each rank's differs): every rank
        # passes rank 0's extra, as checkpoint.save requires the same extra on all ranks.
        box = [extra]
        torch.distributed.broadcast_object_list(box, src=0)
        extra = box[0]
    return checkpoint.save(
        path,
        model=model,
        optimizer=optimizer,
        step=step,
        extra=extra,
        on_bad_layout=on_bad_layout,
        parallel_dims=parallel_dims,
        overwrite=overwrite,
        async_=async_,
    )


def load_state(
    path: str | os.PathLike[str],
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    schedulers: list[Any],
    strict: bool = True,
) -> LoadedSteps:
    """Load what :func:`save_state` wrote, into any layout. Returns the saved steps.

    Raises:
        ValueError: not a shardbridge checkpoint, keys / shapes that do not fit, or a
            different number of schedulers than were saved.
    """
    state = checkpoint.load(path, model=model, optimizer=optimizer, strict=strict)
    hf = state.extra.get(_EXTRA_KEY, {})
    saved = hf.get("schedulers", [])
    if len(saved) != len(schedulers):
        raise ValueError(
            f"checkpoint {str(path)!r} holds {len(saved)} scheduler state(s) but {len(schedulers)} scheduler(s) "
            "were prepared; prepare the same schedulers as the saving run"
        )
    for scheduler, sd in zip(schedulers, saved):
        scheduler.load_state_dict(sd)
    if "python_rng" in hf:
        random.setstate(_tuplify(hf["python_rng"]))
    if "numpy_rng" in hf:
        import numpy as np

        kind, keys, *rest = hf["numpy_rng"]
        np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), *rest))
    step = int(hf.get("step", state.step or 0))
    # Checkpoints written before "accelerate_step" existed recorded Accelerator.step as the step.
    return LoadedSteps(optimizer_steps=step, accelerate_step=int(hf.get("accelerate_step", step)))


def export_pretrained(
    checkpoint_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    config: Any = None,
    dtype: str | torch.dtype | None = None,
    max_shard_size: str | int = "2GB",
    overwrite: bool = False,
) -> Path:
    """Write a folder ``AutoModelForCausalLM.from_pretrained(out_dir)`` loads. One process.

    Args:
        checkpoint_dir: a checkpoint written by ``save_state``.
        out_dir: the output folder (safetensors shards + index + config.json).
        config: the model's ``PretrainedConfig``; None = the one recorded in the checkpoint.
        dtype: cast floating-point weights (e.g. "bfloat16"); None = as trained. Also
            recorded as the config's ``dtype``.
        max_shard_size: largest safetensors file.
        overwrite: replace an earlier export in ``out_dir`` (its safetensors, index and
            ``config.json``); False = ``out_dir`` must be new or empty.

    Returns:
        ``out_dir``.

    Example:
        >>> export_pretrained("ckpt/step-00000100", "hf_out", dtype="bfloat16")  # doctest: +SKIP
        >>> AutoModelForCausalLM.from_pretrained("hf_out")  # doctest: +SKIP
    """
    out = Path(out_dir)
    check_destination(out, ["config.json"], overwrite=overwrite)  # [Note: writer destinations]
    if config is None:
        info = checkpoint.inspect(checkpoint_dir)
        recorded = (info.extra or {}).get(_EXTRA_KEY, {}).get("model_config")
        if recorded is None:
            raise ValueError(f"checkpoint {str(checkpoint_dir)!r} records no model config; pass config=model.config")
        from transformers import AutoConfig

        recorded = _decode_nonfinite(dict(recorded))
        model_type = recorded.pop("model_type")
        config = AutoConfig.for_model(model_type, **recorded)
    checkpoint.export_safetensors(
        checkpoint_dir,
        out,
        name_map=None,
        dtype=dtype,
        max_shard_size=max_shard_size,
        progress=False,
        overwrite=overwrite,
    )
    if dtype is not None:
        config.dtype = str(dtype).replace("torch.", "")
    # What config.save_pretrained writes (to_json_file(use_diff=True)), never through a link.
    write_file(out / "config.json", config.to_json_string(use_diff=True).encode("utf-8"))
    return out


# [Note: non-finite config values]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Some configs hold inf (GraniteMoeHybrid's Mamba ``time_step_limit = (0.0, inf)``); the manifest is
# strict JSON (``to_diff_dict()`` with a bare inf is refused). The config is recorded as transformers
# writes config.json (``to_json_string``), which tags non-finite floats as
# ``{"__float__": "Infinity"}`` (strict JSON, and what ``from_pretrained`` reads back); export
# decodes the tags before building the config.
_FLOAT_TAG = "__float__"
_FLOAT_VALUES = {"Infinity": math.inf, "-Infinity": -math.inf, "NaN": math.nan}


def _config_record(config: Any) -> dict[str, Any]:
    return json.loads(config.to_json_string(use_diff=True))


def _decode_nonfinite(value: Any) -> Any:
    if isinstance(value, dict):
        if set(value) == {_FLOAT_TAG} and value[_FLOAT_TAG] in _FLOAT_VALUES:
            return _FLOAT_VALUES[value[_FLOAT_TAG]]
        return {k: _decode_nonfinite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode_nonfinite(v) for v in value]
    return value


def _jsonable(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_jsonable(v) for v in value]
    return value


def _tuplify(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_tuplify(v) for v in value)
    return value


def load_pretrained(model: nn.Module, path: str | os.PathLike[str], *, cast_dtype: bool = False) -> PretrainedReport:
    """Fill a prepared transformers model from a ``from_pretrained`` folder, each rank its slices.

    Args:
        model: the model ``ShardbridgeAccelerator.prepare`` returned.
        path: a ``save_pretrained`` folder (safetensors, sharded or not).
        cast_dtype: cast floating-point checkpoint values to the model's dtype.

    Raises:
        ValueError: see :func:`shardbridge.pretrained.load_pretrained`; a checkpoint key that
            transformers converts other than by stacking experts (see [Note: checkpoints
            transformers converts while loading]).
    """
    # transformers' own lists are regexes matched with re.search.
    missing = [f".*(?:{p}).*" for p in getattr(model, "_keys_to_ignore_on_load_missing", None) or ()]
    unexpected = [f".*(?:{p}).*" for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()]
    name_map, stacked = converted_names(model, list(read_index(path)))
    report = core_load_pretrained(
        model,
        path,
        name_map=name_map,
        stacked=stacked,
        cast_dtype=cast_dtype,
        ignore_missing=missing,
        ignore_unexpected=unexpected,
    )
    release_guard(model)
    return report


# The operation lists of transformers' WeightConverters that a StackedSource expresses.
_STACKING = ((("MergeModulelist", 0),), (("MergeModulelist", 0), ("Concatenate", 1)))


def converted_names(model: nn.Module, keys: list[str]) -> tuple[dict[str, str], dict[str, StackedSource]]:
    """The core loader's ``name_map`` and ``stacked`` for checkpoint ``keys``, by transformers' own rules.

    See [Note: checkpoints transformers converts while loading].

    Raises:
        ValueError: a key a converter merges in a way a :class:`StackedSource` cannot express, or
            an expert number it cannot read off the key.

    Example:
        >>> converted_names(mixtral, ["model.layers.0.block_sparse_moe.experts.0.w1.weight", ...])  # doctest: +SKIP
        ({}, {'model.layers.0.mlp.experts.gate_up_proj': StackedSource(keys=(('...experts.0.w1.weight', ...
    """
    name_map: dict[str, str] = {}
    experts: dict[str, dict[int, dict[int, str]]] = {}
    for key, conv in rename_checkpoint_keys(model, keys).items():
        if conv.converter is None:
            if conv.target != key:
                name_map[conv.target] = key
            continue
        ops = tuple((type(op).__name__, getattr(op, "dim", None)) for op in conv.converter.operations)
        if ops not in _STACKING or conv.expert is None:
            raise ValueError(
                f"load_pretrained: checkpoint key {key!r} is merged into {conv.target!r} by transformers' "
                f"{[f'{n}(dim={d})' for n, d in ops]}, which shard-on-read does not express (it stacks per-expert "
                "tensors and concatenates them along dim 1); load this folder with from_pretrained on every rank "
                "(prepare broadcasts rank 0's weights)"
            )
        experts.setdefault(conv.target, {}).setdefault(conv.expert, {})[conv.component] = key
    stacked = {}
    for target, by_expert in experts.items():
        components = sorted({c for per in by_expert.values() for c in per})
        holes = [e for e in range(max(by_expert) + 1) if sorted(by_expert.get(e, {})) != components]
        if holes:
            raise ValueError(
                f"load_pretrained: {target!r} is stacked from per-expert keys, but experts {holes[:8]} lack some of "
                f"their {len(components)} tensor(s); the folder is incomplete"
            )
        # MergeModulelist(dim=0) stacks [out, in] -> [E, out, in]; Concatenate(dim=1) joins the components' rows
        stacked[target] = StackedSource(
            keys=tuple(tuple(by_expert[e][c] for c in components) for e in sorted(by_expert)), dim=1
        )
    return name_map, stacked
