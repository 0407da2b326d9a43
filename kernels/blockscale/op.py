"""The official linear() on block-scaled FP8 / FP4 weights as a custom op (semantics:
kernels/blockscale/ref.py). CUDA runs the Gluon product of kernels/blockscale/gluon.py for FP8
weights up to a few rows (where it measured faster) and the Triton kernel of
kernels/blockscale/triton.py otherwise (activations quantised per 128-block, weight codes times
activations in fp16 products, every scale applied in fp32 after them); the CPU runs the plain-torch reference (activations quantised, both
operands dequantised to fp32, one product). Neither syncs with the host."""
from __future__ import annotations

import torch

from kernels.blockscale.ref import blockscale_linear_reference, check_blockscale_inputs
from kernels.impl import COMMON_IMPLS, check_impl


@torch.library.custom_op("v4::blockscale_linear", mutates_args=())
def blockscale_linear_op(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, pow2: bool) -> torch.Tensor:
    return blockscale_linear_reference(x, weight, scale, pow2)


@blockscale_linear_op.register_fake
def _(x, weight, scale, pow2):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@blockscale_linear_op.register_kernel("cuda")
def _(x, weight, scale, pow2):
    if weight.stride(-1) != 1 or not x.is_floating_point():
        return blockscale_linear_reference(x, weight, scale, pow2)
    from kernels.blockscale import gluon  # Triton and Gluon only where the kernels run

    if gluon.takes(x, weight):
        return gluon.blockscale_linear_mma(x, weight, scale, pow2)
    from kernels.blockscale.triton import blockscale_linear_triton

    return blockscale_linear_triton(x, weight, scale, pow2)


IMPLS = COMMON_IMPLS


def blockscale_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, pow2: bool = True, impl: str = "auto") -> torch.Tensor:
    """[..., out] in x's dtype (see blockscale_linear_reference). impl: "auto" (the custom op:
    Gluon / Triton on CUDA, the reference on CPU), "triton" (the Triton kernel directly, e.g. on a CPU
    under TRITON_INTERPRET=1; the weight contiguous along its inputs) or "reference"."""
    check_impl("blockscale_linear", impl, IMPLS)
    check_blockscale_inputs(x, weight, scale)
    if impl == "triton":
        from kernels.blockscale.triton import blockscale_linear_triton

        return blockscale_linear_triton(x, weight, scale, pow2)
    if impl == "reference":
        return blockscale_linear_reference(x, weight, scale, pow2)
    return blockscale_linear_op(x, weight, scale, pow2)
