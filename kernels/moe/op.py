"""Routed experts as a custom op (semantics: kernels/moe/ref.py).

`torch.ops.v4.moe_experts` runs the plain-torch reference on CPU and the Triton grouped GEMM of
kernels/moe/triton.py on CUDA; `torch.ops.v4.moe_experts_scaled` (FP8 / FP4 experts with their
block scales) the reference on CPU and on CUDA the grouped GEMV of kernels/moe/scaled_gluon.py
for FP4 experts (sm_89+), of kernels/moe/scaled.py otherwise; `torch.ops.v4.moe_experts_scaled_shared`
the same with a shared expert of its own FP8 format added, on CUDA its products on a side stream
beside the routed experts' kernels. None of them syncs with the host.
"""
from __future__ import annotations

import torch

from kernels.impl import COMMON_IMPLS, check_impl
from kernels.moe.ref import SharedExpertWeights, check_moe_inputs, moe_experts_reference


@torch.library.custom_op("v4::moe_experts", mutates_args=())
def moe_experts_op(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    expert_weights: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    swiglu_limit: float,
    shared_expert: int,
) -> torch.Tensor:
    return moe_experts_reference(x, expert_ids, expert_weights, w1, w2, w3, swiglu_limit, shared_expert)


@moe_experts_op.register_fake
def _(x, expert_ids, expert_weights, w1, w2, w3, swiglu_limit, shared_expert):
    return x.new_empty(x.shape, dtype=torch.float32)


@moe_experts_op.register_kernel("cuda")
def _(x, expert_ids, expert_weights, w1, w2, w3, swiglu_limit, shared_expert):
    from kernels.moe.triton import moe_experts_triton  # triton only where the kernel runs

    return moe_experts_triton(x, expert_ids, expert_weights, w1, w2, w3, swiglu_limit, shared_expert)


@torch.library.custom_op("v4::moe_experts_scaled", mutates_args=())
def moe_experts_scaled_op(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    expert_weights: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    w1_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    w3_scale: torch.Tensor,
    swiglu_limit: float,
    shared_expert: int,
    pow2: bool,
) -> torch.Tensor:
    """Block-scaled experts (FP8 or FP4 weights with their scales)."""
    scales = (w1_scale, w2_scale, w3_scale)
    return moe_experts_reference(x, expert_ids, expert_weights, w1, w2, w3, swiglu_limit, shared_expert, scales, pow2)


@moe_experts_scaled_op.register_fake
def _(x, expert_ids, expert_weights, w1, w2, w3, w1_scale, w2_scale, w3_scale, swiglu_limit, shared_expert, pow2):
    return x.new_empty(x.shape, dtype=torch.float32)


@moe_experts_scaled_op.register_kernel("cuda")
def _(x, expert_ids, expert_weights, w1, w2, w3, w1_scale, w2_scale, w3_scale, swiglu_limit, shared_expert, pow2):
    scales = (w1_scale, w2_scale, w3_scale)
    product = _scaled_product(x, w1, w2, w3, scales)
    return product(x, expert_ids, expert_weights, w1, w2, w3, scales, swiglu_limit, shared_expert, pow2)


def _scaled_product(x, w1, w2, w3, scales):
    """The op's CUDA product for these experts: the Gluon one where it takes them, else Triton's."""
    from kernels.moe import scaled_gluon  # Triton and Gluon only where the kernels run
    from kernels.moe.scaled import moe_experts_scaled_triton

    return scaled_gluon.moe_experts_scaled_mma if scaled_gluon.takes(x, w1, w2, w3, scales) else moe_experts_scaled_triton


