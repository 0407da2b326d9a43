"""Block-scaled FP8 / FP4 weights and the official linear() on them (kernels/blockscale/), against
brute-force versions written here and in tests/v4_reference.py, on fresh random inputs; the
shared Triton helpers of the formats and the act_quant pre-pass (also the block-scaled experts')
bit for bit against torch's casts and the reference; the Triton kernel against the reference
(interpreter: small shapes, fp16/fp32 activations; GPU: bf16 at V4-Flash widths, inside
torch.compile and a CUDA graph)."""
from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from kernels.blockscale import (
    FP4_BLOCK, FP8_BLOCK, act_quant, act_quant_dequant, blockscale_linear, blockscale_linear_op,
    blockscale_linear_reference, dequantize_fp4_weight, dequantize_fp8_weight, dequantize_weight, quantize_fp4_weight,
    quantize_fp8_weight, unpack_fp4,
)
from kernels.blockscale.device import round_to_e4m3, unpack_e2m1, weight_scale_to_fp32
from kernels.cuda_graph import capture
from v4_reference import fp4_round_trip, fp8_round_trip, pow2_at_least


def weight(out: int, inp: int, seed: int) -> torch.Tensor:
    """Rows of very different sizes, so that block scales differ."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(out, inp, generator=g) * torch.logspace(-2, 1, out)[:, None]


def fp8_blocks_brute_force(w: torch.Tensor) -> torch.Tensor:
    """Dequantised FP8 weight, one 128 x 128 block at a time."""
    out = torch.empty_like(w)
    for r in range(0, w.shape[0], FP8_BLOCK):
        for c in range(0, w.shape[1], FP8_BLOCK):
            block = w[r : r + FP8_BLOCK, c : c + FP8_BLOCK]
            s = pow2_at_least(block.abs().max().clamp(min=1e-4) / 448.0)
            out[r : r + FP8_BLOCK, c : c + FP8_BLOCK] = (block / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s
    return out


@pytest.mark.parametrize("out, inp", [(256, 384), (300, 200), (130, 128)])
def test_fp8_weights_round_trip_block_by_block(out, inp):
    w = weight(out, inp, seed=out + inp)
    values, scale = quantize_fp8_weight(w)
    assert values.dtype == torch.float8_e4m3fn and values.shape == (out, inp)
    assert scale.dtype == torch.float8_e8m0fnu and scale.shape == (-(-out // 128), -(-inp // 128))
    torch.testing.assert_close(dequantize_fp8_weight(values, scale), fp8_blocks_brute_force(w), rtol=0, atol=0)


def test_fp4_weights_round_trip_as_the_brute_force_rounding():
    w = weight(96, 256, seed=3)
    packed, scale = quantize_fp4_weight(w)
    assert packed.dtype == torch.uint8 and packed.shape == (96, 128)
    assert scale.dtype == torch.float8_e8m0fnu and scale.shape == (96, 256 // FP4_BLOCK)
    torch.testing.assert_close(dequantize_fp4_weight(packed, scale), fp4_round_trip(w, FP4_BLOCK), rtol=0, atol=0)


def test_every_fp4_byte_unpacks_and_packs_back():
    """All 256 bytes: two codes each, low nibble first (code 7 is 6.0, bit 3 the sign). Every
    32-value block of them holds a 6, so its scale is 1 and quantising gives the bytes back,
    except that -0 (code 8) comes back as +0."""
    packed = torch.arange(256, dtype=torch.uint8).view(1, 256)
    values = unpack_fp4(packed)
    assert values.shape == (1, 512)
    assert values[0, 2 * 0x71].item() == 0.5 and values[0, 2 * 0x71 + 1].item() == 6.0
    assert values[0, 2 * 0x9F].item() == -6.0 and values[0, 2 * 0x9F + 1].item() == -0.5
    repacked, scale = quantize_fp4_weight(values)
    assert torch.equal(scale.float(), torch.ones_like(scale.float()))
    low, high = packed & 0xF, packed >> 4
    no_negative_zero = torch.where(low == 8, 0, low) | (torch.where(high == 8, 0, high) << 4)
    assert torch.equal(repacked, no_negative_zero)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_act_quant_is_the_official_fp8_round_trip(dtype):
    x = (torch.randn(5, 512) * torch.logspace(-3, 2, 5)[:, None]).to(dtype)
    values, scale = act_quant(x)
    assert values.dtype == torch.float8_e4m3fn and scale.shape == (5, 4)
    assert torch.equal(scale, pow2_at_least(scale))  # ue8m0: powers of two
    torch.testing.assert_close(act_quant_dequant(x), fp8_round_trip(x.float(), FP8_BLOCK, True), rtol=0, atol=0)
    with pytest.raises(ValueError, match="act_quant: the last dim must be a multiple of 128, got 100"):
        act_quant(torch.randn(2, 100))


@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
@pytest.mark.parametrize("rows", [1, 7])
def test_linear_is_the_quantised_activation_times_the_dequantised_weight(fmt, rows):
    w = weight(200, 256, seed=rows)
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(9))
    if fmt == "fp8":
        q, scale = quantize_fp8_weight(w)
        w_seen = fp8_blocks_brute_force(w)
    else:
        q, scale = quantize_fp4_weight(w)
        w_seen = fp4_round_trip(w, FP4_BLOCK)
    expected = fp8_round_trip(x, FP8_BLOCK, True).double() @ w_seen.double().t()
    for impl in ("auto", "reference"):
        y = blockscale_linear(x, q, scale, impl=impl)
        assert y.dtype == x.dtype and y.shape == (rows, 200)
        torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    # the quantisation is there: the unquantised product differs by far more than rounding
    assert (y - x @ w.t()).abs().max() > 1e-3 * (x @ w.t()).abs().max()


def test_bad_operands_are_named():
    w, scale = quantize_fp8_weight(weight(128, 256, seed=1))
    x = torch.randn(2, 256)
    with pytest.raises(ValueError, match="scale must be \\[1, 2\\]"):
        blockscale_linear(x, w, scale[:, :1])
    with pytest.raises(ValueError, match="x has 128 inputs, the weight 256"):
        blockscale_linear(x[:, :128], w, scale)
    with pytest.raises(ValueError, match="weight must be float8_e4m3fn or uint8"):
        blockscale_linear(x, w.float(), scale)
    with pytest.raises(ValueError, match="impl must be one of"):
        blockscale_linear(x, w, scale, impl="cublas")


def test_the_custom_op_is_well_formed():
    """Fake implementation, autograd registration and AOT dispatch (opcheck's schema test cannot
    handle fp8 arguments: it multiplies them)."""
    checks = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")
    w, scale = quantize_fp8_weight(weight(128, 256, seed=2))
    torch.library.opcheck(blockscale_linear_op, (torch.randn(3, 256), w, scale, True), test_utils=checks)
    packed, scale4 = quantize_fp4_weight(weight(64, 256, seed=4))
    torch.library.opcheck(blockscale_linear_op, (torch.randn(2, 256), packed, scale4, True), test_utils=checks)


# -- the Triton kernel ------------------------------------------------------------------------
FP32_EPS = 2.0**-24  # unit roundoff
# One ulp of the output dtype relative to the value: two fp32 sums a hair apart may round to
# neighbouring outputs.
OUT_ULP = {torch.float32: 2.0**-23, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}


def quantized(fmt: str, w: torch.Tensor, scale_dtype: torch.dtype):
    return (quantize_fp8_weight if fmt == "fp8" else quantize_fp4_weight)(w, scale_dtype)


def assert_matches_reference(y, x, q, scale, pow2, ulps=16):
    """Both sides sum the same exact products (e4m3 x e4m3 or e2m1 values, scaled) in fp32, in
    different orders: they differ by a few fp32 roundings of the row's absolute sum, plus one
    ulp of the output dtype. The absolute sum comes from the same dequantised operands."""
    ref = blockscale_linear_reference(x, q, scale, pow2)
    assert y.shape == ref.shape and y.dtype == ref.dtype
    abs_sum = act_quant_dequant(x, pow2).abs().double() @ dequantize_weight(q, scale).abs().double().t()
    bound = ulps * FP32_EPS * abs_sum + OUT_ULP[x.dtype] * ref.double().abs()
    err = (y.double() - ref.double()).abs()
    assert (err <= bound).all(), f"max error {err.max().item():.3e}, worst excess {(err - bound).max().item():.3e}"


def triton_operands(fmt, scale_dtype, rows, n, k, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    # activations spanning four decades across K (so blocks get different scales), weights whose
    # rows differ in size (so weight blocks do)
    x = (torch.randn(rows, k, generator=g) * torch.logspace(-2, 2, k)[torch.randperm(k, generator=g)]).to(dtype)
    q, scale = quantized(fmt, weight(n, k, seed), scale_dtype)
    return x, q, scale


@pytest.mark.interpreter
@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
@pytest.mark.parametrize("scale_dtype", [torch.float8_e8m0fnu, torch.float32])
@pytest.mark.parametrize("pow2", [True, False])
def test_triton_matches_the_reference(fmt, scale_dtype, pow2):
    """Ragged N (200: neither a multiple of the column tiles nor of 128), K three 128-blocks,
    B = 1 and 3 (every program quantises its rows), 17 (the pre-pass, two row tiles' worth)."""
    from kernels.blockscale.triton import blockscale_linear_triton

    for rows, dtype in ((1, torch.float16), (3, torch.float32), (17, torch.float16)):
        x, q, scale = triton_operands(fmt, scale_dtype, rows, 200, 384, dtype, seed=rows + 10 * pow2)
        assert_matches_reference(blockscale_linear_triton(x, q, scale, pow2), x, q, scale, pow2)


@pytest.mark.interpreter
@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
@pytest.mark.parametrize("split,x_quantized", [(2, False), (3, True), (1, True)])
def test_triton_split_k_and_the_pre_pass(fmt, split, x_quantized):
    """Plans the interpreter's 8 SMs would not pick at these sizes: K split 2 or 3 ways (the last
    program of a tile adds the partials, and leaves the counters at zero for the next launch),
    activations quantised in-kernel or by the pre-pass, and more rows than one row tile."""
    from kernels.blockscale.triton import Plan, blockscale_linear_triton, split_plan
    from kernels.arrival import split_counters

    k = 640  # five blocks: splits of 3 + 2 and 2 + 2 + 1
    plan = split_plan(Plan(block_m=16, block_n=32, split=1, blocks_per_split=5, x_quantized=x_quantized), k, split)
    assert plan.split == split
    for rows in (5, 19):
        x, q, scale = triton_operands(fmt, torch.float8_e8m0fnu, rows, 100, k, torch.float32, seed=split + rows)
        y = blockscale_linear_triton(x, q, scale, True, plan)
        assert_matches_reference(y, x, q, scale, True)
        assert torch.equal(blockscale_linear_triton(x, q, scale, True, plan), y)  # deterministic, counters reset
    assert not split_counters(torch.device("cpu"), 16).any()


@pytest.mark.interpreter
@pytest.mark.parametrize("scale_dtype", [torch.float8_e8m0fnu, torch.float32])
@pytest.mark.parametrize("pow2", [True, False])
def test_gemv_matches_the_reference(scale_dtype, pow2):
    """The one-row FP8 GEMV: N not a multiple of its 4 columns' tiles nor of 128 (one program's
    columns past the end), K of three 128-blocks (one block a step) and of eight (1024: every
    block in one step), activations spanning four decades; fp16 and fp32 rows, leading dims kept."""
    from kernels.blockscale.gemv import blockscale_gemv

    for n, k, dtype in ((202, 384, torch.float16), (130, 1024, torch.float32)):
        x, q, scale = triton_operands("fp8", scale_dtype, 1, n, k, dtype, seed=n + pow2)
        if scale_dtype == torch.float32:
            scale = scale * (1 + torch.rand(scale.shape, generator=torch.Generator().manual_seed(n)))
        y = blockscale_gemv(x.view(1, 1, k), q, scale, pow2)
        assert y.shape == (1, 1, n)
        assert_matches_reference(y.view(1, n), x, q, scale, pow2)
    # another launch shape: 8 columns a program, two blocks a step
    y = blockscale_gemv(x, q, scale, pow2, block_n=8, block_k=256)
    assert_matches_reference(y, x, q, scale, pow2)


def test_gemv_refuses_what_it_does_not_compute():
    """More than one row, FP4 weights, K that is not whole 128-blocks or mismatched: refused by name
    before any launch."""
    from kernels.blockscale.gemv import blockscale_gemv

    x, q, scale = triton_operands("fp8", torch.float8_e8m0fnu, 2, 128, 256, torch.float32, seed=1)
    with pytest.raises(ValueError, match="one row of x, got 2"):
        blockscale_gemv(x, q, scale)
    with pytest.raises(ValueError, match="x has 128 inputs, the weight 256"):
        blockscale_gemv(x[:1, :128], q, scale)
    with pytest.raises(ValueError, match="positive multiple of 128"):
        blockscale_gemv(x[:1, :96], q[:, :96], scale)
    for shape in (dict(block_n=3), dict(block_k=192), dict(block_k=512)):  # 512 does not divide K = 256
        with pytest.raises(ValueError, match="must divide 128 and block_k"):
            blockscale_gemv(x[:1], q, scale, **shape)
    x4, q4, scale4 = triton_operands("fp4", torch.float8_e8m0fnu, 1, 128, 256, torch.float32, seed=2)
    with pytest.raises(ValueError, match="FP8 \\(e4m3\\) weights"):
        blockscale_gemv(x4, q4, scale4)


@pytest.mark.interpreter
@pytest.mark.parametrize("rows", [1, 16])
def test_every_plan_the_benchmark_sweeps_computes_the_product(rows):
    """The plans kernels/bench/blockscale_plans.py times (but the e4m3 dot's and mma's, GPU only) give the
    reference's result: a plan the sweep finds fastest can become the default as it is."""
    from kernels.bench.blockscale_plans import candidate_plans
    from kernels.blockscale.triton import blockscale_linear_triton

    n, k = 160, 512
    x, q, scale = triton_operands("fp8", torch.float8_e8m0fnu, rows, n, k, torch.float16, seed=rows)
    plans = candidate_plans(rows, n, k, sms=8)
    assert "default" in plans and {p.product for p in plans.values()} == {"fp16", "e4m3"}  # no mma tiles of 160
    assert "mma" in {p.product for p in candidate_plans(rows, 256, k, sms=8).values()}
    for name, plan in plans.items():
        if plan.product not in ("e4m3", "mma"):  # GPU only (the mma plans: test_gpu_mma_sweep_plans_compute_the_product)
            assert_matches_reference(blockscale_linear_triton(x, q, scale, True, plan), x, q, scale, True)


@pytest.mark.interpreter
@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
def test_triton_per_block_activation_scales_and_a_zero_block(fmt):
    """Each row's four 128-blocks differ in size by up to 10^6, the weight's inputs the other way
    round, so every block adds a like share to each output (a wrong activation scale on any block
    shows); one block of a row is all zeros (its amax takes the 1e-4 floor); fp32 weight scales
    that are not powers of two."""
    from kernels.blockscale.triton import blockscale_linear_triton

    g = torch.Generator().manual_seed(5)
    sizes = torch.tensor([1e3, 1e-3, 1.0, 1e-2]).repeat_interleave(FP8_BLOCK)
    x = torch.randn(3, 512, generator=g) * sizes
    x[1, 128:256] = 0.0
    q, scale = quantized(fmt, weight(72, 512, seed=6) / sizes, torch.float32)
    scale = scale * (1 + torch.rand(scale.shape, generator=g))
    w_seen = dequantize_weight(q, scale).double()
    for pow2 in (True, False):
        y = blockscale_linear_triton(x, q, scale, pow2)
        assert_matches_reference(y, x, q, scale, pow2)
        shares = [act_quant_dequant(x, pow2)[0, b : b + 128].double() @ w_seen[:, b : b + 128].t() for b in range(0, 512, 128)]
        assert min(share.abs().max() for share in shares) > 1e-2 * y[0].abs().max()


def e4m3_values() -> torch.Tensor:
    """Every finite e4m3 value (both zeros), ascending, as fp32."""
    codes = torch.arange(256, dtype=torch.uint8)
    return codes[(codes & 0x7F) != 0x7F].view(torch.float8_e4m3fn).float().sort().values


@triton.jit
def _round_probe(v_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    tl.store(out_ptr + offs, round_to_e4m3(tl.load(v_ptr + offs, mask=ok)), mask=ok)


@triton.jit
def _decode_probe(bytes_ptr, e2m1_ptr, ue8m0_ptr, fp4_scale_ptr):
    """All 256 bytes: as two e2m1 codes each, as ue8m0 scales, as ue8m0 scales of FP4 weights."""
    packed = tl.load(bytes_ptr + tl.arange(0, 256)[None, :])
    tl.store(e2m1_ptr + tl.arange(0, 512)[None, :], unpack_e2m1(packed))
    tl.store(ue8m0_ptr + tl.arange(0, 256)[None, :], weight_scale_to_fp32(packed, True, False))
    tl.store(fp4_scale_ptr + tl.arange(0, 256)[None, :], weight_scale_to_fp32(packed, True, True))


ON_BOTH = pytest.mark.parametrize("device", [
    pytest.param("cpu", marks=pytest.mark.interpreter), pytest.param("cuda", marks=pytest.mark.gpu),
])


@ON_BOTH
def test_e4m3_rounding_is_bit_exact(device):
    """round_to_e4m3 (the shared helper: arithmetic in the interpreter, the hardware's conversion on
    a GPU) against torch's cast: every e4m3 value of either sign, every midpoint between
    neighbours (ties: to even, into the next binade, in the subnormals), the fp32 neighbours of
    each midpoint, fp32 subnormals; -0 and negatives that round to zero keep their sign."""
    grid = e4m3_values()
    mids = (grid[1:] + grid[:-1]) / 2
    v = torch.cat([
        grid, mids, torch.nextafter(mids, torch.tensor(-1e3)), torch.nextafter(mids, torch.tensor(1e3)),
        torch.tensor([1e-40, -1e-40, 2.0**-149, -(2.0**-149)]),
    ])
    v = v.to(device)
    out = torch.empty_like(v)
    _round_probe[(triton.cdiv(len(v), 256),)](v, out, len(v), BLOCK=256)
    want = v.cpu().to(torch.float8_e4m3fn).float()
    assert torch.equal(out.cpu().view(torch.int32), want.view(torch.int32))


@pytest.mark.interpreter
def test_e2m1_and_ue8m0_decoding():
    """Every byte: its two e2m1 codes (low nibble first) decode to 2^-14 times unpack_fp4's values;
    as a ue8m0 scale to torch's float8_e8m0fnu value (byte 0: 2^-127, 255: NaN), times 2^14 for
    FP4 weights."""
    packed = torch.arange(256, dtype=torch.uint8)
    e2m1 = torch.empty(512, dtype=torch.float16)
    ue8m0, fp4_scale = torch.empty(256), torch.empty(256)
    _decode_probe[(1,)](packed, e2m1, ue8m0, fp4_scale)
    assert torch.equal(e2m1.float().view(torch.int32), (unpack_fp4(packed.view(1, 256))[0] * 2.0**-14).view(torch.int32))
    want = packed.view(torch.float8_e8m0fnu).float()
    assert torch.equal(ue8m0[:-1].view(torch.int32), want[:-1].view(torch.int32)) and ue8m0[0].item() == 2.0**-127
    assert ue8m0[-1].isnan() and want[-1].isnan()
    assert torch.equal(fp4_scale[:-1], want[:-1] * 2.0**14) and fp4_scale[-1].isnan()  # inf from 2^114 on


@ON_BOTH
@pytest.mark.parametrize("pow2", [True, False])
def test_act_quant_pre_pass_is_bit_exact(pow2, device):
    """The shared pre-pass (the linear's from 17 rows, the experts' once per token) is
    ref.act_quant bit for bit: every e4m3 value and every midpoint between neighbours (ties: to
    even), e4m3's subnormal range, -0, random values over six decades, a block below the 1e-4
    amax floor; fp32, fp16 and bf16 activations; power-of-two scales or not; rows contiguous,
    strided, or not contiguous along K."""
    from kernels.blockscale.act_quant_pass import act_quant_triton

    g = torch.Generator().manual_seed(1)
    grid = e4m3_values()
    values = torch.cat([grid, (grid[1:] + grid[:-1]) / 2, torch.randn(1000, generator=g) * 50])
    values = torch.cat([values, torch.zeros(-len(values) % 128)]).view(-1, 128)
    values[:, 0] = 448.0  # scale 1 with pow2: the midpoints stay ties
    wide = torch.randn(2, 512, generator=g) * torch.logspace(-3, 3, 512)
    wide[1, 128:256] = torch.randn(128, generator=g) * 1e-6  # amax below the 1e-4 floor
    x = torch.cat([values.view(-1, 512), wide])
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        rows = x.to(dtype)
        want, want_scale = act_quant(rows, pow2)
        assert (want[-2:].float() != 0).float().mean() > 0.9
        for layout in (rows, torch.cat([rows, rows], 1)[:, :512], rows.t().contiguous().t()):
            got, got_scale = act_quant_triton(layout.to(device), pow2)
            assert got.dtype == torch.float8_e4m3fn and got_scale.dtype == torch.float32
            assert torch.equal(got_scale.cpu(), want_scale)
            assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8)), (dtype, layout.stride())


