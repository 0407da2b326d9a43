"""Basic building blocks with parameters named as the official checkpoint names them."""
from __future__ import annotations

from typing import Iterator, Mapping, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from kernels.linear import linears_beside
from model.formats import FP8_BLOCK, from_checkpoint, project, scale_shape, storage_dtype, to_checkpoint, weight_shape
from model.parallel import ONE_PROCESS, Parallel, all_reduce


def empty_weight(fmt: str, out: int, inp: int, dtype: torch.dtype, device, leading: tuple[int, ...] = ()) -> nn.Parameter:
    shape = leading + weight_shape(fmt, out, inp)
    return nn.Parameter(torch.empty(shape, dtype=storage_dtype(fmt, dtype), device=device), requires_grad=False)


def empty_scale(fmt: str, out: int, inp: int, scale_dtype: torch.dtype, device, leading: tuple[int, ...] = ()) -> nn.Parameter | None:
    shape = scale_shape(fmt, out, inp)
    if shape is None:
        return None
    return nn.Parameter(torch.empty(leading + shape, dtype=scale_dtype, device=device), requires_grad=False)


class Linear(nn.Module):
    """y = x W^T with W stored [out, in] in `fmt` (model/formats.py; no bias in V4), with its
    block scales as `scale` where the format has them. Left uninitialised: weights come from
    `Decoder.load_official` or `Decoder.init_random`."""

    def __init__(
        self, in_features: int, out_features: int, dtype: torch.dtype, device=None, fmt: str = "dense",
        scale_dtype: torch.dtype = torch.float8_e8m0fnu, pow2: bool = True,
    ):
        super().__init__()
        self.pow2 = pow2
        self.weight = empty_weight(fmt, out_features, in_features, dtype, device)
        self.scale = empty_scale(fmt, out_features, in_features, scale_dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return project(x, self.weight, self.scale, self.pow2)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "weight"] = to_checkpoint(destination[prefix + "weight"])

    def _load_from_state_dict(self, state_dict, prefix, *args):
        key = prefix + "weight"
        if key in state_dict:
            state_dict[key] = from_checkpoint(state_dict[key])
        super()._load_from_state_dict(state_dict, prefix, *args)


