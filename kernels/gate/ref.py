"""The MoE gate of a decode step: routing weights and expert ids from the hidden rows.

    logits = x W^T in fp32 (the bf16 weight upcast as read, as the official gate computes it)
    scores = sqrt(softplus(logits))                                             [B, E]
    ids    = the top-k experts of scores + bias (ties to the lower index), or the
             ids a hash layer looked up for its tokens                          [B, k]
    weights = scores at ids, over their sum, times route_scale                  [B, k]

The plain-torch reference and the input checks every implementation shares.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def moe_gate_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, hashed_ids: torch.Tensor | None,
                       topk: int, route_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights fp32 [B, k], ids int64 [B, k]); x [B, D] (any float dtype), weight [E, D] bf16 or
    fp16, bias fp32 [E] (None for a hash layer), hashed_ids integer [B, k] (None for a top-k layer)."""
    scores = F.softplus(x.float() @ weight.float().t()).sqrt()
    if hashed_ids is None:
        # a stable sort keeps tied experts in index order: the lower index first, as the kernel picks
        ids = torch.sort(scores + bias, dim=-1, descending=True, stable=True).indices[:, :topk].contiguous()
    else:
        ids = hashed_ids.to(torch.int64, copy=True)  # a custom op's output never aliases its input
    picked = scores.gather(1, ids)
    return picked / picked.sum(-1, keepdim=True) * route_scale, ids


def check_gate_inputs(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, hashed_ids: torch.Tensor | None,
                      topk: int) -> None:
    """Raise ValueError naming the first problem with the arguments (shapes and dtypes only, no
    host sync)."""
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"moe_gate: x must be [B, D] and weight [E, D], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.shape[1] != weight.shape[1]:
        raise ValueError(f"moe_gate: x has {x.shape[1]} features, weight {weight.shape[1]}")
    if not x.dtype.is_floating_point or weight.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"moe_gate: x must be floating point and weight bf16 or fp16, got {x.dtype} and {weight.dtype}")
    experts = weight.shape[0]
    if not 1 <= topk <= experts:
        raise ValueError(f"moe_gate: topk must be in [1, {experts}], got {topk}")
    if (bias is None) == (hashed_ids is None):
        raise ValueError("moe_gate: pass bias (a top-k layer) or hashed_ids (a hash layer), exactly one of them")
    if bias is not None and (tuple(bias.shape) != (experts,) or bias.dtype != torch.float32):
        raise ValueError(f"moe_gate: bias must be fp32 [{experts}], got {bias.dtype} {tuple(bias.shape)}")
    if hashed_ids is not None and (tuple(hashed_ids.shape) != (x.shape[0], topk) or hashed_ids.is_floating_point()):
        raise ValueError(f"moe_gate: hashed_ids must be integer [{x.shape[0]}, {topk}], got {hashed_ids.dtype} {tuple(hashed_ids.shape)}")
    others = [t for t in (weight, bias, hashed_ids) if t is not None]
    if any(t.device != x.device for t in others):
        raise ValueError(f"moe_gate: every tensor must be on x's device ({x.device})")
