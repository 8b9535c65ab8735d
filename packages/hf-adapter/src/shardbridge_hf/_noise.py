"""Upstream log records that concern no user run, dropped by message (and only those).

[Note: upstream noise in a launch]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A CPU launch printed 16 lines that concern no user run, even with FP8 off (transformers imports
torchao while it builds a model, in every worker): per rank, torchao 0.18's "Failed to load
.../_C_mxfp8...so" and "... _C_cutlass_90a...so" (its CUDA kernels, which cannot load without
CUDA and which no CPU path uses), and torch 2.13's "<enum 'KernelPreference'> is an Enum subclass
... register_constant() on Enum subclasses is deprecated" (torchao registers its enums with
torch's pytree; torch deprecated that for Enums). Each is dropped by a logging filter matching
its message, only where it cannot concern the run (the kernels: only without CUDA; the pytree
line: only for torchao's own enums). Every other record of those loggers still prints.

``ShardbridgeAccelerator.get_state_dict`` (``Trainer.save_model``) gathers every parameter with
``full_tensor()``; for a packed ``[gate; up]`` weight (``_StridedShard`` x ``Shard``) torch 2.13
logs once per mesh "While redistributing ... 2 sequential all_gather operations ... may give
inconsistent results between ranks due to different reduction orders": an all-gather reduces
nothing, and the order cannot be merged (torch says so in the same line). It is dropped there
only (:func:`quiet_sequential_all_gather`), for all_gather records only.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator

__all__ = ["quiet_sequential_all_gather", "quiet_upstream_noise"]


class _DropKnownNoise(logging.Filter):
    """Drops the records of [Note: upstream noise in a launch], by message."""

    def __init__(self, match: Callable[[logging.LogRecord], bool]) -> None:
        super().__init__()
        self._match = match

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            return not self._match(record)
        except Exception:  # noqa: BLE001 - a record we cannot read is printed, never lost
            return True


def _torchao_cuda_kernel_not_loaded(record: logging.LogRecord) -> bool:
    # torchao/__init__.py: logger.warning(f"Failed to load {file}: {e}") for each _C*.so. Only
    # its CUDA kernels, and only on a machine without CUDA, where nothing could use them.
    import torch

    message = record.getMessage()
    return (
        message.startswith("Failed to load ")
        and any(name in message for name in ("_C_mxfp8", "_C_cutlass"))
        and not torch.cuda.is_available()
    )


def _torchao_enum_registration(record: logging.LogRecord) -> bool:
    # torch/utils/_pytree.py (2.13): log.warning("%s is an Enum subclass ... register_constant()
    # on Enum subclasses is deprecated ...", cls): torchao's KernelPreference / ScaleCalculationMode.
    cls = record.args[0] if isinstance(record.args, tuple) and record.args else None
    return "register_constant() on Enum subclasses is deprecated" in record.msg and str(
        getattr(cls, "__module__", "")
    ).startswith("torchao")


def _sequential_all_gather(record: logging.LogRecord) -> bool:
    # torch/distributed/tensor/_redistribute.py (2.13): logger.warning(common_warning, src, dst, num_ops,
    # comm_type, reason): only when the operations are all-gathers.
    args = record.args if isinstance(record.args, tuple) else ()
    return "sequential" in str(record.msg) and len(args) >= 4 and args[3] == "all_gather"


@contextlib.contextmanager
def quiet_sequential_all_gather() -> Iterator[None]:
    """Drop torch's "sequential all_gather operations" record while gathering full tensors ([Note: upstream noise in a launch])."""
    logger = logging.getLogger("torch.distributed.tensor._redistribute")
    noise = _DropKnownNoise(_sequential_all_gather)
    logger.addFilter(noise)
    try:
        yield
    finally:
        logger.removeFilter(noise)


_NOISE_FILTERS = {  # logger name -> filter (see [Note: upstream noise in a launch])
    "torchao": _DropKnownNoise(_torchao_cuda_kernel_not_loaded),
    "torch.utils._pytree": _DropKnownNoise(_torchao_enum_registration),
}


def quiet_upstream_noise() -> None:
    """Install the log filters of [Note: upstream noise in a launch] (idempotent).

    Called by the launcher and by every ``ShardbridgeAccelerator`` (the workers), before
    transformers imports torchao.
    """
    for name, noise in _NOISE_FILTERS.items():
        logger = logging.getLogger(name)
        if noise not in logger.filters:
            logger.addFilter(noise)
