"""Mixture of experts: hash- or score-routed top-k experts plus one shared expert, all with the
clamped SwiGLU. All experts are stored stacked ([E + 1, out, in], the shared one last) for the
grouped kernel, and appear in state_dict() under their official names."""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

import kernels
from kernels.moe import swiglu
from model.config import ModelConfig
from model.layers import LinearView, fp32_linear


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


class Experts(nn.Module):
    """The routed experts 0..E-1 and the shared expert E, stacked: w1, w3 [E+1, inter, dim] and
    w2 [E+1, dim, inter], so that the grouped kernel runs the shared expert as every token's last
    pick (kernels.moe_experts' shared_expert) in the routed experts' launches. The routed
    experts appear in state_dict() under their official per-expert names; the shared expert's
    rows belong to MoE.shared_experts, which saves and loads them."""

    NAMES = ("w1", "w2", "w3")

    def __init__(self, n_routed: int, dim: int, inter: int, dtype: torch.dtype, device=None):
        super().__init__()
        self.n_routed = n_routed
        self.shared_index = n_routed
        for name, shape in (("w1", (inter, dim)), ("w2", (dim, inter)), ("w3", (inter, dim))):
            param = nn.Parameter(torch.empty(n_routed + 1, *shape, dtype=dtype, device=device), requires_grad=False)
            self.register_parameter(name, param)
        self.register_state_dict_post_hook(self._split_per_expert)
        self.register_load_state_dict_pre_hook(self._stack_per_expert)

    def own_parameters(self):
        """The routed experts' rows (model.layers.official_parameters)."""
        return [(name, getattr(self, name)[: self.n_routed]) for name in self.NAMES]

    @staticmethod
    def _split_per_expert(module, state_dict, prefix, local_metadata):
        for name in Experts.NAMES:
            stacked = state_dict.pop(prefix + name)
            for e in range(module.n_routed):
                state_dict[f"{prefix}{e}.{name}.weight"] = stacked[e]

    @staticmethod
    def _stack_per_expert(module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        # The shared row keeps its value here; MoE.shared_experts loads it afterwards.
        for name in Experts.NAMES:
            keys = [f"{prefix}{e}.{name}.weight" for e in range(module.n_routed)]
            if all(k in state_dict for k in keys):
                shared = getattr(module, name)[module.n_routed :].detach()
                state_dict[prefix + name] = torch.cat([torch.stack([state_dict.pop(k) for k in keys]).to(shared), shared])

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, swiglu_limit: float) -> torch.Tensor:
        """fp32 sum over each token's routed picks ids [B, k] of its expert's output times
        weights [B, k], then the shared expert's output (its last pick, weight 1)."""
        return kernels.moe_experts(x, ids, weights, self.w1, self.w2, self.w3, swiglu_limit, shared_expert=self.shared_index)


class ExpertView(LinearView):
    """One of the shared expert's projections: its row of an Experts stack, saved and loaded under
    the projection's official name (see LinearView)."""

    def __init__(self, experts: Experts, name: str):
        out_features, in_features = getattr(experts, name).shape[1:]
        super().__init__(in_features, out_features)
        self._stack = (experts, name)  # a tuple, so that the stack is not registered twice

    @property
    def weight(self) -> torch.Tensor:
        experts, name = self._stack
        return getattr(experts, name)[experts.shared_index]


class SharedExpert(nn.Module):
    """The shared expert, whose weights are the last row of the Experts stacks. forward() runs it
    on its own (the unfused product, for comparison); MoE runs it inside the grouped kernel."""

    def __init__(self, experts: Experts, swiglu_limit: float):
        super().__init__()
        self.swiglu_limit = swiglu_limit
        self.w1, self.w2, self.w3 = (ExpertView(experts, name) for name in Experts.NAMES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = swiglu(self.w1(x), self.w3(x), self.swiglu_limit)
        return self.w2(h.to(x.dtype))


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, dtype: torch.dtype, device=None):
        super().__init__()
        self.swiglu_limit = cfg.swiglu_limit
        self.gate = Gate(cfg, layer_id < cfg.n_hash_layers, dtype, device)
        self.experts = Experts(cfg.n_routed_experts, cfg.dim, cfg.moe_inter_dim, dtype, device)
        self.shared_experts = SharedExpert(self.experts, cfg.swiglu_limit)

    def forward(self, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x, tokens)
        # The shared expert runs as every token's last pick with weight 1 (exact in the fp32
        # SwiGLU), so the fp32 sum is the official one: the routed picks, then the shared output.
        return self.experts(x, ids, weights, self.swiglu_limit).to(x.dtype)