@pytest.mark.interpreter
def test_triton_through_the_entry_point_keeps_leading_dims():
    x, q, scale = triton_operands("fp8", torch.float8_e8m0fnu, 6, 40, 256, torch.float32, seed=8)
    y = blockscale_linear(x.view(2, 3, 256), q, scale, impl="triton")
    assert y.shape == (2, 3, 40)
    assert_matches_reference(y.view(6, 40), x, q, scale, True)


@pytest.mark.interpreter
def test_triton_refuses_a_weight_strided_along_its_inputs():
    q, scale = quantize_fp8_weight(weight(128, 512, seed=3))
    with pytest.raises(ValueError, match="contiguous along its inputs"):
        blockscale_linear(torch.randn(2, 256), q[:, ::2], scale[:, ::2], impl="triton")


# V4-Flash's FP8 products: wq_a+wkv fused, wq_b, wo_b, shared expert w1 (w3) and w2.
V4_SHAPES = [(1536, 4096), (32768, 1024), (4096, 8192), (2048, 4096), (4096, 2048)]


def gpu_operands(rows, n, k, fmt="fp8", scale_dtype=torch.float8_e8m0fnu, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, k, generator=g, device="cuda").to(torch.bfloat16)
    w = torch.randn(n, k, generator=g, device="cuda") * k**-0.5 * torch.logspace(-1, 1, n, device="cuda")[:, None]
    q, scale = quantized(fmt, w, scale_dtype)
    return x, q, scale


