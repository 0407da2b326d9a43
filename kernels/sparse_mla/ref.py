"""Sparse MLA decode: one query token per sequence attends to a gathered set of cache rows. The
plain-torch reference and the input checks every implementation shares.

Semantics (the official V4 decode): K and V are the same 512-wide row; scores are fp32 and
scaled; index -1 is masked; a per-head learned sink adds exp(sink - max) to the softmax
denominator only; probabilities are rounded to the activation dtype before P·V. A row whose
indices are all masked returns zeros, and its LSE is the sink.
"""
from __future__ import annotations

import torch


def sparse_mla_decode_reference(
    q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor, sink: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch reference. q [B,H,D]; kv_cache [S,R,D]; indices [B,K] global rows into
    kv_cache viewed as [S*R, D] (-1 = masked); sink [H] fp32. Returns (out [B,H,D] in q.dtype,
    lse [B,H] fp32 natural log of the denominator including the sink)."""
    rows = kv_cache.reshape(-1, kv_cache.shape[-1])
    valid = indices >= 0
    gathered = rows[indices.clamp(min=0).long()].float()  # [B,K,D]
    scores = torch.einsum("bhd,bkd->bhk", q.float(), gathered) * scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    sink = sink.float()[None, :]
    row_max = torch.maximum(scores.amax(-1), sink)  # finite even when every index is masked
    probs = torch.exp(scores - row_max[..., None])
    denom = probs.sum(-1) + torch.exp(sink - row_max)
    probs = probs.to(q.dtype).float()
    out = torch.einsum("bhk,bkd->bhd", probs, gathered) / denom[..., None]
    return out.to(q.dtype), row_max + torch.log(denom)


def check_sparse_mla_inputs(q, kv_cache, indices, sink) -> None:
    if q.dim() != 3 or kv_cache.dim() != 3 or indices.dim() != 2 or sink.dim() != 1:
        raise ValueError(
            "sparse_mla_decode expects q [B,H,D], kv_cache [S,R,D], indices [B,K], sink [H]; got "
            f"{tuple(q.shape)}, {tuple(kv_cache.shape)}, {tuple(indices.shape)}, {tuple(sink.shape)}"
        )
    if q.shape[-1] != kv_cache.shape[-1] or indices.shape[0] != q.shape[0] or sink.shape[0] != q.shape[1]:
        raise ValueError("sparse_mla_decode: q, kv_cache, indices and sink disagree on B, H or D")
    if indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"sparse_mla_decode: indices must be int32 or int64, got {indices.dtype}")
    if not q.is_floating_point() or not kv_cache.is_floating_point() or not sink.is_floating_point():
        raise ValueError(
            f"sparse_mla_decode: q, kv_cache and sink must be floating point, got {q.dtype}, {kv_cache.dtype}, {sink.dtype}"
        )
    if len({t.device for t in (q, kv_cache, indices, sink)}) != 1:
        raise ValueError(
            "sparse_mla_decode: q, kv_cache, indices and sink must be on one device, got "
            f"{q.device}, {kv_cache.device}, {indices.device}, {sink.device}"
        )
