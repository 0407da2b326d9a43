"""Indexer scoring and top-k selection for ratio-4 (CSA) layers: the plain-torch reference and
the input checks.

score[b, t] = sum_h weights[b, h] * relu(q[b, h] . cache[slot_b, t]) over the visible
entries t < visible[b]; the `topk` best entries are returned, -1 where fewer are visible.
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
    return topk_visible_reference(indexer_scores_reference(q, weights, index_cache, slots), visible, topk)


def indexer_scores_reference(q: torch.Tensor, weights: torch.Tensor, index_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The scores [B,R] fp32 of every cache row, visible or not: the first half of the op, apart
    so that heads split across processes can sum their scores before the top-k."""
    keys = index_cache[slots.long()].float()  # [B,R,D]
    scores = torch.einsum("bhd,btd->bht", q.float(), keys).relu()
    return (scores * weights.float()[..., None]).sum(1)


def topk_visible_reference(scores: torch.Tensor, visible: torch.Tensor, topk: int) -> torch.Tensor:
    """The second half: the `topk` best of the visible entries of scores [B,R] (see indexer_topk_reference)."""
    rows = scores.shape[1]
    entry = torch.arange(rows, device=scores.device)
    is_visible = entry[None, :] < visible[:, None]
    scores = scores.masked_fill(~is_visible, float("-inf"))
    if topk > rows:  # fewer entries than picks: pad with never-visible columns
        scores = torch.nn.functional.pad(scores, (0, topk - rows), value=float("-inf"))
    picked = scores.topk(topk, dim=-1).indices
    chosen_visible = torch.gather(
        torch.nn.functional.pad(is_visible, (0, max(0, topk - rows)), value=False), 1, picked
    )
    return torch.where(chosen_visible, picked, -1).to(torch.int32)


def check_indexer_inputs(q, weights, index_cache, slots, visible, topk: int) -> None:
    """Raise ValueError naming the first argument whose shape does not fit (no host sync)."""
    if q.dim() != 3 or weights.shape != q.shape[:2] or index_cache.dim() != 3 or index_cache.shape[-1] != q.shape[-1]:
        raise ValueError(
            "indexer_topk expects q [B,H,D], weights [B,H], index_cache [S,R,D]; got "
            f"{tuple(q.shape)}, {tuple(weights.shape)}, {tuple(index_cache.shape)}"
        )
    if slots.shape != q.shape[:1] or visible.shape != q.shape[:1]:
        raise ValueError("indexer_topk: slots and visible must be [B]")
    if int(topk) < 1:
        raise ValueError(f"indexer_topk: topk must be >= 1, got {topk}")
