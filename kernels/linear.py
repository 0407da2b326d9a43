"""Decode-shaped projections: y = x W^T for a few rows of x and a weight whose reduction
dimension is at least its output dimension (K >= N).

At decode batch sizes such a product reads the whole weight for a handful of rows. cuBLAS
splits K across programs for these shapes (N alone gives too few tiles to fill the GPU) and
then launches a second kernel to add the partial products. `torch.ops.v4.linear` on CUDA runs
one Triton kernel instead (kernels/linear_triton.py): every program owns a strip of output
columns for all rows, streams its strip of the weight once over the whole of K, and writes
the result; no split, no second launch. Larger batches, other shapes and the CPU use
`F.linear`, the reference.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

# Rows up to this count take the Triton kernel (one tile of rows per program); more rows go to
# cuBLAS, which is compute-efficient there and has no reason to split K.
MAX_ROWS = 64
HALF_DTYPES = (torch.bfloat16, torch.float16)


def linear_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.linear(x, weight)


def takes_kernel(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear` routes this product through the custom op: a CUDA half-precision weight
    with K >= N. Depends on the weight and the device only, never on the batch, so a graph
    compiled for a symbolic batch holds no batch-size guard for it."""
    return x.is_cuda and weight.dtype in HALF_DTYPES and weight.shape[1] >= weight.shape[0]


def check_linear_inputs(x: torch.Tensor, weight: torch.Tensor) -> None:
    if weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"linear: x [..., K] and weight [N, K] must agree on K; got {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.dtype != weight.dtype:
        raise ValueError(f"linear: x and weight must have one dtype, got {x.dtype} and {weight.dtype}")


@torch.library.custom_op("v4::linear", mutates_args=())
def linear_op(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return linear_reference(x, weight)


@linear_op.register_fake
def _(x, weight):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@linear_op.register_kernel("cuda")
def _(x, weight):
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if rows == 0 or rows > MAX_ROWS or x.dtype not in HALF_DTYPES:
        return linear_reference(x, weight)
    from kernels.linear_triton import linear_triton  # triton only where the kernel runs

    return linear_triton(x.reshape(rows, x.shape[-1]), weight).view(*x.shape[:-1], weight.shape[0])


IMPLS = ("auto", "triton", "reference")


def linear(x: torch.Tensor, weight: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T. impl: "auto" (the custom op where `takes_kernel` says so,
    else F.linear), "triton" (the Triton kernel directly, e.g. on CPU under TRITON_INTERPRET=1;
    x must be 2-D) or "reference"."""
    if impl not in IMPLS:
        raise ValueError(f"linear: impl must be one of {IMPLS}, got {impl!r}")
    if impl == "reference":
        return linear_reference(x, weight)
    check_linear_inputs(x, weight)
    if impl == "triton":
        from kernels.linear_triton import linear_triton

        return linear_triton(x, weight)
    return linear_op(x, weight) if takes_kernel(x, weight) else linear_reference(x, weight)
