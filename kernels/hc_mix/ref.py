"""The mHC boundary between two sublayers as one op: write the finished sublayer's output back into
the hc residual copies (hc_post), mix the copies into the next sublayer's input (hc_pre: the
normalised mixes GEMV, split + Sinkhorn, the pre-weighted sum) and apply that sublayer's RMSNorm.

    new copy j   = post_j * out + sum_i comb[i, j] * copy_i                  (fp32, stored in the copies' dtype)
    mixes        = (flat copies @ fn^T) * rsqrt(mean(flat copies^2) + hc_norm_eps)
    pre, post', comb' = hc_split_sinkhorn(mixes, scale, base, hc, iters, hc_eps)
    x            = sum_h pre_h * copy_h                                      (rounded to the copies' dtype)
    normed x     = norm_weight * x * rsqrt(mean(x^2) + norm_eps)             (in the copies' dtype)

The plain-torch references of both ops (`hc_post_reference` is also the model's hc_post), the
input checks, and the shapes the Triton kernels take.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.hc_sinkhorn.ref import hc_split_sinkhorn_reference

# The Triton path's Sinkhorn is written out for the model's hc; its first kernel takes the
# flattened copies in slices of SLICE values.
KERNEL_HC = 4
SLICE = 256


def hc_post_reference(out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """The write-back: new copy j = post_j * out + sum_i comb[i, j] * copy_i (fp32 math, the
    copies' dtype as result); also the model's hc_post."""
    mixed = torch.einsum("bij,bid->bjd", comb, streams.float())
    return (post.unsqueeze(-1) * out.float().unsqueeze(1) + mixed).to(streams.dtype)


def hc_pre_norm_reference(
    streams: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, norm_weight: torch.Tensor,
    iters: int, hc_eps: float, hc_norm_eps: float, norm_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """streams [B, hc, D] -> (normed sublayer input [B, D] in the streams' dtype, post [B, hc], comb [B, hc, hc])."""
    hc = streams.shape[1]
    flat = streams.flatten(1).float()
    inv_rms = torch.rsqrt(flat.square().mean(-1, keepdim=True) + hc_norm_eps)
    mixes = F.linear(flat.to(fn.dtype), fn).float() * inv_rms
    pre, post, comb = hc_split_sinkhorn_reference(mixes, scale, base, hc, iters, hc_eps)
    x = (pre.unsqueeze(-1) * flat.view(streams.shape)).sum(1).to(streams.dtype).float()
    x = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + norm_eps)
    return (norm_weight * x).to(streams.dtype), post, comb


def hc_post_pre_norm_reference(
    out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
    fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, norm_weight: torch.Tensor,
    iters: int, hc_eps: float, hc_norm_eps: float, norm_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (new streams [B, hc, D], normed next sublayer input [B, D], its post [B, hc], its comb [B, hc, hc])."""
    new = hc_post_reference(out, streams, post, comb)
    return (new, *hc_pre_norm_reference(new, fn, scale, base, norm_weight, iters, hc_eps, hc_norm_eps, norm_eps))


def check_hc_mix_inputs(streams, fn, scale, base, norm_weight, iters: int, out=None, post=None, comb=None) -> None:
    """Raise ValueError naming the first argument whose shape, dtype or device does not fit (no host sync)."""
    if iters < 1:
        raise ValueError(f"hc_mix: iters must be >= 1, got {iters}")
    if streams.dim() != 3:
        raise ValueError(f"hc_mix: streams must be [B, hc, D], got shape {tuple(streams.shape)}")
    batch, hc, dim = streams.shape
    width = (2 + hc) * hc
    expected = {"fn": (width, hc * dim), "scale": (3,), "base": (width,), "norm_weight": (dim,)}
    if out is not None:
        expected |= {"out": (batch, dim), "post": (batch, hc), "comb": (batch, hc, hc)}
    given = {"fn": fn, "scale": scale, "base": base, "norm_weight": norm_weight, "out": out, "post": post, "comb": comb}
    for name, shape in expected.items():
        if tuple(given[name].shape) != shape:
            raise ValueError(f"hc_mix: {name} must have shape {shape} for streams of shape {tuple(streams.shape)}, got {tuple(given[name].shape)}")
        if given[name].device != streams.device:
            raise ValueError(f"hc_mix: {name} is on {given[name].device}, streams on {streams.device}")
    for name in ("scale", "base", "norm_weight", "post", "comb"):
        if name in expected and given[name].dtype != torch.float32:
            raise ValueError(f"hc_mix: {name} must be float32, got {given[name].dtype}")
    if out is not None and out.dtype != streams.dtype:
        raise ValueError(f"hc_mix: out and streams must have one dtype, got {out.dtype} and {streams.dtype}")


def tiles(dim: int) -> bool:
    """Whether copies of width `dim` split into whole slices, a power of two of them (so `dim`
    itself is a power of two)."""
    slices = KERNEL_HC * dim // SLICE
    return dim % SLICE == 0 and slices & (slices - 1) == 0
