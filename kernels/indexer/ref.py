"""Indexer scoring and top-k selection for ratio-4 (CSA) layers: the plain-torch reference and
the input checks.

score[b, t] = sum_h weights[b, h] * relu(q[b, h] . cache[slot_b, t]) over the visible
entries t < visible[b]; the `topk` best entries are returned, -1 where fewer are visible.
With the heads split across processes, each scores with its own heads (the first half,
`indexer_scores_reference`), the scores are summed, and the top-k is taken of the sum (the
second half, `topk_visible_reference`).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

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
    return topk_visible_reference(indexer_scores_reference(q, weights, index_cache, slots, visible), visible, topk)


def indexer_scores_reference(
    q: torch.Tensor, weights: torch.Tensor, index_cache: torch.Tensor, slots: torch.Tensor, visible: torch.Tensor
) -> torch.Tensor:
    """The first half: scores [B,R] fp32 of the visible cache rows, 0 from visible[b] on."""
    keys = index_cache[slots.long()].float()  # [B,R,D]
    scores = (torch.einsum("bhd,btd->bht", q.float(), keys).relu() * weights.float()[..., None]).sum(1)
    return scores.masked_fill(_past_visible(scores.shape[1], visible), 0.0)


def topk_visible_reference(scores: torch.Tensor, visible: torch.Tensor, topk: int) -> torch.Tensor:
    """The second half: the `topk` best of the visible entries of scores [B,R] (see indexer_topk_reference)."""
    rows = scores.shape[1]
    is_visible = ~_past_visible(rows, visible)
    scores = scores.masked_fill(~is_visible, float("-inf"))
    if topk > rows:  # fewer entries than picks: pad with never-visible columns
        scores = torch.nn.functional.pad(scores, (0, topk - rows), value=float("-inf"))
    picked = scores.topk(topk, dim=-1).indices
    chosen_visible = torch.gather(
        torch.nn.functional.pad(is_visible, (0, max(0, topk - rows)), value=False), 1, picked
    )
    return torch.where(chosen_visible, picked, -1).to(torch.int32)


def _past_visible(rows: int, visible: torch.Tensor) -> torch.Tensor:
    """[B, rows] bool: entry t at or past visible[b]."""
    return torch.arange(rows, device=visible.device)[None, :] >= visible[:, None]


def check_indexer_inputs(q, weights, index_cache, slots, visible, topk: int) -> None:
    """Raise ValueError naming the first argument whose shape does not fit (no host sync)."""
    check_score_inputs(q, weights, index_cache, slots, visible)
    check_topk(topk)


def check_score_inputs(q, weights, index_cache, slots, visible, op: str = "indexer_topk") -> None:
    if q.dim() != 3 or weights.shape != q.shape[:2] or index_cache.dim() != 3 or index_cache.shape[-1] != q.shape[-1]:
        raise ValueError(
            f"{op} expects q [B,H,D], weights [B,H], index_cache [S,R,D]; got "
            f"{tuple(q.shape)}, {tuple(weights.shape)}, {tuple(index_cache.shape)}"
        )
    if slots.shape != q.shape[:1] or visible.shape != q.shape[:1]:
        raise ValueError(f"{op}: slots and visible must be [B]")


def check_select_inputs(scores, visible, topk: int) -> None:
    if scores.dim() != 2 or scores.dtype != torch.float32:
        raise ValueError(f"indexer_select expects scores [B,R] fp32, got {scores.dtype} {tuple(scores.shape)}")
    if visible.shape != scores.shape[:1]:
        raise ValueError(f"indexer_select: visible must be [B] = [{scores.shape[0]}], got {tuple(visible.shape)}")
    check_topk(topk, "indexer_select")


def check_topk(topk: int, op: str = "indexer_topk") -> None:
    if int(topk) < 1:
        raise ValueError(f"{op}: topk must be >= 1, got {topk}")


@contextlib.contextmanager
def exact_fp32_products() -> Iterator[None]:
    """CUDA fp32 matrix products without TF32 inside (the reference's einsum as specified), the
    setting put back exactly as it was after: Inductor's compile-cache key includes it, and
    writing even an unchanged value through the legacy flag changes what the key sees."""
    matmul = torch.backends.cuda.matmul
    name, exact = ("fp32_precision", "ieee") if hasattr(matmul, "fp32_precision") else ("allow_tf32", False)
    saved = getattr(matmul, name)
    setattr(matmul, name, exact)
    try:
        yield
    finally:
        setattr(matmul, name, saved)
