"""How a linear's weight is stored: "dense" (the model dtype), "fp8" (e4m3 with one scale per
128 x 128 block) or "fp4" (e2m1 codes packed two per byte with one scale per 32 inputs), as the
official checkpoints store them (kernels/blockscale/ref.py), and the official product on each."""
from __future__ import annotations

import torch

from kernels.blockscale import FP4_BLOCK, FP8_BLOCK, blockscale_linear
from kernels.linear import linear

FORMATS = ("dense", "fp8", "fp4")
FP4_CHECKPOINT_DTYPE = torch.float4_e2m1fn_x2  # held as uint8: Inductor takes no float4 tensors


def scale_dtype_of(scale_dtype: str) -> torch.dtype:
    """ModelConfig.scale_dtype ("fp8": ue8m0, "fp32") as a torch dtype."""
    return torch.float8_e8m0fnu if scale_dtype == "fp8" else torch.float32


def weight_shape(fmt: str, out: int, inp: int) -> tuple[int, int]:
    return (out, inp // 2) if fmt == "fp4" else (out, inp)


def scale_shape(fmt: str, out: int, inp: int) -> tuple[int, int] | None:
    if fmt == "fp8":
        return -(-out // FP8_BLOCK), -(-inp // FP8_BLOCK)
    if fmt == "fp4":
        return out, inp // FP4_BLOCK
    return None


def storage_dtype(fmt: str, dtype: torch.dtype) -> torch.dtype:
    return {"fp8": torch.float8_e4m3fn, "fp4": torch.uint8}.get(fmt, dtype)


def format_of(weight: torch.Tensor, scale: torch.Tensor | None) -> str:
    if scale is None:
        return "dense"
    return "fp8" if weight.dtype == torch.float8_e4m3fn else "fp4"


def logical_in_features(weight: torch.Tensor, scale: torch.Tensor | None) -> int:
    return weight.shape[-1] * (2 if format_of(weight, scale) == "fp4" else 1)


def project(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, pow2: bool = True) -> torch.Tensor:
    """x W^T in x's dtype: the plain product for a dense weight, the official block-scaled one
    (activations quantised first) for an FP8 or FP4 weight."""
    if scale is None:
        return linear(x, weight)
    return blockscale_linear(x, weight, scale, pow2)


def to_checkpoint(tensor: torch.Tensor) -> torch.Tensor:
    """A packed FP4 weight as checkpoints type it; anything else as it is."""
    return tensor.view(FP4_CHECKPOINT_DTYPE) if tensor.dtype == torch.uint8 else tensor


def from_checkpoint(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.uint8) if tensor.dtype == FP4_CHECKPOINT_DTYPE else tensor
