"""The official linear() on block-scaled FP8 / FP4 weights as a custom op (semantics:
kernels/blockscale/ref.py). CUDA runs (`cuda_product`) the one-row GEMV of
kernels/blockscale/gemv.py for one row of FP8 weights up to a few MB (where it measured faster)
and the Triton kernel of kernels/blockscale/triton.py for the rest (activations quantised
per 128-block, weight codes times activations in fp16 products, every scale applied in fp32 after
them); the CPU runs the plain-torch reference (activations quantised, both operands dequantised to
fp32, one product). Neither syncs with the host."""
from __future__ import annotations

import torch

from kernels.blockscale.ref import blockscale_linear_reference, check_blockscale_inputs
from kernels.impl import COMMON_IMPLS, check_impl
from kernels.triton_util import converts_e4m3


@torch.library.custom_op("v4::blockscale_linear", mutates_args=())
def blockscale_linear_op(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, pow2: bool) -> torch.Tensor:
    return blockscale_linear_reference(x, weight, scale, pow2)


@blockscale_linear_op.register_fake
def _(x, weight, scale, pow2):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def cuda_product(rows: int, weight: torch.Tensor, scale: torch.Tensor, e4m3_gpu: bool) -> str:
    """The product the op runs on CUDA for `rows` rows of x (a weight contiguous along its inputs,
    floating x), from shapes, dtypes and whether the GPU has the e4m3 conversions (sm_89 or newer)
    only: "gemv" where kernels/blockscale/gemv.py takes it (one row of at most
    gemv.OP_MAX_WEIGHT_BYTES of FP8 weights), else "triton". The Gluon mma product
    (kernels/blockscale/gluon.py) measured slower than the Triton kernel's e4m3 plans at every
    row count of V4-Flash's shapes (docs/results.md), so the op does not run it."""
    from kernels.blockscale import gemv  # Triton only where the kernels run

    if e4m3_gpu and gemv.takes_rows(rows, weight, scale):
        return "gemv"
    return "triton"


@blockscale_linear_op.register_kernel("cuda")
def _(x, weight, scale, pow2):
    if weight.stride(-1) != 1 or not x.is_floating_point():
        return blockscale_linear_reference(x, weight, scale, pow2)
    product = cuda_product(x.numel() // max(1, x.shape[-1]), weight, scale, converts_e4m3(x.device))
    if product == "gemv":
        from kernels.blockscale.gemv import blockscale_gemv

        return blockscale_gemv(x, weight, scale, pow2)
    from kernels.blockscale.triton import blockscale_linear_triton

    return blockscale_linear_triton(x, weight, scale, pow2)


IMPLS = COMMON_IMPLS


def blockscale_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, pow2: bool = True, impl: str = "auto") -> torch.Tensor:
    """[..., out] in x's dtype (see blockscale_linear_reference). impl: "auto" (the custom op: on
    CUDA the product `cuda_product` names, GEMV or Triton; the reference on CPU), "triton"
    (the Triton kernel directly, e.g. on a CPU under TRITON_INTERPRET=1; the weight contiguous
    along its inputs) or "reference"."""
    check_impl("blockscale_linear", impl, IMPLS)
    check_blockscale_inputs(x, weight, scale)
    if impl == "triton":
        from kernels.blockscale.triton import blockscale_linear_triton

        return blockscale_linear_triton(x, weight, scale, pow2)
    if impl == "reference":
        return blockscale_linear_reference(x, weight, scale, pow2)
    return blockscale_linear_op(x, weight, scale, pow2)
