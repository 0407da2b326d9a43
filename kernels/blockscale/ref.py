"""Block-scaled FP8 and FP4 weights and the official `linear()` on them, in plain torch.

Formats, as the official V4 checkpoints store them:
- FP8 weight: e4m3 [out, in] with one scale per 128 x 128 block, [ceil(out/128), ceil(in/128)].
- FP4 weight: e2m1 codes packed two per byte, low nibble first, [out, in/2] (held as uint8;
  `torch.float4_e2m1fn_x2` in state dicts), with one scale per 32 inputs, [out, in/32].
- Scales: ue8m0 (powers of two, `torch.float8_e8m0fnu`) or fp32.

The official `linear(x, W)` for such a W first quantises the activations (`act_quant`: e4m3 with
one scale per 128 values along the last dim, a power of two when the scale format is ue8m0),
then sums the block-scaled products in fp32 and returns the activation dtype. `blockscale_linear`
is that product on dequantised operands: products of e4m3 and e2m1 values are exact in fp32, so
it differs from a block-by-block kernel by summation order only."""
from __future__ import annotations

import torch

FP8_BLOCK = 128  # weight blocks are 128 x 128; activations 1 x 128
FP4_BLOCK = 32
FP8_MAX = 448.0
FP4_MAX = 6.0
# e2m1 magnitudes by 3-bit code (exponent 2 bits, mantissa 1 bit); bit 3 is the sign.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
SCALE_DTYPES = (torch.float8_e8m0fnu, torch.float32)


def pow2_ceil(x: torch.Tensor) -> torch.Tensor:
    """2 ** ceil(log2(x)) for positive normal fp32 x, exact (from the IEEE-754 bits)."""
    bits = x.float().view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    has_mantissa = (bits & 0x7FFFFF) != 0
    return ((exponent + has_mantissa.to(torch.int32)) << 23).view(torch.float32)


def _scale(amax: torch.Tensor, qmax: float, pow2: bool) -> torch.Tensor:
    return pow2_ceil(amax * (1.0 / qmax)) if pow2 else amax * (1.0 / qmax)


def scale_to_float(scale: torch.Tensor) -> torch.Tensor:
    return scale.float()  # e8m0 holds powers of two, exactly representable in fp32