@torch.library.custom_op("v4::moe_experts_scaled_shared", mutates_args=())
def moe_experts_scaled_shared_op(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    expert_weights: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    w1_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    w3_scale: torch.Tensor,
    shared_gate_up: torch.Tensor,
    shared_gate_up_scale: torch.Tensor,
    shared_down: torch.Tensor,
    shared_down_scale: torch.Tensor,
    swiglu_limit: float,
    pow2: bool,
) -> torch.Tensor:
    """Block-scaled routed experts plus a shared expert of its own block-scaled format."""
    shared = SharedExpertWeights(shared_gate_up, shared_gate_up_scale, shared_down, shared_down_scale)
    scales = (w1_scale, w2_scale, w3_scale)
    return moe_experts_reference(x, expert_ids, expert_weights, w1, w2, w3, swiglu_limit, -1, scales, pow2, shared)


@moe_experts_scaled_shared_op.register_fake
def _(x, expert_ids, expert_weights, w1, w2, w3, w1_scale, w2_scale, w3_scale,
      shared_gate_up, shared_gate_up_scale, shared_down, shared_down_scale, swiglu_limit, pow2):
    return x.new_empty(x.shape, dtype=torch.float32)


@moe_experts_scaled_shared_op.register_kernel("cuda")
def _(x, expert_ids, expert_weights, w1, w2, w3, w1_scale, w2_scale, w3_scale,
      shared_gate_up, shared_gate_up_scale, shared_down, shared_down_scale, swiglu_limit, pow2):
    shared = SharedExpertWeights(shared_gate_up, shared_gate_up_scale, shared_down, shared_down_scale)
    scales = (w1_scale, w2_scale, w3_scale)
    product = _scaled_product(x, w1, w2, w3, scales)
    return product(x, expert_ids, expert_weights, w1, w2, w3, scales, swiglu_limit, -1, pow2, shared_weights=shared)


IMPLS = COMMON_IMPLS


def moe_experts(
    x, expert_ids, expert_weights, w1, w2, w3, swiglu_limit: float, impl: str = "auto", shared_expert: int = -1,
    scales: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None, pow2: bool = True,
    shared_weights: SharedExpertWeights | None = None,
) -> torch.Tensor:
    """[B,D] fp32 (see moe_experts_reference). impl: "auto" (the custom op: Triton / Gluon on CUDA,
    reference on CPU), "triton" (the Triton path directly, e.g. on CPU under
    TRITON_INTERPRET=1) or "reference". shared_expert: -1, or the expert every token runs after
    its picks with weight 1. scales: the (w1, w2, w3) block scales of FP8 / FP4 experts.
    shared_weights: a shared expert of its own FP8 format (with block-scaled routed experts and
    no shared_expert), added after the picks; on CUDA its products run on a side stream beside
    the routed experts' kernels."""
    check_impl("moe_experts", impl, IMPLS)
    check_moe_inputs(x, expert_ids, expert_weights, w1, w2, w3, shared_expert, scales, shared_weights)
    if scales is not None:
        limit, shared, pow2 = float(swiglu_limit), int(shared_expert), bool(pow2)
        if impl == "triton":
            from kernels.moe.scaled import moe_experts_scaled_triton

            return moe_experts_scaled_triton(x, expert_ids, expert_weights, w1, w2, w3, tuple(scales), limit, shared, pow2,
                                             shared_weights=shared_weights)
        if impl == "reference":
            return moe_experts_reference(x, expert_ids, expert_weights, w1, w2, w3, limit, shared, scales, pow2, shared_weights)
        if shared_weights is not None:
            return moe_experts_scaled_shared_op(x, expert_ids, expert_weights, w1, w2, w3, *scales, *shared_weights, limit, pow2)
        return moe_experts_scaled_op(x, expert_ids, expert_weights, w1, w2, w3, *scales, limit, shared, pow2)
    args = (x, expert_ids, expert_weights, w1, w2, w3, float(swiglu_limit), int(shared_expert))
    if impl == "triton":
        from kernels.moe.triton import moe_experts_triton

        return moe_experts_triton(*args)
    if impl == "reference":
        return moe_experts_reference(*args)
    return moe_experts_op(*args)
