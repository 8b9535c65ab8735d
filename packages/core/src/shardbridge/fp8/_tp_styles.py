"""Tensor-parallel styles that run a Linear's matmul on LOCAL shards, for weight wrappers like torchao's MXFP8.

[Note: MXFP8 under tensor parallelism]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
torchao 0.18's ``MXFP8TrainingWeightWrapperTensor`` makes a plain ``nn.Linear`` compute in MXFP8 by
intercepting ``F.linear`` in ``__torch_function__``. With torch's ``ColwiseParallel`` /
``RowwiseParallel`` the weight is a DTensor whose local tensor is the wrapper; ``F.linear`` on
DTensors dispatches BELOW ``__torch_function__`` (DTensor sharding propagation, then ``aten.mm``
on the local tensors), so the wrapper only sees ``aten`` ops and the matmul silently runs in high
precision. These styles keep torch's parameter placements and input / output layouts (they
subclass torch's styles) and replace the module's forward with the same linear on local tensors,
where the wrapper sees a plain ``F.linear`` call::

    colwise   x: Replicate (after the input layout is redistributed; sequence parallel too)
              y_j = F.linear(x_local, W_j) + b_j            W_j = W[rows of rank j]   Shard(0)
              y: Shard(-1) -> output_layouts                 b_j: Shard(0)
    rowwise   x: Shard(-1)
              p_j = F.linear(x_j, W_j)                       W_j = W[:, cols of rank j] Shard(1)
              y = sum_j p_j: Partial -> output_layouts (all-reduce / reduce-scatter), then + b once
                                                             b: Replicate

Gradients: ``to_local`` / ``from_local`` are differentiable. A Replicate input's local gradient
in colwise is a partial sum (this rank's output features only), so it leaves with
``grad_placements=[Partial()]`` and the input layout's backward reduces it; everything else keeps
its forward placement. torchao's MXFP8 ``F.linear`` ignores ``bias`` (0.18 drops it), so the bias
is added here in high precision, as torch's Linear would.

With FSDP2 on top nothing changes: FSDP2 all-gathers over the dp axes and hands the module the
unsharded TP DTensor, whose local tensor is again the wrapper (its ``fsdp_post_all_gather``
returns one), and this forward reads ``module.weight`` at call time.

Block alignment: MXFP8 scales 32 consecutive elements of the reduction dim (forward: ``in``;
input gradient: ``out``). A local shard whose dim is not a multiple of 32 cannot be quantized
(torchao asserts), and blocks that straddle two ranks' pieces would not be the unsharded model's
blocks: the styles refuse such layouts at ``parallelize`` time, naming the module and the dim.
Where every local dim is a multiple of 32 the blocks are exactly the unsharded model's, so a TP
run quantizes the same values as a single-process run (only summation order differs).
"""

from __future__ import annotations

import functools
import types
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Placement, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from shardbridge.fp8._convert import converted_fqn

__all__ = ["MXFP8ColwiseParallel", "MXFP8RowwiseParallel", "check_mx_tokens"]

MX_BLOCK = 32
"""MXFP8 block size (elements per e8m0 scale), torchao 0.18's only one."""


def _check_block(module: nn.Module, dim: int, what: str, style: str, tp: int) -> None:
    size = module.weight.shape[dim]
    if size % (tp * MX_BLOCK):
        name = converted_fqn(module) or f"a Linear({module.in_features}, {module.out_features})"
        raise ValueError(
            f"fp8 recipe mxfp8 under tensor parallelism: {style} module {name} has {what}={size}, which over "
            f"tp={tp} gives local shards of {size / tp:g}; MXFP8 needs every local {what} to be a multiple of its "
            f"block size {MX_BLOCK}, i.e. {what} % (tp * {MX_BLOCK}) == 0. Choose a tp dividing {what} / {MX_BLOCK} "
            "(or a model whose dims are multiples of tp * 32), or keep this module out of FP8 (fp8.convert's "
            "module_filter)"
        )


def _require_linear(module: nn.Module, style: str) -> None:
    if not isinstance(module, nn.Linear):
        raise NotImplementedError(
            f"{style} shards nn.Linear modules only, got {type(module).__name__}; use torch's styles for others"
        )


