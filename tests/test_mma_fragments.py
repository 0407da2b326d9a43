"""The register layouts of the Gluon products (kernels/blockscale/gluon.py for FP8 weights,
kernels/moe/scaled_gluon.py for FP4 experts, on mma.sync and on Hopper's warpgroup instruction)
in isolation: one 128-input block of 128 (warpgroup: 64) weight rows times 8 tokens' activations,
loaded and converted into the tensor-core operands by the products' own helpers, against torch's
product. Small integer values make every sum exact, so the results
must be equal; with one-hot activations a failure names the weight input each activation input
met, which is where a misplaced fragment slot shows."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared  # noqa: E402

from kernels.blockscale import gluon as fp8_mma  # noqa: E402
from kernels.blockscale.act_quant_pass import in_value_order  # noqa: E402
from kernels.gluon_compat import barrier  # noqa: E402
from kernels.moe import scaled_gluon as fp4_mma  # noqa: E402

ROWS, INPUTS, TOKENS = 128, 128, 8
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


@gluon.jit
def _fp8_block_probe(codes_ptr, values_ptr, out_ptr):
    CODES: gl.constexpr = fp8_mma.codes_layout(128)
    VALUES: gl.constexpr = fp8_mma.values_layout(8)
    MMA: gl.constexpr = fp8_mma.mma_layout()
    rows = gl.arange(0, 128, layout=gl.SliceLayout(1, CODES))
    inputs = gl.arange(0, 128, layout=gl.SliceLayout(0, CODES))
    codes = gl.load(codes_ptr + rows[:, None] * 128 + inputs[None, :])
    value_inputs = gl.arange(0, 128, layout=gl.SliceLayout(1, VALUES))
    tokens = gl.arange(0, 8, layout=gl.SliceLayout(0, VALUES))
    values = gl.load(values_ptr + tokens[None, :] * 128 + value_inputs[:, None])
    acc = fp8_mma._fp8_block_product(codes.to(gl.float16), values.to(gl.float16), 128, 8)
    out_rows = gl.arange(0, 128, layout=gl.SliceLayout(1, MMA))
    out_tokens = gl.arange(0, 8, layout=gl.SliceLayout(0, MMA))
    gl.store(out_ptr + out_rows[:, None] * 8 + out_tokens[None, :], acc)


@gluon.jit
def _fp4_block_probe(packed_ptr, scale_ptr, values_ptr, out_ptr):
    CODES: gl.constexpr = fp4_mma.codes_layout(128)
    VALUES: gl.constexpr = fp4_mma.values_layout(8)
    MMA: gl.constexpr = fp4_mma.mma_layout()
    rows = gl.arange(0, 128, layout=gl.SliceLayout(1, CODES))
    offs = gl.arange(0, 64, layout=gl.SliceLayout(0, CODES))
    packed = gl.load(packed_ptr + rows[:, None] * 64 + offs[None, :])
    value_inputs = gl.arange(0, 128, layout=gl.SliceLayout(1, VALUES))
    tokens = gl.arange(0, 8, layout=gl.SliceLayout(0, VALUES))
    values = gl.load(values_ptr + tokens[None, :] * 128 + value_inputs[:, None])
    v0, v1, v2, v3 = fp4_mma._value_groups(values, 8, MMA)  # fp16 in fragment order
    SCALES: gl.constexpr = fp4_mma.scales_layout(128)
    scale_groups = gl.arange(0, 4, layout=gl.SliceLayout(0, SCALES))
    scales = gl.load(scale_ptr + gl.arange(0, 128, layout=gl.SliceLayout(1, SCALES))[:, None] * 4 + scale_groups[None, :])
    acc = fp4_mma._block_product(packed, v0, v1, v2, v3, scales, True, 128, 8) * fp4_mma.CODES_UNSCALE
    scale_rows = gl.arange(0, 128, layout=gl.SliceLayout(1, MMA))
    out_tokens = gl.arange(0, 8, layout=gl.SliceLayout(0, MMA))
    gl.store(out_ptr + scale_rows[:, None] * 8 + out_tokens[None, :], acc)


def fp8_block(codes: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """codes [128, 128] and values [8, 128] (e4m3) -> the probe's [128, 8] fp32."""
    out = torch.empty(ROWS, TOKENS, dtype=torch.float32, device="cuda")
    _fp8_block_probe[(1,)](codes, values, out, num_warps=fp8_mma.WARPS)
    return out