# The e4m3 dot's share of the output's scale (the tensor cores add each product group with fewer
# bits than fp32), as the kernel benchmarks hold it.
E4M3_TOLERANCE = 8e-3


def assert_op_matches_reference(y, x, q, scale, pow2):
    """The op's output against the reference: to fp32 roundings (assert_matches_reference), or
    where it ran the e4m3 dot (FP8 weights, rows the GEMV does not take, a GPU with the e4m3
    dot) to E4M3_TOLERANCE of the output's largest magnitude."""
    from kernels.blockscale.op import cuda_product
    from kernels.triton_util import converts_e4m3

    rows = x.numel() // x.shape[-1]
    if q.dtype != torch.uint8 and converts_e4m3(x.device) and cuda_product(rows, q, scale, True) == "triton":
        ref = blockscale_linear_reference(x, q, scale, pow2).double()
        assert ((y.double() - ref).abs().max() / ref.abs().max()).item() < E4M3_TOLERANCE
    else:
        assert_matches_reference(y, x, q, scale, pow2)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 64])
@pytest.mark.parametrize("n,k", V4_SHAPES)
def test_gpu_matches_the_reference_at_v4_widths(rows, n, k):
    x, q, scale = gpu_operands(rows, n, k, seed=rows + n)
    assert_op_matches_reference(blockscale_linear(x, q, scale), x, q, scale, True)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
