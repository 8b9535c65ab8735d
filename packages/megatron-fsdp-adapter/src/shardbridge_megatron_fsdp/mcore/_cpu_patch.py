"""Run a Megatron-Core GPTModel under Megatron-Core's Megatron-FSDP on CPU/gloo.

[Note: the Megatron-Core CPU patch]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
megatron-core 0.16.x calls CUDA unconditionally on paths that are device-agnostic otherwise
(the standalone package's patch, ``shardbridge_megatron_fsdp._cpu_patch``, covers the same
for megatron-fsdp 0.6.x). What this patch covers, per module, and why it is safe on a host
without CUDA::

    megatron.core module                       CUDA call                      host stand-in
    models.common.embeddings.rotary_pos_embedding  current_device()          "cpu"
    models.gpt.gpt_model, transformer.attention,   current_device()          "cpu"
      transformer.transformer_layer,
      transformer.dot_product_attention,
      tensor_parallel.layers, tensor_parallel.mappings,
      utils (GlobalMemoryBuffer.get_tensor)
    tensor_parallel.random                     cuda RNG (get/set_rng_state,   the CPU default
                                               manual_seed, default_generators) generator
    distributed.fsdp.mcore_fsdp_adapter        DeviceMesh.from_group("cuda"),  device "cpu";
                                               RNG sync over tp                CPU RNG
    distributed.fsdp.src.megatron_fsdp.*        Stream/stream/current_stream,   one host "stream"
      (megatron_fsdp, param_and_grad_buffer,    synchronize, empty_cache,       (gloo collectives
      utils, fully_shard)                       current_device() (= 0: only     are ordered with
                                                compared/formatted there)       the compute)
    ...megatron_fsdp.uneven_dtensor.validate_uneven_dtensor   .cuda()         same check, host
    fusions.fused_softmax.get_default_causal_mask   torch.ones(device="cuda")   same mask, host

Only the module global ``torch`` of those modules is replaced (by a copy of the torch
namespace whose ``cuda`` is a host stand-in), plus two names (``DeviceMesh`` in the adapter
module, ``validate_uneven_dtensor`` in ``param_and_grad_buffer``); ``torch.cuda`` itself is
untouched. The "CUDA" RNG of ``tensor_parallel.random`` becomes the CPU default generator, so
Megatron's RNG tracker (``model_parallel_cuda_manual_seed``, ``get_cuda_rng_tracker().fork()``)
keeps its meaning: inside a fork, dropout draws from the tracker's per-TP-rank state (the
tracker logs "CPU RNG state changed within GPU RNG context": on CPU that is the point).

Gates: megatron-core 0.16.x (``_compat.py``) and ``torch.cuda.is_available()`` False. With
CUDA, :func:`install` does nothing and returns False. Like the standalone patch it is pinned
once a model is wrapped (the wrapped model calls the stand-ins on every step).

Not covered (CUDA-only on purpose): Transformer Engine layer specs, fused kernels
(``masked_softmax_fusion``, ``bias_activation_fusion``, ``apply_rope_fusion``,
``persist_layer_norm``, ``gradient_accumulation_fusion``: set them False), CUDA graphs,
NCCL user buffers and FP8. The config built by ``shardbridge_megatron_fsdp.mcore`` turns
the fusions off; see docs/megatron-fsdp.md, "CPU vs GPU".
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import sys
import threading
import types
from typing import Any

import torch

from shardbridge_megatron_fsdp._cpu_patch import _HostCuda
from shardbridge_megatron_fsdp.mcore._compat import require_megatron_core

__all__ = ["install", "installed", "uninstall"]

_MCORE = "megatron.core."
_FSDP = "megatron.core.distributed.fsdp.src.megatron_fsdp."
# Modules whose ``torch.cuda.current_device()`` is a device argument: host = "cpu".
_CPU_DEVICE_MODULES = (
    _MCORE + "models.common.embeddings.rotary_pos_embedding",
    _MCORE + "models.gpt.gpt_model",
    _MCORE + "transformer.attention",
    _MCORE + "transformer.transformer_layer",
    _MCORE + "transformer.dot_product_attention",
    _MCORE + "tensor_parallel.layers",
    _MCORE + "tensor_parallel.mappings",
    _MCORE + "tensor_parallel.random",
    _MCORE + "distributed.fsdp.mcore_fsdp_adapter",
    _MCORE + "utils",
)
# The bundled Megatron-FSDP: ``current_device()`` is formatted into "cuda:N" and compared only.
_FSDP_MODULES = (
    _FSDP + "megatron_fsdp",
    _FSDP + "param_and_grad_buffer",
    _FSDP + "utils",
    _FSDP + "fully_shard",
)
_ADAPTER = _MCORE + "distributed.fsdp.mcore_fsdp_adapter"
_SOFTMAX = _MCORE + "fusions.fused_softmax"

_lock = threading.Lock()
_saved: dict[str, Any] = {}
_pinned = False


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


def _validate_uneven_dtensor_host(dtensor: Any) -> None:
    """``uneven_dtensor.validate_uneven_dtensor`` with its boundary check on the tensor's device."""
    from torch.distributed.tensor.placement_types import Shard, _StridedShard

    uneven = sys.modules[_FSDP + "uneven_dtensor"]
    meta = uneven.gather_and_compute_chunk_metadata(dtensor)
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


