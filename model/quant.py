"""Quantise-dequantise simulation of the official FP8 KV cache and FP4 indexer, and the
Hadamard rotation the indexer applies first. Math in fp32, result in the input dtype."""
from __future__ import annotations

import torch

from kernels.blockscale.ref import FP4_MAX, FP8_MAX, pow2_ceil, round_to_e2m1


def _block_amax_per_value(magnitude: torch.Tensor, block: int, blocks: int) -> torch.Tensor:
    """Largest magnitude of each value's block along the last dim, for the first `blocks` blocks
    (0 beyond them), as one masked reduction over the whole row per block."""
    block_of = torch.arange(magnitude.shape[-1], device=magnitude.device) // block
    amax = torch.zeros_like(magnitude)
    for i in range(blocks):
        in_block = block_of == i
        amax = torch.where(in_block, magnitude.masked_fill(~in_block, 0.0).amax(-1, keepdim=True), amax)
    return amax


def _block_qdq(x: torch.Tensor, block: int, qmax: float, amax_floor: float, pow2: bool, round_fn, keep_last: int, rowwise: bool):
    """Quantise-dequantise all but the last `keep_last` values of each row in blocks of `block`
    with one scale per block (amax / qmax, or its power-of-two ceiling); the kept tail passes
    through. `round_fn` maps x / scale, clamped to [-qmax, qmax], to the format's grid.

    Two forms with bitwise-equal results (max is exact). Blocked (eager): the block amax is a
    reduction over an unflattened [..., blocks, block] view. Row-wise (compiled): one masked
    reduction over the whole row per block, the same shape as the row's other reductions (the
    norm before it), so Inductor makes norm, scales, rounding and the cache write one kernel; a
    block-shaped reduction would be a kernel of its own."""
    width = x.shape[-1]
    quantised = width - keep_last
    x32 = x.float()
    if rowwise:
        values, amax = x32, _block_amax_per_value(x32.abs(), block, quantised // block)
    else:
        values = x32[..., :quantised].unflatten(-1, (quantised // block, block))
        amax = values.abs().amax(-1, keepdim=True)
    amax = amax.clamp(min=amax_floor)
    scale = pow2_ceil(amax * (1.0 / qmax)) if pow2 else amax * (1.0 / qmax)
    y = round_fn((values / scale).clamp(-qmax, qmax)) * scale
    if rowwise:
        return torch.where(torch.arange(width, device=x.device) < quantised, y, x32).to(x.dtype)
    y = y.flatten(-2).to(x.dtype)
    return torch.cat([y, x[..., quantised:]], dim=-1) if keep_last else y


def _rowwise(x: torch.Tensor) -> bool:
    """The row-wise form where it pays: compiled for CUDA. Inductor's C++ backend gains nothing
    from it, and in torch 2.13 miscompiled its pass-through tail in whole-step CPU graphs."""
    return torch.compiler.is_compiling() and x.is_cuda


def _to_e4m3(y: torch.Tensor) -> torch.Tensor:
    return y.to(torch.float8_e4m3fn).float()


def fp8_qdq(x: torch.Tensor, block: int = 64, pow2_scale: bool = True, keep_last: int = 0) -> torch.Tensor:
    """Round x to e4m3 with one scale per `block` values along the last dim, and back; the last
    `keep_last` values of each row (the KV cache's rope channels) stay as they are."""
    return _block_qdq(x, block, FP8_MAX, 1e-4, pow2_scale, _to_e4m3, keep_last, _rowwise(x))


def fp4_qdq(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """Round x to e2m1 with one power-of-two scale per `block` values, and back."""
    return _block_qdq(x, block, FP4_MAX, FP4_MAX * 2.0**-126, True, round_to_e2m1, 0, _rowwise(x))


def hadamard_matrix(n: int, device=None) -> torch.Tensor:
    """Sylvester-ordered Hadamard matrix of size n (a power of two), scaled to be orthogonal."""
    h = torch.ones(1, 1, dtype=torch.float32, device=device)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h * n**-0.5


def hadamard_rotate(x: torch.Tensor, hadamard: torch.Tensor) -> torch.Tensor:
    return (x.float() @ hadamard).to(x.dtype)
