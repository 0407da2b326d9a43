"""Basic building blocks with parameters named as the official checkpoint names them."""
from __future__ import annotations

from typing import Iterator, Mapping, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from kernels.linear import linear


class Linear(nn.Module):
    """y = x W^T with W stored [out, in] (no bias in V4). Left uninitialised: weights come
    from `Decoder.load_official` or `Decoder.init_random`."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight)


class LinearView(nn.Module):
    """A projection whose weight is a block of rows of a FusedLinear's weight. It holds no
    parameter of its own but keeps the projection's official name: `.weight` is that block,
    and state_dict() saves and loads `<name>.weight` through it (a view of the fused weight)."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self._source: tuple[FusedLinear, int] | None = None  # (fused module, first row); set by FusedLinear

    @property
    def weight(self) -> torch.Tensor:
        if self._source is None:
            raise RuntimeError("this LinearView is not part of a FusedLinear yet")
        fused, start = self._source
        return fused.weight[start : start + self.out_features]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight)  # the unfused product

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        weight = self.weight
        destination[prefix + "weight"] = weight if keep_vars else weight.detach()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        key = prefix + "weight"
        if strict:
            unexpected_keys.extend(k for k in state_dict if k.startswith(prefix) and k != key)
        if key not in state_dict:
            missing_keys.append(key)
            return
        value, weight = state_dict[key], self.weight
        if value.shape != weight.shape:
            error_msgs.append(f"size mismatch for {key}: got {list(value.shape)}, the model has {list(weight.shape)}")
            return
        with torch.no_grad():
            weight.copy_(value)


class FusedLinear(nn.Module):
    """Projections of one input run as one GEMM: their weights are stacked along the output
    dimension in one [sum of outputs, in] parameter, and forward returns {name: product} (column
    blocks of the one result). The stacked parameter is not in state_dict(): each projection's
    LinearView saves and loads its rows under its official name."""

    def __init__(self, views: Mapping[str, LinearView], dtype: torch.dtype, device=None):
        super().__init__()
        if not views:
            raise ValueError("FusedLinear needs at least one projection")
        widths = {name: view.in_features for name, view in views.items()}
        if len(set(widths.values())) != 1:
            raise ValueError(f"fused projections must read inputs of one width, got {widths}")
        bound = [name for name, view in views.items() if view._source is not None]
        if bound:
            raise ValueError(f"projections already fused elsewhere: {bound}")
        self.names = tuple(views)
        self.sizes = tuple(view.out_features for view in views.values())
        in_features = next(iter(widths.values()))
        self.weight = nn.Parameter(torch.empty(sum(self.sizes), in_features, dtype=dtype, device=device), requires_grad=False)
        start = 0
        for view in views.values():
            view._source = (self, start)  # a plain attribute: the view must not own this module
            start += view.out_features

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return dict(zip(self.names, linear(x, self.weight).split(self.sizes, dim=-1)))

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        pass  # the LinearViews save the rows under their official names

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        if strict:
            unexpected_keys.extend(k for k in state_dict if k.startswith(prefix))


def official_parameters(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """named_parameters() as if no projection were fused: in the same order, each FusedLinear's
    weight is replaced by its LinearViews' blocks, each under its official name and at its
    official place (the views write through to the fused weight). A module that stores other
    modules' weights beside its own says which part is its own with `own_parameters()`."""
    for prefix, submodule in module.named_modules():
        dot = prefix + "." if prefix else ""
        if isinstance(submodule, LinearView):
            yield dot + "weight", submodule.weight
        elif hasattr(submodule, "own_parameters"):
            for name, param in submodule.own_parameters():
                yield dot + name, param
        elif not isinstance(submodule, FusedLinear):
            for name, param in submodule.named_parameters(recurse=False):
                yield dot + name, param


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
    """Per-step tensors every layer reads, on the model's device: one row per sequence, except
    the compressed-rope table."""

    tokens: torch.Tensor  # int64 token ids
    positions: torch.Tensor  # int64 position of each sequence's new token
    slots: torch.Tensor  # int64 cache slot of each sequence
    rope_window: torch.Tensor  # [B, rope_dim/2, 2] cos/sin at the position, window-only layers
    rope_compress: torch.Tensor  # same for compressed layers and their indexer (YaRN)
    rope_compress_table: torch.Tensor  # [max_seq_len, rope_dim/2, 2], for compressed entries' positions

    def per_sequence(self) -> tuple[torch.Tensor, ...]:
        """The tensors whose dim 0 is the batch (a compiler may mark it symbolic)."""
        return self.tokens, self.positions, self.slots, self.rope_window, self.rope_compress
