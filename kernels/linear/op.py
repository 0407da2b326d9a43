"""Decode-shaped projections: y = x W^T for a few rows of x and a weight whose reduction
dimension is at least its output dimension (K >= N), alone or as groups that each have their
own weight (the grouped low-rank output projection).

At decode batch sizes such a product reads the whole weight for a handful of rows. cuBLAS
splits K across programs for these shapes (N alone gives too few tiles to fill the GPU) and
then launches a second kernel to add the partial products; a grouped product through einsum
is a batched GEMM whose [G, M, N] result needs a transposing copy before the next product.
`torch.ops.v4.grouped_linear` on CUDA runs one Triton kernel instead (kernels/linear/triton.py):
every program owns a strip of one group's output columns for all rows, streams its strip of the
weight once over the whole of K, and writes [M, G, N] directly; no split, no second launch, no
copy. One row whose strips would leave SMs idle takes a CUDA-core GEMV with narrower strips
instead (the x projection at batch 1). Larger batches, other shapes and the CPU use the
references (F.linear, einsum). The model's projections (Linear, FusedLinear, the grouped wo_a)
go through it; `python -m kernels.bench --only linear` times it against cuBLAS.
"""
from __future__ import annotations

import torch

from kernels.blockscale.op import blockscale_linear
from kernels.blockscale.ref import check_blockscale_inputs
from kernels.impl import COMMON_IMPLS, check_impl
from kernels.linear.ref import (
    HALF_DTYPES,
    MAX_ROWS,
    check_grouped_inputs,
    check_linear_inputs,
    grouped_linear_reference,
    linear_reference,
    upcasts_weight,
)
from kernels.side_stream import run_beside

IMPLS = COMMON_IMPLS


