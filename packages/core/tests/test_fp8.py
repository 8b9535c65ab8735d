"""shardbridge.fp8._tensors: the FP8 tensor-type registry and the portable-checkpoint rule (torch only).

The framework FP8 classes (torchao, TE) are tested in their adapters; here a minimal wrapper
subclass stands for "some framework's tensor subclass".
"""

from __future__ import annotations

import pytest
import torch
from shardbridge import ParallelDims, checkpoint
from shardbridge._wrap import FP8_DTYPES
from shardbridge.fp8 import is_fp8_tensor, register_fp8_tensor_type, to_plain
from shardbridge.fp8._tensors import _TO_PLAIN, plain_state_dict
from shardbridge.testing import run_distributed
from torch.utils._pytree import tree_map_only


class _Wrapper(torch.Tensor):
    """A wrapper subclass holding a high-precision tensor, like torchao's weight wrapper."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, device=inner.device)

    def __init__(self, inner: torch.Tensor):
        self._inner = inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.detach.default:
            return cls(args[0]._inner)
        args, kwargs = tree_map_only(_Wrapper, lambda t: t._inner, (args, kwargs or {}))
        return func(*args, **kwargs)


class _Unregistered(torch.Tensor):
    """Another framework's subclass nobody registered."""

    __new__ = _Wrapper.__new__
    __init__ = _Wrapper.__init__
    __torch_dispatch__ = _Wrapper.__torch_dispatch__


@pytest.fixture
def registered():
    saved = dict(_TO_PLAIN)
    register_fp8_tensor_type(_Wrapper, lambda t: t._inner)
    yield
    _TO_PLAIN.clear()
    _TO_PLAIN.update(saved)


def test_fp8_dtypes_are_the_float8_family():
    assert torch.float8_e4m3fn in FP8_DTYPES and torch.float8_e5m2 in FP8_DTYPES
    assert torch.uint8 not in FP8_DTYPES and all(d.itemsize == 1 for d in FP8_DTYPES)


def test_register_rejects_non_tensor_types():
    with pytest.raises(ValueError, match="must be a torch.Tensor subclass"):
        register_fp8_tensor_type(int, lambda t: t)
    with pytest.raises(ValueError, match="must be callable"):
        register_fp8_tensor_type(_Wrapper, "t._inner")


def test_to_plain_returns_a_view_of_the_wrapped_tensor(registered):
    inner = torch.randn(4, 3)
    plain = to_plain(_Wrapper(inner))
    assert type(plain) is torch.Tensor and plain.data_ptr() == inner.data_ptr()
    assert is_fp8_tensor(_Wrapper(inner)) and not is_fp8_tensor(inner)
    plain_sd = plain_state_dict({"w": _Wrapper(inner), "b": inner, "step": 3})
    assert type(plain_sd["w"]) is torch.Tensor and plain_sd["b"] is inner and plain_sd["step"] == 3


def test_unregistered_subclass_is_an_error_naming_the_fix(registered):
    with pytest.raises(ValueError, match=r"layers\.0\.w: tensor subclass .*_Unregistered.*register_fp8_tensor_type"):
        to_plain(_Unregistered(torch.randn(2)), key="layers.0.w")


def test_to_plain_must_keep_the_shape(registered):
    register_fp8_tensor_type(_Unregistered, lambda t: t._inner.flatten()[:1])
    with pytest.raises(ValueError, match=r"must return a plain torch.Tensor of shape \(2, 2\)"):
        to_plain(_Unregistered(torch.randn(2, 2)))


def _save_wrapped_dtensor(path: str) -> tuple[bool, bool, str]:
    from torch.distributed.tensor import Shard, distribute_tensor

    register_fp8_tensor_type(_Wrapper, lambda t: t._inner)
    pm = ParallelDims(dp_shard=2).build_mesh("cpu")
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 6, bias=False)
    dt = distribute_tensor(model.weight.detach(), pm["dp_shard"], [Shard(0)])
    local = dt.to_local()
    wrapped = torch.distributed.tensor.DTensor.from_local(
        _Wrapper(local), pm["dp_shard"], [Shard(0)], run_check=False, shape=dt.shape, stride=dt.stride()
    )
    model.weight = torch.nn.Parameter(wrapped)
    plain = to_plain(model.weight)
    same_layout = plain.placements == wrapped.placements and plain.shape == wrapped.shape
    same_storage = plain.to_local().data_ptr() == local.data_ptr()
    checkpoint.save(path, model=model, step=1)
    return same_layout, same_storage, str(_TO_PLAIN.pop(_Wrapper))


def test_dtensor_of_a_registered_subclass_saves_as_plain(tmp_path):
    results = run_distributed(_save_wrapped_dtensor, str(tmp_path / "ck"), world_size=2)
    assert all(r[0] and r[1] for r in results)
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(tmp_path / "ck"), str(tmp_path / "all.pt"))
    sd = torch.load(tmp_path / "all.pt", weights_only=True)  # no custom class in the pickle
    torch.manual_seed(0)
    assert torch.equal(sd["model"]["weight"], torch.nn.Linear(4, 6, bias=False).weight.detach())
