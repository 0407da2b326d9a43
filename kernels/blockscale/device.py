"""Triton device arithmetic of the block-scaled formats (semantics: kernels/blockscale/ref.py), shared
by the block-scaled linear (kernels/blockscale/triton.py) and the block-scaled experts
(kernels/moe/scaled.py).

- act_quant: a 128-block's scale is its amax floored at 1e-4, times fp32(1 / 448), rounded up to a
  power of two with `pow2` (`pow2_ceil`, from the bits); its values are divided by it, clamped to
  +-448 and rounded to the nearest e4m3 value, ties to even (`round_to_e4m3`). On a GPU that is
  the hardware's conversion (one instruction for two values); under the interpreter, which
  converts fp32 to e4m3 wrongly (no ties to even, no subnormals), it is arithmetic on the fp32
  bits. Exact e4m3 values convert exactly everywhere.
- e2m1 weights: `e2m1_pairs_to_fp16` places a code's bits into fp16 bits, which read as 2^-14 times
  its value (a few integer operations a code, no select); `weight_scale_to_fp32` folds the 2^14 back into
  the weight scale, applied in fp32 after the product. fp16 holds e4m3 and these values exactly
  and their products are exact in fp32, so a power-of-two factor in the scale changes no rounding.
- Weight scales: ue8m0 arrives as its byte (Triton has no e8m0 type), 2^(byte - 127): byte 0 is
  2^-127 (an fp32 subnormal), 255 NaN, as torch's float8_e8m0fnu.
"""
from __future__ import annotations

import triton
import triton.language as tl

from kernels.triton_util import interpreting

# Whether fp32 -> e4m3 conversions round as IEEE says (to nearest even, with subnormals): on a GPU.
HARDWARE_E4M3 = tl.constexpr(not interpreting())


@triton.jit
def pow2_ceil(s):
    """2 ** ceil(log2(s)) for positive normal fp32 s, from the bits (ref.pow2_ceil)."""
    bits = s.to(tl.int32, bitcast=True)
    exponent = (bits >> 23) & 0xFF
    has_mantissa = ((bits & 0x7FFFFF) != 0).to(tl.int32)
    return ((exponent + has_mantissa) << 23).to(tl.float32, bitcast=True)


@triton.jit
def act_scale(amax, POW2: tl.constexpr):
    """act_quant's scale of a block from its fp32 amax: fp32(1e-4) floor, times fp32(1 / 448)."""
    scale = tl.maximum(amax, 1e-4) * (1.0 / 448.0)
    if POW2:
        scale = pow2_ceil(scale)
    return scale


@triton.jit
def round_to_e4m3(v):
    """fp32 v in [-448, 448] -> the nearest e4m3 value (ties to even), still fp32.
    Exact: normals drop 20 mantissa bits by integer round-to-nearest-even on the bits (a carry moves
    the exponent up); below 2^-6 the fp32 ulp of 2^14 + |v| is 2^-9, e4m3's subnormal step, so one
    IEEE add rounds there (ties to even) and subtracting 2^14 back is exact. The sign is put back
    from its bit, so -0 and negatives rounding to zero stay -0. On a GPU: the hardware's
    conversion, which rounds the same way."""
    if HARDWARE_E4M3:
        return v.to(tl.float8e4nv).to(tl.float32)
    mag = tl.abs(v)
    bits = mag.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)
    subnormal = (mag + 16384.0) - 16384.0
    rounded = tl.where(mag < 0.015625, subnormal, normal)
    return tl.where(v.to(tl.int32, bitcast=True) < 0, -rounded, rounded)


@triton.jit
def divide_and_clamp(x, scale, POW2: tl.constexpr):
    """x / scale clamped to +-448 (fp32). A power-of-two scale divides exactly as a product with
    its inverse, 2^-e from the bits of 2^e (a normal power of two: act_scale's floor keeps it one);
    any other takes the IEEE division, as the reference's."""
    if POW2:
        y = x * (0x7F000000 - scale.to(tl.int32, bitcast=True)).to(tl.float32, bitcast=True)
    else:
        y = tl.math.div_rn(x, scale)
    return tl.minimum(tl.maximum(y, -448.0), 448.0)


@triton.jit
def quantize_e4m3(x, scale, POW2: tl.constexpr):
    """x / scale clamped to +-448 and rounded to e4m3 (fp32)."""
    return round_to_e4m3(divide_and_clamp(x, scale, POW2))


@triton.jit
def act_quant_rows(v, POW2: tl.constexpr):
    """v [R, 128] fp32, one activation block a row -> (e4m3 values [R, 128] as fp32, fp32 scales
    [R]): ref.act_quant bit for bit."""
    scale = act_scale(tl.max(tl.abs(v), axis=1), POW2)
    return quantize_e4m3(v, scale[:, None], POW2), scale


@triton.jit
def e2m1_pairs_to_fp16(packed):
    """[R, C] bytes of two e2m1 codes each -> (low codes, high codes), fp16 [R, C] each, 2^-14 times
    their values: a code's exponent bits (2) and mantissa bit moved to fp16 bits 11..9 and its sign
    to bit 15 make exponent field e and mantissa m/2, i.e. 2^(e-15) * (1 + m/2) = 2^-14 * 2^(e-1) *
    (1 + m/2) for e > 0 and the fp16 subnormal 2^-14 * m/2 for e = 0. Shifted and masked in place,
    two shifts, two masks and an or a code (uint16 shifts drop the other code's bits);
    `weight_scale_to_fp32` undoes the 2^-14."""
    b = packed.to(tl.uint16)
    low = ((b << 9) & 0x0E00) | ((b << 12) & 0x8000)
    high = ((b << 5) & 0x0E00) | ((b << 8) & 0x8000)
    return low.to(tl.float16, bitcast=True), high.to(tl.float16, bitcast=True)


@triton.jit
def unpack_e2m1(packed):
    """[R, C] bytes of two e2m1 codes each, low nibble first -> fp16 [R, 2C] (e2m1_pairs_to_fp16's)."""
    low, high = e2m1_pairs_to_fp16(packed)
    return tl.interleave(low, high)


@triton.jit
def weight_scale_to_fp32(s, E8M0: tl.constexpr, FP4: tl.constexpr):
    """Loaded weight scales as fp32: ue8m0 bytes are 2^(byte - 127), the fp32 with that exponent
    field (byte 0 is 2^-127, an fp32 subnormal; 255 is NaN); fp32 scales as they are. FP4 scales
    times 2^14, undoing e2m1_pairs_to_fp16's 2^-14 (exact for scales below 2^114)."""
    if E8M0:
        biased = s.to(tl.int32)
        bits = tl.where(biased == 0, 0x400000, tl.where(biased == 255, 0x7FC00000, biased << 23))
        scale = bits.to(tl.float32, bitcast=True)
    else:
        scale = s
    if FP4:
        scale = scale * 16384.0
    return scale
