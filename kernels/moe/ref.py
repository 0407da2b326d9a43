"""Routed experts: the weighted sum of each token's top-k clamped-SwiGLU experts.

For each token b and pick j with expert e = ids[b, j] and routing weight w = weights[b, j]
(as the official code: matrix products in the activation dtype, the SwiGLU in fp32, the
routing weight applied before w2, each expert's output rounded to the activation dtype and
summed in fp32):
    g = clamp(x w1[e]^T, max=limit), u = clamp(x w3[e]^T, -limit, limit)
    out[b] += (w * silu(g) * u) w2[e]^T

Block-scaled experts (FP8 or FP4 weights with their scales, kernels/blockscale/ref.py) follow the
official linear(): each product's input is quantised first (x before w1 and w3, the weighted
SwiGLU before w2) and the product is returned in the activation dtype.

The shared expert is either one of the stacked experts (`shared_expert`: every token's last pick,
weight 1) or, where it is stored in a format of its own (V4-Flash: FP8 beside FP4 routed
experts), `shared_weights`: its products as the official MLP runs them, added to each token's
sum after the routed picks.

The plain-torch reference, the shared-expert helpers and the input checks.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from kernels.blockscale.ref import act_quant_dequant, blockscale_linear_reference, check_blockscale_inputs, dequantize_weight


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


class SharedExpertWeights(NamedTuple):
    """A shared expert of its own block-scaled format (FP8: e4m3, one scale per 128 x 128 block)."""

    gate_up: torch.Tensor  # w1 and w3 stacked along the outputs [2I, D], one product
    gate_up_scale: torch.Tensor
    down: torch.Tensor  # w2 [D, I]
    down_scale: torch.Tensor


def shared_expert_product(
    x: torch.Tensor, weights: SharedExpertWeights, swiglu_limit: float, pow2: bool,
    product: Callable[..., torch.Tensor] = blockscale_linear_reference,
) -> torch.Tensor:
    """[B, D] in x's dtype: the shared expert as the official MLP (weight 1): gate and up in one
    block-scaled `product`, the clamped SwiGLU in fp32 rounded to x's dtype, then down."""
    gate, up = product(x, weights.gate_up, weights.gate_up_scale, pow2).chunk(2, dim=-1)
    return product(swiglu(gate, up, swiglu_limit).to(x.dtype), weights.down, weights.down_scale, pow2)


