"""STRUCTURAL TIER support: pure-torch FORMAT REFERENCES standing in for TE's quantize / dequantize.

TEST SUPPORT ONLY. Nothing in ``shardbridge_te`` imports this module; it is never on the
adapter's runtime path. These functions are NOT TransformerEngine's kernels: they implement each
FP8 / FP4 format as TE documents it (and as TE's own Python references in
``transformer_engine/pytorch/custom_recipes`` describe it), small and readable, so that TE's REAL
Python tensor classes (``Float8Tensor``, ``MXFP8Tensor``, ``Float8BlockwiseQTensor``,
``NVFP4Tensor``) can be built, saved and re-quantized on a CPU. What they are checked against is
the format's definition (``tests/test_te_reference_kernels.py``), never TE's CUDA code, so every
numerical claim built on them (rounding of ties, scale padding contents, swizzled layouts) still
needs the GPU tier (``tools/gpu/te_checks.py``).

[Note: reference kernels]
~~~~~~~~~~~~~~~~~~~~~~~~~
``reference_kernels()`` puts four functions on the structural stand-in module that replaces
``transformer_engine_torch`` (see [Note: the structural tier] in ``_te_structural.py``) while
it runs, and removes them afterwards (the stand-in's kernels raise again):

* ``quantize(src, quantizer, out=None, noop_flag=None)`` - what every TE quantizer's
  ``quantize_impl`` / ``update_quantized`` calls;
* ``dequantize(tensor, te_dtype)`` - what ``Float8Tensor`` (on CUDA), ``MXFP8Tensor`` and
  ``NVFP4Tensor`` call (``Float8BlockwiseQTensor`` dequantizes in TE's own Python code, and
  ``Float8Tensor`` has TE's own CPU fallback: both are TE's code, not replaced here);
* ``fp8_transpose(data, fp8_dtype, out=None)`` and ``create_empty_quantized_tensor(quantizer,
  shape, dtype, device, pin_memory)`` (TE's own pure-Python ``TensorSpec`` allocation).

The formats (x is the high-precision tensor viewed as 2D ``[M, K]``; "cast" rounds to nearest
even and saturates at the format's largest finite value, as TE's ``satfinite`` casts do)::

    tensorwise   Float8CurrentScalingQuantizer: amax over the quantizer's amax group (MAX
                 all-reduce), scale = fp8_max / amax (amax 0 -> 1; power of 2 if
                 force_pow_2_scales: mantissa bits cleared), scale_inv = 1 / scale, data =
                 cast(x * scale); Float8Quantizer (delayed): the quantizer's own scale, its amax
                 buffer updated. Columnwise usage on Hopper = a transposed copy of the data.
    MXFP8        32-element blocks, rowwise along K and (columnwise copy) along M; E8M0 scale
                 per block = 2 ** ceil(log2(block_amax / fp8_max)) (rounded UP so no element
                 saturates; an all-zero block gets 0 = 2**-127), biased exponent in a uint8, scale shapes padded to [128, 4]
                 (rowwise) and [4, 128] (columnwise); data = cast(x / scale).
    blockwise    Float8BlockQuantizer: 128 x 128 tiles (block_scaling_dim 2; weights) or 1 x 128
                 (dim 1); per tile scale as tensorwise (power of 2 by default), fp32 scale_inv;
                 columnwise data is the transposed tensor; 1D scales are stored transposed
                 ([K / 128, M] rowwise), 2D scales padded to multiples of 4 in the last dim.
    NVFP4        16-element blocks (1 x 16; 16 x 16 tiles with 2D quantization, TE's weight
                 default), e2m1 values {0, .5, 1, 1.5, 2, 3, 4, 6} packed two per byte (even
                 index in the low nibble); global scale = 448 * 6 / global_amax (fp32, amax over
                 the quantizer's amax group), block scale = e4m3(block_amax / 6 * global_scale),
                 data = cast_e2m1(x / (block_scale / global_scale)); dequantized value =
                 e2m1 * block_scale * global_amax / (6 * 448). Columnwise copy = the transposed tensor
                 quantized the same way. Random Hadamard transforms, stochastic rounding,
                 row-scaled and 4over6 NVFP4 are not modelled (NotImplementedError): TE's
                 NVFP4 recipe uses none of them for weights.

[Note: reference grouped GEMM]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``module_execution()`` also stands in ``te_general_grouped_gemm``, the one kernel a non-FP8
``GroupedLinear`` forward and backward call (TE 2.20.2 ``cpp_extensions/gemm.py``,
``general_grouped_gemm``; its argument order below), so TE's REAL ``_GroupedLinear`` autograd
function (input split by ``m_splits``, saved tensors, dgrad and wgrad dispatch) runs on a CPU.
TE hands cuBLAS row-major tensors; in row-major terms each GEMM i computes::

    D_i = op(B_i) @ op(A_i)        op(A) = A^T if transa else A, op(B) = B^T if transb else B
    forward  "TN": A = weight_i [out, in], B = x_i [m_i, in]        -> y_i  = x_i W_i^T
    dgrad    "NN": A = weight_i,           B = dy_i [m_i, out]      -> dx_i = dy_i W_i
    wgrad    "NT": A = x_i,                B = dy_i                 -> dW_i = dy_i^T x_i

``single_output``: ``out`` is one tensor whose rows ``m_splits`` splits among the GEMMs;
``accumulate``: ``D_i += ...``; a non-empty forward ``bias_i`` is added to every row; in
``grad`` mode with ``bias`` the ``bias`` list receives ``sum_rows(B_i)`` (the bias gradient).
Products accumulate in fp32 (as cuBLAS does for 16-bit inputs) and are cast to ``out``'s dtype.
FP8 inputs, GELU epilogues: NotImplementedError. The rule is TE's calling convention read from
its Python code; the oracle is ``test_te_reference_kernels.py``
(``test_grouped_linear_runs_as_f_linear_per_expert``: TE's GroupedLinear with this GEMM equals
``F.linear`` per expert, forward and every gradient). cuBLAS's own numerics (TF32, split
accumulators, kernel choice) are GPU tier (``tools/gpu/te_checks.py``, check grouped-experts).

Running a module also needs what TE's Python asks of CUDA around the kernel, answered for a
CPU: ``torch.cuda.is_current_stream_capturing()`` is False, ``get_device_properties`` reports
an sm_90 with 132 SMs (workspace sizes, SM margins), ``tensor.cuda()`` stays on the CPU (TE's
empty placeholder tensors), ``get_num_cublas_streams()`` is 1, and ``inp.is_cuda`` is True for
the one check in ``TransformerEngineBaseModule.prepare_forward`` that refuses CPU inputs (asked
from TE's ``module/base.py`` only; every other caller sees the truth). Torch-function modes are
not active inside autograd's backward, so ``_GroupedLinear.backward`` is wrapped to enter them
again (restored on exit; TE's backward code itself runs unchanged).
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import types
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
E2M1_MAX = 6.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""The non-negative e2m1 values; code ``i`` (0..7) is ``E2M1_VALUES[i]``, code ``8 + i`` its negative."""
MXFP8_BLOCK = 32
NVFP4_BLOCK = 16
FP8_BLOCK = 128

