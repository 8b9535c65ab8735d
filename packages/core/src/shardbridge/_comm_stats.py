"""Count the bytes that collectives move, for the demo and the benchmarks.

FSDP2 (torch >= 2.13) issues its all-gathers and reduce-scatters through
``torch.distributed.all_gather_single`` / ``reduce_scatter_single`` (older releases through
``all_gather_into_tensor`` / ``reduce_scatter_tensor``); DTensor and HSDP use ``all_reduce``.
:func:`count_collectives` wraps those entry points for the duration of a ``with`` block and
records, per call, the bytes of the *output* of an all-gather (what lands on this rank) and the
*input* of a reduce-scatter / all-reduce (what this rank contributes).
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
        if isinstance(tensor, torch.Tensor):
            counts.bytes[kind] += tensor.numel() * tensor.element_size()
            counts.dtypes.setdefault(kind, set()).add(tensor.dtype)
        counts.calls[kind] += 1
        return fn(*args, **kwargs)

    wrapper.__wrapped__ = fn
    return wrapper
