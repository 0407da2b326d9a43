"""Triton indexer top-k (semantics: kernels/indexer/ref.py), with work proportional to the visible
entries rather than the cache capacity.

Two kernels:

- score: grid (sequence, worker). Worker p of sequence b scores the chunks p, p + W, p + 2W, ...
  of SCORE_BLOCK_T entries below visible[b]: one tensor-core product K q^T per chunk, relu,
  then the head-weighted sum in fp32. The worker count W comes from the batch and the SM count
  (one resident wave), capped only by a tiny capacity, so a larger capacity adds no program.
  Each score is written as an order-preserving int32 key (the fp32 bits with the magnitude
  flipped for negatives) to a [B, capacity] scratch, visible part only.
- select: one program per sequence. With at most `topk` visible entries the answer is
  0..visible-1; otherwise a radix select over the visible keys (four 8-bit digit passes, each a
  histogram of the keys that still match the prefix found so far; it stops early once the
  threshold bin holds exactly the remaining picks) finds the top-k threshold, and a final pass
  writes the entries above it, plus the first threshold ties by entry number, to the output.

With the heads split across processes the two kernels run apart (`indexer_scores_triton`, then
`select_topk_scores` on the summed scores): score writes the fp32 scores instead of keys, and
select turns them into keys as it reads them.

The output is the same *set* as the reference's top-k but in ascending entry order, not sorted
by score. Ties at the threshold go to the lowest entry numbers (the reference leaves tie order
to torch.topk).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.dependent_launch import dependent_options, wait_for_predecessor
from kernels.triton_util import dot_precision, num_sms

SCORE_BLOCK_T = 64
SELECT_BLOCK = 2048
# Score programs resident per SM (about 65 KB of shared memory each at 3 stages): one wave of
# workers covers the GPU, each looping over its share of the visible chunks.
WORKERS_PER_SM = 3


@triton.jit
def _visible_count(visible_ptr, b, rows):
    """visible[b] clamped to [0, rows], as int32."""
    vis = tl.load(visible_ptr + b)
    return tl.minimum(tl.maximum(vis, 0), rows).to(tl.int32)


@triton.jit
def _order_key(score):
    """The order-preserving int32 key of fp32 scores: the bits, magnitude flipped for negatives."""
    bits = score.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _load_keys(row_ptr, offs, mask, FROM_SCORES: tl.constexpr):
    """Keys at offs of one row: int32 keys as stored, or fp32 scores as their keys."""
    if FROM_SCORES:
        return _order_key(tl.load(row_ptr + offs, mask=mask, other=0.0))
    else:
        return tl.load(row_ptr + offs, mask=mask, other=0)


@triton.jit
def _indexer_score_kernel(
    q_ptr, w_ptr, cache_ptr, slots_ptr, visible_ptr, out_ptr,
    rows,
    stride_qb, stride_qh, stride_qd,
    stride_wb, stride_wh,
    stride_cs, stride_cr, stride_cd,
    stride_ob,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr,
    DOT_PRECISION: tl.constexpr, AS_KEYS: tl.constexpr,
    DEPENDENT: tl.constexpr = False,
):
    wait_for_predecessor(DEPENDENT)
    b = tl.program_id(0)
    worker = tl.program_id(1)
    num_workers = tl.num_programs(1)
    vis = _visible_count(visible_ptr, b, rows)
    num_chunks = tl.cdiv(vis, BLOCK_T)
    if worker >= num_chunks:
        return

    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    head_ok = heads < NUM_HEADS
    dim_ok = dims < HEAD_DIM
    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + dims[None, :] * stride_qd,
        mask=head_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    q_t = tl.trans(q)  # [BLOCK_D, BLOCK_H]
    w = tl.load(w_ptr + b * stride_wb + heads * stride_wh, mask=head_ok, other=0.0).to(tl.float32)
    slot_base = cache_ptr + tl.load(slots_ptr + b).to(tl.int64) * stride_cs
    out_row = out_ptr + b.to(tl.int64) * stride_ob
    entries = tl.arange(0, BLOCK_T)

    for chunk in range(worker, num_chunks, num_workers):
        t = chunk * BLOCK_T + entries
        t_ok = t < vis
        k = tl.load(
            slot_base + t[:, None].to(tl.int64) * stride_cr + dims[None, :] * stride_cd,
            mask=t_ok[:, None] & dim_ok[None, :],
            other=0.0,
        )
        s = tl.dot(k, q_t, input_precision=DOT_PRECISION)  # [BLOCK_T, BLOCK_H], fp32
        score = tl.sum(tl.maximum(s, 0.0) * w[None, :], axis=1)
        if AS_KEYS:
            tl.store(out_row + t, _order_key(score), mask=t_ok)
        else:
            tl.store(out_row + t, score, mask=t_ok)


@triton.jit
def _indexer_select_kernel(
    keys_ptr, visible_ptr, out_ptr,
    rows, stride_kb, stride_ob,
    TOPK: tl.constexpr, BLOCK: tl.constexpr, FROM_SCORES: tl.constexpr,
    DEPENDENT: tl.constexpr = False,
):
    wait_for_predecessor(DEPENDENT)
    b = tl.program_id(0)
    vis = _visible_count(visible_ptr, b, rows)
    key_row = keys_ptr + b.to(tl.int64) * stride_kb
    out_row = out_ptr + b.to(tl.int64) * stride_ob
    lanes = tl.arange(0, BLOCK)

    if vis <= TOPK:  # everything visible is picked
        for start in range(0, TOPK, BLOCK):
            j = start + lanes
            tl.store(out_row + j, tl.where(j < vis, j, -1), mask=j < TOPK)
        return

    # Radix select of the TOPK-th largest key, most significant digit first. Invariant: the
    # threshold key starts with `prefix` (bits >= shift) and is the want-th largest of the keys
    # with that prefix.
    bins = tl.arange(0, 256)
    prefix = vis * 0
    shift = vis * 0
    want = vis * 0 + TOPK
    done = vis < 0
    for digit_pass in tl.static_range(4):
        digit_shift = 24 - 8 * digit_pass
        hist = tl.zeros([256], dtype=tl.int32)
        for start in range(0, tl.where(done, 0, vis), BLOCK):
            offs = start + lanes
            in_range = offs < vis
            key = _load_keys(key_row, offs, in_range, FROM_SCORES)
            if digit_pass == 0:
                digit = ((key >> 24) + 128) & 255  # signed top byte, biased to [0, 256)
                match = in_range
            else:
                digit = (key >> digit_shift) & 255
                match = in_range & ((key >> (digit_shift + 8)) == (prefix >> (digit_shift + 8)))
            hist += tl.histogram(digit, 256, mask=match)
        at_or_above = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist
        bin_ = tl.max(tl.where(at_or_above >= want, bins, -1), axis=0)
        above = tl.sum(tl.where(bins > bin_, hist, 0), axis=0)
        in_bin = tl.sum(tl.where(bins == bin_, hist, 0), axis=0)
        if digit_pass == 0:
            new_prefix = (bin_ - 128) << 24
        else:
            new_prefix = prefix | (bin_ << digit_shift)
        prefix = tl.where(done, prefix, new_prefix)
        shift = tl.where(done, shift, digit_shift)
        want = tl.where(done, want, want - above)
        # The bin holds exactly the remaining picks: every key with this prefix is taken.
        done = done | (in_bin == want)

    # Write the picks in entry order: keys above the threshold prefix, and the first `want` of
    # the keys equal to it (all of them when the select stopped early).
    threshold = prefix >> shift
    written = vis * 0
    ties_seen = vis * 0
    for start in range(0, vis, BLOCK):
        offs = start + lanes
        in_range = offs < vis
        key = _load_keys(key_row, offs, in_range, FROM_SCORES) >> shift
        tie = (in_range & (key == threshold)).to(tl.int32)
        tie_rank = ties_seen + tl.cumsum(tie, axis=0) - tie
        take = (in_range & (key > threshold)) | ((tie != 0) & (tie_rank < want))
        take_i = take.to(tl.int32)
        pos = written + tl.cumsum(take_i, axis=0) - take_i
        tl.store(out_row + pos, offs, mask=take & (pos < TOPK))
        written += tl.sum(take_i, axis=0)
        ties_seen += tl.sum(tie, axis=0)






def select_topk_keys(keys: torch.Tensor, visible: torch.Tensor, topk: int) -> torch.Tensor:
    """The selection stage alone: keys [B, R] int32 (order-preserving score keys, only
    keys[b, :visible[b]] are read) -> the entries of the `topk` largest keys per row, [B, topk]
    int32 in ascending entry order, -1 past the visible count; ties at the threshold go to the
    lowest entry numbers."""
    if keys.dtype != torch.int32 or keys.dim() != 2:
        raise ValueError(f"select_topk_keys: keys must be [B, R] int32, got {keys.dtype} {tuple(keys.shape)}")
    return _select(keys, visible, topk, from_scores=False)


def select_topk_scores(scores: torch.Tensor, visible: torch.Tensor, topk: int) -> torch.Tensor:
    """select_topk_keys on fp32 scores [B, R] (only scores[b, :visible[b]] are read)."""
    if scores.dtype != torch.float32 or scores.dim() != 2:
        raise ValueError(f"select_topk_scores: scores must be [B, R] fp32, got {scores.dtype} {tuple(scores.shape)}")
    return _select(scores, visible, topk, from_scores=True)


def _select(keys: torch.Tensor, visible: torch.Tensor, topk: int, from_scores: bool) -> torch.Tensor:
    keys = keys if keys.stride(1) == 1 else keys.contiguous()
    batch, rows = keys.shape
    out = torch.empty((batch, topk), dtype=torch.int32, device=keys.device)
    if batch == 0:
        return out
    _indexer_select_kernel[(batch,)](
        keys, visible, out,
        rows, keys.stride(0), out.stride(0),
        TOPK=topk, BLOCK=SELECT_BLOCK, FROM_SCORES=from_scores,
        num_warps=8, **dependent_options(out.device),
    )
    return out


def _check(q, index_cache, slots, visible, op: str) -> None:
    if q.dtype != index_cache.dtype:
        raise ValueError(f"{op}: q is {q.dtype} but index_cache is {index_cache.dtype}")
    if slots.dtype.is_floating_point or visible.dtype.is_floating_point:
        raise ValueError(f"{op}: slots and visible must be integer tensors")


def _score(q, weights, index_cache, slots, visible, out: torch.Tensor, as_keys: bool) -> None:
    """The score kernel into out [B, R] (int32 keys or fp32 scores), visible entries only."""
    batch, num_heads, head_dim = q.shape
    rows = index_cache.shape[1]
    workers = max(1, min(triton.cdiv(rows, SCORE_BLOCK_T), WORKERS_PER_SM * num_sms(q.device) // batch))
    _indexer_score_kernel[(batch, workers)](
        q, weights, index_cache, slots, visible, out,
        rows,
        q.stride(0), q.stride(1), q.stride(2),
        weights.stride(0), weights.stride(1),
        index_cache.stride(0), index_cache.stride(1), index_cache.stride(2),
        out.stride(0),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim,
        BLOCK_H=max(16, triton.next_power_of_2(num_heads)),
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_T=SCORE_BLOCK_T,
        DOT_PRECISION=dot_precision(q.dtype), AS_KEYS=as_keys,
        num_warps=4, **dependent_options(q.device),
        num_stages=3,
    )


def indexer_topk_triton(
    q: torch.Tensor,
    weights: torch.Tensor,
    index_cache: torch.Tensor,
    slots: torch.Tensor,
    visible: torch.Tensor,
    topk: int,
) -> torch.Tensor:
    """Top-`topk` entry numbers [B, topk] int32 per sequence, -1 past the visible count.

    Same arguments and same set of picks as `indexer_topk_reference`; the picks come in
    ascending entry order (not by score). Launch shapes depend on B, the head sizes and the
    SM count only, so the op is CUDA-graph safe and its cost follows visible[b], not the
    capacity index_cache.shape[1]."""
    if topk < 1:
        raise ValueError(f"indexer_topk: topk must be >= 1, got {topk}")
    _check(q, index_cache, slots, visible, "indexer_topk")
    batch, rows = q.shape[0], index_cache.shape[1]
    if batch == 0 or rows == 0:  # nothing can be visible
        return torch.full((batch, topk), -1, dtype=torch.int32, device=q.device)
    keys = torch.empty((batch, rows), dtype=torch.int32, device=q.device)
    _score(q, weights, index_cache, slots, visible, keys, as_keys=True)
    return select_topk_keys(keys, visible, topk)


def indexer_scores_triton(
    q: torch.Tensor, weights: torch.Tensor, index_cache: torch.Tensor, slots: torch.Tensor, visible: torch.Tensor
) -> torch.Tensor:
    """The scores [B, R] fp32 of the visible entries with these heads, 0 from visible[b] on (as
    `indexer_scores_reference`): the first half of indexer_topk_triton, for heads split across
    processes, whose scores are summed before `select_topk_scores`."""
    _check(q, index_cache, slots, visible, "indexer_scores")
    scores = torch.zeros((q.shape[0], index_cache.shape[1]), dtype=torch.float32, device=q.device)
    if scores.numel():
        _score(q, weights, index_cache, slots, visible, scores, as_keys=False)
    return scores