def act_quant(x: torch.Tensor, pow2: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations [..., K] (K a multiple of 128) -> (e4m3 values [..., K], fp32 scales
    [..., K/128]): the official act_quant, amax floored at 1e-4."""
    k = x.shape[-1]
    if k % FP8_BLOCK:
        raise ValueError(f"act_quant: the last dim must be a multiple of {FP8_BLOCK}, got {k}")
    blocks = x.float().unflatten(-1, (k // FP8_BLOCK, FP8_BLOCK))
    scale = _scale(blocks.abs().amax(-1, keepdim=True).clamp(min=1e-4), FP8_MAX, pow2)
    values = (blocks / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return values.flatten(-2), scale.squeeze(-1)


def act_quant_dequant(x: torch.Tensor, pow2: bool = True) -> torch.Tensor:
    """act_quant, then back to fp32: the activations the block-scaled product sees."""
    values, scale = act_quant(x, pow2)
    return (values.float().unflatten(-1, (scale.shape[-1], FP8_BLOCK)) * scale[..., None]).flatten(-2)


def quantize_fp8_weight(w: torch.Tensor, scale_dtype: torch.dtype = torch.float8_e8m0fnu) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., out, in] -> (e4m3 [..., out, in], scales [..., ceil(out/128), ceil(in/128)]): one
    power-of-two scale per 128 x 128 block (amax / 448 rounded up), edge blocks partial."""
    *lead, out, inp = w.shape
    rows, cols = -(-out // FP8_BLOCK), -(-inp // FP8_BLOCK)
    padded = w.float().new_zeros(*lead, rows * FP8_BLOCK, cols * FP8_BLOCK)
    padded[..., :out, :inp] = w.float()
    blocks = padded.view(*lead, rows, FP8_BLOCK, cols, FP8_BLOCK)
    scale = pow2_ceil(blocks.abs().amax((-3, -1)).clamp(min=1e-4) / FP8_MAX)  # [..., rows, cols]
    values = (blocks / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).view_as(padded)[..., :out, :inp]
    return values.to(torch.float8_e4m3fn), scale.to(scale_dtype)


def dequantize_fp8_weight(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """[..., out, in] e4m3 with [..., ceil(out/128), ceil(in/128)] scales -> fp32."""
    out, inp = w.shape[-2:]
    s = scale_to_float(scale).repeat_interleave(FP8_BLOCK, -2)[..., :out, :].repeat_interleave(FP8_BLOCK, -1)[..., :inp]
    return w.float() * s


def round_to_e2m1(y: torch.Tensor) -> torch.Tensor:
    """Values in [-6, 6] to the e2m1 grid, ties to even (the grid steps are 0.5 below 2, 1
    below 4 and 2 above, so y / step rounded half-to-even lands on the grid)."""
    mag = y.abs()
    step = torch.where(mag < 2, 0.5, torch.where(mag < 4, 1.0, 2.0))
    return torch.sign(y) * torch.round(mag / step) * step


def _e2m1_codes(values: torch.Tensor) -> torch.Tensor:
    """Grid values -> 4-bit codes (sign in bit 3). The grid (0, .5, 1, 1.5, 2, 3, 4, 6) is
    2*m below 2, m + 2 below 4 and m/2 + 4 above: codes by arithmetic, no per-value table."""
    mag = values.abs()
    code = torch.where(mag < 2, mag * 2, torch.where(mag < 4, mag + 2, mag / 2 + 4)).to(torch.uint8)
    return code | ((values < 0).to(torch.uint8) << 3)


def quantize_fp4_weight(w: torch.Tensor, scale_dtype: torch.dtype = torch.float8_e8m0fnu) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., out, in] (in a multiple of 32) -> (packed codes uint8 [..., out, in/2], scales
    [..., out, in/32]): one power-of-two scale per 32 inputs (amax / 6 rounded up)."""
    inp = w.shape[-1]
    if inp % FP4_BLOCK:
        raise ValueError(f"fp4 weights need the input dim to be a multiple of {FP4_BLOCK}, got {inp}")
    blocks = w.float().unflatten(-1, (inp // FP4_BLOCK, FP4_BLOCK))
    scale = pow2_ceil(blocks.abs().amax(-1, keepdim=True).clamp(min=FP4_MAX * 2.0**-126) / FP4_MAX)
    codes = _e2m1_codes(round_to_e2m1((blocks / scale).clamp(-FP4_MAX, FP4_MAX))).flatten(-2)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), scale.squeeze(-1).to(scale_dtype)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """[..., in/2] bytes of two e2m1 codes (low nibble first) -> [..., in] fp32 grid values."""
    codes = packed.view(torch.uint8)
    codes = torch.stack([codes & 0xF, codes >> 4], dim=-1).flatten(-2).long()
    magnitude = torch.tensor(E2M1_VALUES, device=packed.device)[codes & 0x7]
    return torch.where(codes >= 8, -magnitude, magnitude)


def dequantize_fp4_weight(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return unpack_fp4(packed) * scale_to_float(scale).repeat_interleave(FP4_BLOCK, -1)


def dequantize_weight(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Either format, by the weight's dtype (e4m3: FP8; uint8: packed FP4), as fp32."""
    if weight.dtype == torch.float8_e4m3fn:
        return dequantize_fp8_weight(weight, scale)
    return dequantize_fp4_weight(weight, scale)


def check_blockscale_inputs(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> None:
    """Raise ValueError naming what does not fit (shapes and dtypes only: no host sync)."""
    if weight.dtype == torch.float8_e4m3fn:
        out, inp = weight.shape
        expected = (-(-out // FP8_BLOCK), -(-inp // FP8_BLOCK))
    elif weight.dtype == torch.uint8:
        out, inp = weight.shape[0], 2 * weight.shape[1]
        expected = (out, inp // FP4_BLOCK)
    else:
        raise ValueError(f"blockscale_linear: weight must be float8_e4m3fn or uint8 (packed fp4), got {weight.dtype}")
    if x.shape[-1] != inp:
        raise ValueError(f"blockscale_linear: x has {x.shape[-1]} inputs, the weight {inp}")
    if inp % FP8_BLOCK:
        raise ValueError(f"blockscale_linear: inputs must be a multiple of {FP8_BLOCK} (activation blocks), got {inp}")
    if tuple(scale.shape) != expected or scale.dtype not in SCALE_DTYPES:
        raise ValueError(f"blockscale_linear: scale must be {list(expected)} in {SCALE_DTYPES}, got {list(scale.shape)} {scale.dtype}")


def blockscale_linear_reference(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, pow2: bool = True) -> torch.Tensor:
    """The official linear() on a block-scaled weight: act_quant(x), then the product of the
    dequantised operands in fp32, returned in x's dtype. x [..., in]; weight and scale as in
    the module docstring."""
    y = act_quant_dequant(x, pow2) @ dequantize_weight(weight, scale).t()
    return y.to(x.dtype)