@pytest.mark.parametrize("rows", [1, 33])
def test_gpu_fp4_weights_and_fp32_scales(fmt, rows):
    x, q, scale = gpu_operands(rows, 1000, 2048, fmt, torch.float32, seed=rows)
    for pow2 in (True, False):
        assert_op_matches_reference(blockscale_linear(x, q, scale, pow2), x, q, scale, pow2)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 16, 64])
def test_gpu_e4m3_tensor_core_product(rows):
    """The e4m3 x e4m3 dot with the tiles plan_launch gives it: the tensor cores add each product
    group with fewer bits than fp32, so it is held to E4M3_TOLERANCE (about two bf16 roundings of
    the largest output) instead of fp32 roundings."""
    from kernels.blockscale.triton import blockscale_linear_triton, plan_launch

    for n, k in V4_SHAPES:
        x, q, scale = gpu_operands(rows, n, k, seed=rows + k)
        plan = plan_launch(rows, n, k, torch.cuda.get_device_properties(0).multi_processor_count, e4m3=True)
        assert plan.product == "e4m3"
        y, ref = blockscale_linear_triton(x, q, scale, True, plan).double(), blockscale_linear_reference(x, q, scale).double()
        assert ((y - ref).abs().max() / ref.abs().max()).item() < E4M3_TOLERANCE
    with pytest.raises(ValueError, match="e4m3 product takes FP8 weights"):
        x, q, scale = gpu_operands(rows, 256, 512, "fp4")
        blockscale_linear_triton(x, q, scale, True, plan)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 64])