def takes_kernel(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a product runs the Triton kernel: a CUDA half-precision weight with K >= N (per
    group), x in its dtype or in fp32 (`upcasts_weight`: one row only, else the reference inside
    the op). Only then does `linear` go through the custom op (grouped products always do).
    Depends on the weight and the device only, never on the batch, so a graph compiled for a
    symbolic batch holds no batch-size guard for it."""
    return x.is_cuda and weight.dtype in HALF_DTYPES and weight.shape[-1] >= weight.shape[-2]


@torch.library.custom_op("v4::grouped_linear", mutates_args=())
def grouped_linear_op(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return _contiguous_reference(x, weight)


def _contiguous_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # einsum leaves [M, G, N] strided as its batched GEMM wrote it; the op (and its fake) promise
    # a contiguous result, which compiled graphs assert.
    return grouped_linear_reference(x, weight).contiguous()


@grouped_linear_op.register_fake
def _(x, weight):
    return x.new_empty((x.shape[0], x.shape[1], weight.shape[1]))


@grouped_linear_op.register_kernel("cuda")
def _(x, weight):
    strided_k = x.stride(-1) != 1 or weight.stride(-1) != 1
    # An upcast weight takes the GEMV (one row); more rows keep the library's fp32 product.
    rows_limit = 1 if upcasts_weight(x, weight) else MAX_ROWS
    if not takes_kernel(x, weight) or x.shape[0] > rows_limit or strided_k:
        return _contiguous_reference(x, weight)
    from kernels.linear.triton import linear_triton  # triton only where the kernel runs

    return linear_triton(x, weight)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    """x [M, G, K] and weight [G, N, K] -> [M, G, N], each group its own product. impl: "auto"
    (the custom op: the Triton kernel where `takes_kernel` says so, else the einsum reference),
    "triton" (the Triton kernel directly, e.g. on CPU under TRITON_INTERPRET=1) or "reference".
    The grouped product stays opaque to the compiler on every device: Inductor's batched-product
    lowering guards the row count against 1, which a graph shared by every batch size cannot have."""
    check_impl("grouped_linear", impl, IMPLS)
    check_grouped_inputs(x, weight)
    return _grouped_linear_checked(x, weight, impl)


def _grouped_linear_checked(x: torch.Tensor, weight: torch.Tensor, impl: str) -> torch.Tensor:
    if impl == "triton":
        from kernels.linear.triton import linear_triton

        return linear_triton(x, weight)
    if impl == "reference":
        return grouped_linear_reference(x, weight)
    return grouped_linear_op(x, weight)


def linear(x: torch.Tensor, weight: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T: F.linear, or the one-group case of `grouped_linear` where
    `takes_kernel` says so (impl as there)."""
    check_impl("linear", impl, IMPLS)
    check_linear_inputs(x, weight)
    if impl == "reference" or (impl == "auto" and not takes_kernel(x, weight)):
        return linear_reference(x, weight)
    rows = x.reshape(-1, 1, x.shape[-1])  # one group: already checked, as [M, 1, K] and [1, N, K]
    return _grouped_linear_checked(rows, weight.unsqueeze(0), impl).view(*x.shape[:-1], weight.shape[0])


@torch.library.custom_op("v4::linears_beside", mutates_args=())
def linears_beside_op(inputs: list[torch.Tensor], weights: list[torch.Tensor], scales: list[torch.Tensor | None],
                      pow2: bool) -> list[torch.Tensor]:
    return [_product(x, w, s, pow2, "reference") for x, w, s in zip(inputs, weights, scales)]


@linears_beside_op.register_fake
def _(inputs, weights, scales, pow2):
    return [x.new_empty((*x.shape[:-1], w.shape[0])) for x, w in zip(inputs, weights)]


# Products that must go beside the first for the side stream to pay: with two it gains at every
# batch; with one it is no faster beyond the spread of runs (0.88x to 1.14x at one row, a ~17 us
# pair), so one stream keeps the graph simpler (`python -m kernels.bench --only linears_beside`).
MIN_SIDE_PRODUCTS = 2


@linears_beside_op.register_kernel("cuda")
def _(inputs, weights, scales, pow2):
    return run_products(inputs, weights, scales, pow2, beside=len(inputs) - 1 >= MIN_SIDE_PRODUCTS)


def run_products(inputs: list[torch.Tensor], weights: list[torch.Tensor], scales: list[torch.Tensor | None], pow2: bool,
                 beside: bool) -> list[torch.Tensor]:
    """Every product through its own op; with `beside` (CUDA) all but the first on the side stream."""

    def products(which: range) -> list[torch.Tensor]:
        return [_product(inputs[i], weights[i], scales[i], pow2, "auto").contiguous() for i in which]

    if not beside:
        return products(range(len(inputs)))
    rest, first = run_beside(lambda: products(range(1, len(inputs))), lambda: products(range(1)), inputs[0].device)
    return first + rest


def _product(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, pow2: bool, impl: str) -> torch.Tensor:
    """x W^T: `linear` for a dense weight, the block-scaled product for one with scales (impl as theirs)."""
    return linear(x, weight, impl) if scale is None else blockscale_linear(x, weight, scale, pow2, impl)


def linears_beside(
    inputs: list[torch.Tensor], weights: list[torch.Tensor], scales: list[torch.Tensor | None], pow2: bool = True,
    impl: str = "auto",
) -> list[torch.Tensor]:
    """[inputs[i] weights[i]^T for every i], each as `linear` (no scale) or `blockscale_linear`
    (its block scales) computes it, in its input's dtype: the products of one step's input that
    no other launch can hold (weights of several formats). impl "auto": the custom op, on CUDA
    the first product on the current stream and, where at least MIN_SIDE_PRODUCTS follow it, those
    on a side stream beside it (small products are latency-bound: one alone leaves most SMs idle);
    "reference" or "triton": each product's, one after another."""
    check_impl("linears_beside", impl, IMPLS)
    if not inputs or not len(inputs) == len(weights) == len(scales):
        raise ValueError(f"linears_beside: needs as many inputs, weights and scales (at least one), got "
                         f"{len(inputs)}, {len(weights)}, {len(scales)}")
    for i, (x, w, s) in enumerate(zip(inputs, weights, scales)):
        try:
            if s is None:
                check_linear_inputs(x, w)
            else:
                check_blockscale_inputs(x, w, s)
        except ValueError as error:
            raise ValueError(f"linears_beside: product {i}: {error}") from None
    if impl == "auto":
        return linears_beside_op(list(inputs), list(weights), list(scales), bool(pow2))
    return [_product(x, w, s, pow2, impl) for x, w, s in zip(inputs, weights, scales)]
