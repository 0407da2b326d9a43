"""Rotary embeddings as real-valued rotations of interleaved pairs (complex tensors compile
poorly), with the YaRN frequency interpolation the compressed layers use."""
from __future__ import annotations

import math

import torch


def rope_frequencies(
    dim: int, theta: float, original_seq_len: int = 0, factor: float = 1.0, beta_fast: int = 32, beta_slow: int = 1
) -> torch.Tensor:
    """Angular frequency of each of the dim/2 pairs; YaRN blends in frequencies divided by
    `factor` below the correction range when original_seq_len > 0."""
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if original_seq_len > 0:

        def correction_dim(rotations: float) -> float:
            return dim * math.log(original_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low = max(math.floor(correction_dim(beta_fast)), 0)
        high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        keep = 1 - ramp
        freqs = freqs / factor * (1 - keep) + freqs * keep
    return freqs


def rope_table(max_seq_len: int, freqs: torch.Tensor) -> torch.Tensor:
    """[max_seq_len, dim/2, 2] table of (cos, sin) per position and pair."""
    angles = torch.outer(torch.arange(max_seq_len), freqs)
    return torch.stack([torch.cos(angles), torch.sin(angles)], dim=-1)


def apply_rope(x: torch.Tensor, cos_sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the last rope_dim = 2 * cos_sin.shape[-2] channels of x; cos_sin is [B, rope_dim/2, 2]
    and broadcasts over any dims between batch and channels. Math in fp32, result in x.dtype.
    Pair (a, b) becomes (a cos - b sin, a sin + b cos).

    Two forms with bitwise-equal results: eager rotates the tail and concatenates it (fewest
    kernels one op at a time); under torch.compile the rotation is written over all channels
    (cos 1, sin 0 outside the rope channels), which Inductor fuses with the norm before it into
    one kernel per row, where a concatenation would split it into separately written pieces."""
    if torch.compiler.is_compiling():
        return _rope_full_width(x, cos_sin, inverse)
    return _rope_tail(x, cos_sin, inverse)


def _rope_tail(x: torch.Tensor, cos_sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Eager form: rotate the rope channels only and concatenate them to the untouched head."""
    rope_dim = 2 * cos_sin.shape[-2]
    head, tail = x[..., :-rope_dim], x[..., -rope_dim:]
    pairs = tail.float().unflatten(-1, (-1, 2))
    # [B, rope_dim/2] -> [B, 1, ..., 1, rope_dim/2] to broadcast over head dims
    shape = (cos_sin.shape[0],) + (1,) * (x.dim() - 2) + (-1,)
    cos, sin = cos_sin[..., 0].reshape(shape), cos_sin[..., 1].reshape(shape)
    if inverse:
        sin = -sin
    real, imag = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack([real * cos - imag * sin, real * sin + imag * cos], dim=-1).flatten(-2)
    return torch.cat([head, rotated.to(x.dtype)], dim=-1)


def _rope_full_width(x: torch.Tensor, cos_sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Compiled form: every channel is x * cos + partner * sin, partner = its pair's other channel."""
    width, rope_dim = x.shape[-1], 2 * cos_sin.shape[-2]
    channel = torch.arange(width, device=x.device)
    rope = channel >= width - rope_dim
    pair = ((channel - (width - rope_dim)) // 2).clamp(min=0)
    # [B, width] -> [B, 1, ..., 1, width] to broadcast over head dims
    shape = (cos_sin.shape[0],) + (1,) * (x.dim() - 2) + (width,)
    cos = torch.where(rope, cos_sin[:, pair, 0], 1.0).reshape(shape)
    sin = torch.where(rope, cos_sin[:, pair, 1], 0.0)
    # Channel 2i takes -sin times its partner 2i+1; channel 2i+1 takes +sin times 2i.
    sin = torch.where(channel % 2 == 0, -sin, sin).reshape(shape)
    if inverse:
        sin = -sin
    x32 = x.float()
    partner = x32.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    return (x32 * cos + partner * sin).to(x.dtype)