class MXFP8ColwiseParallel(ColwiseParallel):
    """torch's ``ColwiseParallel`` whose linear runs on the local weight shard (MXFP8 weight wrappers).

    Same keywords, placements and layouts as :class:`~torch.distributed.tensor.parallel.ColwiseParallel`.
    See [Note: MXFP8 under tensor parallelism].

    Example:
        >>> parallelize_module(model, pm["tp"], {"w1": MXFP8ColwiseParallel()})  # doctest: +SKIP
    """

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        _require_linear(module, type(self).__name__)
        _check_block(module, 0, "out_features", "colwise", device_mesh.size())
        module = super()._apply(module, device_mesh)
        module.forward = types.MethodType(_colwise_forward, module)
        return module


class MXFP8RowwiseParallel(RowwiseParallel):
    """torch's ``RowwiseParallel`` whose linear runs on the local weight shard (MXFP8 weight wrappers).

    Same keywords, placements and layouts as :class:`~torch.distributed.tensor.parallel.RowwiseParallel`;
    the bias is added once, after the partial sums are reduced. See [Note: MXFP8 under tensor parallelism].

    Example:
        >>> parallelize_module(model, pm["tp"], {"w2": MXFP8RowwiseParallel()})  # doctest: +SKIP
    """

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        _require_linear(module, type(self).__name__)
        _check_block(module, 1, "in_features", "rowwise", device_mesh.size())
        module = super()._apply(module, device_mesh)
        module.forward = functools.partial(_rowwise_forward, module, self.output_layouts)
        return module


def check_mx_tokens(module: nn.Module, x: torch.Tensor) -> None:
    """ValueError if a training step of an MXFP8 Linear gets a token count that is not a multiple of 32.

    MXFP8's weight gradient scales blocks of 32 along the token dimension (torchao's dim-1 cast of
    the input and the output gradient), so torchao fails in the middle of backward otherwise;
    forward alone (no gradient) takes any count.
    """
    tokens = x.numel() // max(1, x.shape[-1])
    if tokens % MX_BLOCK and torch.is_grad_enabled() and (x.requires_grad or module.weight.requires_grad):
        raise ValueError(
            f"fp8 recipe mxfp8: {converted_fqn(module) or 'a Linear'} gets {tokens} tokens (batch x sequence on this "
            "rank); MXFP8's weight gradient scales blocks of 32 tokens, so training needs a multiple of 32: change "
            "the per-rank batch size or sequence length, or keep this module out of FP8 (fp8.convert's module_filter)"
        )


def _local_weight(module: nn.Linear) -> torch.Tensor:
    weight = module.weight.to_local()
    if type(weight) is torch.Tensor:  # not a subclass: nothing would intercept F.linear
        raise NotImplementedError(
            f"{converted_fqn(module) or 'a Linear'}: the local weight shard is a plain tensor (no FP8 weight wrapper), "
            "so its matmul would run in high precision; the MXFP8 TP styles are for Linears fp8.convert converted "
            "with recipe mxfp8"
        )
    return weight


def _colwise_forward(self: nn.Linear, x: DTensor) -> DTensor:
    # x: Replicate. Its local gradient is this rank's partial sum: Partial, reduced by the input layout.
    x_local = x.to_local(grad_placements=[Partial()])
    check_mx_tokens(self, x_local)
    y = F.linear(x_local, _local_weight(self))  # the wrapper's own F.linear: MXFP8
    if self.bias is not None:
        y = y + self.bias.to_local()
    return DTensor.from_local(y, x.device_mesh, [Shard(-1)], run_check=False)  # local out features: Shard(-1)


def _rowwise_forward(self: nn.Linear, output_layouts: tuple[Placement, ...], x: DTensor) -> DTensor:
    # x: Shard(-1), W: Shard(1): the local product is this rank's partial sum.
    check_mx_tokens(self, x.to_local())
    partial = F.linear(x.to_local(), _local_weight(self))  # the wrapper's own F.linear: MXFP8
    y = DTensor.from_local(partial, x.device_mesh, [Partial()], run_check=False)
    y = y.redistribute(placements=output_layouts)  # Partial -> Replicate (all-reduce) / Shard (reduce-scatter)
    if self.bias is not None:
        y = y + self.bias  # Replicate, added once after the reduction
    return y
