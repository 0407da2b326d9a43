"""Routed experts as a custom op (semantics: kernels/moe/ref.py).

`torch.ops.v4.moe_experts` runs the plain-torch reference on CPU and the Triton grouped GEMM of
kernels/moe/triton.py on CUDA; neither syncs with the host.
"""
from __future__ import annotations

import torch

from kernels.impl import COMMON_IMPLS, check_impl
from kernels.moe.ref import check_moe_inputs, moe_experts_reference


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


IMPLS = COMMON_IMPLS


def moe_experts(
    x, expert_ids, expert_weights, w1, w2, w3, swiglu_limit: float, impl: str = "auto", shared_expert: int = -1
) -> torch.Tensor:
    """[B,D] fp32 (see moe_experts_reference). impl: "auto" (the custom op: Triton on CUDA,
    reference on CPU), "triton" (the Triton path directly, e.g. on CPU under
    TRITON_INTERPRET=1) or "reference". shared_expert: -1, or the expert every token runs after
    its picks with weight 1."""
    check_impl("moe_experts", impl, IMPLS)
    check_moe_inputs(x, expert_ids, expert_weights, w1, w2, w3, shared_expert)
    args = (x, expert_ids, expert_weights, w1, w2, w3, float(swiglu_limit), int(shared_expert))
    if impl == "triton":
        from kernels.moe.triton import moe_experts_triton

        return moe_experts_triton(*args)
    if impl == "reference":
        return moe_experts_reference(*args)
    return moe_experts_op(*args)
