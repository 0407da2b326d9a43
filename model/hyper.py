"""Manifold-constrained hyper-connections (mHC): the residual stream is kept as hc_mult copies;
each sublayer reads a weighted sum of them and writes back through a doubly-stochastic mix.
The parameters live on the owning module under their official names; these are the functions."""
from __future__ import annotations

import torch

import kernels
from kernels.hc_mix import hc_post_reference as hc_post  # the write-back, as the boundary op's reference states it
from kernels.hc_mix import takes_kernel as boundary_takes_kernel
from model.layers import RMSNorm, fp32_linear


def normalized_mixes(streams: torch.Tensor, fn: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """streams [B, hc, D] -> (streams as fp32 [B, hc*D], mixes [B, rows of fn]): a GEMV in fn's
    dtype (fp32 as the official code, unless ModelConfig.fp32_products is "fast") scaled by the
    inverse RMS of the flattened streams."""
    flat = streams.flatten(1).float()
    inv_rms = torch.rsqrt(flat.square().mean(-1, keepdim=True) + eps)
    return flat, fp32_linear(flat, fn) * inv_rms


def hc_pre(streams, fn, scale, base, sinkhorn_iters: int, hc_eps: float, norm_eps: float):
    """streams [B, hc, D] -> (sublayer input [B, D] in the stream dtype, post [B, hc], comb [B, hc, hc])."""
    hc = streams.shape[1]
    flat, mixes = normalized_mixes(streams, fn, norm_eps)
    # CUDA: one fused kernel (Inductor's Triton backend would launch one per half-iteration).
    # CPU: the plain function, which Inductor's C++ backend fuses into one loop nest by itself.
    impl = "auto" if streams.is_cuda else "reference"
    pre, post, comb = kernels.hc_split_sinkhorn(mixes, scale, base, hc, sinkhorn_iters, hc_eps, impl=impl)
    x = (pre.unsqueeze(-1) * flat.view(streams.shape)).sum(1)
    return x.to(streams.dtype), post, comb


def hc_pre_norm(streams, fn, scale, base, norm: RMSNorm, sinkhorn_iters: int, hc_eps: float, norm_eps: float):
    """hc_pre, then the sublayer's `norm`: (normed input [B, D], post [B, hc], comb [B, hc, hc]).
    On CUDA one op of one or two kernels (kernels/hc_mix/), where Inductor would write 4-5."""
    if boundary_takes_kernel(streams, fn):
        return kernels.hc_pre_norm(streams, fn, scale, base, norm.weight, sinkhorn_iters, hc_eps, norm_eps, norm.eps)
    x, post, comb = hc_pre(streams, fn, scale, base, sinkhorn_iters, hc_eps, norm_eps)
    return norm(x), post, comb


def hc_post_pre_norm(out, streams, post, comb, fn, scale, base, norm: RMSNorm, sinkhorn_iters: int, hc_eps: float, norm_eps: float):
    """hc_post of one sublayer, then hc_pre_norm of the next: (new streams, normed input, post, comb)."""
    if boundary_takes_kernel(streams, fn):
        return kernels.hc_post_pre_norm(
            out, streams, post, comb, fn, scale, base, norm.weight, sinkhorn_iters, hc_eps, norm_eps, norm.eps
        )
    streams = hc_post(out, streams, post, comb)
    return (streams, *hc_pre_norm(streams, fn, scale, base, norm, sinkhorn_iters, hc_eps, norm_eps))


def hc_head(streams, fn, scale, base, hc_eps: float, norm_eps: float) -> torch.Tensor:
    """Collapse the copies into one stream [B, D] before the final norm."""
    flat, mixes = normalized_mixes(streams, fn, norm_eps)
    pre = torch.sigmoid(mixes * scale + base) + hc_eps
    return (pre.unsqueeze(-1) * flat.view(streams.shape)).sum(1).to(streams.dtype)
