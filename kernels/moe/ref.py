"""Routed experts: the weighted sum of each token's top-k clamped-SwiGLU experts.

For each token b and pick j with expert e = ids[b, j] and routing weight w = weights[b, j]
(as the official code: matrix products in the activation dtype, the SwiGLU in fp32, the
routing weight applied before w2, each expert's output rounded to the activation dtype and
summed in fp32):
    g = clamp(x w1[e]^T, max=limit), u = clamp(x w3[e]^T, -limit, limit)
    out[b] += (w * silu(g) * u) w2[e]^T

The plain-torch reference, the shared-expert helpers and the input checks.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    gate, up = gate.float(), up.float()
    if limit > 0:
        up = up.clamp(-limit, limit)
        gate = gate.clamp(max=limit)
    return F.silu(gate) * up


def check_shared_expert(shared_expert: int, num_experts: int) -> None:
    if not -1 <= shared_expert < num_experts:
        raise ValueError(f"moe_experts: shared_expert must be -1 or an expert in [0, {num_experts}), got {shared_expert}")


def with_shared_ids(expert_ids: torch.Tensor, shared_expert: int) -> torch.Tensor:
    """ids [B, k+1]: the shared expert appended to every row."""
    return torch.cat([expert_ids, torch.full_like(expert_ids[:, :1], shared_expert)], 1)


def with_shared_pick(expert_ids: torch.Tensor, expert_weights: torch.Tensor, shared_expert: int):
    """ids and weights [B, k+1]: the shared expert appended to every row with weight 1."""
    ids = with_shared_ids(expert_ids, shared_expert)
    weights = torch.cat([expert_weights.float(), expert_weights.new_ones(expert_weights.shape[0], 1, dtype=torch.float32)], 1)
    return ids, weights


def moe_experts_reference(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    expert_weights: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    swiglu_limit: float,
    shared_expert: int = -1,
) -> torch.Tensor:
    """Plain-torch reference without host syncs. x [B,D]; expert_ids [B,k]; expert_weights
    [B,k] fp32; w1, w3 [E,I,D]; w2 [E,D,I]; shared_expert: -1 or an expert every token runs
    last with weight 1. Returns [B,D] fp32.

    Few pairs: gather the picked experts' weights (reads only those). Many pairs: run every
    expert densely with a zero routing weight for the tokens that did not pick it; a zero
    weight zeroes the intermediate, so the sum is unchanged."""
    if shared_expert >= 0:
        expert_ids, expert_weights = with_shared_pick(expert_ids, expert_weights, shared_expert)
    batch, picks = expert_ids.shape
    num_experts = w1.shape[0]
    if batch * picks <= num_experts:
        ids = expert_ids.reshape(-1).long()
        xs = x.repeat_interleave(picks, 0)[:, None, :]  # [P,1,D]
        h = swiglu(xs @ w1[ids].transpose(1, 2), xs @ w3[ids].transpose(1, 2), swiglu_limit)
        h = (h * expert_weights.reshape(-1, 1, 1).float()).to(x.dtype)
        y = (h @ w2[ids].transpose(1, 2)).float()  # [P,1,D]
        return y.view(batch, picks, -1).sum(1)
    out = x.new_zeros(x.shape, dtype=torch.float32)
    for e in range(num_experts):
        weight = (expert_weights.float() * (expert_ids == e)).sum(1, keepdim=True)  # [B,1]
        h = (swiglu(x @ w1[e].t(), x @ w3[e].t(), swiglu_limit) * weight).to(x.dtype)
        out += (h @ w2[e].t()).float()
    return out


def check_moe_inputs(x, expert_ids, expert_weights, w1, w2, w3, shared_expert: int) -> None:
    """Raise ValueError naming the first argument whose shape does not fit (no host sync)."""
    if x.dim() != 2 or expert_ids.shape != expert_weights.shape or expert_ids.shape[0] != x.shape[0]:
        raise ValueError(
            "moe_experts expects x [B,D], expert_ids and expert_weights [B,k]; got "
            f"{tuple(x.shape)}, {tuple(expert_ids.shape)}, {tuple(expert_weights.shape)}"
        )
    if w1.shape != w3.shape or w1.shape[2] != x.shape[1] or w2.shape != (w1.shape[0], w1.shape[2], w1.shape[1]):
        raise ValueError(
            f"moe_experts: expert weights disagree: w1 {tuple(w1.shape)}, w2 {tuple(w2.shape)}, w3 {tuple(w3.shape)}"
        )
    check_shared_expert(shared_expert, w1.shape[0])
