"""mHC split + Sinkhorn: turn each token's (2+hc)*hc hyper-connection mixes into the pre weights,
the post weights and the doubly-stochastic combination matrix.

With hc copies, mixes[b] holds hc pre logits, hc post logits and hc*hc comb logits (row major):
    pre  = sigmoid(m[:hc] * scale[0] + base[:hc]) + eps                          [B, hc]
    post = 2 * sigmoid(m[hc:2hc] * scale[1] + base[hc:2hc])                      [B, hc]
    comb = softmax over each row of (m[2hc:] * scale[2] + base[2hc:]) + eps      [B, hc, hc]
    comb /= column sums + eps, then iters - 1 rounds of: comb /= row sums + eps; comb /= column sums + eps

The plain-torch reference and the input checks every implementation shares.
"""
from __future__ import annotations

import torch


def hc_split_sinkhorn_reference(
    mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int, iters: int, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plain-torch fp32 reference. mixes [B, (2+hc)*hc], scale [3], base [(2+hc)*hc], all fp32.
    Returns (pre [B, hc], post [B, hc], comb [B, hc, hc])."""
    pre = torch.sigmoid(mixes[:, :hc] * scale[0] + base[:hc]) + eps
    post = 2 * torch.sigmoid(mixes[:, hc : 2 * hc] * scale[1] + base[hc : 2 * hc])
    logits = (mixes[:, 2 * hc :] * scale[2] + base[2 * hc :]).unflatten(-1, (hc, hc))
    comb = torch.softmax(logits, dim=-1) + eps
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return pre, post, comb


def check_hc_inputs(mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int, iters: int) -> None:
    """Raise ValueError naming the first problem with the arguments (shapes only, no host sync)."""
    if hc < 1:
        raise ValueError(f"hc_split_sinkhorn: hc must be >= 1, got {hc}")
    width = (2 + hc) * hc
    if mixes.dim() != 2:
        raise ValueError(f"hc_split_sinkhorn: mixes must be [B, (2+hc)*hc], got shape {tuple(mixes.shape)}")
    if mixes.shape[1] != width:
        raise ValueError(
            f"hc_split_sinkhorn: mixes width {mixes.shape[1]} != (2+hc)*hc = {width} for hc={hc}"
        )
    if tuple(scale.shape) != (3,):
        raise ValueError(f"hc_split_sinkhorn: scale must have shape (3,), got {tuple(scale.shape)}")
    if tuple(base.shape) != (width,):
        raise ValueError(f"hc_split_sinkhorn: base must have shape ({width},), got {tuple(base.shape)}")
    for name, t in (("mixes", mixes), ("scale", scale), ("base", base)):
        if t.dtype != torch.float32:
            raise ValueError(f"hc_split_sinkhorn: {name} dtype must be float32, got {t.dtype}")
    if not (mixes.device == scale.device == base.device):
        raise ValueError(
            f"hc_split_sinkhorn: mixes, scale and base must share a device, got "
            f"{mixes.device}, {scale.device}, {base.device}"
        )
    if iters < 1:
        raise ValueError(f"hc_split_sinkhorn: iters must be >= 1, got {iters}")
