"""Products Inductor should see as reductions rather than as library GEMM calls.

A decode step has a few matrix products with very few output columns: the hyper-connection
mixes (24 columns, 16384 deep), the MoE gate (one column per expert) and, inside hc_post, a
batch of 4x4 by 4xD products. cuBLAS runs the skinny ones as a CUDA-core GEMM followed by a
split-K reduce kernel, and the tiny batched one as a GEMM of its own; none of them can fuse
with the norms and casts around them. Written as multiply-and-sum, Inductor makes each one a
reduction (or, for a 4-deep sum, plain pointwise code) fused with its neighbours. Wide products
keep the library GEMM. The result is the same product in fp32 arithmetic, summed in another
order."""
from __future__ import annotations

from typing import Callable

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.decomposition import select_decomp_table
from torch.fx.experimental.symbolic_shapes import statically_known_true

aten = torch.ops.aten

# A batched product this shallow is cheaper unrolled into pointwise code than as a GEMM call.
MAX_UNROLLED_DEPTH = 16


def _upcast_product(a: torch.Tensor, b: torch.Tensor, sum_dim: int) -> torch.Tensor:
    """sum(a * b) over sum_dim in fp32, in a's dtype, as a GEMM with fp32 accumulation gives it."""
    return (a.float() * b.float()).sum(sum_dim).to(a.dtype)


def skinny_product_table(max_columns: int) -> dict:
    """Inductor's own decomposition table, plus: mm(a [M, K], b [K, N]) with N <= max_columns and
    bmm with a contraction depth <= MAX_UNROLLED_DEPTH become multiply-and-sum. Anything else
    goes to Inductor's rule for the op, as before."""
    table = dict(select_decomp_table())
    inductor_mm, inductor_bmm = table.get(aten.mm.default), table.get(aten.bmm.default)

    def fallback(rule: Callable | None, *args):
        return rule(*args) if rule is not None else NotImplemented

    def mm(a: torch.Tensor, b: torch.Tensor, *rest):
        if not rest and a.dtype == b.dtype and statically_known_true(b.shape[1] <= max_columns):
            return _upcast_product(a.unsqueeze(1), b.t().unsqueeze(0), sum_dim=-1)
        return fallback(inductor_mm, a, b, *rest)

    def bmm(a: torch.Tensor, b: torch.Tensor, *rest):
        if not rest and a.dtype == b.dtype and statically_known_true(a.shape[2] <= MAX_UNROLLED_DEPTH):
            return _upcast_product(a.unsqueeze(-1), b.unsqueeze(1), sum_dim=2)
        return fallback(inductor_bmm, a, b, *rest)

    if max_columns > 0:
        table[aten.mm.default] = mm
        table[aten.bmm.default] = bmm
    return table


class CacheTag(CustomGraphPass):
    """A post-grad pass that changes nothing: its uuid puts the decomposition setting into the
    keys of Inductor's and AOTAutograd's compile caches, which do not hash the table itself (a
    warm cache would otherwise hand back graphs decomposed under another setting)."""

    def __init__(self, max_columns: int):
        self.max_columns = max_columns

    def __call__(self, graph: torch.fx.Graph) -> None:
        pass

    def uuid(self) -> str:
        return f"fuse.decompositions.skinny_product_table(max_columns={self.max_columns}, depth={MAX_UNROLLED_DEPTH}) v1"
