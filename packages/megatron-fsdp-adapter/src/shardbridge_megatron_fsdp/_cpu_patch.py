"""Run Megatron-FSDP on CPU with gloo: one scoped, version-gated, idempotent patch for both hosts.

[Note: the CPU patch]
~~~~~~~~~~~~~~~~~~~~~
Megatron-FSDP calls CUDA unconditionally in code that is device-agnostic otherwise, in both
copies (the standalone megatron-fsdp 0.6.1 and the one megatron-core 0.16.1 bundles), and
megatron-core's models do too. Each call the patch covers, and why it is safe to replace on CPU
(no CUDA means one host "stream"; the collectives Megatron-FSDP issues with ``async_op=True`` are
all waited on the host before their buffers are used or freed: the parameter all-gathers through
``_coalescing_manager``'s handle in ``wait_bucket_ready`` / ``release_bucket``, the gradient
reduce-scatters inside a synchronous ``_coalescing_manager``; so stand-in streams and events lose
no ordering)::

    <copy>.megatron_fsdp           torch.cuda.current_device()  in __init__ (device default / warning)
                                   torch.cuda.Stream()          side streams of the two pipelines
    <copy>.param_and_grad_buffer   torch.cuda.stream(s)         ctx around reduce-scatter / all-gather
                                   torch.cuda.current_stream()  wait_stream / record events
                                   torch.cuda.Stream()          HSDP outer-DP streams
                                   torch.cuda.synchronize()     buffer init
                                   torch.cuda.empty_cache()     after buffer init
                                   validate_uneven_dtensor      builds its boundary check with .cuda()
    <copy>.utils, .fully_shard     torch.cuda.current_device()  GlobalMemoryBuffer.get_tensor, 0 = only
                                                                compared / formatted there

  megatron-core only (host :data:`MEGATRON_CORE`):
    models.common.embeddings.rotary_pos_embedding, models.gpt.gpt_model, transformer.attention,
    transformer.transformer_layer, transformer.dot_product_attention, tensor_parallel.layers,
    tensor_parallel.mappings, utils (GlobalMemoryBuffer.get_tensor)
                                   torch.cuda.current_device()  "cpu" (a device argument there)
    tensor_parallel.random         cuda RNG (get/set_rng_state, the CPU default generator
                                   manual_seed, default_generators)
    transformer.moe.token_dispatcher
                                   torch.cuda.Stream()          MoEAlltoAllTokenDispatcher.__init__'s
                                                                device-to-host stream (a host stream)
                                   maybe_move_tensor_to_cpu     numpy split sizes for a host tensor
                                                                too (upstream converts only tensors it
                                                                moves off a GPU; all_to_all_single
                                                                refuses a tensor of split sizes)
    transformer.moe.router, .experts, .moe_utils
                                   torch.cuda.current_device()  "cpu" (TopKRouter.gating moves a host
                                                                router weight to it; expert and
                                                                statistics buffers are created on it)
    distributed.fsdp.mcore_fsdp_adapter
                                   DeviceMesh.from_group("cuda") device "cpu"
    fusions.fused_softmax.get_default_causal_mask
                                   torch.ones(device="cuda")    the same mask on the host

The patch does NOT touch ``torch.cuda`` itself: in each of those modules it replaces the module
global ``torch`` by a copy of the torch module namespace whose ``cuda`` attribute is a host
stand-in (:class:`_HostCuda`; :class:`_HostCudaCPU` where ``current_device()`` is a device
argument), plus the named functions and ``DeviceMesh`` above, so only Megatron sees the host
shims, and only until :func:`uninstall`. The "CUDA" RNG of megatron-core's
``tensor_parallel.random`` becomes the CPU default generator, so Megatron's RNG tracker
(``model_parallel_cuda_manual_seed``, ``get_cuda_rng_tracker().fork()``) keeps its meaning:
inside a fork, dropout draws from the tracker's per-TP-rank state (the tracker logs "CPU RNG
state changed within GPU RNG context": on CPU that is the point).

Not a patch but a configuration: gloo has no ``PREMUL_SUM``, so on gloo both entry points set
``ddp_config.gradient_reduce_div_fusion = False`` (Megatron-FSDP then scales gradients and
reduces with SUM, its own non-NCCL path).

Gates: the host's version (``_compat``: megatron-fsdp in [0.6.1, 0.7), megatron-core in
[0.16.1, 0.17)) and ``torch.cuda.is_available()`` False. With CUDA, :func:`install` does nothing
and returns False. Not covered on megatron-core (CUDA-only on purpose): Transformer Engine layer
specs, fused kernels (``masked_softmax_fusion``, ``bias_activation_fusion``,
``apply_rope_fusion``, ``persist_layer_norm``, ``gradient_accumulation_fusion``: set them False;
``mcore.check_cpu_config`` names them), CUDA graphs, NCCL user buffers and FP8.

Lifetime: a wrapped model calls the patched functions on every forward/backward (stream
contexts around its collectives), not only while it is built. So both ``shard_model`` entry
points install the patch *pinned*: it then stays for the process, a :func:`cpu_patch` context
that exits afterwards leaves it in place (measured: without the pin, ``with cpu_patch():
shard_model(...)`` followed by a training step dies with "Torch not compiled with CUDA
enabled"), and :func:`uninstall` refuses unless ``force=True``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import sys
import threading
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from shardbridge.adapters import patch_attr

from shardbridge_megatron_fsdp._compat import BUNDLED, STANDALONE, bundled_fsdp, require_megatron_fsdp

__all__ = ["MEGATRON_CORE", "MEGATRON_FSDP", "Host", "cpu_patch", "install", "installed", "uninstall"]


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
    """The part of ``torch.cuda`` Megatron-FSDP calls, for a host without CUDA.

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


