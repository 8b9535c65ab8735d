"""The one home of torch's private names, and the version rules every package shares.

[Note: upstream internals]
~~~~~~~~~~~~~~~~~~~~~~~~~~
shardbridge needs a few things torch does not expose publicly (FSDP2's per-unit state, a
DTensor's local tensor without autograd, flattening a DeviceMesh, DCP's state-dict
flattening). Every such name is reached here and nowhere else in the monorepo: the core and
all three adapters call the named helpers below. Each helper says which torch versions it
was checked against; :data:`TORCH_CHECKED` is the range the test suite runs (``nox -s
torch_versions`` runs it on the floor, 2.11.0, on 2.14.1 and on the newest, 2.15.0). When
torch renames one of these, this file is the only place to change, and :func:`require_attr` turns the
``AttributeError`` deep inside a training step into an error naming the torch version.

Host-framework internals (Accelerate, megatron_fsdp, TE, torchao) live in each adapter's own
``_compat.py``; the version parser they share is :func:`parse_version`.

Checked against torch 2.11.0, 2.13.0 (CPU), 2.14.1 and 2.15.0 (2.11.0, 2.14.1 and 2.15.0: CUDA
builds run on CPU by ``nox -s torch_versions``).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import pickle
import re
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

__all__ = [
    "TORCH_CHECKED",
    "WRAPPER_NAMES",
    "all_gather_single",
    "reduce_scatter_single",
    "AllGather",
    "DCPStorageInfo",
    "DCPStoragePrefix",
    "DCP_MEM_FORMAT_ENCODING",
    "PyUnpickler",
    "dcp_set_element",
    "compute_local_shape_and_global_offset",
    "distribution_version",
    "dtensor_boundary",
    "dcp_fsspec_classes",
    "dtensor_to_local",
    "fake_store",
    "flash_attention_cpu",
    "flash_attention_cpu_backward",
    "flatten_mesh",
    "flatten_sharded_tensors",
    "flatten_state_dict",
    "GLOO_WORKER_THREAD",
    "fsdp_param_groups",
    "fsdp_params",
    "fsdp_shard_process_group",
    "fsdp_unit_key",
    "fsdp_unit_modules",
    "group_timeout",
    "local_tensor",
    "parse_version",
    "require_attr",
    "require_module",
    "reset_sharded_params",
    "state_dict_fqns",
    "torch_version",
    "torch_save_without_crc",
    "tree_map",
    "unflatten_mesh",
    "unview",
]

TORCH_CHECKED = ((2, 11, 0), (2, 15, 0))
"""Oldest and newest torch the test suite has run on (inclusive)."""


def parse_version(text: str) -> tuple[int, ...]:
    """The release part of a version string as ints: leading digits of each dotted part.

    Pre-release and local suffixes end the release part (``"2.8.0rc1"`` -> ``(2, 8, 0)``).

    Raises:
        ValueError: ``text`` does not start with a number.

    Example:
        >>> parse_version("2.20.2+cu12"), parse_version("0.6.1"), parse_version("2.13.0a0+git")
        ((2, 20, 2), (0, 6, 1), (2, 13, 0))
        >>> parse_version("1.10rc2")
        (1, 10)
    """
    out: list[int] = []
    for part in text.strip().split("."):
        match = re.match(r"\d+", part)
        if match is None:
            break
        out.append(int(match.group()))
        if match.end() != len(part):
            break
    if not out:
        raise ValueError(f"version {text!r} does not start with a number (expected e.g. '2.13.0')")
    return tuple(out)


def distribution_version(name: str) -> tuple[int, ...] | None:
    """The installed version of distribution ``name`` (pip name) as a tuple; None if missing.

    Example:
        >>> distribution_version("torch") >= (2, 6)
        True
        >>> distribution_version("no-such-distribution-xyz") is None
        True
    """
    try:
        return parse_version(importlib.metadata.version(name))
    except importlib.metadata.PackageNotFoundError:
        return None


def torch_version() -> tuple[int, ...]:
    """The running torch's version as a tuple (``torch.__version__``)."""
    return parse_version(torch.__version__)


def require_module(module: str, *, hint: str) -> Any:
    """Import ``module``, or raise ImportError carrying ``hint`` (the install command).

    Any failure of the import counts (TransformerEngine raises OSError / RuntimeError on a
    machine without CUDA, not ImportError); the message keeps the original error.

    Example:
        >>> require_module("math", hint='pip install "mathlib>=1.0"').sqrt(4.0)
        2.0
    """
    try:
        return importlib.import_module(module)
    except Exception as err:  # noqa: BLE001 - re-raised as ImportError with the hint
        raise ImportError(f"{module} is not importable: {hint} (import failed with: {err})") from err


