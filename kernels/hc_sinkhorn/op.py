"""mHC split + Sinkhorn as a custom op (semantics: kernels/hc_sinkhorn/ref.py).

`torch.ops.v4.hc_split_sinkhorn` runs the plain-torch reference on CPU and one Triton kernel
(kernels/hc_sinkhorn/triton.py) on CUDA. Unfused, every half-iteration is its own kernel (a row
normalisation reads what other threads wrote in the column step before it); the Triton kernel
keeps each matrix in registers through all iterations.
"""
from __future__ import annotations

import torch

from kernels.hc_sinkhorn.ref import check_hc_inputs, hc_split_sinkhorn_reference
from kernels.impl import COMMON_IMPLS, check_impl


@torch.library.custom_op("v4::hc_split_sinkhorn", mutates_args=())
def hc_split_sinkhorn_op(
    mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int, iters: int, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # Custom-op outputs may not alias inputs or each other: the slices of the reference do not,
    # as every output comes out of an arithmetic op.
    return hc_split_sinkhorn_reference(mixes, scale, base, hc, iters, eps)


@hc_split_sinkhorn_op.register_fake
def _(mixes, scale, base, hc, iters, eps):
    batch = mixes.shape[0]
    return (
        mixes.new_empty((batch, hc), dtype=torch.float32),
        mixes.new_empty((batch, hc), dtype=torch.float32),
        mixes.new_empty((batch, hc, hc), dtype=torch.float32),
    )


@hc_split_sinkhorn_op.register_kernel("cuda")
def _(mixes, scale, base, hc, iters, eps):
    from kernels.hc_sinkhorn.triton import hc_split_sinkhorn_triton  # triton only where the kernel runs

    return hc_split_sinkhorn_triton(mixes, scale, base, hc, iters, eps)


IMPLS = COMMON_IMPLS


def hc_split_sinkhorn(
    mixes: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    hc: int,
    iters: int,
    eps: float,
    impl: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pre [B, hc], post [B, hc], comb [B, hc, hc]) in fp32 (semantics: kernels/hc_sinkhorn/ref.py).
    impl: "auto" (the custom op: Triton on CUDA, reference on CPU), "triton" (the Triton path
    directly, e.g. on CPU under TRITON_INTERPRET=1) or "reference"."""
    check_impl("hc_split_sinkhorn", impl, IMPLS)
    hc, iters, eps = int(hc), int(iters), float(eps)
    check_hc_inputs(mixes, scale, base, hc, iters)
    if impl == "triton":
        from kernels.hc_sinkhorn.triton import hc_split_sinkhorn_triton

        return hc_split_sinkhorn_triton(mixes, scale, base, hc, iters, eps)
    if impl == "reference":
        return hc_split_sinkhorn_reference(mixes, scale, base, hc, iters, eps)
    return hc_split_sinkhorn_op(mixes, scale, base, hc, iters, eps)