# --------------------------------------------------------------------------- format references (pure torch)


def cast_fp8(x: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """fp32 -> FP8 bytes (uint8): round to nearest even, saturating at +-fp8_max (TE's satfinite)."""
    m = FP8_MAX[fp8_dtype]
    return x.float().clamp(-m, m).to(fp8_dtype).view(torch.uint8)


def fp8_to_float(data: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """FP8 bytes (uint8) -> fp32 values."""
    return data.view(fp8_dtype).float()


def scale_from_amax(amax: torch.Tensor, fp8_max: float, *, pow2: bool, epsilon: float = 0.0) -> torch.Tensor:
    """``fp8_max / amax`` per element (fp32), as TE's current / block scaling computes it.

    amax below ``epsilon`` is raised to it; amax 0 or inf -> 1; an infinite quotient -> fp32 max;
    ``pow2`` clears the mantissa (the power of 2 at or below the quotient).
    """
    amax = amax.float().clamp_min(epsilon)
    scale = torch.full_like(amax, fp8_max) / amax
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, torch.finfo(torch.float32).max), scale)
    scale = torch.where((amax == 0) | torch.isinf(amax) | torch.isnan(scale), torch.ones_like(scale), scale)
    if pow2:
        scale = (scale.view(torch.int32) & ~((1 << 23) - 1)).view(torch.float32)
    return scale


