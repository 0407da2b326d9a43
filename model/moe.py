"""Mixture of experts: hash- or score-routed top-k experts plus one shared expert, all with the
clamped SwiGLU. All experts are stored stacked ([E + 1, out, in], the shared one last) for the
grouped kernel, and appear in state_dict() under their official names.

Split across ranks (model/parallel.py), rank r holds the r-th contiguous share of the routed
experts (and every rank the gate and the shared expert): each rank sums its own experts' picks
in fp32, the ranks' sums are added (one all-reduce), then the shared expert's output, as the
official inference orders the sum."""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

import kernels
from kernels.linear import linear
from kernels.moe import SharedExpertWeights, swiglu
from model.config import ModelConfig
from model.formats import from_checkpoint, logical_in_features, project, scale_dtype_of, to_checkpoint
from model.layers import FusedLinear, Linear, LinearView, empty_scale, empty_weight, fp32_linear
from model.parallel import ONE_PROCESS, Parallel, all_reduce


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
        # The official code upcasts the weight each call (here as it is read, where a kernel
        # takes the shape); "fast" multiplies in the model dtype.
        logits = linear(x.float(), self.weight) if self.exact else fp32_linear(x, self.weight)
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
    """The routed experts 0..E-1 and, where it is stored in their format, the shared expert E,
    stacked: w1, w3 [rows, inter, dim] and w2 [rows, dim, inter] in `fmt` (model/formats.py),
    with their block scales w1_scale, w2_scale, w3_scale where the format has them. Stacked, the
    grouped kernel runs the shared expert as every token's last pick (kernels.moe_experts'
    shared_expert) in the routed experts' launches. The routed experts appear in state_dict()
    under their official per-expert names; the shared expert's rows belong to
    MoE.shared_experts, which saves and loads them. `first` is the official number of the first
    routed expert held (another than 0 where the experts are split across ranks)."""

    NAMES = ("w1", "w2", "w3")

    def __init__(
        self, n_routed: int, dim: int, inter: int, dtype: torch.dtype, device=None, fmt: str = "dense",
        with_shared: bool = True, scale_dtype: torch.dtype = torch.float8_e8m0fnu, pow2: bool = True, first: int = 0,
    ):
        super().__init__()
        self.n_routed = n_routed
        self.first = first
        self.shared_index = n_routed if with_shared else -1
        self.pow2 = pow2
        rows = (n_routed + 1 if with_shared else n_routed,)
        for name, (out, inp) in (("w1", (inter, dim)), ("w2", (dim, inter)), ("w3", (inter, dim))):
            self.register_parameter(name, empty_weight(fmt, out, inp, dtype, device, rows))
            self.register_parameter(f"{name}_scale", empty_scale(fmt, out, inp, scale_dtype, device, rows))
        self.register_state_dict_post_hook(self._split_per_expert)
        self.register_load_state_dict_pre_hook(self._stack_per_expert)

    def stored(self, name: str) -> list[tuple[str, torch.Tensor | None]]:
        """(official leaf, stacked tensor) of projection `name`: its weight and scale."""
        return [("weight", getattr(self, name)), ("scale", getattr(self, f"{name}_scale"))]

    def own_parameters(self):
        """The routed experts' rows, per projection (model.layers.official_parameters)."""
        return [(f"{name}.{leaf}", t[: self.n_routed]) for name in self.NAMES for leaf, t in self.stored(name) if t is not None]

    @staticmethod
    def _split_per_expert(module, state_dict, prefix, local_metadata):
        for name in Experts.NAMES:
            for leaf, key in (("weight", name), ("scale", f"{name}_scale")):
                if prefix + key not in state_dict:
                    continue
                stacked = state_dict.pop(prefix + key)
                for e in range(module.n_routed):
                    state_dict[f"{prefix}{module.first + e}.{name}.{leaf}"] = to_checkpoint(stacked[e])

    @staticmethod
    def _stack_per_expert(module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        # A shared row keeps its value here; MoE.shared_experts loads it afterwards.
        for name in Experts.NAMES:
            for leaf, stacked in module.stored(name):
                keys = [f"{prefix}{module.first + e}.{name}.{leaf}" for e in range(module.n_routed)]
                if stacked is None or not all(k in state_dict for k in keys):
                    continue
                routed = torch.stack([from_checkpoint(state_dict.pop(k)) for k in keys]).to(stacked)
                key = prefix + (name if leaf == "weight" else f"{name}_scale")
                state_dict[key] = torch.cat([routed, stacked[module.n_routed :].detach()])

    def scales(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        if self.w1_scale is None:
            return None
        return self.w1_scale, self.w2_scale, self.w3_scale

    def forward(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, swiglu_limit: float, with_shared: bool = True,
        shared_weights: SharedExpertWeights | None = None,
    ) -> torch.Tensor:
        """fp32 sum over each token's routed picks ids [B, k] (row numbers of the stack; -1 and
        weight 0: no expert) of its expert's output times weights [B, k], then, if stacked here
        and `with_shared`, the shared expert's output (its last pick, weight 1), or that of a
        shared expert of its own FP8 format (`shared_weights`)."""
        return kernels.moe_experts(
            x, ids, weights, self.w1, self.w2, self.w3, swiglu_limit, shared_expert=self.shared_index if with_shared else -1,
            scales=self.scales(), pow2=self.pow2, shared_weights=shared_weights,
        )


class ExpertView(LinearView):
    """One of the shared expert's projections: its row of an Experts stack (and of the stack's
    scales), saved and loaded under the projection's official name (see LinearView)."""

    def __init__(self, experts: Experts, name: str):
        out_features = getattr(experts, name).shape[1]
        super().__init__(logical_in_features(getattr(experts, name), getattr(experts, f"{name}_scale")), out_features)
        self._stack = (experts, name)  # a tuple, so that the stack is not registered twice

    @property
    def weight(self) -> torch.Tensor:
        experts, name = self._stack
        return getattr(experts, name)[experts.shared_index]

    @property
    def scale(self) -> torch.Tensor | None:
        experts, name = self._stack
        scale = getattr(experts, f"{name}_scale")
        return None if scale is None else scale[experts.shared_index]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return project(x, self.weight, self.scale, self._stack[0].pow2)


class SharedExpert(nn.Module):
    """The shared expert: the last row of the Experts stacks where it has the routed experts'
    format (MoE then runs it inside the grouped kernel, and forward() is the unfused product, for
    comparison), otherwise projections of its own, stored as `own_format` says (Linear's keyword
    arguments), that MoE runs after the routed experts: w1 and w3 read the same input and run as
    one product (`gate_up`), w2 on its own."""

    def __init__(self, experts: Experts, swiglu_limit: float, dim: int, inter: int, own_format: dict | None = None):
        super().__init__()
        self.swiglu_limit = swiglu_limit
        self.stacked = own_format is None
        if self.stacked:
            self.w1, self.w2, self.w3 = (ExpertView(experts, name) for name in Experts.NAMES)
        else:
            self.w1, self.w3 = LinearView(dim, inter), LinearView(dim, inter)
            self.w2 = Linear(inter, dim, **own_format)
            self.gate_up = FusedLinear({"w1": self.w1, "w3": self.w3}, **own_format)

    def own_weights(self) -> SharedExpertWeights | None:
        """Its FP8 weights and scales as the routed experts' op takes them (kernels.moe_experts'
        shared_weights), None where it is stacked or its format has no scales."""
        if self.stacked or self.gate_up.scale is None:
            return None
        return SharedExpertWeights(self.gate_up.weight, self.gate_up.scale, self.w2.weight, self.w2.scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.stacked:
            gate, up = self.w1(x), self.w3(x)
        else:
            projected = self.gate_up(x)
            gate, up = projected["w1"], projected["w3"]
        return self.w2(swiglu(gate, up, self.swiglu_limit).to(x.dtype))


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, dtype: torch.dtype, device=None, parallel: Parallel = ONE_PROCESS):
        super().__init__()
        self.parallel = parallel
        self.swiglu_limit = cfg.swiglu_limit
        self.gate = Gate(cfg, layer_id < cfg.n_hash_layers, dtype, device)
        stored = dict(scale_dtype=scale_dtype_of(cfg.scale_dtype), pow2=cfg.pow2_scales)
        # The shared expert joins the routed experts' stacks where it has their format.
        stacked = cfg.expert_format == cfg.linear_format
        self.experts = Experts(
            parallel.local(cfg.n_routed_experts), cfg.dim, cfg.moe_inter_dim, dtype, device, fmt=cfg.expert_format,
            with_shared=stacked, first=parallel.first(cfg.n_routed_experts), **stored,
        )
        own_format = None if stacked else dict(dtype=dtype, device=device, fmt=cfg.linear_format, **stored)
        self.shared_experts = SharedExpert(self.experts, cfg.swiglu_limit, cfg.dim, cfg.moe_inter_dim, own_format)
        if parallel.world_size > 1:
            # The first expert held, as a buffer rather than a number in the code: every rank
            # traces the same graph (fuse/step.py).
            self.register_buffer("experts_first", torch.tensor(self.experts.first, device=device), persistent=False)

    def forward(self, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x, tokens)
        if self.parallel.world_size > 1:
            return self._split_forward(x, weights, ids)
        # Stacked, the shared expert runs as every token's last pick with weight 1 (exact in the
        # fp32 SwiGLU); in FP8 beside FP4 experts, the experts' op runs it beside them (on CUDA
        # on a side stream); either way the fp32 sum is the official one: the routed picks, then
        # the shared output.
        own = self.shared_experts.own_weights() if self.experts.scales() is not None else None
        y = self.experts(x, ids, weights, self.swiglu_limit, shared_weights=own)
        if not self.shared_experts.stacked and own is None:
            y = y + self.shared_experts(x).float()
        return y.to(x.dtype)

    def _split_forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The experts split across ranks: this rank's picks (the others' become no expert, -1
        with weight 0, which the kernel skips), the ranks' fp32 sums added, then the shared
        expert's output, which every rank computes: the official order of the sum."""
        local = ids - self.experts_first
        mine = (local >= 0) & (local < self.experts.n_routed)
        routed = self.experts(x, torch.where(mine, local, -1), torch.where(mine, weights, 0.0), self.swiglu_limit, with_shared=False)
        y = all_reduce(routed, self.parallel) + self.shared_experts(x).float()
        return y.to(x.dtype)