class _AnyIndex:
    """``torch.cuda.default_generators`` on the host: every index is the CPU default generator."""

    def __getitem__(self, index: object) -> torch.Generator:
        return torch.default_generator

    def __len__(self) -> int:
        return 1


class _HostCudaCPU(_HostCuda):
    """``torch.cuda`` for megatron.core modules: device "cpu", RNG = the CPU default generator."""

    default_generators = _AnyIndex()

    @staticmethod
    def current_device() -> torch.device:  # type: ignore[override]
        return torch.device("cpu")

    @staticmethod
    def get_rng_state(device: object = None) -> torch.Tensor:
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state: torch.Tensor, device: object = None) -> None:
        torch.set_rng_state(state)

    @staticmethod
    def manual_seed(seed: int) -> None:
        torch.manual_seed(seed)

    @property
    def random(self) -> types.SimpleNamespace:
        return types.SimpleNamespace(get_rng_state=self.get_rng_state, set_rng_state=self.set_rng_state)


def _host_torch(cuda: object) -> types.ModuleType:
    """A copy of the ``torch`` module namespace with ``cuda`` = ``cuda``."""
    proxy = types.ModuleType("torch")
    proxy.__dict__.update(torch.__dict__)
    proxy.cuda = cuda  # type: ignore[attr-defined]
    return proxy


class _HostDeviceMesh:
    """``DeviceMesh`` as the Megatron-Core FSDP adapter uses it, with device "cpu"."""

    @staticmethod
    def from_group(*args: Any, device_type: str = "cpu", **kwargs: Any) -> Any:
        from torch.distributed.device_mesh import DeviceMesh

        return DeviceMesh.from_group(*args, device_type="cpu", **kwargs)


def _validate_uneven_dtensor_host(root: str, dtensor: Any) -> None:
    """``uneven_dtensor.validate_uneven_dtensor`` of the copy at ``root``, with its boundary check on the tensor's device."""
    from torch.distributed.tensor.placement_types import Shard, _StridedShard

    meta = sys.modules[f"{root}.uneven_dtensor"].gather_and_compute_chunk_metadata(dtensor)
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