def test_gpu_mma_product_matches_the_reference(rows):
    """The Gluon product (e4m3 codes converted into the tensor-core fragments) at V4-Flash's
    widths with its own plans (activations quantised in-kernel up to 16 rows, by the pre-pass
    above; 64 rows as two tiles); then column tiles of 64 (a width of 4160), K split 3 ways
    (one split of an odd number of blocks), one or two blocks loaded ahead, fp32 scales that are
    not powers of two, one all-zero activation block and blocks whose sizes differ by 10^4. The
    same bits twice (the split sums in a fixed order)."""
    from dataclasses import replace

    from kernels.blockscale.gluon import blockscale_linear_mma, plan_mma
    from kernels.blockscale.triton import split_plan

    for n, k in V4_SHAPES:
        x, q, scale = gpu_operands(rows, n, k, seed=rows + n)
        y = blockscale_linear_mma(x, q, scale)
        assert_matches_reference(y, x, q, scale, True)
        assert torch.equal(blockscale_linear_mma(x, q, scale), y)
    n, k = 4160, 1408  # eleven blocks: splits of 4, 4 and 3 (an odd last one)
    x, q, scale = gpu_operands(rows, n, k, scale_dtype=torch.float32, seed=rows)
    x = x * torch.logspace(-2, 2, k // FP8_BLOCK, device="cuda").repeat_interleave(FP8_BLOCK).to(x.dtype)
    x[0, 256:384] = 0
    scale = scale * (1 + torch.rand(scale.shape, device="cuda"))
    plan = split_plan(plan_mma(rows, n, k, 132), k, 3)
    assert plan.block_n == 64 and plan.split == 3
    for pow2, ahead in ((True, 1), (True, 2), (False, 2)):
        y = blockscale_linear_mma(x, q, scale, pow2, replace(plan, blocks_per_step=ahead))
        assert_matches_reference(y, x, q, scale, pow2)
        assert torch.equal(blockscale_linear_mma(x, q, scale, pow2, replace(plan, blocks_per_step=ahead)), y)


@pytest.mark.gpu
def test_gpu_gemv_matches_the_reference():
    """The one-row FP8 GEMV in bf16 at V4-Flash's widths, then fp32 scales that are not powers of two
    with one all-zero activation block; the same bits twice (no split: one order of sums)."""
    from kernels.blockscale.gemv import blockscale_gemv

    for n, k in V4_SHAPES:
        x, q, scale = gpu_operands(1, n, k, seed=n + k)
        y = blockscale_gemv(x, q, scale)
        assert_matches_reference(y, x, q, scale, True)
        assert torch.equal(blockscale_gemv(x, q, scale), y)
    x, q, scale = gpu_operands(1, 4160, 1408, scale_dtype=torch.float32, seed=3)
    x[0, 256:384] = 0
    scale = scale * (1 + torch.rand(scale.shape, device="cuda"))
    assert_matches_reference(blockscale_gemv(x, q, scale, False), x, q, scale, False)


@pytest.mark.gpu
def test_gpu_mma_sweep_plans_compute_the_product():
    """Every mma plan kernels/bench/blockscale_plans.py times gives the reference's result."""
    from kernels.bench.blockscale_plans import candidate_plans, run_plan

    n, k = 1536, 4096
    for rows in (1, 16, 64):
        x, q, scale = gpu_operands(rows, n, k, seed=rows)
        for plan in candidate_plans(rows, n, k, torch.cuda.get_device_properties(0).multi_processor_count).values():
            if plan.product == "mma":
                assert_matches_reference(run_plan(x, q, scale, plan), x, q, scale, True)


def test_mma_product_refuses_what_it_cannot_run(monkeypatch):
    """FP4 weights, a plan of the Triton products, column tiles the weight does not fill and the
    Triton interpreter are refused by name before any launch."""
    from dataclasses import replace

    from kernels.blockscale.gluon import blockscale_linear_mma, plan_mma
    from kernels.blockscale.triton import plan_launch

    x = torch.randn(2, 256)
    q, scale = quantize_fp4_weight(weight(128, 256, seed=1))
    with pytest.raises(ValueError, match="takes FP8"):
        blockscale_linear_mma(x, q, scale)
    q, scale = quantize_fp8_weight(weight(192, 256, seed=2))
    with pytest.raises(ValueError, match="not a plan of the mma product"):
        blockscale_linear_mma(x, q, scale, plan=plan_launch(2, 192, 256, 8))
    with pytest.raises(ValueError, match="not whole tiles of 128"):
        blockscale_linear_mma(x, q, scale, plan=replace(plan_mma(2, 192, 256, 8), block_n=128))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ValueError, match="interpreter"):
        blockscale_linear_mma(x, q, scale)


