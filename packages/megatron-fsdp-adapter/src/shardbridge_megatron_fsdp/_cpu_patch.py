"""Run Megatron-FSDP 0.6.x on CPU with gloo: a scoped, version-gated, idempotent patch.

[Note: the CPU patch]
~~~~~~~~~~~~~~~~~~~~~
Megatron-FSDP 0.6.1 calls CUDA unconditionally in code that is device-agnostic otherwise.
Each call the patch covers, and why it is safe to replace on CPU (no CUDA means one host
"stream": every collective of gloo is already ordered with the compute that follows it)::

    megatron_fsdp.py           torch.cuda.current_device()  in __init__ (device default / warning)
                               torch.cuda.Stream()          side streams of the two pipelines
    param_and_grad_buffer.py   torch.cuda.stream(s)         ctx around reduce-scatter / all-gather
                               torch.cuda.current_stream()  wait_stream / record events
                               torch.cuda.Stream()          HSDP outer-DP streams
                               torch.cuda.synchronize()     buffer init
                               torch.cuda.empty_cache()     after buffer init
                               validate_uneven_dtensor      builds its boundary check with .cuda()
    utils.py                   torch.cuda.current_device()  GlobalMemoryBuffer.get_tensor

The patch does NOT touch ``torch.cuda`` itself: in each of those megatron_fsdp modules it
replaces the module global ``torch`` by a copy of the torch module namespace whose ``cuda``
attribute is :class:`_HostCuda`, so only Megatron-FSDP sees the host shims, and only until
:func:`uninstall`. ``validate_uneven_dtensor`` (imported by name into
``param_and_grad_buffer``) is replaced by a host version of the same check.

Not a patch but a configuration: gloo has no ``PREMUL_SUM``, so on gloo the adapter sets
``ddp_config.gradient_reduce_div_fusion = False`` (Megatron-FSDP then scales gradients and
reduces with SUM, its own non-NCCL path). See ``_shard.py``.

Gates: megatron-fsdp in [0.6.1, 0.7) (``_compat.py``) and ``torch.cuda.is_available()`` is
False. With CUDA, :func:`install` does nothing and returns False.

Lifetime: a wrapped model calls the patched functions on every forward/backward (stream
contexts around its collectives), not only while it is built. So
:func:`~shardbridge_megatron_fsdp.shard_model` installs the patch *pinned*: it then stays for
the process, a :func:`cpu_patch` context that exits afterwards leaves it in place (measured:
without the pin, ``with cpu_patch(): shard_model(...)`` followed by a training step dies with
"Torch not compiled with CUDA enabled"), and :func:`uninstall` refuses unless ``force=True``.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import types
from collections.abc import Iterator

import torch

from shardbridge_megatron_fsdp._compat import megatron_fsdp_version, require_megatron_fsdp

__all__ = ["cpu_patch", "install", "installed", "uninstall"]

# The megatron_fsdp modules whose global ``torch`` is replaced (their CUDA calls: see the note).
_PATCHED_MODULES = (
    "megatron_fsdp.megatron_fsdp",
    "megatron_fsdp.param_and_grad_buffer",
    "megatron_fsdp.utils",
    "megatron_fsdp.fully_shard",
)
_lock = threading.Lock()
_saved: dict[str, object] = {}
_pinned = False  # a model built by shard_model relies on the patch (see "Lifetime" above)


class _HostStream:
    """A CUDA stream stand-in: on the host every operation is already in program order."""

    def wait_stream(self, stream: object) -> None:
        pass

    def wait_event(self, event: object) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, event: object | None = None) -> _HostEvent:
        return _HostEvent()

    def query(self) -> bool:
        return True


class _HostEvent:
    """A CUDA event stand-in (always complete)."""

    def record(self, stream: object | None = None) -> None:
        pass

    def wait(self, stream: object | None = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _HostCuda(types.SimpleNamespace):
    """The part of ``torch.cuda`` Megatron-FSDP 0.6.x calls, for a host without CUDA.

    Anything else is looked up on the real ``torch.cuda`` (``is_available`` stays False).
    """

    Stream = _HostStream
    Event = _HostEvent

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def current_stream(device: object | None = None) -> _HostStream:
        return _HostStream()

    @staticmethod
    def stream(stream: object | None) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    @staticmethod
    def synchronize(device: object | None = None) -> None:
        pass

    @staticmethod
    def empty_cache() -> None:
        pass

    def __getattr__(self, name: str) -> object:
        return getattr(torch.cuda, name)


def _host_torch() -> types.ModuleType:
    """A copy of the ``torch`` module namespace with ``cuda`` = :class:`_HostCuda`."""
    proxy = types.ModuleType("torch")
    proxy.__dict__.update(torch.__dict__)
    proxy.cuda = _HostCuda()  # type: ignore[attr-defined]
    return proxy


def _validate_uneven_dtensor_host(dtensor: torch.Tensor) -> None:
    """``uneven_dtensor.validate_uneven_dtensor`` with its boundary check on the tensor's device."""
    from megatron_fsdp.uneven_dtensor import gather_and_compute_chunk_metadata
    from torch.distributed.tensor.placement_types import Shard, _StridedShard

    meta = gather_and_compute_chunk_metadata(dtensor)
    assert all(0 <= o and o + s <= dtensor.shape[d] for d, (o, s) in enumerate(zip(meta.offsets, meta.sizes))), (
        "[Megatron-FSDP] DTensor chunk metadata is invalid",
        meta,
        dtensor.shape,
    )
    checks = torch.tensor(
        [[o == 0, o + s == dtensor.shape[d]] for d, (o, s) in enumerate(zip(meta.offsets, meta.sizes))],
        dtype=torch.int,
        device=dtensor.to_local().device,
    )
    for i, p in enumerate(dtensor.placements):
        if isinstance(p, (Shard, _StridedShard)):
            torch.distributed.all_reduce(
                checks, op=torch.distributed.ReduceOp.MAX, group=dtensor.device_mesh.get_group(i)
            )
    assert bool(torch.all(checks)), ("[Megatron-FSDP] DTensor chunk metadata boundary check failed", meta)


