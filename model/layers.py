"""Basic building blocks with parameters named as the official checkpoint names them."""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """y = x W^T with W stored [out, in] (no bias in V4). Left uninitialised: weights come
    from `Decoder.load_official` or `Decoder.init_random`."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class RMSNorm(nn.Module):
    """RMSNorm with an fp32 weight; math in fp32, result in the input dtype."""

    def __init__(self, dim: int, eps: float, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, dtype=torch.float32, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + self.eps)
        return (self.weight * x32).to(x.dtype)


def fp32_param(*shape: int, device=None) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=torch.float32, device=device), requires_grad=False)


def product_dtype(fp32_products: str, dtype: torch.dtype) -> torch.dtype:
    """Weight dtype of a product the official code runs in fp32 (see ModelConfig.fp32_products)."""
    return torch.float32 if fp32_products == "exact" else dtype


def fp32_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x W^T in W's dtype, returned as fp32: exact for an fp32 W, a half-width product otherwise."""
    return F.linear(x.to(weight.dtype), weight).float()


class Embedding(nn.Module):
    def __init__(self, vocab_size: int, dim: int, dtype: torch.dtype, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, dim, dtype=dtype, device=device), requires_grad=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, self.weight)


class DecodeStep(NamedTuple):
    """Per-step tensors every layer reads, all on the model's device, all [B, ...]."""

    tokens: torch.Tensor  # int64 token ids
    positions: torch.Tensor  # int64 position of each sequence's new token
    slots: torch.Tensor  # int64 cache slot of each sequence
    rope_window: torch.Tensor  # [B, rope_dim/2, 2] cos/sin at the position, window-only layers
    rope_compress: torch.Tensor  # same for compressed layers and their indexer (YaRN)
    rope_compress_table: torch.Tensor  # [max_seq_len, rope_dim/2, 2], for compressed entries' positions
