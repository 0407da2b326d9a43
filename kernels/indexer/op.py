"""Indexer top-k as a custom op (semantics: kernels/indexer/ref.py).

`torch.ops.v4.indexer_topk` runs the plain-torch reference on CPU and the Triton kernels of
kernels/indexer/triton.py on CUDA (work proportional to the visible entries). Both return the
same set of entries; the reference orders them by descending score, the CUDA kernel by entry
number. Callers must treat the picks as a set.

Its two halves are ops too, for index heads split across processes: `v4::indexer_scores` (the
visible entries' scores with this process's heads) and, on the summed scores,
`v4::indexer_select` (the top-k). They launch the same kernels as `v4::indexer_topk`.
"""
from __future__ import annotations

import torch

from kernels.impl import COMMON_IMPLS, check_impl
from kernels.indexer.ref import (
    check_indexer_inputs,
    check_score_inputs,
    check_select_inputs,
    indexer_scores_reference,
    indexer_topk_reference,
    topk_visible_reference,
)


@torch.library.custom_op("v4::indexer_topk", mutates_args=())
def indexer_topk_op(
    q: torch.Tensor,
    weights: torch.Tensor,
    index_cache: torch.Tensor,
    slots: torch.Tensor,
    visible: torch.Tensor,
    topk: int,
) -> torch.Tensor:
    return indexer_topk_reference(q, weights, index_cache, slots, visible, topk)


@indexer_topk_op.register_fake
def _(q, weights, index_cache, slots, visible, topk):
    return q.new_empty((q.shape[0], topk), dtype=torch.int32)


@indexer_topk_op.register_kernel("cuda")
def _(q, weights, index_cache, slots, visible, topk):
    from kernels.indexer.triton import indexer_topk_triton  # triton only where the kernel runs

    return indexer_topk_triton(q, weights, index_cache, slots, visible, topk)


IMPLS = COMMON_IMPLS


def indexer_topk(q, weights, index_cache, slots, visible, topk: int, impl: str = "auto") -> torch.Tensor:
    """Entry numbers [B, topk] int32 (semantics: kernels/indexer/ref.py; their order: the module
    docstring). impl: "auto" (the custom op: Triton on CUDA, reference on CPU), "triton" (the
    Triton path directly, e.g. on CPU under TRITON_INTERPRET=1) or "reference"."""
    check_impl("indexer_topk", impl, IMPLS)
    check_indexer_inputs(q, weights, index_cache, slots, visible, topk)
    if impl == "triton":
        from kernels.indexer.triton import indexer_topk_triton

        return indexer_topk_triton(q, weights, index_cache, slots, visible, int(topk))
    if impl == "reference":
        return indexer_topk_reference(q, weights, index_cache, slots, visible, int(topk))
    return indexer_topk_op(q, weights, index_cache, slots, visible, int(topk))


@torch.library.custom_op("v4::indexer_scores", mutates_args=())
def indexer_scores_op(
    q: torch.Tensor, weights: torch.Tensor, index_cache: torch.Tensor, slots: torch.Tensor, visible: torch.Tensor
) -> torch.Tensor:
    return indexer_scores_reference(q, weights, index_cache, slots, visible)


@indexer_scores_op.register_fake
def _(q, weights, index_cache, slots, visible):
    return q.new_empty((q.shape[0], index_cache.shape[1]), dtype=torch.float32)


@indexer_scores_op.register_kernel("cuda")
def _(q, weights, index_cache, slots, visible):
    from kernels.indexer.triton import indexer_scores_triton

    return indexer_scores_triton(q, weights, index_cache, slots, visible)


@torch.library.custom_op("v4::indexer_select", mutates_args=())
def indexer_select_op(scores: torch.Tensor, visible: torch.Tensor, topk: int) -> torch.Tensor:
    return topk_visible_reference(scores, visible, topk)


@indexer_select_op.register_fake
def _(scores, visible, topk):
    return scores.new_empty((scores.shape[0], topk), dtype=torch.int32)


@indexer_select_op.register_kernel("cuda")
def _(scores, visible, topk):
    from kernels.indexer.triton import select_topk_scores

    return select_topk_scores(scores, visible, topk)


def indexer_scores(q, weights, index_cache, slots, visible, impl: str = "auto") -> torch.Tensor:
    """Scores [B, R] fp32 of the visible entries with q's heads, 0 from visible[b] on
    (indexer_scores_reference). impl as for indexer_topk."""
    check_impl("indexer_scores", impl, IMPLS)
    check_score_inputs(q, weights, index_cache, slots, visible, "indexer_scores")
    if impl == "triton":
        from kernels.indexer.triton import indexer_scores_triton

        return indexer_scores_triton(q, weights, index_cache, slots, visible)
    if impl == "reference":
        return indexer_scores_reference(q, weights, index_cache, slots, visible)
    return indexer_scores_op(q, weights, index_cache, slots, visible)


def indexer_select(scores, visible, topk: int, impl: str = "auto") -> torch.Tensor:
    """The top-`topk` visible entries of scores [B, R] fp32, [B, topk] int32, -1 past the
    visible count (topk_visible_reference; a set, in entry order on CUDA). impl as for indexer_topk."""
    check_impl("indexer_select", impl, IMPLS)
    check_select_inputs(scores, visible, topk)
    if impl == "triton":
        from kernels.indexer.triton import select_topk_scores

        return select_topk_scores(scores, visible, int(topk))
    if impl == "reference":
        return topk_visible_reference(scores, visible, int(topk))
    return indexer_select_op(scores, visible, int(topk))