def e8m0_from_amax(amax: torch.Tensor, fp8_max: float) -> torch.Tensor:
    """MXFP8 block scale as a biased E8M0 exponent: ``2 ** (e - 127) = 2 ** ceil(log2(amax / fp8_max))``.

    Rounded up (toward +inf; TE's ``float_to_e8m0`` of ``amax * (1 / fp8_max)``) so the block's
    largest element does not saturate; amax 0 -> 0 (2**-127, as TE). Clamped to [0, 254].
    """
    ratio = amax.float() * (1.0 / fp8_max)
    mantissa, exponent = torch.frexp(ratio)  # ratio = mantissa * 2**exponent, mantissa in [0.5, 1)
    ceil_log2 = torch.where(mantissa == 0.5, exponent - 1, exponent)
    biased = torch.where(ratio > 0, ceil_log2 + 127, torch.zeros_like(ceil_log2))
    return biased.clamp(0, 254).to(torch.uint8)


def e8m0_to_float(biased: torch.Tensor) -> torch.Tensor:
    """Biased E8M0 exponents (uint8) -> their fp32 powers of 2."""
    return torch.ldexp(torch.ones(biased.shape), biased.to(torch.int32) - 127)


def _blocks(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """[M, K] (zero-padded up to multiples of the block) -> [M/rows, K/cols, rows, cols]."""
    m, k = x.shape
    pm, pk = -m % rows, -k % cols
    x = torch.nn.functional.pad(x, (0, pk, 0, pm))
    return x.view((m + pm) // rows, rows, (k + pk) // cols, cols).permute(0, 2, 1, 3)


def _expand(per_block: torch.Tensor, rows: int, cols: int, m: int, k: int) -> torch.Tensor:
    """[M/rows, K/cols] -> [M, K] (each block's value repeated over its elements)."""
    return per_block.repeat_interleave(rows, 0).repeat_interleave(cols, 1)[:m, :k]


def _block_amax(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    return _blocks(x.float().abs(), rows, cols).amax(dim=(-1, -2))


def mxfp8_quantize(x: torch.Tensor, fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Rowwise MXFP8 of a 2D ``x``: (data uint8 [M, K], E8M0 scales uint8 [M, K/32], unpadded)."""
    m, k = x.shape
    biased = e8m0_from_amax(_block_amax(x, 1, MXFP8_BLOCK), FP8_MAX[fp8_dtype])
    exp = _expand(biased.to(torch.int32) - 127, 1, MXFP8_BLOCK, m, k)
    return cast_fp8(torch.ldexp(x.float(), -exp), fp8_dtype), biased


def mxfp8_dequantize(data: torch.Tensor, biased: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`mxfp8_quantize` (scales unpadded, ``[M, K/32]``)."""
    m, k = data.shape
    exp = _expand(biased[:m, : -(-k // MXFP8_BLOCK)].to(torch.int32) - 127, 1, MXFP8_BLOCK, m, k)
    return torch.ldexp(fp8_to_float(data, fp8_dtype), exp)


def block_quantize(
    x: torch.Tensor, rows: int, cols: int, fp8_dtype: torch.dtype, *, pow2: bool, epsilon: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 with one fp32 scale per ``rows x cols`` tile: (data uint8 [M, K], scale_inv [M/rows, K/cols])."""
    m, k = x.shape
    scale = scale_from_amax(_block_amax(x, rows, cols), FP8_MAX[fp8_dtype], pow2=pow2, epsilon=epsilon)
    data = cast_fp8(x.float() * _expand(scale, rows, cols, m, k), fp8_dtype)
    return data, 1.0 / scale


def e2m1_encode(v: torch.Tensor) -> torch.Tensor:
    """fp32 values already scaled into [-6, 6] -> e2m1 codes (uint8 0..15): nearest, ties to even code."""
    grid = torch.tensor(E2M1_VALUES)
    a = v.float().abs().clamp(max=E2M1_MAX)
    dist_ = (a.unsqueeze(-1) - grid).abs()
    best = dist_.min(dim=-1, keepdim=True).values
    ties = dist_ == best
    # Nearest value; on a tie the even code (even mantissa bit), as round-to-nearest-even does.
    even = torch.arange(8) % 2 == 0
    code = torch.where((ties & even).any(-1), (ties & even).float().argmax(-1), ties.float().argmax(-1))
    sign = (v < 0) | ((v == 0) & torch.signbit(v))
    return (code + 8 * sign.long()).to(torch.uint8)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes (uint8 0..15) -> fp32 values."""
    grid = torch.tensor(E2M1_VALUES)
    c = codes.long()
    mag = grid[c & 7]
    return torch.where(c >= 8, -mag, mag)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """[M, K] codes -> [M, K/2] bytes, element 2j in the low nibble, 2j+1 in the high nibble."""
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_e2m1`."""
    lo, hi = packed & 0xF, packed >> 4
    return torch.stack([lo, hi], dim=-1).reshape(packed.shape[0], -1)


def nvfp4_global_scale(global_amax: torch.Tensor) -> torch.Tensor:
    """``448 * 6 / amax`` (fp32; amax 0 -> 1, capped at fp32 max)."""
    amax = global_amax.float()
    scale = torch.full_like(amax, FP8_MAX[torch.float8_e4m3fn] * E2M1_MAX) / amax
    scale = scale.clamp(max=torch.finfo(torch.float32).max)
    return torch.where(amax == 0, torch.ones_like(scale), scale)


def nvfp4_quantize(x: torch.Tensor, global_amax: torch.Tensor, tile_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4 of a 2D ``x`` with ``tile_rows x 16`` blocks (1: 1D, 16: 2D).

    Returns (packed e2m1 uint8 [M, K/2], E4M3 block scales as uint8 [M, K/16], one per row and
    16-column block: a 2D tile's scale repeated over its 16 rows).
    """
    m, k = x.shape
    gscale = nvfp4_global_scale(global_amax)
    # The kernel's order of fp32 operations (TE's custom_recipes/reference_nvfp4.py says so):
    # block = amax * (global_scale * (1/6)); encode = 1 / (fp32(e4m3 block) * (1 / global_scale)).
    block = _block_amax(x, tile_rows, NVFP4_BLOCK) * (gscale * (1.0 / E2M1_MAX))
    block = block.clamp(max=FP8_MAX[torch.float8_e4m3fn]).to(torch.float8_e4m3fn)
    per_row = block.repeat_interleave(tile_rows, 0)[:m]  # [M, K/16]
    encode = 1.0 / (_expand(per_row.float(), 1, NVFP4_BLOCK, m, k) * (1.0 / gscale))
    encode = encode.clamp(max=torch.finfo(torch.float32).max)  # an all-zero block: 0 * max = 0
    codes = e2m1_encode((x.float() * encode).clamp(-E2M1_MAX, E2M1_MAX))
    return pack_e2m1(codes), per_row.view(torch.uint8)


def nvfp4_dequantize(packed: torch.Tensor, scales: torch.Tensor, global_amax: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`nvfp4_quantize` (scales unpadded ``[M, K/16]`` or padded, sliced here)."""
    m, half = packed.shape
    k = 2 * half
    s = scales[:m, : -(-k // NVFP4_BLOCK)].view(torch.float8_e4m3fn).float()
    # e2m1 * block scale * amax / (6 * 448): the dequantization factor of TE's NVFP4 GEMM reference.
    decode = global_amax.float().reshape(()) / (E2M1_MAX * FP8_MAX[torch.float8_e4m3fn])
    decode = torch.where(global_amax.reshape(()) == 0, torch.ones_like(decode), decode)
    return e2m1_decode(unpack_e2m1(packed)) * _expand(s, 1, NVFP4_BLOCK, m, k) * decode


# --------------------------------------------------------------------------- TE glue


def _te():
    from transformer_engine.pytorch import constants
    from transformer_engine.pytorch.tensor import (
        float8_blockwise_tensor,
        float8_tensor,
        mxfp8_tensor,
        nvfp4_tensor,
    )
    from transformer_engine.pytorch.tensor.storage import (
        float8_blockwise_tensor_storage,
        float8_tensor_storage,
        mxfp8_tensor_storage,
        nvfp4_tensor_storage,
    )

    return (
        constants,
        float8_tensor,
        mxfp8_tensor,
        float8_blockwise_tensor,
        nvfp4_tensor,
        (
            float8_tensor_storage.Float8TensorStorage,
            mxfp8_tensor_storage.MXFP8TensorStorage,
            float8_blockwise_tensor_storage.Float8BlockwiseQTensorStorage,
            nvfp4_tensor_storage.NVFP4TensorStorage,
        ),
    )


def _torch_fp8(te_dtype) -> torch.dtype:  # type: ignore[no-untyped-def]
    constants = _te()[0]
    return constants.TE_DType_To_Torch[constants.DType.cast(te_dtype)]


def _as_2d(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x


def _transposed(x2d: torch.Tensor) -> torch.Tensor:
    """The 2D view transposed: TE's columnwise layout (last logical dim first)."""
    return x2d.t().contiguous()


def _reduced_amax(x: torch.Tensor, quantizer) -> torch.Tensor:  # type: ignore[no-untyped-def]
    amax = x.detach().float().abs().amax().reshape(1) if x.numel() else torch.zeros(1)
    group = getattr(quantizer, "amax_reduction_group", None)
    if getattr(quantizer, "with_amax_reduction", False) and group is not None:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    return amax


def _new_output(quantizer, src: torch.Tensor):  # type: ignore[no-untyped-def]
    """An empty TE tensor of the quantizer's class for ``src`` (TE's own pure-Python allocation path)."""
    _c, float8_tensor, *_ = _te()
    shape = tuple(src.shape)
    if isinstance(quantizer, float8_tensor.Float8Quantizer):  # no TensorSpec allocation for delayed scaling
        cls = float8_tensor.Float8TensorStorage if quantizer.internal else float8_tensor.Float8Tensor
        kw = dict(
            data=torch.empty(shape, dtype=torch.uint8) if quantizer.rowwise_usage else None,
            data_transpose=torch.empty((shape[-1], *shape[:-1]), dtype=torch.uint8)
            if quantizer.columnwise_usage
            else None,
            fp8_scale_inv=torch.empty(1),
            fp8_dtype=quantizer.dtype,
            quantizer=quantizer,
            fake_dtype=src.dtype,
        )
        return cls(**kw) if quantizer.internal else cls(shape=shape, dtype=src.dtype, device=src.device, **kw)
    return create_empty_quantized_tensor(quantizer, shape, src.dtype, src.device, False)


def create_empty_quantized_tensor(quantizer, shape, dtype, device, pin_memory=False):  # type: ignore[no-untyped-def]
    """Stand-in for ``tex.create_empty_quantized_tensor``: TE's TensorSpec allocation, uninitialized."""
    meta = quantizer.create_metadata(shape, dtype=dtype)
    buffers = quantizer.alloc_tensors(tuple(shape), device=device)
    stride = None
    return meta["cls"].__tensor_unflatten__(buffers, meta, tuple(shape), stride)


def quantize(src: torch.Tensor, quantizer, out=None, noop_flag=None):  # type: ignore[no-untyped-def]
    """Stand-in for ``tex.quantize``: fills ``out`` (or a new tensor) with the format reference."""
    _c, f8, mx, bw, nv, _storages = _te()
    if noop_flag is not None and float(noop_flag.reshape(-1)[0]) != 0.0:
        return out
    if out is None:
        out = _new_output(quantizer, src)
    x = _as_2d(src.detach()).float()
    rowwise = (
        out._data is not None if isinstance(quantizer, (f8.Float8Quantizer, f8.Float8CurrentScalingQuantizer)) else None
    )
    if isinstance(quantizer, f8.Float8CurrentScalingQuantizer):
        amax = _reduced_amax(x, quantizer)
        scale = scale_from_amax(amax, FP8_MAX[_torch_fp8(quantizer.dtype)], pow2=quantizer.force_pow_2_scales,
                                epsilon=quantizer.amax_epsilon)  # fmt: skip
        _fill_tensorwise(out, x, src.shape, scale, _torch_fp8(quantizer.dtype), rowwise)
    elif isinstance(quantizer, f8.Float8Quantizer):
        quantizer.amax.copy_(
            torch.maximum(quantizer.amax.reshape(-1)[:1], _reduced_amax(x, None)).reshape(quantizer.amax.shape)
        )
        scale = quantizer.scale.detach().float().reshape(1)
        _fill_tensorwise(out, x, src.shape, scale, _torch_fp8(quantizer.dtype), rowwise)
    elif isinstance(quantizer, mx.MXFP8Quantizer):
        _fill_mxfp8(out, x, _torch_fp8(quantizer.dtype), quantizer)
    elif isinstance(quantizer, bw.Float8BlockQuantizer):
        _fill_blockwise(out, x, src.shape, _torch_fp8(quantizer.dtype), quantizer)
    elif isinstance(quantizer, nv.NVFP4Quantizer):
        _fill_nvfp4(out, x, quantizer)
    else:
        raise NotImplementedError(f"reference kernels: no format reference for {type(quantizer).__name__}")
    return out


def _fill_tensorwise(out, x, shape, scale, fp8, rowwise) -> None:  # type: ignore[no-untyped-def]
    data = cast_fp8(x * scale, fp8)
    out._scale_inv.copy_((1.0 / scale).reshape(out._scale_inv.shape))
    if rowwise:
        out._data.copy_(data.view(shape))
    if getattr(out, "_transpose", None) is not None:
        out._transpose.copy_(_transposed(data).view(out._transpose.shape))
        out._transpose_invalid = False


def _fill_mxfp8(out, x, fp8, quantizer) -> None:  # type: ignore[no-untyped-def]
    if quantizer.with_2d_quantization:
        raise NotImplementedError("reference kernels: MXFP8 2D quantization is not modelled")
    m, k = x.shape
    if out._rowwise_data is not None:
        data, biased = mxfp8_quantize(x, fp8)
        out._rowwise_data.copy_(data.view(out._rowwise_data.shape))
        out._rowwise_scale_inv.fill_(0)
        out._rowwise_scale_inv[:m, : biased.shape[1]].copy_(biased)
    if out._columnwise_data is not None:
        data_t, biased_t = mxfp8_quantize(x.t().contiguous(), fp8)  # blocks of 32 along M
        out._columnwise_data.copy_(data_t.t().contiguous().view(out._columnwise_data.shape))
        out._columnwise_scale_inv.fill_(0)
        out._columnwise_scale_inv[: biased_t.shape[1], :k].copy_(biased_t.t())
    out._with_gemm_swizzled_scales = False


def _fill_blockwise(out, x, shape, fp8, quantizer) -> None:  # type: ignore[no-untyped-def]
    pow2, eps = quantizer.force_pow_2_scales, quantizer.amax_epsilon
    two_d = quantizer.block_scaling_dim == 2
    rows = FP8_BLOCK if two_d else 1
    for which, xx in (("rowwise", x), ("columnwise", x.t().contiguous())):
        data_buf = getattr(out, f"_{which}_data")
        if data_buf is None:
            continue
        data, scale_inv = block_quantize(xx, rows, FP8_BLOCK, fp8, pow2=pow2, epsilon=eps)
        data_buf.copy_(data.view(data_buf.shape))
        buf = getattr(out, f"_{which}_scale_inv")
        buf.fill_(0)
        if not two_d:
            scale_inv = scale_inv.t()  # 1D scales are stored [K / 128, M] (TE's _dequantize_vectorwise)
        buf[: scale_inv.shape[0], : scale_inv.shape[1]].copy_(scale_inv)


def _fill_nvfp4(out, x, quantizer) -> None:  # type: ignore[no-untyped-def]
    unsupported = [n for n in ("with_rht", "stochastic_rounding", "row_scaled_nvfp4", "nvfp4_use_4over6")
                   if getattr(quantizer, n, False)]  # fmt: skip
    if unsupported and not (unsupported == ["with_rht"] and out._columnwise_data is None):
        raise NotImplementedError(f"reference kernels: NVFP4 {unsupported} are not modelled")
    amax = _reduced_amax(x, quantizer)
    tile_rows = NVFP4_BLOCK if quantizer.with_2d_quantization else 1
    if out._rowwise_data is not None:
        packed, scales = nvfp4_quantize(x, amax, tile_rows)
        out._rowwise_data.copy_(packed.view(out._rowwise_data.shape))
        out._rowwise_scale_inv.fill_(0)
        out._rowwise_scale_inv[: scales.shape[0], : scales.shape[1]].copy_(scales)
        out._amax_rowwise.copy_(amax.reshape(out._amax_rowwise.shape))
    if out._columnwise_data is not None:
        packed, scales = nvfp4_quantize(x.t().contiguous(), amax, tile_rows)
        out._columnwise_data.copy_(packed.view(out._columnwise_data.shape))
        out._columnwise_scale_inv.fill_(0)
        out._columnwise_scale_inv[: scales.shape[0], : scales.shape[1]].copy_(scales)
        out._amax_columnwise.copy_(amax.reshape(out._amax_columnwise.shape))
    out._with_gemm_swizzled_scales = False


def dequantize(tensor, te_dtype):  # type: ignore[no-untyped-def]
    """Stand-in for ``tex.dequantize``: the format reference's inverse, in the requested dtype."""
    constants, *_rest, storages = _te()
    f8s, mxs, _bws, nvs = storages
    out_dtype = constants.TE_DType_To_Torch[constants.DType.cast(te_dtype)]
    if isinstance(tensor, f8s):
        values = fp8_to_float(tensor._data, _torch_fp8(tensor._fp8_dtype)) * tensor._scale_inv.float()
        return values.to(out_dtype)
    if isinstance(tensor, mxs):
        fp8 = _torch_fp8(tensor._fp8_dtype)
        if tensor._with_gemm_swizzled_scales:
            raise NotImplementedError("reference kernels: swizzled MXFP8 scales are not modelled")
        if tensor._rowwise_data is not None:
            d = tensor._rowwise_data
            values = mxfp8_dequantize(_as_2d(d), tensor._rowwise_scale_inv, fp8)
        else:
            d = tensor._columnwise_data
            d2 = _as_2d(d)
            values = mxfp8_dequantize(d2.t().contiguous(), tensor._columnwise_scale_inv.t(), fp8).t()
        return values.reshape(d.shape).to(out_dtype)
    if isinstance(tensor, nvs):
        if tensor._rowwise_data is None:
            raise NotImplementedError("reference kernels: columnwise-only NVFP4 (TE refuses it too)")
        d = tensor._rowwise_data
        values = nvfp4_dequantize(_as_2d(d), tensor._rowwise_scale_inv, tensor._amax_rowwise.reshape(1))
        return values.reshape(*d.shape[:-1], 2 * d.shape[-1]).to(out_dtype)
    raise NotImplementedError(f"reference kernels: no dequantize reference for {type(tensor).__name__}")


def fp8_transpose(data: torch.Tensor, fp8_dtype, out=None):  # type: ignore[no-untyped-def]
    """Stand-in for ``tex.fp8_transpose``: last dim first (bytes moved, no arithmetic)."""
    t = data.reshape(-1, data.shape[-1]).t().contiguous().view(data.shape[-1], *data.shape[:-1])
    if out is None:
        return t
    out.copy_(t)
    return out


def grouped_gemm(  # type: ignore[no-untyped-def]
    A, transa, B, transb, out, out_dtype, m_splits, bias, bias_dtype, single_output, pre_gelu_out, grad,
    workspaces, workspace_size, accumulate, use_split_accumulator, sm_margin,
):  # fmt: skip
    """Stand-in for ``tex.te_general_grouped_gemm``. See [Note: reference grouped GEMM]."""
    _c, _f8, _mx, _bw, _nv, storages = _te()
    if any(isinstance(t, storages) for t in (*A, *B)):
        raise NotImplementedError("reference grouped GEMM: FP8 operands are not modelled (GPU tier)")
    if any(t.numel() for t in pre_gelu_out):
        raise NotImplementedError("reference grouped GEMM: the GELU epilogue is not modelled")
    outs = list(out[0].split(list(m_splits))) if single_output else list(out)
    for i, (a, b) in enumerate(zip(A, B)):
        a32, b32 = a.float(), b.float()
        d = (b32.t() if transb else b32) @ (a32.t() if transa else a32)
        if not grad and bias[i].numel():
            d = d + bias[i].float()
        if grad and bias[i].numel():
            bias[i].copy_(b32.sum(0))
        if accumulate:
            outs[i].add_(d.to(outs[i].dtype))
        else:
            outs[i].copy_(d.to(outs[i].dtype))
    return bias


KERNELS = {
    "quantize": quantize,
    "dequantize": dequantize,
    "fp8_transpose": fp8_transpose,
    "create_empty_quantized_tensor": create_empty_quantized_tensor,
}


@contextlib.contextmanager
def reference_kernels() -> Iterator[None]:
    """Inside: the structural stand-in's ``quantize`` / ``dequantize`` / ... are the format references.

    See [Note: reference kernels]. Outside, those names are raising kernels again. Also maps
    ``device="cuda"`` in torch calls to the CPU (and nothing else: ``torch.cuda.is_available()``
    stays False, so DCP and FSDP2 run their CPU paths): TE's ``MXFP8Tensor`` / ``NVFP4Tensor``
    dequantize moves its buffers to ``"cuda"`` before calling the kernel. And
    ``torch.cuda.current_device()`` returns 0: ``NVFP4Quantizer.__init__`` calls it
    (``nvfp4_tensor.py:176``), and so every ``NVFP4Tensor.detach()`` (``make_like`` ->
    ``quantizer.copy()``); ``torch.cuda.synchronize()`` does nothing (TE's ``get_extra_state``
    calls it).
    """
    from _te_structural import STAND_IN, _CudaToDevice, import_te

    import_te()
    saved = {name: STAND_IN.__dict__.get(name) for name in KERNELS}
    for name, fn in KERNELS.items():
        setattr(STAND_IN, name, fn)
    current_device, synchronize = torch.cuda.current_device, torch.cuda.synchronize
    torch.cuda.current_device = lambda: 0
    torch.cuda.synchronize = lambda *a, **k: None
    try:
        with _CudaToDevice("cpu"):
            yield
    finally:
        torch.cuda.current_device, torch.cuda.synchronize = current_device, synchronize
        for name, old in saved.items():
            if old is None:
                delattr(STAND_IN, name)
            else:
                setattr(STAND_IN, name, old)


class _OnCpu(TorchFunctionMode):
    """``tensor.cuda()`` stays put; ``is_cuda`` is True when TE's ``module/base.py`` asks (prepare_forward)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is torch.Tensor.cuda:
            return args[0]
        if getattr(func, "__self__", None) is torch.Tensor.is_cuda and _BASE_MODULE in sys._getframe(1).f_code.co_filename:
            return True
        return func(*args, **(kwargs or {}))


_BASE_MODULE = os.path.join("transformer_engine", "pytorch", "module", "base.py")


def _device_properties(*args, **kwargs):  # type: ignore[no-untyped-def]
    return types.SimpleNamespace(name="structural tier (CPU)", major=9, minor=0, multi_processor_count=132)


@contextlib.contextmanager
def module_execution() -> Iterator[None]:
    """Inside: non-FP8 ``GroupedLinear`` forward / backward run on a CPU (see [Note: reference grouped GEMM]).

    Everything :func:`reference_kernels` does, plus the reference grouped GEMM and the CUDA
    answers TE's Python asks for around it. Other TE kernels still raise.
    """
    from _te_structural import STAND_IN, _CudaToDevice
    from transformer_engine.pytorch.module import grouped_linear

    extra = {"te_general_grouped_gemm": grouped_gemm, "get_num_cublas_streams": lambda: 1}
    saved_kernels = {name: STAND_IN.__dict__.get(name) for name in extra}
    saved_cuda = {n: getattr(torch.cuda, n) for n in ("is_current_stream_capturing", "get_device_properties")}
    function = grouped_linear._GroupedLinear
    backward = vars(function)["backward"]

    def backward_on_cpu(ctx, *grads):  # type: ignore[no-untyped-def]
        # Torch-function modes are not active in autograd's backward: enter them again for it.
        with _CudaToDevice("cpu"), _OnCpu():
            return backward.__func__(ctx, *grads)

    with reference_kernels():
        for name, fn in extra.items():
            setattr(STAND_IN, name, fn)
        torch.cuda.is_current_stream_capturing = lambda: False
        torch.cuda.get_device_properties = _device_properties
        function.backward = staticmethod(backward_on_cpu)
        try:
            with _OnCpu():
                yield
        finally:
            function.backward = backward
            for name, value in saved_cuda.items():
                setattr(torch.cuda, name, value)
            for name, old in saved_kernels.items():
                if old is None:
                    delattr(STAND_IN, name)
                else:
                    setattr(STAND_IN, name, old)


assert math.isclose(FP8_MAX[torch.float8_e4m3fn], float(torch.finfo(torch.float8_e4m3fn).max))
