"""Count the bytes that collectives move, for the demo and the benchmarks.

FSDP2 (torch >= 2.13) issues its all-gathers and reduce-scatters through
``torch.distributed.all_gather_single`` / ``reduce_scatter_single`` (older releases through
``all_gather_into_tensor`` / ``reduce_scatter_tensor``); DTensor and HSDP use ``all_reduce``;
expert parallelism (``shardbridge._ep``) ``all_to_all_single`` and the list forms
``all_gather`` / ``reduce_scatter`` (counted as ``all_gather_list`` / ``reduce_scatter_list``, apart
from FSDP2's). :func:`count_collectives` wraps those entry points for the
duration of a ``with`` block and records, per call, the bytes of the *output* of an all-gather or
all-to-all (what lands on this rank) and the *input* of a reduce-scatter / all-reduce (what this
rank contributes). For an all-to-all it also records ``all_to_all_remote``: the output bytes
that came from OTHER ranks (what crossed the network).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

__all__ = ["CollectiveCounts", "count_collectives"]

# (torch.distributed function, kind, position and keyword of the tensor whose bytes count)
_WRAPPED = (
    ("all_gather_single", "all_gather", 0, "output_tensor"),
    ("all_gather_into_tensor", "all_gather", 0, "output_tensor"),
    ("reduce_scatter_single", "reduce_scatter", 1, "input"),
    ("reduce_scatter_tensor", "reduce_scatter", 1, "input"),
    ("all_reduce", "all_reduce", 0, "tensor"),
    ("all_to_all_single", "all_to_all", 0, "output"),
    ("all_gather", "all_gather_list", 0, "tensor_list"),
    ("reduce_scatter", "reduce_scatter_list", 1, "input_list"),
)


@dataclass
class CollectiveCounts:
    """Bytes and calls per collective kind, and the dtypes seen."""

    bytes: Counter = field(default_factory=Counter)
    calls: Counter = field(default_factory=Counter)
    dtypes: dict[str, set[torch.dtype]] = field(default_factory=dict)

    def reset(self) -> None:
        """Forget everything counted so far."""
        self.bytes.clear()
        self.calls.clear()
        self.dtypes.clear()


@contextlib.contextmanager
def count_collectives() -> Iterator[CollectiveCounts]:
    """Record the bytes of every all-gather, reduce-scatter and all-reduce in the block.

    Example:
        >>> with count_collectives() as counts:  # doctest: +SKIP
        ...     loss = model(batch).sum(); loss.backward()
        >>> counts.bytes["all_gather"]  # doctest: +SKIP
        131072
    """
    counts = CollectiveCounts()
    originals = {}
    for name, kind, index, keyword in _WRAPPED:
        fn = getattr(dist, name, None)
        if fn is None:
            continue
        originals[name] = fn
        setattr(dist, name, _counting(fn, kind, index, keyword, counts))
    try:
        yield counts
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def _counting(fn, kind: str, index: int, keyword: str, counts: CollectiveCounts):
    def wrapper(*args, **kwargs):
        tensor = args[index] if len(args) > index else kwargs.get(keyword)
        tensors = list(tensor) if isinstance(tensor, (list, tuple)) else [tensor]
        for t in tensors:
            if isinstance(t, torch.Tensor):
                counts.bytes[kind] += t.numel() * t.element_size()
                counts.dtypes.setdefault(kind, set()).add(t.dtype)
        if kind == "all_to_all" and isinstance(tensor, torch.Tensor):
            counts.bytes["all_to_all_remote"] += _remote_bytes(tensor, args, kwargs)
        counts.calls[kind] += 1
        return fn(*args, **kwargs)

    wrapper.__wrapped__ = fn
    return wrapper


def _remote_bytes(output: torch.Tensor, args: tuple, kwargs: dict) -> int:
    """Bytes of an ``all_to_all_single`` output that come from other ranks."""
    splits = args[2] if len(args) > 2 else kwargs.get("output_split_sizes")
    group = args[4] if len(args) > 4 else kwargs.get("group")
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    row = output[0].numel() * output.element_size() if output.dim() and output.shape[0] else 0
    rows = list(splits) if splits else [output.shape[0] // size] * size
    return sum(n for r, n in enumerate(rows) if r != rank) * row
