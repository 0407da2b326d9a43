"""Quantise-dequantise simulation of the official FP8 KV cache and FP4 indexer, and the
Hadamard rotation the indexer applies first. Math in fp32, result in the input dtype."""
from __future__ import annotations

import torch

FP8_MAX = 448.0
FP4_MAX = 6.0


def _pow2_ceil(x: torch.Tensor) -> torch.Tensor:
    """2 ** ceil(log2(x)) for positive normal fp32 x, exact, via the IEEE-754 bit layout
    (a log2/ceil round trip can be off by one for values just above a power of two)."""
    bits = x.float().view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    has_mantissa = (bits & 0x7FFFFF) != 0
    return ((exponent + has_mantissa.to(torch.int32)) << 23).view(torch.float32)


def _block_scale(x: torch.Tensor, block: int, qmax: float, amax_floor: float, pow2: bool):
    blocks = x.float().unflatten(-1, (x.shape[-1] // block, block))
    amax = blocks.abs().amax(-1, keepdim=True).clamp(min=amax_floor)
    scale = _pow2_ceil(amax * (1.0 / qmax)) if pow2 else amax * (1.0 / qmax)
    return blocks, scale


def fp8_qdq(x: torch.Tensor, block: int = 64, pow2_scale: bool = True) -> torch.Tensor:
    """Round x to e4m3 with one scale per `block` values along the last dim, and back."""
    blocks, scale = _block_scale(x, block, FP8_MAX, 1e-4, pow2_scale)
    q = (blocks / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return (q.float() * scale).flatten(-2).to(x.dtype)


def round_to_e2m1(y: torch.Tensor) -> torch.Tensor:
    """Round values in [-6, 6] to the e2m1 grid {0, .5, 1, 1.5, 2, 3, 4, 6}, ties to even.
    The grid spacing is 0.5 below 2, 1 below 4 and 2 above, so rounding y/step half-to-even
    and scaling back lands on the grid with the right tie behaviour."""
    mag = y.abs()
    step = torch.where(mag < 2, 0.5, torch.where(mag < 4, 1.0, 2.0))
    return torch.sign(y) * torch.round(mag / step) * step


def fp4_qdq(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """Round x to e2m1 with one power-of-two scale per `block` values, and back."""
    blocks, scale = _block_scale(x, block, FP4_MAX, FP4_MAX * 2.0**-126, True)
    q = round_to_e2m1((blocks / scale).clamp(-FP4_MAX, FP4_MAX))
    return (q * scale).flatten(-2).to(x.dtype)


def hadamard_matrix(n: int, device=None) -> torch.Tensor:
    """Sylvester-ordered Hadamard matrix of size n (a power of two), scaled to be orthogonal."""
    h = torch.ones(1, 1, dtype=torch.float32, device=device)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h * n**-0.5


def hadamard_rotate(x: torch.Tensor, hadamard: torch.Tensor) -> torch.Tensor:
    return (x.float() @ hadamard).to(x.dtype)
