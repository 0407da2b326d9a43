"""Block-scaled FP8 / FP4 weights and the official linear() on them (kernels/blockscale/), against
brute-force versions written here and in tests/v4_reference.py, on fresh random inputs."""
from __future__ import annotations

import pytest
import torch

from kernels.blockscale import (
    FP4_BLOCK, FP8_BLOCK, act_quant, act_quant_dequant, blockscale_linear, blockscale_linear_op, dequantize_fp4_weight,
    dequantize_fp8_weight, quantize_fp4_weight, quantize_fp8_weight, unpack_fp4,
)
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
        blockscale_linear(x, w, scale, impl="triton")


def test_the_custom_op_is_well_formed():
    """Fake implementation, autograd registration and AOT dispatch (opcheck's schema test cannot
    handle fp8 arguments: it multiplies them)."""
    checks = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")
    w, scale = quantize_fp8_weight(weight(128, 256, seed=2))
    torch.library.opcheck(blockscale_linear_op, (torch.randn(3, 256), w, scale, True), test_utils=checks)
    packed, scale4 = quantize_fp4_weight(weight(64, 256, seed=4))
    torch.library.opcheck(blockscale_linear_op, (torch.randn(2, 256), packed, scale4, True), test_utils=checks)
