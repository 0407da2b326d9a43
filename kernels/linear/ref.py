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
    return torch.einsum("mgk,gnk->mgn", x, weight)


def linear_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.linear(x, weight)


def check_same_dtype(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dtype != weight.dtype:
        raise ValueError(f"linear: x and weight must have one dtype, got {x.dtype} and {weight.dtype}")


def check_grouped_inputs(x: torch.Tensor, weight: torch.Tensor) -> None:
    if weight.dim() != 3 or x.dim() != 3 or x.shape[1:] != (weight.shape[0], weight.shape[2]):
        raise ValueError(
            f"linear: x [M, G, K] and weight [G, N, K] must agree on G and K; got {tuple(x.shape)} and {tuple(weight.shape)}"
        )
    check_same_dtype(x, weight)


def check_linear_inputs(x: torch.Tensor, weight: torch.Tensor) -> None:
    if weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"linear: x [..., K] and weight [N, K] must agree on K; got {tuple(x.shape)} and {tuple(weight.shape)}")
    check_same_dtype(x, weight)
