"""Indexer top-k: `ref` (the plain-torch reference and input checks), `triton` (the CUDA kernels),
`op` (the custom op `v4::indexer_topk`, its halves `v4::indexer_scores` and `v4::indexer_select`,
and the choice of implementation)."""
from kernels.indexer.op import IMPLS, indexer_scores, indexer_select, indexer_topk, indexer_topk_op
from kernels.indexer.ref import exact_fp32_products, indexer_scores_reference, indexer_topk_reference, topk_visible_reference

__all__ = [
    "IMPLS", "exact_fp32_products", "indexer_scores", "indexer_scores_reference", "indexer_select", "indexer_topk", "indexer_topk_op",
    "indexer_topk_reference", "topk_visible_reference",
]
