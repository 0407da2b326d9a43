"""The register layouts of the Gluon products (kernels/blockscale/gluon.py for FP8 weights,
kernels/moe/scaled_gluon.py for FP4 experts) in isolation: one 128-input block of 128 weight rows
times 8 tokens' activations, loaded and converted into the tensor-core fragments by the products'
own helpers, against torch's product. Small integer values make every sum exact, so the results
must be equal; with one-hot activations a failure names the weight input each activation input
met, which is where a misplaced fragment slot shows."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402

from kernels.blockscale import gluon as fp8_mma  # noqa: E402
from kernels.blockscale.act_quant_pass import in_value_order  # noqa: E402
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
