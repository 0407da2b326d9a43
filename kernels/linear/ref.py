"""Decode-shaped projections, y = x W^T alone or per group: the plain-torch references, the input
checks and the shapes the Triton kernel takes.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

# Rows up to this count take the Triton kernel (one tile of rows per program); more rows go to
# cuBLAS, which is compute-efficient there and has no reason to split K.
MAX_ROWS = 64
HALF_DTYPES = (torch.bfloat16, torch.float16)


def grouped_linear_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, G, K], weight [G, N, K] -> [M, G, N]: out[:, g] = x[:, g] @ weight[g]^T."""
    return torch.einsum("mgk,gnk->mgn", x, weight.to(x.dtype))


def linear_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.linear(x, weight.to(x.dtype))


def upcasts_weight(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """fp32 x with a half-precision weight: the product in fp32, the weight upcast (exactly) as read."""
    return x.dtype == torch.float32 and weight.dtype in HALF_DTYPES


def check_dtypes(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dtype != weight.dtype and not upcasts_weight(x, weight):
        raise ValueError(
            f"linear: x and weight must have one dtype, or x fp32 with a bf16/fp16 weight; got {x.dtype} and {weight.dtype}"
        )


def check_grouped_inputs(x: torch.Tensor, weight: torch.Tensor) -> None:
    if weight.dim() != 3 or x.dim() != 3 or x.shape[1:] != (weight.shape[0], weight.shape[2]):
        raise ValueError(
            f"linear: x [M, G, K] and weight [G, N, K] must agree on G and K; got {tuple(x.shape)} and {tuple(weight.shape)}"
        )
    check_dtypes(x, weight)


def check_linear_inputs(x: torch.Tensor, weight: torch.Tensor) -> None:
    if weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"linear: x [..., K] and weight [N, K] must agree on K; got {tuple(x.shape)} and {tuple(weight.shape)}")
    check_dtypes(x, weight)