def check_shared_weights(x: torch.Tensor, weights: SharedExpertWeights) -> None:
    """Raise ValueError naming the shared expert's tensor whose shape or dtype does not fit x [B, D]."""
    gate_up, down = weights.gate_up, weights.down
    if gate_up.dim() != 2 or gate_up.shape[0] % 2 or down.dim() != 2 or down.shape != (x.shape[1], gate_up.shape[0] // 2):
        raise ValueError(
            f"moe_experts: the shared expert's gate_up must be [2I, D] and its down [D, I] with D = {x.shape[1]}; "
            f"got gate_up {tuple(gate_up.shape)}, down {tuple(down.shape)}"
        )
    for name, w, s, inp in (("gate_up", gate_up, weights.gate_up_scale, x.shape[1]), ("down", down, weights.down_scale, down.shape[1])):
        try:
            check_blockscale_inputs(x.new_empty(1, inp), w, s)
        except ValueError as error:
            raise ValueError(f"moe_experts: shared expert {name}: {error}") from None


def _picked(w: torch.Tensor, scale: torch.Tensor | None, ids) -> torch.Tensor:
    """The weights of experts `ids` (an index or an index tensor), dequantised to fp32 where scaled."""
    return w[ids] if scale is None else dequantize_weight(w[ids], scale[ids])


def _product(x: torch.Tensor, w: torch.Tensor, scaled: bool, pow2: bool) -> torch.Tensor:
    """x @ w^T in x's dtype: as it is for dense w, the official block-scaled product for a
    dequantised w (x quantised first, the product in fp32)."""
    if not scaled:
        return x @ w.transpose(-1, -2)
    return (act_quant_dequant(x, pow2) @ w.transpose(-1, -2)).to(x.dtype)


def moe_experts_reference(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    expert_weights: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    swiglu_limit: float,
    shared_expert: int = -1,
    scales: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    pow2: bool = True,
    shared_weights: SharedExpertWeights | None = None,
) -> torch.Tensor:
    """Plain-torch reference without host syncs. x [B,D]; expert_ids [B,k]; expert_weights
    [B,k] fp32; w1, w3 [E,I,D]; w2 [E,D,I] (block-scaled: as stored, with `scales` (w1, w2, w3
    scales) and `pow2` activation scales); shared_expert: -1 or an expert every token runs last
    with weight 1; shared_weights: a shared expert of its own format, its output added last.
    Returns [B,D] fp32.

    Few pairs: gather the picked experts' weights (reads only those). Many pairs: run every
    expert densely with a zero routing weight for the tokens that did not pick it; a zero
    weight zeroes the intermediate, so the sum is unchanged."""
    routed = _routed_reference(x, expert_ids, expert_weights, w1, w2, w3, swiglu_limit, shared_expert, scales, pow2)
    if shared_weights is None:
        return routed
    return routed + shared_expert_product(x, shared_weights, swiglu_limit, pow2).float()


def _routed_reference(x, expert_ids, expert_weights, w1, w2, w3, swiglu_limit, shared_expert, scales, pow2) -> torch.Tensor:
    s1, s2, s3 = scales if scales is not None else (None, None, None)
    scaled = scales is not None
    if shared_expert >= 0:
        expert_ids, expert_weights = with_shared_pick(expert_ids, expert_weights, shared_expert)
    batch, picks = expert_ids.shape
    num_experts = w1.shape[0]
    if batch * picks <= num_experts:
        ids = expert_ids.reshape(-1).long()
        xs = x.repeat_interleave(picks, 0)[:, None, :]  # [P,1,D]
        gate = _product(xs, _picked(w1, s1, ids), scaled, pow2)
        up = _product(xs, _picked(w3, s3, ids), scaled, pow2)
        h = (swiglu(gate, up, swiglu_limit) * expert_weights.reshape(-1, 1, 1).float()).to(x.dtype)
        y = _product(h, _picked(w2, s2, ids), scaled, pow2).float()  # [P,1,D]
        return y.view(batch, picks, -1).sum(1)
    out = x.new_zeros(x.shape, dtype=torch.float32)
    for e in range(num_experts):
        weight = (expert_weights.float() * (expert_ids == e)).sum(1, keepdim=True)  # [B,1]
        gate, up = _product(x, _picked(w1, s1, e), scaled, pow2), _product(x, _picked(w3, s3, e), scaled, pow2)
        h = (swiglu(gate, up, swiglu_limit) * weight).to(x.dtype)
        out += _product(h, _picked(w2, s2, e), scaled, pow2).float()
    return out


def check_moe_inputs(x, expert_ids, expert_weights, w1, w2, w3, shared_expert: int, scales=None, shared_weights=None) -> None:
    """Raise ValueError naming the first argument whose shape does not fit (no host sync)."""
    if x.dim() != 2 or expert_ids.shape != expert_weights.shape or expert_ids.shape[0] != x.shape[0]:
        raise ValueError(
            "moe_experts expects x [B,D], expert_ids and expert_weights [B,k]; got "
            f"{tuple(x.shape)}, {tuple(expert_ids.shape)}, {tuple(expert_weights.shape)}"
        )
    if scales is not None:
        _check_scaled_experts(x, w1, w2, w3, scales)
    elif w1.shape != w3.shape or w1.shape[2] != x.shape[1] or w2.shape != (w1.shape[0], w1.shape[2], w1.shape[1]):
        raise ValueError(
            f"moe_experts: expert weights disagree: w1 {tuple(w1.shape)}, w2 {tuple(w2.shape)}, w3 {tuple(w3.shape)}"
        )
    check_shared_expert(shared_expert, w1.shape[0])
    if shared_weights is not None:
        if scales is None or shared_expert >= 0:
            raise ValueError("moe_experts: shared_weights (a shared expert of its own format) goes with block-scaled "
                             "routed experts (scales) and no stacked shared_expert")
        check_shared_weights(x, shared_weights)


def _check_scaled_experts(x, w1, w2, w3, scales) -> None:
    """Block-scaled experts: FP8 (e4m3 [E,out,in]) or FP4 (uint8 [E,out,in/2]), scales to match."""
    if len(scales) != 3 or w1.dim() != 3 or w1.shape != w3.shape or w1.shape[0] != w2.shape[0]:
        raise ValueError(f"moe_experts: expert weights disagree: w1 {tuple(w1.shape)}, w2 {tuple(w2.shape)}, w3 {tuple(w3.shape)}")
    inter = w1.shape[1]
    for name, w, s, inp in (("w1", w1, scales[0], x.shape[1]), ("w2", w2, scales[1], inter), ("w3", w3, scales[2], x.shape[1])):
        if s.dim() != 3 or s.shape[0] != w.shape[0]:
            raise ValueError(f"moe_experts: {name}'s scale must be [E, ...] like its weight, got {tuple(s.shape)}")
        try:
            check_blockscale_inputs(x.new_empty(1, inp), w[0], s[0])
        except ValueError as error:
            raise ValueError(f"moe_experts: {name}: {error}") from None
