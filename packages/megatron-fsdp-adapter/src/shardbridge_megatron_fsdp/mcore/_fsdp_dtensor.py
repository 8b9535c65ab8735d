r"""Read checkpoints written by Megatron-Core's own ``fsdp_dtensor`` path (Megatron-LM, Bridge).

[Note: fsdp_dtensor checkpoints]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Megatron-LM with ``--use-megatron-fsdp --ckpt-format fsdp_dtensor`` saves
``{"model": FullyShardedDataParallel.state_dict_for_save_checkpoint(), "optimizer": ...}``
through ``megatron/core/transformer/fsdp_dtensor_checkpoint.py`` and plain
``torch.distributed.checkpoint.save``::

    key in the DCP metadata                                     here (Megatron-Core name)
    model.module.decoder.layers.0.self_attention.linear_qkv.weight   decoder.layers.0.self_attention.linear_qkv.weight
    model.module.decoder.layers.0.mlp.linear_fc1.weight_w  \
    model.module.decoder.layers.0.mlp.linear_fc1.weight_v  /    decoder.layers.0.mlp.linear_fc1.weight ([w; v])
    model.module.<...>._extra_state                              (dropped: TE/FP8 metadata)
    optimizer.state.module.module.module.<name>.exp_avg          optimizer state <name> "exp_avg"
    optimizer.state.<...>.linear_fc1.weight_w.exp_avg (+ _v)     merged like the weight

``handle_swiglu_in_state_dict`` splits SwiGLU ``linear_fc1`` into ``weight_w`` (gate) and
``weight_v`` (up). Each rank cuts its local shard at slices computed from
``data.numel() // tp``: for a DTensor that is the TP-local numel (right), for a plain-tensor
optimizer state (TE's FusedAdam keeps ``exp_avg`` so) it is the LOCAL shard numel divided by
tp (wrong: Megatron-LM #4423 / #5265, unfixed in 0.16.1; see [Note: item coordinates] in the
core's ``_fused.py``). What that does to a checkpoint, per rank whose FSDP slice starts at
``s`` and holds ``L`` elements of the TP-local piece, ``n = L // tp``::

    w = [0, n/2) & [s, s+L)     v = [n/2, n) & [s, s+L)      the rest of [s, s+L) is dropped
    s >= n (every rank but the first of each TP group): nothing is written at all

Measured with megatron-core 0.16.1 (``test_mcore_fsdp_dtensor.py``): 0.16.1 itself raises on
plain states (the even-size assert, else ``.to_local()`` of a plain tensor); Megatron-LM
main's plain path (``data`` used as is) either fails ``validate_uneven_dtensor`` on some ranks
(the others wait in its collective) or, at dp=1 x tp=4, writes ``_w``/``_v`` states of the
wrong size (24 rows where the parameter's ``_w`` has 96: the first eighth of each TP piece).
The values that are present cannot be placed (their true coordinates are not in the file),
so :func:`read_fsdp_dtensor` never repairs them: it refuses when a tensor's chunks do not add
up to its size or an optimizer state is not shaped like its parameter, naming the tensor
and the fix (read the model alone with ``optimizer=False``: model weights are DTensors and
always split right).

Nothing in the checkpoint runs code: ``.metadata`` goes through the core's restricted
unpickler (``shardbridge.adapters.read_metadata``, which reads Megatron-FSDP's tuple chunk
offsets as ``torch.Size``), tensors through ``weights_only`` reads.
Runs in one process, no process group; the result holds the whole model (and optimizer
states) in memory.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from shardbridge.adapters import TrustedReader, check_no_links, raise_untrusted, read_metadata
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

__all__ = ["FsdpDTensorCheckpoint", "SwiGLUSplitError", "read_fsdp_dtensor"]

_MODEL = re.compile(r"^model\.(?:module\.)*(?P<name>.+)$")
_OPTIM = re.compile(r"^optimizer\.state\.(?:module\.)*(?P<name>.+)\.(?P<state>[^.]+)$")
_SWIGLU = re.compile(r"^(?P<base>.+\.linear_fc1\.(?:weight|bias))_(?P<part>[wv])$")


class SwiGLUSplitError(ValueError):
    """An fsdp_dtensor SwiGLU optimizer state written by the #4423 split: values are missing."""


@dataclass
class FsdpDTensorCheckpoint:
    """Full tensors of an fsdp_dtensor checkpoint under Megatron-Core names (tp=1 layout)."""

    model: dict[str, torch.Tensor] = field(default_factory=dict)
    """Megatron-Core parameter name -> full tensor (``linear_fc1`` as ``[gate; up]``)."""
    optimizer: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    """Parameter name -> {state name (``exp_avg``, ...): full tensor}; empty with ``optimizer=False``."""


def _coverage(entry: TensorStorageMetadata) -> int:
    return sum(math.prod(c.sizes) for c in entry.chunks)


def _wanted(path: Path, md: Metadata, *, optimizer: bool) -> list[str]:
    """The entries to read: model weights (no ``_extra_state``), and optimizer tensor states if asked; checked."""
    wanted: dict[str, TensorStorageMetadata] = {}
    for key, entry in md.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            continue
        if key.startswith("model.") and not key.endswith("._extra_state"):
            wanted[key] = entry
        elif optimizer and _OPTIM.match(key) and entry.size != torch.Size([]):
            wanted[key] = entry
    _check_covered(path, wanted)
    return list(wanted)