def require_attr(obj: Any, name: str, *, what: str) -> Any:
    """``getattr(obj, name)``, or RuntimeError naming torch's version and the checked range."""
    try:
        return getattr(obj, name)
    except AttributeError:
        lo, hi = (".".join(map(str, v)) for v in TORCH_CHECKED)
        raise RuntimeError(
            f"{what}: torch {torch.__version__} has no {name!r} (shardbridge uses this private torch name and was "
            f"checked against torch {lo} .. {hi}); install a torch in that range or report it. "
            "See [Note: upstream internals] in shardbridge/_compat.py"
        ) from None


tree_map = importlib.import_module("torch.utils._pytree").tree_map
"""``torch.utils._pytree.tree_map`` (private module, stable since 2.0). Checked: 2.11, 2.13, 2.14, 2.15."""


# -- DTensor ------------------------------------------------------------------------------


def local_tensor(t: DTensor) -> torch.Tensor:
    """A DTensor's local tensor as stored, outside autograd (``DTensor._local_tensor``).

    ``to_local()`` is public but goes through autograd (a new view per call, gradient
    plumbing); checkpoint and gradient code needs the stored tensor itself. Checked: 2.6 .. 2.15.
    """
    return t._local_tensor


class _ToLocalKeepingLayout(torch.autograd.Function):
    """``DTensor.to_local(grad_placements=...)`` whose gradient carries the DTensor's own stride.

    torch 2.11 gives the gradient of ``to_local`` a global stride computed from the local
    gradient (``compute_global_tensor_info``), which for an uneven shard (dim 9 as Shard(1) over
    2 ranks: (10, 1) instead of (9, 1)) breaks AccumulateGrad's layout contract; AccumulateGrad
    then re-creates ``param.grad`` as a Replicate DTensor. torch 2.13 keeps the placements.
    """

    @staticmethod
    def forward(ctx: Any, t: DTensor, grad_placements: tuple[Any, ...]) -> torch.Tensor:  # type: ignore[override]
        ctx.meta = (t.device_mesh, tuple(grad_placements), t.shape, t.stride())
        ctx.set_materialize_grads(False)
        local = t._local_tensor
        return local.view_as(local)  # a fresh tensor: autograd metadata must not land on _local_tensor

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor | None) -> tuple[DTensor | None, None]:  # type: ignore[override]
        if grad is None:
            return None, None
        mesh, placements, shape, stride = ctx.meta
        return DTensor.from_local(grad, mesh, placements, run_check=False, shape=shape, stride=stride), None


