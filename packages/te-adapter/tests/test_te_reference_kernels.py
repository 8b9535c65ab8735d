"""The structural tier's format references, checked against each format's definition.

``_te_reference_kernels`` stands in for TE's quantize / dequantize kernels on CPU (test support
only; see [Note: reference kernels]). These tests are its oracle, independent of its code paths:

* values built ON the format's grid (chosen FP8 / e2m1 codes times chosen scales) quantize to
  exactly those codes and scales and dequantize to exactly those values;
* values OFF the grid come back within the format's precision (half a step of the element format
  at the block's scale);
* layouts are read back with TE's OWN Python code where TE has some: ``Float8Tensor``'s CPU
  dequantize, ``Float8BlockwiseQTensor``'s 2D and 1D (vectorwise) dequantize, and TE's NVFP4
  reference quantizer (``custom_recipes/reference_nvfp4.py``, TE's CPU description of its kernel).

Passing them says the references implement the formats; it says nothing about TE's CUDA kernels
(rounding of ties, padding contents, swizzling), which the GPU tier checks.
"""

from __future__ import annotations

import pytest
import torch
from _te_reference_kernels import (
    E2M1_VALUES,
    block_quantize,
    cast_fp8,
    e2m1_decode,
    e2m1_encode,
    e8m0_from_amax,
    e8m0_to_float,
    fp8_to_float,
    mxfp8_dequantize,
    mxfp8_quantize,
    nvfp4_dequantize,
    nvfp4_quantize,
    pack_e2m1,
    reference_kernels,
    scale_from_amax,
    unpack_e2m1,
)
from shardbridge.testing import run_distributed

E4M3 = torch.float8_e4m3fn
HALF_STEP_REL = 2.0**-4  # e4m3: 3 mantissa bits -> half a step is 2**-4 of the value (normals)
HALF_SUBNORMAL = 2.0**-10  # e4m3 subnormal step 2**-9


def _finite_e4m3_bytes() -> torch.Tensor:
    b = torch.arange(256, dtype=torch.uint8)
    return b[torch.isfinite(b.view(E4M3).float())]


def _fp8_within_precision(dq: torch.Tensor, x: torch.Tensor, scale_inv: torch.Tensor) -> None:
    """|dq - x| <= max(2**-4 |x|, 2**-10 * scale_inv): half an e4m3 step at the block's scale."""
    bound = torch.maximum(x.abs() * HALF_STEP_REL, HALF_SUBNORMAL * scale_inv) * (1 + 2**-20)
    assert ((dq - x).abs() <= bound).all(), ((dq - x).abs() / bound).max()


# --------------------------------------------------------------------------- element formats


def test_fp8_cast_is_exact_on_the_grid_saturates_and_rounds_to_nearest_even() -> None:
    b = _finite_e4m3_bytes()
    vals = fp8_to_float(b, E4M3)
    assert torch.equal(cast_fp8(vals, E4M3), torch.where(vals == 0, cast_fp8(vals, E4M3), b))
    assert fp8_to_float(cast_fp8(torch.tensor([1e6, -1e6]), E4M3), E4M3).tolist() == [448.0, -448.0]
    # 1 + 1/16 lies halfway between 1 and 1.125: nearest EVEN mantissa -> 1; 1 + 3/16 -> 1.25.
    assert fp8_to_float(cast_fp8(torch.tensor([1.0625, 1.1875]), E4M3), E4M3).tolist() == [1.0, 1.25]