def read_fsdp_dtensor(path: str | os.PathLike[str], *, optimizer: bool = True) -> FsdpDTensorCheckpoint:
    """Read a Megatron-Core ``fsdp_dtensor`` checkpoint into full tensors. See [Note: fsdp_dtensor checkpoints].

    Args:
        path: the DCP directory Megatron-LM wrote (``iter_0000100`` of ``--ckpt-format fsdp_dtensor``).
        optimizer: also read the optimizer's tensor states; False reads the model weights only
            (and ignores optimizer entries, damaged or not).

    Returns:
        The model weights and optimizer states under Megatron-Core parameter names.

    Raises:
        SwiGLUSplitError: a ``linear_fc1`` ``_w``/``_v`` optimizer state covers only part of
            its tensor (written by the #4423 split from plain-tensor states).
        ValueError: any other tensor not fully covered, a missing ``_w``/``_v`` partner, or a
            directory that is not a DCP checkpoint.
        shardbridge.checkpoint.UntrustedCheckpointError: metadata that is not DCP's.

    Example:
        >>> ckpt = read_fsdp_dtensor("ckpt/iter_0000100", optimizer=False)  # doctest: +SKIP
        >>> ckpt.model["decoder.layers.0.mlp.linear_fc1.weight"].shape     # doctest: +SKIP
        torch.Size([2 * ffn_hidden_size, hidden_size])
    """
    path = Path(path)
    if not (path / ".metadata").is_file():
        raise ValueError(f"{str(path)!r} has no .metadata: it is not a DCP / fsdp_dtensor checkpoint")
    check_no_links(path)
    # No code runs; Megatron-FSDP's tuple chunk offsets are read as torch.Size; only the wanted
    # entries are kept and checked (the others may be the damaged states of the Note).
    md = read_metadata(path, select=lambda md: _wanted(path, md, optimizer=optimizer))
    buffers = {k: torch.empty(e.size, dtype=e.properties.dtype) for k, e in md.state_dict_metadata.items()}
    with raise_untrusted():  # a refused record: its one-line error, not DCP's CheckpointException
        dcp.load(buffers, storage_reader=TrustedReader(path, metadata=md), no_dist=True)
    out = FsdpDTensorCheckpoint()
    for key, value in buffers.items():
        if (m := _MODEL.match(key)) and key.startswith("model."):
            out.model[m["name"]] = value
        elif m := _OPTIM.match(key):
            out.optimizer.setdefault(m["name"], {})[m["state"]] = value
    out.model = _merge_swiglu(out.model, "")
    merged: dict[str, dict[str, torch.Tensor]] = {}
    by_state: dict[str, dict[str, torch.Tensor]] = {}
    for name, states in out.optimizer.items():
        for state, value in states.items():
            by_state.setdefault(state, {})[name] = value
    for state, values in by_state.items():
        for name, value in _merge_swiglu(values, f" ({state})").items():
            merged.setdefault(name, {})[state] = value
    out.optimizer = merged
    return out


_SPLIT_FIX = (
    "Megatron-Core's handle_swiglu_in_state_dict split this SwiGLU linear_fc1 optimizer state from plain "
    "(non-DTensor, e.g. FusedAdam) tensors with the local numel (Megatron-LM #4423/#5265): values are dropped "
    "and gate rows filed under _v, and their true places are not in the file. The model weights are intact: read "
    "them with optimizer=False (shardbridge ckpt convert --no-optimizer) and restart the optimizer, or re-save the "
    "run with shardbridge's checkpoints"
)


def _check_covered(path: Path, wanted: dict[str, TensorStorageMetadata]) -> None:
    """Every tensor fully covered by its chunks; every optimizer state shaped like its parameter."""
    params = {_MODEL.match(k)["name"]: e.size for k in wanted if k.startswith("model.") for e in (wanted[k],)}
    for key, entry in wanted.items():
        where = f"{str(path)!r}: {key!r} (size {tuple(entry.size)})"
        optim = _OPTIM.match(key) if key.startswith("optimizer.") else None
        swiglu = optim is not None and _SWIGLU.match(optim["name"]) is not None
        have, need = _coverage(entry), math.prod(entry.size)
        if have != need:
            problem = f"{where} holds {have} of its {need} elements"
            if swiglu:
                raise SwiGLUSplitError(f"{problem}: {_SPLIT_FIX}")
            raise ValueError(
                f"{problem}: the checkpoint is incomplete or damaged; read it with optimizer=False if only "
                "optimizer entries are affected"
            )
        if optim is not None and optim["name"] in params and params[optim["name"]] != entry.size:
            problem = f"{where} is not shaped like its parameter {tuple(params[optim['name']])}"
            if swiglu:
                raise SwiGLUSplitError(f"{problem}: {_SPLIT_FIX}")
            raise ValueError(f"{problem}: the checkpoint is damaged; read it with optimizer=False")


def _merge_swiglu(values: dict[str, torch.Tensor], what: str) -> dict[str, torch.Tensor]:
    """``linear_fc1.weight_w`` + ``_v`` -> ``linear_fc1.weight`` = ``[w; v]`` (tp=1 layout)."""
    out: dict[str, torch.Tensor] = {}
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for name, value in values.items():
        if m := _SWIGLU.match(name):
            halves.setdefault(m["base"], {})[m["part"]] = value
        else:
            out[name] = value
    for base, parts in halves.items():
        if set(parts) != {"w", "v"}:
            raise ValueError(
                f"fsdp_dtensor checkpoint has {base}_{''.join(parts)}{what} without its "
                f"{'_v' if 'w' in parts else '_w'} half; the checkpoint is incomplete"
            )
        out[base] = torch.cat([parts["w"], parts["v"]], dim=0)
    return out
