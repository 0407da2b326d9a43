"""Graph passes compile_decode adds to Inductor's.

SkinnyProducts: a decode step has a few matrix products with very few output columns: the
hyper-connection mixes (24 columns, 16384 deep), the MoE gate (one column per expert) and,
inside hc_post, a batch of 4x4 by 4xD products (at batch 1 traced as one 4-deep mm). cuBLAS runs
the skinny ones as a CUDA-core GEMM followed by a split-K reduce kernel, and the shallow ones as a
GEMM of their own (at batch 1 after a kernel that writes the fp32 copy of its operand); none of them
can fuse with the norms and casts around them. Rewritten as multiply-and-sum, Inductor makes each
one a reduction (or, for a 4-deep sum, plain pointwise code) fused with its neighbours. Wide
products keep the library GEMM. The result is the same product in fp32 arithmetic, summed in
another order.

It runs as Inductor's post-grad pre-pass, whose uuid is part of the compile-cache keys (a
decomposition table would not be, and passing one turns Inductor's FX graph cache off)."""
from __future__ import annotations

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.fx.experimental.symbolic_shapes import statically_known_true

aten, prims = torch.ops.aten, torch.ops.prims

# A batched product this shallow is cheaper unrolled into pointwise code than as a GEMM call.
MAX_UNROLLED_DEPTH = 16


class SkinnyProducts(CustomGraphPass):
    """mm(a [M, K], b [K, N]) with N <= max_columns, and mm and bmm with a contraction depth <=
    MAX_UNROLLED_DEPTH, become multiply-and-sum in fp32 (the dtype of a GEMM's accumulator),
    cast back to the product's dtype. max_columns = 0 leaves every product alone."""

    def __init__(self, max_columns: int):
        self.max_columns = max_columns

    def uuid(self) -> str:
        return f"fuse.passes.SkinnyProducts(max_columns={self.max_columns}, depth={MAX_UNROLLED_DEPTH}) v4"

    def __call__(self, graph: torch.fx.Graph) -> None:
        if self.max_columns <= 0:
            return
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target not in (aten.mm.default, aten.bmm.default):
                continue
            a, b = node.args
            va, vb = a.meta.get("val"), b.meta.get("val")
            if va is None or vb is None or va.dtype != vb.dtype:
                continue
            if node.target is aten.mm.default and statically_known_true(vb.shape[1] <= self.max_columns):
                # [M, 1, K] * [1, N, K] (b transposed), summed over K
                _replace_by_sum(graph, node, a_dim=1, b_transpose=True, b_dim=0, sum_dim=-1)
            elif node.target is aten.mm.default and statically_known_true(va.shape[1] <= MAX_UNROLLED_DEPTH):
                # A shallow wide product, e.g. hc_post's at batch 1, where the batched product of
                # the batch sizes above is traced as an mm: [M, K, 1] * [1, K, N], summed over K
                _replace_by_sum(graph, node, a_dim=-1, b_transpose=False, b_dim=0, sum_dim=1)
            elif node.target is aten.bmm.default and statically_known_true(va.shape[2] <= MAX_UNROLLED_DEPTH):
                # [B, M, K, 1] * [B, 1, K, N], summed over K
                _replace_by_sum(graph, node, a_dim=-1, b_transpose=False, b_dim=1, sum_dim=2)
        graph.lint()


def _replace_by_sum(graph: torch.fx.Graph, node: torch.fx.Node, a_dim: int, b_transpose: bool, b_dim: int, sum_dim: int) -> None:
    """Replace the product node(a, b) by sum(unsqueeze(a, a_dim) * unsqueeze(b', b_dim), sum_dim)
    in fp32, b' = b transposed if b_transpose else b, cast back to the product's dtype."""
    a, b = node.args
    emit = _emitter(graph, node)
    with graph.inserting_before(node):
        if b_transpose:
            b = emit(aten.permute.default, b, [1, 0])
        a, b = emit(aten.unsqueeze.default, a, a_dim), emit(aten.unsqueeze.default, b, b_dim)
        _replace_in_its_dtype(graph, node, emit, _fp32_sum_of_products(emit, a, b, sum_dim))


def _fp32_sum_of_products(emit, a: torch.fx.Node, b: torch.fx.Node, sum_dim: int) -> torch.fx.Node:
    """sum(a * b, sum_dim) in fp32, the dtype of a GEMM's accumulator."""
    if a.meta["val"].dtype != torch.float32:
        a = emit(prims.convert_element_type.default, a, torch.float32)
        b = emit(prims.convert_element_type.default, b, torch.float32)
    return emit(aten.sum.dim_IntList, emit(aten.mul.Tensor, a, b), [sum_dim])


def _replace_in_its_dtype(graph: torch.fx.Graph, node: torch.fx.Node, emit, out: torch.fx.Node) -> None:
    """Replace node by the fp32 result out, cast back to node's dtype."""
    dtype = node.meta["val"].dtype
    if dtype != torch.float32:
        out = emit(prims.convert_element_type.default, out, dtype)
    node.replace_all_uses_with(out)
    graph.erase_node(node)


def _emitter(graph: torch.fx.Graph, node: torch.fx.Node):
    """emit(target, *args): a new call node (inserted where the graph's insertion point is) with
    its fake value computed and the replaced node's other metadata."""
    fake_mode = node.meta["val"].fake_mode

    def emit(target, *args):
        with fake_mode:
            value = target(*[arg.meta["val"] if isinstance(arg, torch.fx.Node) else arg for arg in args])
        new = graph.call_function(target, args)
        new.meta.update({k: v for k, v in node.meta.items() if k not in ("val", "tensor_meta")})
        new.meta["val"] = value
        return new

    return emit
