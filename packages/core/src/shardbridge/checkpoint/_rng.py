"""Per-rank torch RNG states in a checkpoint (plain uint8 tensors, ``weights_only``-loadable)."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch

from shardbridge.checkpoint._manifest import rng_file

__all__ = ["restore_rng", "save_rng"]


def save_rng(checkpoint_dir: Path, rank: int) -> None:
    """Write this rank's CPU (and current CUDA device's) generator state, fsynced."""
    states = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state()
    path = checkpoint_dir / rng_file(rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        torch.save(states, f)
        f.flush()
        os.fsync(f.fileno())


def restore_rng(checkpoint_dir: Path, rank: int, world_size: int, saved_world_size: int) -> None:
    """Restore the RNG state saved by the same rank; rank 0's (and warn) if the world changed."""
    source = rank
    if world_size != saved_world_size:
        source = 0
        if rank == 0:
            warnings.warn(
                f"checkpoint {str(checkpoint_dir)!r} was saved by {saved_world_size} ranks, this run has "
                f"{world_size}: every rank restores rank 0's RNG state, so random streams differ from the "
                "saving run",
                stacklevel=3,
            )
    path = checkpoint_dir / rng_file(source)
    if not path.is_file():
        raise ValueError(f"checkpoint {str(checkpoint_dir)!r} has no RNG file {rng_file(source)!r}; it is damaged")
    states = torch.load(path, weights_only=True)
    torch.set_rng_state(states["cpu"])
    if "cuda" in states:
        if torch.cuda.is_available():
            torch.cuda.set_rng_state(states["cuda"])
        elif rank == 0:
            warnings.warn(
                f"checkpoint {str(checkpoint_dir)!r} holds CUDA RNG states but CUDA is not available: only the "
                "CPU generator is restored",
                stacklevel=3,
            )