def fp4_block(packed: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """packed [128, 64] e2m1 codes (low nibble first, every scale 1) and values [8, 128] (e4m3)
    -> the probe's [128, 8] fp32."""
    out = torch.empty(ROWS, TOKENS, dtype=torch.float32, device="cuda")
    ones = torch.full((ROWS, INPUTS // 32), 127, dtype=torch.uint8, device="cuda")  # ue8m0 127 = 1.0
    _fp4_block_probe[(1,)](packed, ones, in_value_order(values.float(), "mma"), out, num_warps=fp4_mma.WARPS)
    return out


@gluon.jit
def _fp4_wgmma_block_probe(packed_ptr, scale_ptr, values_ptr, out_ptr):
    CODES: gl.constexpr = fp4_mma.codes_layout(64)
    MMA: gl.constexpr = fp4_mma.mma_layout(True)
    rows = gl.arange(0, 64, layout=gl.SliceLayout(1, CODES))
    offs = gl.arange(0, 64, layout=gl.SliceLayout(0, CODES))
    packed = gl.load(packed_ptr + rows[:, None] * 64 + offs[None, :])
    # The block's activations (e4m3 in "wgmma" order, [8 tokens, 128]) as the product's copies
    # leave them in shared memory: row 8g + token holds the token's 32 inputs of group g.
    TILES: gl.constexpr = gl.BlockedLayout([1, 16], [16, 2], [4, 1], [1, 0])
    tile_rows = gl.arange(0, 32, layout=gl.SliceLayout(1, TILES))
    tile_cols = gl.arange(0, 32, layout=gl.SliceLayout(0, TILES))
    values = gl.load(values_ptr + ((tile_rows % 8) * 128 + (tile_rows // 8) * 32)[:, None] + tile_cols[None, :])
    TILE_SMEM: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=32, element_bitwidth=8, rank=2)
    values_smem = gl.allocate_shared_memory(gl.float8e4nv, [32, 32], TILE_SMEM, values)
    fence_async_shared()
    barrier()
    SCALES: gl.constexpr = fp4_mma.scales_layout(64)
    scale_groups = gl.arange(0, 4, layout=gl.SliceLayout(0, SCALES))
    scales = gl.load(scale_ptr + gl.arange(0, 64, layout=gl.SliceLayout(1, SCALES))[:, None] * 4 + scale_groups[None, :])
    acc = fp4_mma._wgmma_block_product(packed, values_smem, 0, scales, True, 64, 8) * fp4_mma.E4M3_CODES_UNSCALE
    out_rows = gl.arange(0, 64, layout=gl.SliceLayout(1, MMA))
    out_tokens = gl.arange(0, 8, layout=gl.SliceLayout(0, MMA))
    gl.store(out_ptr + out_rows[:, None] * 8 + out_tokens[None, :], acc)


def fp4_wgmma_block(packed: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """fp4_block's probe for the warpgroup instruction, 64 weight rows: packed [64, 64], values
    [8, 128] (e4m3) -> [64, 8] fp32."""
    out = torch.empty(64, TOKENS, dtype=torch.float32, device="cuda")
    ones = torch.full((64, INPUTS // 32), 127, dtype=torch.uint8, device="cuda")
    _fp4_wgmma_block_probe[(1,)](packed, ones, in_value_order(values.float(), "wgmma"), out, num_warps=fp4_mma.WARPS)
    return out


def small_integers(shape, low: int, high: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, high + 1, shape, generator=g).float()


def met_inputs(block, weight: torch.Tensor) -> list[tuple[int, int]]:
    """(activation input, weight input it met) where they differ, from one-hot activations:
    weight row r holds 1.0 at input r only, so the row that answers names the input met."""
    misplaced = []
    for j in range(INPUTS):
        values = torch.zeros(TOKENS, INPUTS)
        values[0, j] = 1.0
        rows = block(weight, values.to(torch.float8_e4m3fn).cuda())[:, 0].nonzero().flatten().tolist()
        if rows != [j]:
            misplaced.append((j, rows))
    return misplaced


@pytest.mark.gpu
def test_fp8_fragments_multiply_each_input_with_its_own():
    codes = small_integers((ROWS, INPUTS), -8, 8, seed=1)
    values = small_integers((TOKENS, INPUTS), -8, 8, seed=2)
    out = fp8_block(codes.to(torch.float8_e4m3fn).cuda(), values.to(torch.float8_e4m3fn).cuda())
    if not torch.equal(out.cpu(), codes @ values.t()):
        identity = torch.eye(ROWS, INPUTS).to(torch.float8_e4m3fn).cuda()
        pytest.fail(f"activation input -> weight inputs met: {met_inputs(fp8_block, identity)[:8]}")


@pytest.mark.gpu
def test_fp4_fragments_decode_and_multiply_each_input_with_its_own():
    g = torch.Generator().manual_seed(3)
    nibbles = torch.randint(0, 16, (ROWS, INPUTS), generator=g, dtype=torch.uint8)
    packed = (nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)).cuda()
    values = small_integers((TOKENS, INPUTS), -8, 8, seed=4)
    out = fp4_block(packed, values.to(torch.float8_e4m3fn).cuda())
    if not torch.equal(out.cpu(), E2M1[nibbles.long()] @ values.t()):
        ones = torch.eye(ROWS, INPUTS, dtype=torch.uint8) * 2  # code 2 is 1.0
        identity = (ones[:, 0::2] | (ones[:, 1::2] << 4)).cuda()
        pytest.fail(f"activation input -> weight inputs met: {met_inputs(fp4_block, identity)[:8]}")


@pytest.mark.gpu
def test_fp4_wgmma_operands_decode_and_multiply_each_input_with_its_own():
    if not fp4_mma.runs_wgmma(torch.device("cuda")):
        pytest.skip("the warpgroup instruction is Hopper's (compute capability 9.x)")
    g = torch.Generator().manual_seed(5)
    nibbles = torch.randint(0, 16, (64, INPUTS), generator=g, dtype=torch.uint8)
    packed = (nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)).cuda()
    values = small_integers((TOKENS, INPUTS), -8, 8, seed=6)
    out = fp4_wgmma_block(packed, values.to(torch.float8_e4m3fn).cuda()).cpu()
    expected = E2M1[nibbles.long()] @ values.t()
    if not torch.equal(out, expected):
        wrong = (out != expected).nonzero()[:8].tolist()
        pytest.fail(f"(row, token) that differ: {wrong}; first: got {out[tuple(wrong[0])]}, expected {expected[tuple(wrong[0])]}")
