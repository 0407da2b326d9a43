"""Routed experts: `ref` (the plain-torch reference, SwiGLU, the shared-expert helpers, input
checks), `triton` (the CUDA grouped GEMM), `scaled` (the CUDA grouped GEMV of block-scaled FP4 /
FP8 experts), `scaled_gluon` (its FP4 products with the codes decoded into tensor-core
registers), `shared` (a shared expert of its own FP8 format, run beside them), `op` (the custom
ops `v4::moe_experts`, `v4::moe_experts_scaled` and `v4::moe_experts_scaled_shared` and the
choice of implementation)."""
from kernels.moe.op import IMPLS, moe_experts, moe_experts_op
from kernels.moe.ref import SharedExpertWeights, moe_experts_reference, swiglu

__all__ = ["IMPLS", "SharedExpertWeights", "moe_experts", "moe_experts_op", "moe_experts_reference", "swiglu"]