def unview(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a tensor of its own when it is a view (``t._base``), same storage, no copy: ``aten._unsafe_view``.

    For the local tensor ``DTensor.to_local()`` returns (``local.view_as(local)`` of a DTensor
    nobody else holds); see [Note: TP outputs are not views] in ``shardbridge._tp``. autograd
    tracks ``_unsafe_view`` as an ordinary op (``reshape`` uses it for its fresh results), so an
    in-place op on the result is allowed and keeps the hooks registered on it. Checked: 2.13.
    """
    if t._base is None:
        return t
    return torch.ops.aten._unsafe_view(t, t.shape)


def dtensor_boundary(node: Any) -> tuple[str, tuple[Any, ...]] | None:
    """Is autograd ``node`` a DTensor <-> local tensor boundary, and with which placements?

    ``("to_local", placements of the DTensor)`` for the node ``DTensor.to_local()`` creates
    (torch's ``_ToTorchTensor``: its ctx ``dtensor_spec``), ``("from_local", placements)`` for
    ``DTensor.from_local()``'s (``_FromTorchTensor``: ctx ``forward_input_placements``); None for any
    other node. Gradient-flow analyses walk the plain-tensor graph between such boundaries.
    Checked: 2.11, 2.13, 2.14.
    """
    name = type(node).__name__
    if name == "_ToTorchTensorBackward":
        return "to_local", tuple(node.dtensor_spec.placements)
    if name == "_FromTorchTensorBackward":
        return "from_local", tuple(node.forward_input_placements)
    if name == "_ToLocalKeepingLayoutBackward":
        return "to_local", node.meta[1]
    return None


def dtensor_to_local(t: DTensor, grad_placements: Any) -> torch.Tensor:
    """``t.to_local(grad_placements=grad_placements)``: its gradient reaches ``t`` with those placements.

    torch < 2.13 (checked: 2.11.0) returns an uneven sharded parameter's gradient as Replicate
    (see ``_ToLocalKeepingLayout``); there the gradient is built with ``t``'s global shape and
    stride instead. Checked: 2.11 (workaround), 2.13, 2.14, 2.15 (public ``to_local``).
    """
    if torch_version() < (2, 13):  # torch 2.11: to_local's grad stride breaks AccumulateGrad's layout contract
        return _ToLocalKeepingLayout.apply(t, tuple(grad_placements))
    return t.to_local(grad_placements=grad_placements)


def compute_local_shape_and_global_offset(
    global_shape: tuple[int, ...], mesh_shape: tuple[int, ...], coordinate: list[int], placements: list[Any]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """What torch (hence DCP) says a coordinate holds: ``tensor._utils``'s private function.

    Checked: 2.11, 2.13, 2.14, 2.15 (the ``(global_shape, mesh_shape, coordinate, placements)`` form).
    """
    from torch.distributed.tensor import _utils

    fn = require_attr(_utils, "_compute_local_shape_and_global_offset", what="layout algebra")
    return fn(global_shape, mesh_shape, coordinate, placements)


# -- DeviceMesh ---------------------------------------------------------------------------


def flatten_mesh(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """``mesh._flatten(name)``: one 1-D mesh over all of ``mesh``'s ranks. Checked: 2.6 .. 2.15."""
    return require_attr(mesh, "_flatten", what="ParallelDims.build_mesh")(name)


def unflatten_mesh(mesh: DeviceMesh, dim: int, sizes: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    """``mesh._unflatten(dim, sizes, names)``, reusing ``mesh``'s groups. Checked: 2.11, 2.13, 2.14, 2.15."""
    return require_attr(mesh, "_unflatten", what="ParallelMesh.fsdp_mesh (HSDP)")(dim, sizes, names)


def concatenate_meshes(meshes: list[DeviceMesh]) -> DeviceMesh:
    """``DeviceMesh._concatenate(meshes)``: one mesh of orthogonal sub-meshes of one root.

    Reuses their process groups (none is created); FSDP2's own TP/EP path joins its DP and TP/EP
    meshes with it (pytorch#165492, torch >= 2.10). Checked: 2.13.
    """
    from torch.distributed.device_mesh import DeviceMesh

    return require_attr(DeviceMesh, "_concatenate", what="ParallelDims.build_mesh (expert axes)")(meshes)


# -- attention ----------------------------------------------------------------------------


def flash_attention_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, scale: float | None):
    """SDPA's CPU flash kernel with its log-sum-exp: ``(out, lse)``, lse ``[b, h, q]`` float32/64.

    ``aten._scaled_dot_product_flash_attention_for_cpu`` (what SDPA dispatches to on CPU; public
    SDPA drops the lse). Equal q and kv heads. Checked: 2.13, 2.15 (2.11 and 2.14 not yet run).
    """
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, scale=scale)


def flash_attention_cpu_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    is_causal: bool,
    scale: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of :func:`flash_attention_cpu` given the (possibly merged) ``out`` and ``lse``.

    ``aten._scaled_dot_product_flash_attention_for_cpu_backward``. Checked: 2.13, 2.15 (2.11, 2.14 not yet run).
    """
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, q, k, v, out, lse, 0.0, is_causal, scale=scale
    )


# -- FSDP2 --------------------------------------------------------------------------------

AllGather = importlib.import_module("torch.distributed.fsdp._fully_shard._fsdp_api").AllGather
"""FSDP2's base class for ``set_custom_all_gather`` (private module ``_fsdp_api``). Checked: 2.11, 2.13, 2.14, 2.15."""


def _fsdp_state(module: FSDPModule) -> Any:
    return require_attr(module, "_get_fsdp_state", what="FSDP2 unit state")()


def fsdp_param_groups(module: FSDPModule) -> list[Any]:
    """The ``FSDPParamGroup``s of one FSDP2 unit.

    torch 2.13 - 2.15: the list ``_fsdp_param_groups``; 2.11: one ``_fsdp_param_group`` (or None).
    """
    state = _fsdp_state(module)
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = require_attr(state, "_fsdp_param_group", what="FSDP2 unit state")
    return [] if group is None else [group]


def fsdp_unit_modules(module: FSDPModule) -> tuple[nn.Module, ...]:
    """The modules one ``fully_shard`` call grouped into the unit ``module`` belongs to."""
    return tuple(require_attr(_fsdp_state(module), "_modules", what="FSDP2 unit state"))


def fsdp_unit_key(module: FSDPModule) -> int:
    """An id shared by every module of one FSDP2 unit (``fully_shard([a, b])``)."""
    return id(_fsdp_state(module))


def fsdp_params(module: FSDPModule) -> Iterator[Any]:
    """The ``FSDPParam`` objects of one unit (``.sharded_param``, ``.reset_sharded_param()``)."""
    for group in fsdp_param_groups(module):
        yield from group.fsdp_params


def reset_sharded_params(module: FSDPModule) -> None:
    """Re-point FSDP2's sharded parameters at their (replaced) local tensors.

    Needed after a parameter's local tensor is swapped in place (materialising a meta
    module, quantizing), as torch's own ``fully_shard`` tests do. Checked: 2.11, 2.13, 2.14, 2.15.
    """
    for fsdp_param in fsdp_params(module):
        fsdp_param.reset_sharded_param()


def fsdp_shard_process_group(module: FSDPModule) -> Any:
    """The shard process group of a unit's parameters, or None (no parameters)."""
    for group in fsdp_param_groups(module):
        return getattr(getattr(group, "mesh_info", None), "shard_process_group", None)
    return None


# -- DCP ----------------------------------------------------------------------------------


DCPStorageInfo = importlib.import_module("torch.distributed.checkpoint.filesystem")._StorageInfo
"""Where one DCP item lives in its file (``filesystem._StorageInfo``); in every ``.metadata``. Checked: 2.11, 2.13, 2.14, 2.15."""

DCPStoragePrefix = importlib.import_module("torch.distributed.checkpoint.filesystem")._StoragePrefix
"""The file-name prefix of one rank's DCP data files (``filesystem._StoragePrefix``: ``__<rank>_``), the
``storage_data`` of each rank's part of DCP's global save plan. Checked: 2.11, 2.13, 2.14."""

DCP_MEM_FORMAT_ENCODING = importlib.import_module("torch.distributed.checkpoint.metadata")._MEM_FORMAT_ENCODING
"""How ``TensorProperties`` pickles a memory format (``metadata._MEM_FORMAT_ENCODING``). Checked: 2.11, 2.13, 2.14, 2.15."""

dcp_set_element = importlib.import_module("torch.distributed.checkpoint._traverse").set_element
"""DCP's nested-dict setter (``_traverse.set_element``), as its load planner uses it. Checked: 2.11, 2.13, 2.14, 2.15."""

PyUnpickler = pickle._Unpickler  # type: ignore[attr-defined]
"""Python's pure-Python unpickler (``pickle._Unpickler``): its dispatch table is a dict, so a subclass
can restrict single opcodes (BUILD) as well as globals. CPython 3.10 .. 3.13."""


def flatten_state_dict(state_dict: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    """DCP's nested -> dotted-key flattening (``checkpoint._nested_dict``). Checked: 2.11, 2.13, 2.14, 2.15."""
    from torch.distributed.checkpoint import _nested_dict

    return require_attr(_nested_dict, "flatten_state_dict", what="checkpoint")(state_dict)


WRAPPER_NAMES = frozenset({"_orig_mod", "module", "_checkpoint_wrapped_module"})
"""The attribute names torch's wrappers hold the wrapped module under (torch.compile, DDP, activation
checkpointing): a state-dict key can differ from a tensor's name only where one of them is in it."""


def state_dict_fqns(model: nn.Module, name: str) -> set[str]:
    """The keys torch's ``get_state_dict`` gives the parameter or buffer ``name`` of ``model``.

    ``checkpoint.state_dict._get_fqns``: activation checkpointing's ``_checkpoint_wrapped_module.``,
    ``torch.compile``'s ``_orig_mod.`` and a DDP wrapper's ``module.`` dropped, by module type (a
    submodule merely named ``module`` keeps its name). A name without any of :data:`WRAPPER_NAMES`
    is its own key (no torch call, no import). Checked: 2.13.
    """
    if WRAPPER_NAMES.isdisjoint(name.split(".")):
        return {name}
    from torch.distributed.checkpoint import state_dict

    get_fqns = require_attr(state_dict, "_get_fqns", what="checkpoint")
    # some torch releases wrapped it in an unbounded lru_cache, which would keep every model alive
    return set(getattr(get_fqns, "__wrapped__", get_fqns)(model, name))


def flatten_sharded_tensors(state_dict: dict[str, Any]) -> dict[str, Any]:
    """DCP's ShardedTensor flattening (``checkpoint._sharded_tensor_utils``). Checked: 2.11, 2.13, 2.14, 2.15."""
    from torch.distributed.checkpoint import _sharded_tensor_utils

    return require_attr(_sharded_tensor_utils, "_flatten_sharded_tensors", what="checkpoint")(state_dict)


def dcp_fsspec_classes() -> tuple[type, type]:
    """Plain DCP's fsspec storage: ``(FsspecWriter, FsspecReader)``.

    ``checkpoint._fsspec_filesystem`` is a private module; the plain-DCP baseline of the
    object-store benchmark. Checked: 2.11, 2.13, 2.14.
    """
    module = importlib.import_module("torch.distributed.checkpoint._fsspec_filesystem")
    return (
        require_attr(module, "FsspecWriter", what="checkpoint"),
        require_attr(module, "FsspecReader", what="checkpoint"),
    )


def torch_save_without_crc(obj: Any, stream: Any) -> None:
    """``torch.save(obj, stream)``, the zip records' CRC32 left at 0, without torch's global option.

    ``torch.serialization.set_crc32_options(False)`` does the same for every thread of the
    process; this passes the choice to this one writer (``PyTorchFileWriter(stream, crc32,
    alignment)``, ``serialization._save``: private). torch.load does not check the CRC32
    (the option's documented contract). Checked: 2.11, 2.13, 2.14, 2.15.
    """
    from torch import serialization

    alignment = require_attr(serialization, "_get_storage_alignment", what="checkpoint writer")()
    save = require_attr(serialization, "_save", what="checkpoint writer")
    writer = torch._C.PyTorchFileWriter(stream, False, alignment)
    try:
        save(obj, writer, pickle, serialization.DEFAULT_PROTOCOL, False)
    except BaseException:
        # As torch.save's context manager does: a writer left unfinished finishes itself in its
        # destructor, whenever the error's traceback lets go of it, and a second failure there
        # (the same full disk) is a C++ exception out of a destructor: std::terminate, SIGABRT.
        # write_end_of_file marks it finished even when it raises.
        try:
            writer.write_end_of_file()
        except Exception:  # noqa: BLE001 (the first error is the one to raise)
            pass
        raise
    writer.write_end_of_file()


def all_gather_single(output: torch.Tensor, input: torch.Tensor, group: Any = None, async_op: bool = False) -> Any:  # noqa: A002
    """``dist.all_gather_single``, or ``all_gather_into_tensor`` where torch lacks it.

    ``all_gather_into_tensor`` is its name up to torch 2.12 (2.11 has no other); 2.13 renamed it
    and keeps the old name with a FutureWarning. Checked: 2.11, 2.13, 2.15.
    """
    import torch.distributed as dist

    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, input, group=group, async_op=async_op)


def reduce_scatter_single(output: torch.Tensor, input: torch.Tensor, group: Any = None, op: Any = None) -> Any:  # noqa: A002
    """``dist.reduce_scatter_single`` (torch >= 2.13), else ``reduce_scatter_tensor`` (2.11, 2.12)."""
    import torch.distributed as dist

    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(output, input, op=dist.ReduceOp.SUM if op is None else op, group=group)


def group_timeout(group: Any = None) -> Any:
    """The timeout (a ``timedelta``) of ``group`` (None = the default group), or None if unknown.

    The CPU backend's ``options._timeout``, else the CUDA one's (an NCCL-only group); used to give
    the checkpoint's own gloo groups the timeout the user chose for the job. Checked: 2.13.
    """
    import torch.distributed as dist

    pg = dist.group.WORLD if group is None else group
    for device in ("cpu", "cuda"):
        try:
            return pg._get_backend(torch.device(device)).options._timeout
        except (AttributeError, RuntimeError):
            continue
    return None


GLOO_WORKER_THREAD = "pt_gloo_runloop"
"""The name torch gives a gloo process group's worker threads (``ProcessGroupGloo::runLoop``; two per
group), which run its collectives and drop each collective's tensors when it is done. Not an API:
the Linux thread name (``/proc/self/task/*/comm``) torch sets. Checked: 2.13 (``strings
libtorch_cpu.so``). See [Note: gloo threads at exit] in ``_distributed.py``."""


# -- testing ------------------------------------------------------------------------------


def fake_store() -> Any:
    """A store for ``init_process_group("fake", ...)``: one process pretends to be any rank.

    ``torch.testing._internal.distributed.fake_pg.FakeStore`` (private). Checked: 2.11, 2.13, 2.14, 2.15.
    """
    from torch.testing._internal.distributed import fake_pg

    return require_attr(fake_pg, "FakeStore", what="fake process group")()
