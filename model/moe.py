"""Mixture of experts: hash- or score-routed top-k experts plus one shared expert, all with the
clamped SwiGLU. Routed experts are stored stacked ([E, out, in]) for the grouped kernel, and
appear in state_dict() under the official per-expert names."""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

import kernels
from kernels.moe import swiglu
from model.config import ModelConfig
from model.layers import FusedLinear, Linear, LinearView, fp32_linear


def top_k_by_rounds(keys: torch.Tensor, values: torch.Tensor, k: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The indices [B, 1] of the k largest keys along the last dim, largest first, and the values
    [B, 1] at them, as k rounds of argmax that each mask the pick: the compiled gate's form of
    topk + gather. Inductor fuses all rounds over a row of experts into one kernel, where ATen's
    top-k is a select and a sort kernel of their own. Ties go to the lower index (topk leaves
    their order open)."""
    column = torch.arange(keys.shape[-1], device=keys.device)
    ids, picked = [], []
    for _ in range(k):
        best = keys.argmax(-1, keepdim=True)
        hit = column == best
        ids.append(best)
        picked.append(torch.where(hit, values, 0.0).sum(-1, keepdim=True))  # exact: one nonzero term
        keys = torch.where(hit, float("-inf"), keys)
    return ids, picked


class Gate(nn.Module):
    """Routing weights: sqrt(softplus(x W^T)) in fp32. Hash layers take the experts from a
    token -> experts table; the others pick the top-k of the scores plus a selection-only bias.
    The picked scores are renormalised and scaled by route_scale."""

    def __init__(self, cfg: ModelConfig, hashed: bool, dtype: torch.dtype, device=None):
        super().__init__()
        self.topk = cfg.n_activated_experts
        self.route_scale = cfg.route_scale
        self.hashed = hashed
        self.exact = cfg.fp32_products == "exact"
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.dim, dtype=dtype, device=device), requires_grad=False)
        if hashed:
            self.tid2eid = nn.Parameter(
                torch.empty(cfg.vocab_size, self.topk, dtype=torch.int32, device=device), requires_grad=False
            )
        else:
            self.bias = nn.Parameter(torch.empty(cfg.n_routed_experts, dtype=torch.float32, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # The official code upcasts the weight each call; "fast" multiplies in the model dtype.
        logits = fp32_linear(x, self.weight.float() if self.exact else self.weight)
        scores = F.softplus(logits).sqrt()
        if not self.hashed and torch.compiler.is_compiling():
            ids, picked = top_k_by_rounds(scores + self.bias, scores, self.topk)
            # Renormalised pick by pick before concatenating, so that the sum and the scaling
            # join the rounds' kernel instead of a kernel over the concatenated weights.
            total = functools.reduce(torch.add, picked)
            return torch.cat([p / total * self.route_scale for p in picked], -1), torch.cat(ids, -1)
        if self.hashed:
            ids = self.tid2eid[tokens].long()
        else:
            ids = (scores + self.bias).topk(self.topk, dim=-1).indices
        weights = scores.gather(1, ids)
        weights = weights / weights.sum(-1, keepdim=True) * self.route_scale
        return weights, ids


class RoutedExperts(nn.Module):
    """Stacked expert weights w1, w3 [E, inter, dim] and w2 [E, dim, inter]."""

    NAMES = ("w1", "w2", "w3")

    def __init__(self, n_experts: int, dim: int, inter: int, dtype: torch.dtype, device=None):
        super().__init__()
        self.n_experts = n_experts
        for name, shape in (("w1", (inter, dim)), ("w2", (dim, inter)), ("w3", (inter, dim))):
            param = nn.Parameter(torch.empty(n_experts, *shape, dtype=dtype, device=device), requires_grad=False)
            self.register_parameter(name, param)
        self.register_state_dict_post_hook(self._split_per_expert)
        self.register_load_state_dict_pre_hook(self._stack_per_expert)

    @staticmethod
    def _split_per_expert(module, state_dict, prefix, local_metadata):
        for name in RoutedExperts.NAMES:
            stacked = state_dict.pop(prefix + name)
            for e in range(module.n_experts):
                state_dict[f"{prefix}{e}.{name}.weight"] = stacked[e]

    @staticmethod
    def _stack_per_expert(module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        for name in RoutedExperts.NAMES:
            keys = [f"{prefix}{e}.{name}.weight" for e in range(module.n_experts)]
            if all(k in state_dict for k in keys):
                state_dict[prefix + name] = torch.stack([state_dict.pop(k) for k in keys])

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, swiglu_limit: float) -> torch.Tensor:
        return kernels.moe_experts(x, ids, weights, self.w1, self.w2, self.w3, swiglu_limit)


class SharedExpert(nn.Module):
    """w1 and w3 read the same input: they run as one GEMM (w13), keeping their official names."""

    def __init__(self, dim: int, inter: int, swiglu_limit: float, dtype: torch.dtype, device=None):
        super().__init__()
        self.swiglu_limit = swiglu_limit
        self.w1 = LinearView(dim, inter)
        self.w2 = Linear(inter, dim, dtype, device)
        self.w3 = LinearView(dim, inter)
        self.w13 = FusedLinear({"w1": self.w1, "w3": self.w3}, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.w13(x)
        return self.w2(swiglu(h["w1"], h["w3"], self.swiglu_limit).to(x.dtype))


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, dtype: torch.dtype, device=None):
        super().__init__()
        self.swiglu_limit = cfg.swiglu_limit
        self.gate = Gate(cfg, layer_id < cfg.n_hash_layers, dtype, device)
        self.experts = RoutedExperts(cfg.n_routed_experts, cfg.dim, cfg.moe_inter_dim, dtype, device)
        self.shared_experts = SharedExpert(cfg.dim, cfg.moe_inter_dim, cfg.swiglu_limit, dtype, device)

    def forward(self, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x, tokens)
        routed = self.experts(x, ids, weights, self.swiglu_limit)  # fp32 sum of per-expert outputs
        return (routed + self.shared_experts(x).float()).to(x.dtype)
