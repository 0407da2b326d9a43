"""A shared expert of its own block-scaled format on the device (semantics: kernels/moe/ref.py's
shared_expert_product): [w1; w3] and w2 through the block-scaled linear op (its GEMV at one row),
the clamped SwiGLU between them as one kernel. The routed experts' ops run it on a side stream
beside their own kernels and add its output in their combine."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.blockscale.op import blockscale_linear
from kernels.dependent_launch import dependent_options, wait_for_predecessor
from kernels.moe.ref import SharedExpertWeights
from kernels.moe.triton import clamped_swiglu

SWIGLU_BLOCK = 1024  # intermediate columns per program


@triton.jit
def _shared_swiglu_kernel(
    gate_up_ptr, h_ptr, inter, stride_gm, stride_hm, swiglu_limit,
    HAS_LIMIT: tl.constexpr, BLOCK: tl.constexpr,
    DEPENDENT: tl.constexpr = False,
):
    wait_for_predecessor(DEPENDENT)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < inter
    gate = tl.load(gate_up_ptr + row * stride_gm + offs, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_gm + inter + offs, mask=ok, other=0.0).to(tl.float32)
    h = clamped_swiglu(gate, up, swiglu_limit, HAS_LIMIT)
    tl.store(h_ptr + row * stride_hm + offs, h.to(h_ptr.dtype.element_ty), mask=ok)


def swiglu_rows(gate_up: torch.Tensor, swiglu_limit: float) -> torch.Tensor:
    """[B, I] in gate_up's dtype: the clamped SwiGLU of gate_up [B, 2I] (gate, then up) in fp32."""
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    h = gate_up.new_empty(rows, inter)
    if rows:
        block = min(SWIGLU_BLOCK, triton.next_power_of_2(inter))
        _shared_swiglu_kernel[(rows, triton.cdiv(inter, block))](
            gate_up, h, inter, gate_up.stride(0), h.stride(0), float(swiglu_limit),
            HAS_LIMIT=swiglu_limit > 0, BLOCK=block, num_warps=4, **dependent_options(h.device),
        )
    return h


def shared_expert_triton(x: torch.Tensor, weights: SharedExpertWeights, swiglu_limit: float, pow2: bool,
                         gate_up_gemv: bool = False) -> torch.Tensor:
    """[B, D] in x's dtype, rows contiguous: the shared expert's output. gate_up_gemv (tuning): at
    one row the gate/up product through the FP8 GEMV whatever its size, not the linear op's choice."""
    if gate_up_gemv and x.shape[0] == 1:
        from kernels.blockscale.gemv import blockscale_gemv

        gate_up = blockscale_gemv(x, weights.gate_up, weights.gate_up_scale, pow2).contiguous()
    else:
        gate_up = blockscale_linear(x, weights.gate_up, weights.gate_up_scale, pow2).contiguous()
    h = swiglu_rows(gate_up, swiglu_limit)
    return blockscale_linear(h, weights.down, weights.down_scale, pow2).contiguous()
