"""Per-rank torch RNG states in a checkpoint (plain uint8 tensors, ``weights_only``-loadable)."""

from __future__ import annotations

import io
import os
import warnings

import torch

from shardbridge.checkpoint.storage._backend import Stored
from shardbridge.checkpoint.storage._manifest import rng_file
from shardbridge.checkpoint.storage._trust import UntrustedCheckpointError, _stored, load_bytes_weights_only

__all__ = ["restore_rng", "rng_bytes", "rng_states"]

_RNG_KEYS = ("cpu", "cuda")


def rng_states() -> dict[str, torch.Tensor]:
    """This rank's CPU (and current CUDA device's) generator state, now."""
    states = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def rng_bytes(states: dict[str, torch.Tensor] | None = None) -> bytes:
    """This rank's RNG file: ``torch.save`` of its generator states (``states``, or :func:`rng_states` now)."""
    buffer = io.BytesIO()
    torch.save(rng_states() if states is None else states, buffer)
    return buffer.getvalue()


def restore_rng(checkpoint: Stored | str | os.PathLike[str], rank: int, world_size: int, saved_world_size: int) -> None:
    """Restore the RNG state saved by the same rank; rank 0's (and warn) if the world changed."""
    checkpoint = _stored(checkpoint)
    source = rank
    if world_size != saved_world_size:
        source = 0
        if rank == 0:
            warnings.warn(
                f"checkpoint {str(checkpoint)!r} was saved by {saved_world_size} ranks, this run has "
                f"{world_size}: every rank restores rank 0's RNG state, so random streams differ from the "
                "saving run",
                stacklevel=3,
            )
    path = checkpoint.show(rng_file(source))
    try:
        data = checkpoint.backend.read_bytes(checkpoint.file(rng_file(source)))
    except (FileNotFoundError, IsADirectoryError):
        raise ValueError(f"checkpoint {str(checkpoint)!r} has no RNG file {rng_file(source)!r}; it is damaged") from None
    states = _read_rng_file(path, data)
    try:
        torch.set_rng_state(states["cpu"])
    except RuntimeError as exc:
        raise ValueError(
            f"RNG file {path!r} holds an invalid CPU generator state ({exc}); the checkpoint is damaged; "
            "load it with rng=False to skip the RNG states"
        ) from None
    if "cuda" in states:
        if torch.cuda.is_available():
            torch.cuda.set_rng_state(states["cuda"])
        elif rank == 0:
            warnings.warn(
                f"checkpoint {str(checkpoint)!r} holds CUDA RNG states but CUDA is not available: only the "
                "CPU generator is restored",
                stacklevel=3,
            )


def _read_rng_file(path: str, data: bytes) -> dict[str, torch.Tensor]:
    """``{"cpu": uint8 tensor[, "cuda": uint8 tensor]}`` from ``data`` (the file ``path``); ValueError naming it otherwise."""
    damaged = f"RNG file {path!r}"
    fix = "the checkpoint is damaged; load it with rng=False to skip the RNG states"
    try:
        states = load_bytes_weights_only(data, where=repr(path))  # See [Note: untrusted checkpoints] in _trust.py
    except UntrustedCheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 (garbage bytes fail in many ways: unpickling, zip, EOF)
        first = (str(exc).strip().splitlines() or [""])[0]
        raise ValueError(f"{damaged} cannot be read ({type(exc).__name__}: {first}); {fix}") from None
    if not isinstance(states, dict) or "cpu" not in states or not set(states) <= set(_RNG_KEYS):
        keys = sorted(map(str, states)) if isinstance(states, dict) else type(states).__name__
        raise ValueError(f"{damaged} holds {keys}, expected a dict with keys {list(_RNG_KEYS)} ('cpu' required); {fix}")
    for key, value in states.items():
        if not isinstance(value, torch.Tensor) or value.dtype != torch.uint8 or value.dim() != 1:
            what = (
                f"a {value.dtype} tensor of shape {tuple(value.shape)}"
                if isinstance(value, torch.Tensor)
                else type(value).__name__
            )
            raise ValueError(f"{damaged}: {key!r} is {what}, expected a 1-D uint8 tensor; {fix}")
    return states