def _e2m1_codes() -> None:
    codes = torch.arange(16, dtype=torch.uint8)
    grid = torch.tensor(E2M1_VALUES)
    assert torch.equal(e2m1_decode(codes), torch.cat([grid, -grid]))
    assert torch.equal(e2m1_encode(e2m1_decode(codes)), codes)  # -0.0 keeps its sign: code 8
    # Ties go to the even code (0.25 -> 0, 0.75 -> 1.0, 2.5 -> 2, 5 -> 4).
    assert e2m1_decode(e2m1_encode(torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]))).tolist() == [
        0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]  # fmt: skip
    pairs = torch.randint(0, 16, (4, 8), dtype=torch.uint8)
    packed = pack_e2m1(pairs)
    assert packed.shape == (4, 4) and torch.equal(packed[:, 0], pairs[:, 0] | (pairs[:, 1] << 4))
    assert torch.equal(unpack_e2m1(packed), pairs)
    # TE's own Python reference (custom_recipes/reference_nvfp4.cast_to_fp4x2): same codes, same packing.
    from _te_structural import import_te

    import_te()
    from transformer_engine.pytorch.custom_recipes.reference_nvfp4 import cast_to_fp4x2

    v = torch.cat([torch.linspace(-6, 6, 4001), torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -5.0])])
    v = v[: v.numel() // 2 * 2].reshape(1, -1)
    assert torch.equal(pack_e2m1(e2m1_encode(v)), cast_to_fp4x2(v))


def test_scales() -> None:
    amax = torch.tensor([448.0, 1.0, 0.0, 3.0])
    assert scale_from_amax(amax, 448.0, pow2=False).tolist() == [1.0, 448.0, 1.0, torch.tensor(448.0 / 3.0).item()]
    assert scale_from_amax(amax, 448.0, pow2=True).tolist() == [1.0, 256.0, 1.0, 128.0]
    # E8M0 = 2**ceil(log2(amax / 448)): a power of 2 times 448 is exact, a hair above goes one up.
    amax = torch.tensor([448.0 * 2**-5, 448.0 * 2**-5 * (1 + 2**-20), 448.0 * 0.75, 0.0])
    assert (e8m0_from_amax(amax, 448.0).int() - 127).tolist() == [-5, -4, 0, -127]
    assert e8m0_to_float(torch.tensor([127, 130, 120], dtype=torch.uint8)).tolist() == [1.0, 8.0, 2.0**-7]


# --------------------------------------------------------------------------- block formats


def _on_grid_blocks(m: int, k: int, rows: int, cols: int, exps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Random finite e4m3 codes, one 448 per block, times 2**exp per block: (x, codes)."""
    b = _finite_e4m3_bytes()
    codes = b[torch.randint(0, b.numel(), (m, k))]
    codes[::rows, ::cols] = cast_fp8(torch.tensor(448.0), E4M3)
    scale = torch.ldexp(torch.ones(exps.shape), exps).repeat_interleave(rows, 0).repeat_interleave(cols, 1)[:m, :k]
    return fp8_to_float(codes, E4M3) * scale, codes


def test_mxfp8_on_grid_is_exact_and_off_grid_within_precision() -> None:
    torch.manual_seed(0)
    m, k = 64, 96
    exps = torch.randint(-20, 10, (m, k // 32))
    x, codes = _on_grid_blocks(m, k, 1, 32, exps)
    data, biased = mxfp8_quantize(x, E4M3)
    assert torch.equal(data, codes) and torch.equal(biased.int() - 127, exps.int())
    assert torch.equal(mxfp8_dequantize(data, biased, E4M3), x)
    y = torch.randn(m, k) * torch.logspace(-4, 4, m).unsqueeze(1)
    data, biased = mxfp8_quantize(y, E4M3)
    _fp8_within_precision(mxfp8_dequantize(data, biased, E4M3), y, e8m0_to_float(biased).repeat_interleave(32, 1))


@pytest.mark.parametrize("rows", [128, 1])
def test_blockwise_on_grid_is_exact_and_off_grid_within_precision(rows: int) -> None:
    torch.manual_seed(1)
    m, k = 256, 384
    exps = torch.randint(-12, 12, (m // rows, k // 128))
    # pow2 scale = 448 / amax exactly when amax = 448 * 2**e -> scale_inv = 2**e.
    x, codes = _on_grid_blocks(m, k, rows, 128, exps)
    data, scale_inv = block_quantize(x, rows, 128, E4M3, pow2=True)
    assert torch.equal(data, codes) and torch.equal(scale_inv, torch.ldexp(torch.ones(exps.shape), exps))
    y = torch.randn(m, k) * torch.logspace(-3, 3, k)
    data, scale_inv = block_quantize(y, rows, 128, E4M3, pow2=True)
    expanded = scale_inv.repeat_interleave(rows, 0).repeat_interleave(128, 1)
    _fp8_within_precision(fp8_to_float(data, E4M3) * expanded, y, expanded)


def _nvfp4_on_grid(tile_rows: int) -> None:
    torch.manual_seed(2)
    m, k = 64, 128
    # Block scales: powers of 2 in e4m3's normal range, one block at 448 so the global amax is 6 * 448 * g.
    exps = torch.randint(-6, 8, (m // tile_rows, k // 16))
    block = torch.ldexp(torch.ones(exps.shape), exps)
    block[0, 0] = 448.0
    g = 2.0**-9
    codes = torch.randint(0, 16, (m, k), dtype=torch.uint8)
    codes[::tile_rows, ::16] = 7  # each block's max is 6
    per_elem = block.repeat_interleave(tile_rows, 0).repeat_interleave(16, 1)
    x = e2m1_decode(codes) * per_elem * g
    amax = x.abs().amax().reshape(1)
    assert amax.item() == 6 * 448 * g
    packed, scales = nvfp4_quantize(x, amax, tile_rows)
    negzero = codes == 8  # -0 encodes as 8 or 0 alike
    assert torch.equal(torch.where(negzero, 0, unpack_e2m1(packed)), torch.where(negzero, 0, codes))
    assert torch.equal(scales.view(E4M3).float(), block.repeat_interleave(tile_rows, 0))
    assert torch.equal(nvfp4_dequantize(packed, scales, amax), x)
    # Off the grid: within half the largest e2m1 step (1.0) at the block's scale, plus the clamp at 6.
    y = torch.randn(m, k)
    amax = y.abs().amax().reshape(1)
    packed, scales = nvfp4_quantize(y, amax, tile_rows)
    decode = scales.view(E4M3).float().repeat_interleave(16, 1) * amax / (6 * 448)
    assert ((nvfp4_dequantize(packed, scales, amax) - y).abs() <= decode * 1.0 + 1e-12).all()
    # TE's own Python reference of its kernel gives the same codes and block scales.
    from _te_structural import import_te

    import_te()
    from transformer_engine.pytorch.custom_recipes.reference_nvfp4 import NVFP4QuantizerRef

    ref_packed, ref_scales = NVFP4QuantizerRef._quantize_blockwise_reference(
        y, amax, 16, tile_rows, pow_2_scales=False, eps=0.0
    )
    assert torch.equal(ref_packed, packed)
    assert torch.equal(ref_scales.view(torch.uint8).reshape(scales.shape), scales)


# --------------------------------------------------------------------------- with TE's classes


def _stand_ins_fill_te_classes() -> None:
    """Quantize with TE's real quantizers via the stand-ins; read back with TE's own Python dequantize."""
    from _te_structural import STAND_IN, cuda_construction, import_te

    import_te()
    from transformer_engine.pytorch.constants import DType
    from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockQuantizer
    from transformer_engine.pytorch.tensor.float8_tensor import Float8CurrentScalingQuantizer

    torch.manual_seed(3)
    x = torch.randn(256, 384) * torch.logspace(-2, 2, 384)
    with cuda_construction("cpu"), reference_kernels():
        for dim in (2, 1):
            q = Float8BlockQuantizer(DType.kFloat8E4M3, rowwise=True, columnwise=True, block_scaling_dim=dim)
            t = q(x)
            rows = 128 if dim == 2 else 1
            data, scale_inv = block_quantize(x, rows, 128, E4M3, pow2=True)
            want = fp8_to_float(data, E4M3) * scale_inv.repeat_interleave(rows, 0).repeat_interleave(128, 1)
            assert torch.equal(t.dequantize(), want), dim  # TE's Python (2D tiles / vectorwise) dequantize
            data_t, scale_inv_t = block_quantize(x.t().contiguous(), rows, 128, E4M3, pow2=True)
            want_t = fp8_to_float(data_t, E4M3) * scale_inv_t.repeat_interleave(rows, 0).repeat_interleave(128, 1)
            t.update_usage(rowwise_usage=False)  # TE reads the columnwise (transposed) copy now
            assert torch.equal(t.dequantize(), want_t.t()), dim
        f = Float8CurrentScalingQuantizer(DType.kFloat8E4M3, device="cpu")(x)
        assert f._data is not None and f._transpose is not None
        want = fp8_to_float(cast_fp8(x * (448.0 / x.abs().max()), E4M3), E4M3) * (1.0 / (448.0 / x.abs().max()))
        assert torch.equal(f.dequantize(), want)  # TE's own CPU fallback (data * scale_inv)
        assert torch.equal(f._transpose, f._data.t())
    with pytest.raises(RuntimeError, match="structural tier: kernel quantize not available"):
        STAND_IN.quantize(x, None)


# TE is imported only in pool workers, never in the pytest process: a process that imported the
# structural tier's TE would hand it to every later import of transformer_engine (megatron-fsdp's
# among them) in the same pytest run.


def test_e2m1_codes_packing_and_ties_match_the_definition_and_te_reference() -> None:
    run_distributed(_e2m1_codes, world_size=1)


@pytest.mark.parametrize("tile_rows", [1, 16])
def test_nvfp4_on_grid_is_exact_and_off_grid_within_precision(tile_rows: int) -> None:
    run_distributed(_nvfp4_on_grid, tile_rows, world_size=1)


def test_stand_ins_fill_te_classes_that_te_python_code_reads_back() -> None:
    run_distributed(_stand_ins_fill_te_classes, world_size=1)


# --------------------------------------------------------------------------- the reference grouped GEMM


def _grouped_linear_vs_f_linear(fuse_wgrad: bool) -> dict[str, float]:
    """TE's GroupedLinear (its real Python autograd function, the reference GEMM) vs F.linear per expert."""
    import torch.nn.functional as F
    from _te_reference_kernels import module_execution
    from _te_structural import cuda_construction, import_te

    te = import_te()
    with cuda_construction("cpu"):
        module = te.GroupedLinear(
            3, 8, 6, bias=not fuse_wgrad, params_dtype=torch.float32, device="cpu", fuse_wgrad_accumulation=fuse_wgrad
        )
    torch.manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_()
    if fuse_wgrad:  # Megatron's main_grad: TE accumulates wgrad into it (the GEMM's accumulate=True)
        for i in range(3):
            getattr(module, f"weight{i}").main_grad = torch.full((6, 8), 0.5)
    splits = [2, 0, 5]  # an expert without tokens, as under routing
    x, dy = torch.randn(7, 8, requires_grad=True), torch.randn(7, 6)
    with module_execution():
        y = module(x, splits)
        y.backward(dy)
    xr = x.detach().clone().requires_grad_()
    ws = [getattr(module, f"weight{i}").detach().clone().requires_grad_() for i in range(3)]
    bs = [getattr(module, f"bias{i}").detach().clone().requires_grad_() if not fuse_wgrad else None for i in range(3)]
    yr = torch.cat([F.linear(part, w, b) for part, w, b in zip(xr.split(splits), ws, bs)])
    yr.backward(dy)
    diff = {"y": (y - yr).abs().max().item(), "dx": (x.grad - xr.grad).abs().max().item()}
    for i in range(3):
        w = getattr(module, f"weight{i}")
        want = torch.full((6, 8), 0.5) + ws[i].grad if fuse_wgrad else ws[i].grad  # accumulated into main_grad
        diff[f"dw{i}"] = ((w.main_grad if fuse_wgrad else w.grad) - want).abs().max().item()
        if not fuse_wgrad:
            diff[f"db{i}"] = (getattr(module, f"bias{i}").grad - bs[i].grad).abs().max().item()
    return diff


@pytest.mark.skipif(
    __import__("os").environ.get("SHARDBRIDGE_MOE_MATRIX") != "all",
    reason="GroupedLinear experts matrix: SHARDBRIDGE_MOE_MATRIX=all (nox -s moe)",
)
@pytest.mark.parametrize("fuse_wgrad", [False, True], ids=["bias", "main_grad"])
def test_grouped_linear_runs_as_f_linear_per_expert(fuse_wgrad: bool) -> None:
    """[Note: reference grouped GEMM]: forward, dgrad, wgrad (and the bias gradient, or the wgrad
    accumulated into main_grad) of TE's GroupedLinear equal F.linear's per expert, bit for bit in fp32."""
    diff = run_distributed(_grouped_linear_vs_f_linear, fuse_wgrad, world_size=1)[0]
    assert all(v == 0.0 for v in diff.values()), diff