class LinearView(nn.Module):
    """A projection whose weight (and scale) is a block of rows of a FusedLinear's. It holds no
    parameter of its own but keeps the projection's official name: `.weight` is that block, and
    state_dict() saves and loads `<name>.weight` (and `<name>.scale`) through it (views of the
    fused tensors)."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self._source: tuple[FusedLinear, int] | None = None  # (fused module, first row); set by FusedLinear

    def _fused(self) -> tuple["FusedLinear", int]:
        if self._source is None:
            raise RuntimeError("this LinearView is not part of a FusedLinear yet")
        return self._source

    @property
    def weight(self) -> torch.Tensor:
        fused, start = self._fused()
        return fused.weight[start : start + self.out_features]

    @property
    def scale(self) -> torch.Tensor | None:
        fused, start = self._fused()
        if fused.scale is None:
            return None
        rows = fused.scale.shape[0] * self.out_features // fused.weight.shape[0]  # FP8: whole 128-row blocks
        first = fused.scale.shape[0] * start // fused.weight.shape[0]
        return fused.scale[first : first + rows]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused, _ = self._fused()
        return project(x, self.weight, self.scale, fused.pow2)  # the unfused product

    def own_tensors(self) -> list[tuple[str, torch.Tensor]]:
        return [("weight", self.weight)] + ([("scale", self.scale)] if self.scale is not None else [])

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        for name, tensor in self.own_tensors():
            destination[prefix + name] = to_checkpoint(tensor if keep_vars else tensor.detach())

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        own = dict(self.own_tensors())
        if strict:
            unexpected_keys.extend(k for k in state_dict if k.startswith(prefix) and k[len(prefix):] not in own)
        for name, target in own.items():
            key = prefix + name
            if key not in state_dict:
                missing_keys.append(key)
                continue
            value = from_checkpoint(state_dict[key])
            if value.shape != target.shape:
                error_msgs.append(f"size mismatch for {key}: got {list(value.shape)}, the model has {list(target.shape)}")
                continue
            with torch.no_grad():
                target.copy_(value)


class FusedLinear(nn.Module):
    """Projections of one input run as one product: their weights (and FP8 scales) are stacked
    along the output dimension in one parameter, and forward returns {name: product} (column
    blocks of the one result). With FP8 weights each projection's outputs must fill whole
    128-row scale blocks. The stacked parameters are not in state_dict(): each projection's
    LinearView saves and loads its rows under its official name."""

    def __init__(
        self, views: Mapping[str, LinearView], dtype: torch.dtype, device=None, fmt: str = "dense",
        scale_dtype: torch.dtype = torch.float8_e8m0fnu, pow2: bool = True,
    ):
        super().__init__()
        if not views:
            raise ValueError("FusedLinear needs at least one projection")
        widths = {name: view.in_features for name, view in views.items()}
        if len(set(widths.values())) != 1:
            raise ValueError(f"fused projections must read inputs of one width, got {widths}")
        bound = [name for name, view in views.items() if view._source is not None]
        if bound:
            raise ValueError(f"projections already fused elsewhere: {bound}")
        if fmt == "fp4":
            raise ValueError("FusedLinear takes dense or FP8 weights")
        ragged = [name for name, view in views.items() if fmt == "fp8" and view.out_features % FP8_BLOCK]
        if ragged:
            raise ValueError(f"FP8 projections fused into one must have whole {FP8_BLOCK}-row scale blocks: {ragged}")
        self.names = tuple(views)
        self.sizes = tuple(view.out_features for view in views.values())
        self.pow2 = pow2
        in_features = next(iter(widths.values()))
        self.weight = empty_weight(fmt, sum(self.sizes), in_features, dtype, device)
        self.scale = empty_scale(fmt, sum(self.sizes), in_features, scale_dtype, device)
        start = 0
        for view in views.values():
            view._source = (self, start)  # a plain attribute: the view must not own this module
            start += view.out_features

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return self.split(project(x, self.weight, self.scale, self.pow2))

    def split(self, product: torch.Tensor) -> dict[str, torch.Tensor]:
        """{projection name: its columns} of the one product."""
        return dict(zip(self.names, product.split(self.sizes, dim=-1)))

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        pass  # the LinearViews save the rows under their official names

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        if strict:
            unexpected_keys.extend(k for k in state_dict if k.startswith(prefix))


def fused_products(calls: list[tuple["FusedLinear", torch.Tensor]]) -> dict[str, torch.Tensor]:
    """{projection name: product} of every (FusedLinear, its input): one product alone, several
    through `linears_beside` (on CUDA the first on the current stream, the others beside it on a
    side stream), for the products of one input that differ in weight format."""
    if len(calls) == 1:
        fused, x = calls[0]
        return fused(x)
    pow2 = {fused.pow2 for fused, _ in calls if fused.scale is not None}
    if len(pow2) > 1:
        raise ValueError("fused_products: the block-scaled products must agree on pow2")
    products = linears_beside([x for _, x in calls], [f.weight for f, _ in calls], [f.scale for f, _ in calls],
                              pow2.pop() if pow2 else True)
    return {name: t for (fused, _), product in zip(calls, products) for name, t in fused.split(product).items()}


def official_parameters(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """named_parameters() as if no projection were fused: in the same order, each FusedLinear's
    weight is replaced by its LinearViews' blocks, each under its official name and at its
    official place (the views write through to the fused weight). A module that stores other
    modules' weights beside its own says which part is its own with `own_parameters()`."""
    for prefix, submodule in module.named_modules():
        dot = prefix + "." if prefix else ""
        if isinstance(submodule, LinearView):
            for name, tensor in submodule.own_tensors():
                yield dot + name, tensor
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
    """The token embedding; split across ranks, rank r holds the r-th contiguous part of the
    vocabulary: a token outside it is looked up as row 0 and zeroed, and the ranks' rows summed."""

    def __init__(self, vocab_size: int, dim: int, dtype: torch.dtype, device=None, parallel: Parallel = ONE_PROCESS):
        super().__init__()
        self.parallel = parallel
        if parallel.world_size > 1:
            # A buffer rather than a number in the code: every rank traces the same graph (fuse/step.py).
            self.register_buffer("first", torch.tensor(parallel.first(vocab_size), device=device), persistent=False)
        rows = parallel.local(vocab_size)
        self.weight = nn.Parameter(torch.empty(rows, dim, dtype=dtype, device=device), requires_grad=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.parallel.world_size == 1:
            return F.embedding(tokens, self.weight)
        local = tokens - self.first
        outside = (local < 0) | (local >= self.weight.shape[0])
        rows = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside[:, None], 0)
        return all_reduce(rows, self.parallel)


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

    def check_batch(self, rows: torch.Tensor) -> None:
        """States that every per-sequence tensor has `rows`' batch: a compiled block that gets each
        input with a batch size of its own (unknown, to serve every size) must be told they agree."""
        for t in self.per_sequence():
            torch._check(t.shape[0] == rows.shape[0])
