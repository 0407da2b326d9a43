"""The MoE gate as a custom op (semantics: kernels/gate/ref.py).

`torch.ops.v4.moe_gate` runs the plain-torch reference on CPU and, on CUDA for up to MAX_ROWS
rows of up to kernels/gate/triton.py's MAX_DIM features, one Triton kernel (kernels/gate/triton.py): the GEMV, the scores, the top-k and the
renormalisation in one launch instead of a GEMV and one or two generated kernels.
"""
from __future__ import annotations

import torch

from kernels.gate.ref import check_gate_inputs, moe_gate_reference
from kernels.impl import COMMON_IMPLS, check_impl

MAX_ROWS = 64  # decode batches; more rows (a prefill) take the reference's matrix product
IMPLS = COMMON_IMPLS


@torch.library.custom_op("v4::moe_gate", mutates_args=())
def moe_gate_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, hashed_ids: torch.Tensor | None,
                topk: int, route_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    return moe_gate_reference(x, weight, bias, hashed_ids, topk, route_scale)


@moe_gate_op.register_fake
def _(x, weight, bias, hashed_ids, topk, route_scale):
    return x.new_empty((x.shape[0], topk), dtype=torch.float32), x.new_empty((x.shape[0], topk), dtype=torch.int64)


@moe_gate_op.register_kernel("cuda")
def _(x, weight, bias, hashed_ids, topk, route_scale):
    from kernels.gate.triton import MAX_DIM, moe_gate_triton  # triton only where the kernel runs

    if x.shape[0] > MAX_ROWS or x.shape[1] > MAX_DIM:
        return moe_gate_reference(x, weight, bias, hashed_ids, topk, route_scale)

    return moe_gate_triton(x, weight, bias, hashed_ids, topk, route_scale)


def moe_gate(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, hashed_ids: torch.Tensor | None,
             topk: int, route_scale: float, impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """(weights fp32 [B, k], ids int64 [B, k]) (semantics: kernels/gate/ref.py). impl: "auto" (the
    custom op: Triton on CUDA, reference on CPU), "triton" (the kernel directly, e.g. on CPU under
    TRITON_INTERPRET=1) or "reference"."""
    check_impl("moe_gate", impl, IMPLS)
    topk, route_scale = int(topk), float(route_scale)
    check_gate_inputs(x, weight, bias, hashed_ids, topk)
    if impl == "triton":
        from kernels.gate.triton import moe_gate_triton

        return moe_gate_triton(x, weight, bias, hashed_ids, topk, route_scale)
    if impl == "reference":
        return moe_gate_reference(x, weight, bias, hashed_ids, topk, route_scale)
    return moe_gate_op(x, weight, bias, hashed_ids, topk, route_scale)