@functools.lru_cache(maxsize=32)
def _causal_mask_host(sq: int) -> torch.Tensor:
    """``transformer.utils.get_default_causal_mask`` built on the host."""
    return torch.triu(torch.ones(sq, sq), diagonal=1).bool()


def installed() -> bool:
    """Whether the Megatron-Core CPU patch is active."""
    return bool(_saved)


def install(*, pin: bool = False) -> bool:
    """Install the Megatron-Core CPU patch (idempotent). See [Note: the Megatron-Core CPU patch].

    Args:
        pin: keep it for the process (a wrapped model calls the stand-ins on every step).

    Returns:
        True when the patch is active after the call; False when CUDA is available (nothing
        is patched).

    Raises:
        ImportError: megatron-core missing or not 0.16.x.

    Example:
        >>> install()  # doctest: +SKIP
        True
    """
    global _pinned
    require_megatron_core()
    if torch.cuda.is_available():
        return False
    with _lock:
        _pinned = _pinned or pin
        if _saved:
            return True
        modules = [importlib.import_module(name) for name in (*_CPU_DEVICE_MODULES, *_FSDP_MODULES)]
        cpu_torch, fsdp_torch = _host_torch(_HostCudaCPU()), _host_torch(_HostCuda())
        for module in modules:
            _saved[module.__name__] = module.torch
            module.torch = cpu_torch if module.__name__ in _CPU_DEVICE_MODULES else fsdp_torch
        adapter = sys.modules[_ADAPTER]
        _saved["DeviceMesh"] = adapter.DeviceMesh
        adapter.DeviceMesh = _HostDeviceMesh
        softmax = importlib.import_module(_SOFTMAX)
        _saved["get_default_causal_mask"] = softmax.get_default_causal_mask
        softmax.get_default_causal_mask = _causal_mask_host
        pgb = sys.modules[_FSDP + "param_and_grad_buffer"]
        _saved["validate_uneven_dtensor"] = pgb.validate_uneven_dtensor
        pgb.validate_uneven_dtensor = _validate_uneven_dtensor_host
    return True


def uninstall(*, force: bool = False) -> None:
    """Undo :func:`install` (no-op when not installed).

    Args:
        force: also undo a pinned patch (models wrapped in this process then fail on their
            next step).

    Raises:
        RuntimeError: the patch is pinned and ``force`` is False.
    """
    global _pinned
    with _lock:
        if not _saved:
            return
        if _pinned and not force:
            raise RuntimeError(
                "the megatron-core CPU patch is pinned: a model wrapped in this process calls the patched "
                "functions on every step; call uninstall(force=True) only when no such model will run again"
            )
        _pinned = False
        sys.modules[_ADAPTER].DeviceMesh = _saved.pop("DeviceMesh")
        sys.modules[_SOFTMAX].get_default_causal_mask = _saved.pop("get_default_causal_mask")
        sys.modules[_FSDP + "param_and_grad_buffer"].validate_uneven_dtensor = _saved.pop("validate_uneven_dtensor")
        for name, original in _saved.items():
            sys.modules[name].torch = original
        _saved.clear()


@contextlib.contextmanager
def cpu_patch():
    """Context manager form: install on enter, uninstall on exit unless something pinned it.

    Yields:
        Whether the patch is active (False on a CUDA machine).
    """
    was = installed()
    active = install()
    try:
        yield active
    finally:
        if active and not was and not _pinned:
            uninstall()
