"""Indexer top-k as a custom op (semantics: kernels/indexer/ref.py).

`torch.ops.v4.indexer_topk` runs the plain-torch reference on CPU and the Triton kernels of
kernels/indexer/triton.py on CUDA (work proportional to the visible entries). Both return the
same set of entries; the reference orders them by descending score, the CUDA kernel by entry
number. Callers must treat the picks as a set.
"""
from __future__ import annotations

import torch

from kernels.impl import COMMON_IMPLS, check_impl
from kernels.indexer.ref import check_indexer_inputs, indexer_topk_reference


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