def _move_to_host(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    """``moe_utils.maybe_move_tensor_to_cpu`` for tensors already on the host: numpy when asked.

    Upstream converts to numpy only a tensor it moves off a GPU; a host tensor stays a tensor,
    and ``all_to_all_single`` refuses a tensor as its split sizes (it takes a sequence of ints).
    """
    if as_numpy and torch.is_tensor(tensor) and tensor.device.type == "cpu":
        return tensor.numpy()
    return tensor


@functools.lru_cache(maxsize=32)
def _causal_mask_host(sq: int) -> torch.Tensor:
    """``transformer.utils.get_default_causal_mask`` built on the host."""
    return torch.triu(torch.ones(sq, sq), diagonal=1).bool()


_MCORE = "megatron.core."


@dataclass(frozen=True, kw_only=True)
class Host:
    """One Megatron-FSDP host: where its copy of Megatron-FSDP lives and what else of it calls CUDA."""

    name: str
    """How messages name it ("megatron-fsdp", "megatron-core")."""
    root: str
    """Package root of its Megatron-FSDP copy (:data:`~shardbridge_megatron_fsdp._compat.COPIES`)."""
    require: Callable[[], object]
    """The version gate: imports the host, or ImportError with the install hint."""
    device_modules: tuple[str, ...] = ()
    """Modules whose ``torch.cuda.current_device()`` is a device argument (-> "cpu", CPU RNG)."""
    names: tuple[tuple[str, str, Any], ...] = ()
    """``(module, attribute, host stand-in)``: names replaced besides the module globals ``torch``."""

    @property
    def fsdp_modules(self) -> tuple[str, ...]:
        """The Megatron-FSDP modules whose global ``torch`` gets :class:`_HostCuda`."""
        return tuple(f"{self.root}.{m}" for m in ("megatron_fsdp", "param_and_grad_buffer", "utils", "fully_shard"))


MEGATRON_FSDP = Host(name="megatron-fsdp", root=STANDALONE, require=require_megatron_fsdp)
"""The standalone megatron-fsdp 0.6.x (``shardbridge_megatron_fsdp.shard_model``)."""

MEGATRON_CORE = Host(
    name="megatron-core",
    root=BUNDLED,
    require=bundled_fsdp,
    device_modules=tuple(
        _MCORE + m
        for m in (
            "models.common.embeddings.rotary_pos_embedding",
            "models.gpt.gpt_model",
            "transformer.attention",
            "transformer.transformer_layer",
            "transformer.dot_product_attention",
            "tensor_parallel.layers",
            "tensor_parallel.mappings",
            "tensor_parallel.random",
            "transformer.moe.experts",
            "transformer.moe.moe_utils",
            "transformer.moe.router",
            "transformer.moe.token_dispatcher",
            "distributed.fsdp.mcore_fsdp_adapter",
            "utils",
        )
    ),
    names=(
        (_MCORE + "distributed.fsdp.mcore_fsdp_adapter", "DeviceMesh", _HostDeviceMesh),
        (_MCORE + "fusions.fused_softmax", "get_default_causal_mask", _causal_mask_host),
        (_MCORE + "transformer.moe.token_dispatcher", "maybe_move_tensor_to_cpu", _move_to_host),
    ),
)
"""megatron-core 0.16.x and its bundled Megatron-FSDP (``shardbridge_megatron_fsdp.mcore``)."""

_lock = threading.Lock()
_undo: dict[str, list[Callable[[], None]]] = {}  # host name -> undos, in install order
_pinned: set[str] = set()  # hosts a wrapped model relies on (see "Lifetime" in the Note)


def installed(host: Host = MEGATRON_FSDP) -> bool:
    """Whether the CPU patch of ``host`` is active."""
    return host.name in _undo


def install(host: Host = MEGATRON_FSDP, *, pin: bool = False) -> bool:
    """Install the CPU patch for ``host`` (idempotent). See [Note: the CPU patch].

    Args:
        host: :data:`MEGATRON_FSDP` (standalone, the default) or :data:`MEGATRON_CORE`.
        pin: keep it installed for the process (both ``shard_model`` entry points pin: their
            models need it on every step); a pinned patch outlives :func:`cpu_patch` contexts.

    Returns:
        True when the patch is active after the call, False when CUDA is available (then
        nothing is patched: Megatron runs unmodified).

    Raises:
        ImportError: the host is missing or outside its checked versions.

    Example:
        >>> install()  # doctest: +SKIP
        True
    """
    host.require()
    if torch.cuda.is_available():
        return False
    with _lock:
        if pin:
            _pinned.add(host.name)
        if host.name in _undo:
            return True
        fsdp_torch, cpu_torch = _host_torch(_HostCuda()), _host_torch(_HostCudaCPU())
        undo = []
        for name in (*host.device_modules, *host.fsdp_modules):
            module = importlib.import_module(name)
            undo.append(patch_attr(module, "torch", cpu_torch if name in host.device_modules else fsdp_torch))
        validate = functools.partial(_validate_uneven_dtensor_host, host.root)
        names = (*host.names, (f"{host.root}.param_and_grad_buffer", "validate_uneven_dtensor", validate))
        for module, attr, stand_in in names:
            undo.append(patch_attr(importlib.import_module(module), attr, stand_in))
        _undo[host.name] = undo
    return True


def uninstall(host: Host = MEGATRON_FSDP, *, force: bool = False) -> None:
    """Undo :func:`install` for ``host`` (a no-op when it is not installed).

    Args:
        host: as for :func:`install`.
        force: also undo a pinned patch. Models wrapped in this process then fail on their
            next step ("Torch not compiled with CUDA enabled").

    Raises:
        RuntimeError: the patch is pinned and ``force`` is False.
    """
    with _lock:
        if host.name not in _undo:
            return
        if host.name in _pinned and not force:
            raise RuntimeError(
                f"the {host.name} CPU patch is pinned: a model wrapped in this process calls the patched "
                "functions on every step; call uninstall(force=True) only when no such model will run again"
            )
        _pinned.discard(host.name)
        for undo in reversed(_undo.pop(host.name)):
            undo()


@contextlib.contextmanager
def cpu_patch(host: Host = MEGATRON_FSDP) -> Iterator[bool]:
    """Context manager form: install on enter, on exit uninstall what this context installed.

    Nothing is uninstalled if something pinned the patch since (``shard_model`` inside the
    context pins it: its model needs the patch after the context ends).

    Yields:
        Whether the patch is active (False on a CUDA machine).

    Example:
        >>> with cpu_patch():  # doctest: +SKIP
        ...     model, opt = shard_model(model, opt, pm)
    """
    was = installed(host)
    active = install(host)
    try:
        yield active
    finally:
        if active and not was and host.name not in _pinned:
            uninstall(host)