def installed() -> bool:
    """Whether the CPU patch is active."""
    return bool(_saved)


def install(*, pin: bool = False) -> bool:
    """Install the CPU patch (idempotent). See [Note: the CPU patch].

    Args:
        pin: keep it installed for the process (``shard_model`` pins: its models need it on
            every step); a pinned patch outlives :func:`cpu_patch` contexts.

    Returns:
        True when the patch is active after the call, False when CUDA is available (then
        nothing is patched: Megatron-FSDP runs unmodified).

    Raises:
        ImportError: megatron-fsdp missing or outside [0.6.1, 0.7).

    Example:
        >>> install()  # doctest: +SKIP
        True
    """
    global _pinned
    megatron_fsdp_version()
    if torch.cuda.is_available():
        return False
    require_megatron_fsdp()
    with _lock:
        _pinned = _pinned or pin
        if _saved:
            return True
        host = _host_torch()
        for name in _PATCHED_MODULES:
            module = sys.modules[name]
            _saved[name] = module.torch
            module.torch = host
        pgb = sys.modules["megatron_fsdp.param_and_grad_buffer"]
        _saved["validate_uneven_dtensor"] = pgb.validate_uneven_dtensor
        pgb.validate_uneven_dtensor = _validate_uneven_dtensor_host
    return True


def uninstall(*, force: bool = False) -> None:
    """Undo :func:`install` (a no-op when it is not installed).

    Args:
        force: also undo a pinned patch. Models built by ``shard_model`` in this process then
            fail on their next step ("Torch not compiled with CUDA enabled").

    Raises:
        RuntimeError: the patch is pinned and ``force`` is False.
    """
    global _pinned
    with _lock:
        if not _saved:
            return
        if _pinned and not force:
            raise RuntimeError(
                "the megatron-fsdp CPU patch is pinned: a model built by shard_model in this process calls "
                "the patched functions on every step; call uninstall(force=True) only when no such model "
                "will run again"
            )
        _pinned = False
        validate = _saved.pop("validate_uneven_dtensor")
        sys.modules["megatron_fsdp.param_and_grad_buffer"].validate_uneven_dtensor = validate
        for name, original in _saved.items():
            sys.modules[name].torch = original
        _saved.clear()


@contextlib.contextmanager
def cpu_patch() -> Iterator[bool]:
    """Context manager form: install on enter, on exit uninstall what this context installed.

    Nothing is uninstalled if something pinned the patch since (``shard_model`` inside the
    context pins it: its model needs the patch after the context ends).

    Yields:
        Whether the patch is active (False on a CUDA machine).

    Example:
        >>> with cpu_patch():  # doctest: +SKIP
        ...     model, opt = shard_model(model, opt, pm)
    """
    was = installed()
    active = install()
    try:
        yield active
    finally:
        if active and not was and not _pinned:
            uninstall()