def test_the_op_leaves_the_mma_products_to_gpus_with_e4m3_conversions():
    """The experts op's dispatch: weights the mma product takes, but on the CPU, go to the other path."""
    from kernels.moe import scaled_gluon

    packed, scale = quantize_fp4_weight(weight(256, 256, seed=4))
    x = torch.randn(1, 256)
    experts, scales = packed.view(1, 256, 128), (scale.view(1, 256, 8),) * 3
    assert not scaled_gluon.takes(x, experts, experts, experts, scales)


def meta_fp8(n: int, k: int, scale_dtype: torch.dtype = torch.float8_e8m0fnu):
    """An FP8 weight [n, k] and its block scales, shapes and dtypes only (no memory)."""
    q = torch.empty(n, k, dtype=torch.float8_e4m3fn, device="meta")
    return q, torch.empty(-(-n // FP8_BLOCK), -(-k // FP8_BLOCK), dtype=scale_dtype, device="meta")


@pytest.mark.parametrize("rows,n,k,product", [
    (1, 1536, 4096, "gemv"),  # the fused x projection, 6 MiB
    (1, 4096, 2048, "gemv"),  # the shared w2, 8 MiB: the limit itself
    (1, 4096 + 64, 2048, "triton"),  # just over it
    (1, 4096, 8192, "triton"),  # wo_b, 32 MiB
    (1, 32768, 1024, "triton"),  # wq_b, 32 MiB
    (2, 1536, 4096, "triton"),  # small, but two rows
    (64, 1536, 4096, "triton"),
    (1, 200, 384, "gemv"),  # outputs in no tiles of 64: the GEMV takes them all the same
    (2, 200, 384, "triton"),
])
def test_the_op_picks_its_cuda_product(rows, n, k, product):
    """The op's CUDA dispatch (`cuda_product`, from shapes and dtypes): one row of at most 8 MiB of
    FP8 weights takes the GEMV, everything else the Triton kernel (the mma product measured
    slower at every row count); without the e4m3 conversions (before sm_89) always the Triton kernel. The
    benchmark's 'FP8 op runs' column names the candidate column of that product."""
    from kernels.bench.blockscale import candidates, op_product
    from kernels.blockscale.gemv import OP_MAX_WEIGHT_BYTES
    from kernels.blockscale.op import cuda_product

    assert OP_MAX_WEIGHT_BYTES == 8 * 2**20
    q, scale = meta_fp8(n, k)
    assert cuda_product(rows, q, scale, e4m3_gpu=True) == product
    assert cuda_product(rows, q, scale, e4m3_gpu=False) == "triton"
    assert op_product(rows, q, scale, True) in candidates(rows, n, k, 132)


def test_the_op_leaves_to_the_triton_kernel_what_the_gemv_does_not_take():
    """One row of a small weight, but FP4 codes or scales of neither ue8m0 nor fp32: not the GEMV.
    fp32 scales are its."""
    from kernels.blockscale.op import cuda_product

    q, scale = meta_fp8(1536, 4096, torch.float32)
    assert cuda_product(1, q, scale, e4m3_gpu=True) == "gemv"
    assert cuda_product(1, q, scale.bfloat16(), e4m3_gpu=True) == "triton"
    packed = torch.empty(1536, 2048, dtype=torch.uint8, device="meta")
    assert cuda_product(1, packed, torch.empty(1536, 128, device="meta"), e4m3_gpu=True) == "triton"


@pytest.mark.parametrize("rows", [1, 7, 16, 17, 64])
@pytest.mark.parametrize("n,k", V4_SHAPES)
def test_mma_plans_cover_the_product(rows, n, k):
    """plan_mma's tiles: the instruction's token tiles, column tiles the weight fills, every
    128-block of K in exactly one split, the pre-pass (and one block loaded ahead, not two) from
    more than 16 rows, and K split until
    two programs an SM of 132 (as far as whole blocks allow) or two blocks a split."""
    from kernels.blockscale.gluon import COLUMN_TILES, TOKEN_TILES, plan_mma

    plan = plan_mma(rows, n, k, 132)
    assert plan.product == "mma" and plan.block_m in TOKEN_TILES and plan.block_n in COLUMN_TILES
    assert n % plan.block_n == 0 and plan.block_m >= min(rows, TOKEN_TILES[-1])
    blocks = k // FP8_BLOCK
    assert (plan.split - 1) * plan.blocks_per_split < blocks <= plan.split * plan.blocks_per_split
    assert plan.x_quantized == (rows > 16) and plan.blocks_per_step == (2 if rows <= 16 else 1)
    tiles = (n // plan.block_n) * -(-rows // plan.block_m)
    assert plan.split == 1 or plan.blocks_per_split >= 2
    # Fewer blocks a split would exceed the programs wanted, or could not be that small.
    assert plan.blocks_per_split <= 2 or tiles * -(-blocks // (plan.blocks_per_split - 1)) >= 264


@pytest.mark.gpu
def test_gpu_inside_compile_and_a_cuda_graph():
    """torch.compile around the op, captured per batch bucket, replayed with fresh activations:
    the split plans (the fused x projection splits K at every bucket) keep their counters right
    from replay to replay, and a replay of the same inputs gives the same bits."""
    n, k = 1536, 4096
    _, q, scale = gpu_operands(1, n, k, seed=1)
    step = torch.compile(lambda x: blockscale_linear(x, q, scale) * 2, fullgraph=True)
    for bucket in (1, 16, 64):
        x = torch.zeros(bucket, k, dtype=torch.bfloat16, device="cuda")
        graph, out = capture(lambda: step(x))
        for seed in (1, 2):
            fresh = gpu_operands(bucket, n, k, seed=100 * bucket + seed)[0]
            x.copy_(fresh)
            graph.replay()
            first = out.clone()
            graph.replay()
            assert torch.equal(out, first), f"bucket {bucket}: replays differ"
            assert_op_matches_reference(out / 2, fresh, q, scale, True)


@pytest.mark.gpu
def test_gpu_opcheck():
    x, q, scale = gpu_operands(8, 256, 512, seed=4)
    checks = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")
    torch.library.opcheck(blockscale_linear_op, (x, q, scale, True), test_utils=checks)


@pytest.mark.parametrize("rows", [1, 9, 16, 17, 64])
@pytest.mark.parametrize("n,k", V4_SHAPES)
def test_e4m3_plans_cover_the_product_and_fill_the_sms(rows, n, k):
    """plan_launch with the e4m3 dot: that product, all rows in one tile, every 128-block of K in
    exactly one split, the pre-pass from more than 16 rows, 128 columns up to 16 rows, and every
    SM of 132 given a program where K has blocks enough. Without it, the fp16 dot and the same rows."""
    from kernels.blockscale.triton import MIN_BLOCKS_PER_SPLIT, plan_launch

    plan, fp16 = plan_launch(rows, n, k, 132, e4m3=True), plan_launch(rows, n, k, 132)
    assert (plan.product, fp16.product) == ("e4m3", "fp16") and plan.block_m == fp16.block_m >= rows
    blocks = k // FP8_BLOCK
    assert (plan.split - 1) * plan.blocks_per_split < blocks <= plan.split * plan.blocks_per_split
    assert plan.x_quantized == fp16.x_quantized == (rows > 16)
    assert rows > 16 or (plan.block_n, plan.num_warps) == (128, 8)
    tiles = -(-n // plan.block_n) * -(-rows // plan.block_m)
    assert tiles * plan.split >= 132 or plan.blocks_per_split <= MIN_BLOCKS_PER_SPLIT
