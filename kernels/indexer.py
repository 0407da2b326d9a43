"""Indexer scoring and top-k selection for ratio-4 (CSA) layers.

score[b, t] = sum_h weights[b, h] * relu(q[b, h] . cache[slot_b, t]) over the visible
entries t < visible[b]; the `topk` best entries are returned, -1 where fewer are visible.

`torch.ops.v4.indexer_topk` runs the plain-torch reference on CPU and the Triton kernels of
kernels/indexer_triton.py on CUDA (work proportional to the visible entries). Both return the
same set of entries; the reference orders them by descending score, the CUDA kernel by entry
number. Callers must treat the picks as a set.
"""
from __future__ import annotations

import torch


def indexer_topk_reference(
    q: torch.Tensor,
    weights: torch.Tensor,
    index_cache: torch.Tensor,
    slots: torch.Tensor,
    visible: torch.Tensor,
    topk: int,
) -> torch.Tensor:
    """Plain-torch reference over the whole cache capacity (static shapes, no host sync).
    q [B,H,D]; weights [B,H]; index_cache [S,R,D]; slots, visible [B] int. Returns [B,topk]
    int32 entry numbers in [0, R), sorted by descending score, -1 past the visible count."""
    rows = index_cache.shape[1]
    keys = index_cache[slots.long()].float()  # [B,R,D]
    scores = torch.einsum("bhd,btd->bht", q.float(), keys).relu()
    scores = (scores * weights.float()[..., None]).sum(1)  # [B,R]
    entry = torch.arange(rows, device=q.device)
    is_visible = entry[None, :] < visible[:, None]
    scores = scores.masked_fill(~is_visible, float("-inf"))
    if topk > rows:  # fewer entries than picks: pad with never-visible columns
        scores = torch.nn.functional.pad(scores, (0, topk - rows), value=float("-inf"))
    picked = scores.topk(topk, dim=-1).indices
    chosen_visible = torch.gather(
        torch.nn.functional.pad(is_visible, (0, max(0, topk - rows)), value=False), 1, picked
    )
    return torch.where(chosen_visible, picked, -1).to(torch.int32)


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
    from kernels.indexer_triton import indexer_topk_triton  # triton only where the kernel runs

    return indexer_topk_triton(q, weights, index_cache, slots, visible, topk)


IMPLS = ("auto", "triton", "reference")


def indexer_topk(q, weights, index_cache, slots, visible, topk: int, impl: str = "auto") -> torch.Tensor:
    """Entry numbers [B, topk] int32 (see the module docstring). impl: "auto" (the custom op:
    Triton on CUDA, reference on CPU), "triton" (the Triton path directly, e.g. on CPU under
    TRITON_INTERPRET=1) or "reference"."""
    if impl not in IMPLS:
        raise ValueError(f"indexer_topk: impl must be one of {IMPLS}, got {impl!r}")
    if q.dim() != 3 or weights.shape != q.shape[:2] or index_cache.dim() != 3 or index_cache.shape[-1] != q.shape[-1]:
        raise ValueError(
            "indexer_topk expects q [B,H,D], weights [B,H], index_cache [S,R,D]; got "
            f"{tuple(q.shape)}, {tuple(weights.shape)}, {tuple(index_cache.shape)}"
        )
    if slots.shape != q.shape[:1] or visible.shape != q.shape[:1]:
        raise ValueError("indexer_topk: slots and visible must be [B]")
    if int(topk) < 1:
        raise ValueError(f"indexer_topk: topk must be >= 1, got {topk}")
    if impl == "triton":
        from kernels.indexer_triton import indexer_topk_triton

        return indexer_topk_triton(q, weights, index_cache, slots, visible, int(topk))
    if impl == "reference":
        return indexer_topk_reference(q, weights, index_cache, slots, visible, int(topk))
    return indexer_topk_op(q, weights, index_cache, slots, visible, int(topk))
