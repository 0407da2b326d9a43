"""The official linear() on block-scaled FP8 / FP4 weights as a custom op (semantics:
kernels/blockscale/ref.py). Every device runs the plain-torch form for now: activations
quantised, both operands dequantised to fp32, one product."""
from __future__ import annotations

import torch

from kernels.blockscale.ref import blockscale_linear_reference, check_blockscale_inputs
from kernels.impl import check_impl


@torch.library.custom_op("v4::blockscale_linear", mutates_args=())
def blockscale_linear_op(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, pow2: bool) -> torch.Tensor:
    return blockscale_linear_reference(x, weight, scale, pow2)


@blockscale_linear_op.register_fake
def _(x, weight, scale, pow2):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


IMPLS = ("auto", "reference")


def blockscale_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, pow2: bool = True, impl: str = "auto") -> torch.Tensor:
    """[..., out] in x's dtype (see blockscale_linear_reference). impl: "auto" (the custom op)
    or "reference"."""
    check_impl("blockscale_linear", impl, IMPLS)
    check_blockscale_inputs(x, weight, scale)
    if impl == "reference":
        return blockscale_linear_reference(x, weight, scale, pow2)
    return blockscale_linear_op(x, weight, scale, pow2)
