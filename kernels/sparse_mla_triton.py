"""Triton implementations of sparse MLA decode (semantics: kernels/sparse_mla.py).

Three kernels compute the same thing:

- simt: one program per (sequence, head) with CUDA-core dot products. Every gathered row is
  fetched once per head (64x for V4), which makes it the baseline to beat.
- head_batched: one program per (sequence, block of heads). Each KV tile of `block_k` gathered
  rows is loaded once and feeds two tensor-core products, S = Q K^T and O += P V, with an online
  softmax in fp32. The 512-wide head dim is one tile (Triton splits the products into MMA steps),
  except that a 64-head block splits its output columns between two programs (see _tiles_for).
- split_k: head_batched with the index list cut into `num_splits` contiguous pieces. Each
  program writes its normalised partial output and base-2 LSE to fp32 scratch; a combine kernel
  merges the pieces with log-sum-exp and adds the sink. This fills the GPU when
  batch x head-blocks is far below the SM count.
- split_k with fused_combine=True (opt-in): the same split programs, one launch. Each program
  counts its arrival per (sequence, head block, column part) in an int32 counter in the
  workspace; the last one to arrive merges the splits (same math as the combine kernel) and
  resets the counter, so the next call and CUDA-graph replays start from zero.

`sparse_mla_decode_triton` is the default: tiles and split count are pure functions of the shapes
and the SM count (so one CUDA-graph capture per batch bucket stays valid), and it skips the
combine when one split suffices. Softmax runs in base 2: scores carry scale * log2(e).
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.triton_util import INTERPRETER_NUM_SMS  # noqa: F401  (re-exported for the tests)
from kernels.triton_util import interpreting, launches_dependents
from kernels.triton_util import num_sms as device_sm_count

from kernels.sparse_mla import check_sparse_mla_inputs

LOG2E = 1.4426950408889634
# Globals read inside kernels must be constexpr.
LOG2E_C = tl.constexpr(LOG2E)
LN2_C = tl.constexpr(0.6931471805599453)
MAX_SPLITS = 64
# The interpreter has no SMs; a small count keeps the default plan (and the grids) small there.


@dataclass(frozen=True)
class TileConfig:
    """Launch shape of the head-batched kernel: heads and gathered rows per program, warps,
    pipeline depth, into how many programs (1 or 2) the output columns are split, and whether
    the kernel double-buffers the gather by hand (prefetch: the next block's rows are requested
    before this block's products, the indices two blocks ahead; meant for num_stages=1, which
    leaves Triton's own pipelining out)."""

    block_h: int
    block_k: int
    num_warps: int
    num_stages: int
    dv_split: int = 1
    prefetch: bool = False


# ---------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------


@triton.jit
def _row_offsets(idx_row_ptr, offs_k, k_end, stride_ik, rows_per_slot, stride_slot, stride_row, FLAT_ROWS: tl.constexpr):
    """Element offsets of the KV rows named by indices[offs_k] (global row numbers; -1 and
    offs_k >= k_end are masked: offset 0, valid False). FLAT_ROWS: slots are evenly strided
    (stride_slot = rows_per_slot * stride_row), so row g sits at g * stride_row; otherwise g is
    split into (slot, row) first."""
    idx = tl.load(idx_row_ptr + offs_k * stride_ik, mask=offs_k < k_end, other=-1)
    valid = idx >= 0
    row = tl.where(valid, idx, 0)
    if FLAT_ROWS:
        row_off = row.to(tl.int64) * stride_row
    else:
        slot = row // rows_per_slot
        row_off = slot.to(tl.int64) * stride_slot + (row - slot * rows_per_slot).to(tl.int64) * stride_row
    return row_off, valid


@triton.jit
def _load_rows(kv_ptr, row_off, valid, offs_d, d_ok, stride_d):
    """The tile [len(row_off), len(offs_d)] of those rows' columns offs_d, zeros where masked."""
    return tl.load(
        kv_ptr + row_off[:, None] + offs_d[None, :] * stride_d, mask=valid[:, None] & d_ok[None, :], other=0.0
    )


@triton.jit
def _online_softmax_step(s, valid, m_i, l_i):
    """One online-softmax update on base-2 scores s [rows, BLOCK_K] (masked columns become -inf).
    Returns the unnormalised probabilities p, the factor alpha that rescales earlier sums, and the
    new (m, l). A row with no valid score so far keeps m = -inf; m_ref = 0 keeps p, alpha finite."""
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    l_new = l_i * alpha + tl.sum(p, axis=1)
    return p, alpha, m_new, l_new


@triton.jit
def _finish_with_sink(m_i, l_i, sink2):
    """Add the sink (base 2) to the denominator only. Returns the factor that turns the
    unnormalised accumulator into the output, and the natural-log LSE. With no valid index
    m_i = -inf, the factor is 0 and the LSE is the sink."""
    m_all = tl.maximum(m_i, sink2)
    w = tl.exp2(m_i - m_all)
    denom = l_i * w + tl.exp2(sink2 - m_all)
    return w / denom, (m_all + tl.log2(denom)) * LN2_C


@triton.jit
def _simt_kernel(
    q_ptr, kv_ptr, idx_ptr, sink_ptr, out_ptr, lse_ptr,
    K, D, rows_per_slot, scale_log2,
    stride_qb, stride_qh, stride_qd,
    stride_slot, stride_row, stride_d,
    stride_ib, stride_ik, stride_sink,
    stride_ob, stride_oh, stride_lb,
    BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, FLAT_ROWS: tl.constexpr,
):
    h = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    q = tl.load(q_ptr + b * stride_qb + h * stride_qh + offs_d * stride_qd, mask=d_ok, other=0.0).to(tl.float32)

    # One query row: the softmax state is [1]-shaped so it shares the head-batched helpers.
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    m_i = tl.full([1], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([1], dtype=tl.float32)
    idx_row_ptr = idx_ptr + b * stride_ib
    for start in range(0, K, BLOCK_K):
        offs_k = start + tl.arange(0, BLOCK_K)
        row_off, valid = _row_offsets(
            idx_row_ptr, offs_k, K, stride_ik, rows_per_slot, stride_slot, stride_row, FLAT_ROWS
        )
        kv = _load_rows(kv_ptr, row_off, valid, offs_d, d_ok, stride_d)
        kv_f = kv.to(tl.float32)
        s = tl.sum(kv_f * q[None, :], axis=1) * scale_log2
        p, alpha, m_i, l_i = _online_softmax_step(s[None, :], valid, m_i, l_i)
        p = tl.reshape(p, (BLOCK_K,)).to(kv.dtype).to(tl.float32)  # activation dtype before P.V
        acc = acc * alpha + tl.sum(p[:, None] * kv_f, axis=0)

    sink2 = tl.load(sink_ptr + h * stride_sink).to(tl.float32) * LOG2E_C
    out_scale, lse = _finish_with_sink(m_i, l_i, sink2)
    out = acc * out_scale
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=d_ok)
    tl.store(lse_ptr + b * stride_lb + h + tl.arange(0, 1), lse)


@triton.jit
def _combine_if_last(
    counter_ptr, part_out_ptr, part_lse_ptr, sink_ptr, out_ptr, lse_ptr,
    b, part, offs_h, h_ok, H, D,
    stride_sink, stride_ob, stride_oh, stride_lb,
    BLOCK_H: tl.constexpr, BLOCK_DV: tl.constexpr, DV_SPLIT: tl.constexpr,
    BLOCK_DC: tl.constexpr, SPLITS_PER_STEP: tl.constexpr,
):
    """Run by every split program right after it wrote its partial: count the arrival at this
    (sequence, head block, column part); the last of the num_splits programs merges all their
    partials and sets the counter back to 0 for the next call.

    The merge is _combine_kernel's (weights exp2(lse_s - max), the sink in the denominator only)
    done in one pass: a running max seeded with the finite sink rescales the sums when a split
    raises it, so an empty split (lse -inf) weighs exactly 0 and nothing becomes NaN. Every value
    then lives in the row layout of the loaded tiles (no layout conversion, hence no barrier, in
    the loop), and each step loads SPLITS_PER_STEP splits at once: the lone merging program is
    bound by the bytes it keeps in flight. It reads its own partial back like the others, in split
    order, so the result does not depend on which split arrives last. Columns go in chunks of
    BLOCK_DC so the accumulator fits in registers; partials are read at L2 (.cg): other SMs wrote
    them during this launch."""
    num_splits = tl.num_programs(1)
    # All threads' partial stores are issued before the one thread that does the atomic releases
    # them; acquire on the last arrival orders the reads below after every other program's stores.
    tl.debug_barrier()
    arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel")
    if arrived == num_splits - 1:
        sink2 = tl.load(sink_ptr + offs_h * stride_sink, mask=h_ok, other=0.0).to(tl.float32) * LOG2E_C
        # Defined before the loop so the LSE below can read them; every chunk restarts them and
        # reaches the same values.
        m_i = sink2
        denom = tl.full([BLOCK_H], 1.0, dtype=tl.float32)
        for c in range(0, BLOCK_DV, BLOCK_DC):
            offs_d = part * BLOCK_DV + c + tl.arange(0, BLOCK_DC)
            mask = h_ok[:, None] & (offs_d < D)[None, :]
            m_i = sink2
            denom = tl.full([BLOCK_H], 1.0, dtype=tl.float32)  # the sink's own term, exp2(sink2 - m_i)
            acc = tl.zeros([BLOCK_H, BLOCK_DC], dtype=tl.float32)
            for s0 in range(0, num_splits, SPLITS_PER_STEP):
                for j in tl.static_range(SPLITS_PER_STEP):
                    # A vector, not a scalar: Triton's interpreter mishandles scalar & vector masks.
                    row_ok = h_ok & (tl.full([BLOCK_H], s0 + j, tl.int32) < num_splits)
                    row = (b * num_splits + s0 + j) * H + offs_h
                    lse = tl.load(
                        part_lse_ptr + row * DV_SPLIT + part, mask=row_ok, other=float("-inf"), cache_modifier=".cg"
                    )
                    parts = tl.load(
                        part_out_ptr + row[:, None] * D + offs_d[None, :], mask=row_ok[:, None] & mask, other=0.0,
                        cache_modifier=".cg",
                    )
                    m_new = tl.maximum(m_i, lse)
                    alpha = tl.exp2(m_i - m_new)
                    w = tl.exp2(lse - m_new)
                    acc = acc * alpha[:, None] + parts * w[:, None]
                    denom = denom * alpha + w
                    m_i = m_new
            tl.store(
                out_ptr + b * stride_ob + offs_h[:, None] * stride_oh + offs_d[None, :],
                (acc / denom[:, None]).to(out_ptr.dtype.element_ty),
                mask=mask,
            )
        if part == 0:
            tl.store(lse_ptr + b * stride_lb + offs_h, (m_i + tl.log2(denom)) * LN2_C, mask=h_ok)
        tl.atomic_xchg(counter_ptr, 0)


@triton.jit
def _block_update(q, q_other, kv, kv_other, valid, m_i, l_i, acc, scale_log2, DV_SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One gathered KV block into the running softmax and accumulator: S = Q K^T (from both
    column halves when DV_SPLIT=2; q_other and kv_other are unused otherwise), then acc += P V on
    this program's columns."""
    s = tl.dot(q, tl.trans(kv), input_precision=DOT_PRECISION)  # [BLOCK_H, BLOCK_K] fp32
    if DV_SPLIT == 2:
        s = tl.dot(q_other, tl.trans(kv_other), s, input_precision=DOT_PRECISION)
    p, alpha, m_i, l_i = _online_softmax_step(s * scale_log2, valid, m_i, l_i)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(kv.dtype), kv, acc, input_precision=DOT_PRECISION)
    return acc, m_i, l_i


@triton.jit
def _head_batched_kernel(
    q_ptr, kv_ptr, idx_ptr, sink_ptr, out_ptr, lse_ptr, part_out_ptr, part_lse_ptr, counters_ptr,
    H, K, D, rows_per_slot, blocks_per_split, scale_log2,
    stride_qb, stride_qh, stride_qd,
    stride_slot, stride_row, stride_d,
    stride_ib, stride_ik, stride_sink,
    stride_ob, stride_oh, stride_lb,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, DV_SPLIT: tl.constexpr,
    FLAT_ROWS: tl.constexpr, SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    FUSED_COMBINE: tl.constexpr, BLOCK_DC: tl.constexpr, SPLITS_PER_STEP: tl.constexpr,
    LAUNCH_DEPENDENTS: tl.constexpr = False, PREFETCH: tl.constexpr = False,
):
    """Program (head block x column part, split, sequence).

    DV_SPLIT=2: two programs share a head block, each computing all of S = Q K^T (from its own
    half of the columns plus the other half) but P V only for its own half, which halves the
    accumulator and lets one warpgroup own a 64-head tile. SPLIT=False: the only split, writes out
    and lse. SPLIT=True: writes the partial output (normalised by its own sum, zeros when the split
    has no valid index) and its base-2 LSE (-inf when empty) to the fp32 scratch. FUSED_COMBINE
    (with SPLIT): every column part writes its own LSE (its Q K^T sums in its own order), and the
    last split program of the block merges the splits (_combine_if_last). PREFETCH: the gather
    is double-buffered by hand (TileConfig.prefetch)."""
    BLOCK_DV: tl.constexpr = BLOCK_D // DV_SPLIT
    if LAUNCH_DEPENDENTS:
        # Let the combine launch now: its programs wait on the device until this grid is done.
        tl.extra.cuda.gdc_launch_dependents()
    hb = tl.program_id(0) // DV_SPLIT
    part = tl.program_id(0) % DV_SPLIT
    split = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs_h < H
    offs_dv = part * BLOCK_DV + tl.arange(0, BLOCK_DV)  # the output columns of this program
    dv_ok = offs_dv < D
    q_row_ptr = q_ptr + b * stride_qb + offs_h[:, None] * stride_qh
    q = tl.load(q_row_ptr + offs_dv[None, :] * stride_qd, mask=h_ok[:, None] & dv_ok[None, :], other=0.0)
    if DV_SPLIT == 2:
        offs_do = (1 - part) * BLOCK_DV + tl.arange(0, BLOCK_DV)  # the other half, for Q K^T only
        do_ok = offs_do < D
        q_other = tl.load(q_row_ptr + offs_do[None, :] * stride_qd, mask=h_ok[:, None] & do_ok[None, :], other=0.0)
    else:
        q_other = q  # unused: one column part computes Q K^T from its own columns

    acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    k_begin = split * blocks_per_split * BLOCK_K
    k_end = tl.minimum(k_begin + blocks_per_split * BLOCK_K, K)
    idx_row_ptr = idx_ptr + b * stride_ib
    if PREFETCH:
        # Block i's products run while block i+1's rows are on their way (requested before them)
        # and block i+2's indices too, so no block waits for its indices and then its rows in
        # turn. Blocks past k_end are fully masked: their loads move no bytes.
        offs_k = k_begin + tl.arange(0, BLOCK_K)
        row_off, valid = _row_offsets(
            idx_row_ptr, offs_k, k_end, stride_ik, rows_per_slot, stride_slot, stride_row, FLAT_ROWS
        )
        kv = _load_rows(kv_ptr, row_off, valid, offs_dv, dv_ok, stride_d)
        if DV_SPLIT == 2:
            kv_other = _load_rows(kv_ptr, row_off, valid, offs_do, do_ok, stride_d)
        next_off, next_valid = _row_offsets(
            idx_row_ptr, offs_k + BLOCK_K, k_end, stride_ik, rows_per_slot, stride_slot, stride_row, FLAT_ROWS
        )
        for start in range(k_begin, k_end, BLOCK_K):
            kv_next = _load_rows(kv_ptr, next_off, next_valid, offs_dv, dv_ok, stride_d)
            if DV_SPLIT == 2:
                kv_other_next = _load_rows(kv_ptr, next_off, next_valid, offs_do, do_ok, stride_d)
            after_off, after_valid = _row_offsets(
                idx_row_ptr, start + 2 * BLOCK_K + tl.arange(0, BLOCK_K), k_end,
                stride_ik, rows_per_slot, stride_slot, stride_row, FLAT_ROWS,
            )
            if DV_SPLIT == 2:
                acc, m_i, l_i = _block_update(
                    q, q_other, kv, kv_other, valid, m_i, l_i, acc, scale_log2, DV_SPLIT, DOT_PRECISION
                )
                kv_other = kv_other_next
            else:
                acc, m_i, l_i = _block_update(q, q, kv, kv, valid, m_i, l_i, acc, scale_log2, DV_SPLIT, DOT_PRECISION)
            kv, valid = kv_next, next_valid
            next_off, next_valid = after_off, after_valid
    else:
        for start in range(k_begin, k_end, BLOCK_K):
            offs_k = start + tl.arange(0, BLOCK_K)
            row_off, valid = _row_offsets(
                idx_row_ptr, offs_k, k_end, stride_ik, rows_per_slot, stride_slot, stride_row, FLAT_ROWS
            )
            kv = _load_rows(kv_ptr, row_off, valid, offs_dv, dv_ok, stride_d)
            kv_other = kv  # unused unless DV_SPLIT == 2
            if DV_SPLIT == 2:
                kv_other = _load_rows(kv_ptr, row_off, valid, offs_do, do_ok, stride_d)
            acc, m_i, l_i = _block_update(
                q, q_other, kv, kv_other, valid, m_i, l_i, acc, scale_log2, DV_SPLIT, DOT_PRECISION
            )

    if SPLIT:
        # l_i >= 1 whenever any index was valid (the max term is exp2(0)); the floor only keeps an
        # empty split at out = 0 and lse = -inf + finite = -inf, never 0/0.
        l_safe = tl.maximum(l_i, 1e-30)
        row = (b * tl.num_programs(1) + split) * H + offs_h  # scratch is [B, splits, H, D]
        tl.store(
            part_out_ptr + row[:, None] * D + offs_dv[None, :], acc / l_safe[:, None],
            mask=h_ok[:, None] & dv_ok[None, :],
        )
        if FUSED_COMBINE:
            tl.store(part_lse_ptr + row * DV_SPLIT + part, m_i + tl.log2(l_safe), mask=h_ok)
            _combine_if_last(
                counters_ptr + b * tl.num_programs(0) + tl.program_id(0),
                part_out_ptr, part_lse_ptr, sink_ptr, out_ptr, lse_ptr,
                b, part, offs_h, h_ok, H, D,
                stride_sink, stride_ob, stride_oh, stride_lb,
                BLOCK_H, BLOCK_DV, DV_SPLIT, BLOCK_DC, SPLITS_PER_STEP,
            )
        elif part == 0:
            tl.store(part_lse_ptr + row, m_i + tl.log2(l_safe), mask=h_ok)
    else:
        sink2 = tl.load(sink_ptr + offs_h * stride_sink, mask=h_ok, other=0.0).to(tl.float32) * LOG2E_C
        out_scale, lse = _finish_with_sink(m_i, l_i, sink2)
        out = acc * out_scale[:, None]
        tl.store(
            out_ptr + b * stride_ob + offs_h[:, None] * stride_oh + offs_dv[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=h_ok[:, None] & dv_ok[None, :],
        )
        if part == 0:
            tl.store(lse_ptr + b * stride_lb + offs_h, lse, mask=h_ok)


@triton.jit
def _combine_kernel(
    part_out_ptr, part_lse_ptr, sink_ptr, out_ptr, lse_ptr,
    H, D, num_splits,
    stride_sink, stride_ob, stride_oh, stride_lb,
    BLOCK_S: tl.constexpr, BLOCK_DC: tl.constexpr, WAIT_FOR_SPLITS: tl.constexpr = False,
):
    """Program (column chunk, head, sequence): merge the splits' partial outputs with weights
    exp2(lse_s - M) and add the sink to the denominator. Empty splits have lse_s = -inf and
    weight 0; M includes the (finite) sink, so the weights never become NaN.
    WAIT_FOR_SPLITS: launched as a programmatic dependent of the split kernel, so it waits on the
    device for that grid (and its writes) before it reads a partial."""
    dc = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    s_ok = offs_s < num_splits
    row = (b * num_splits + offs_s) * H + h
    sink2 = tl.load(sink_ptr + h * stride_sink).to(tl.float32) * LOG2E_C
    if WAIT_FOR_SPLITS:
        tl.extra.cuda.gdc_wait()
    lse_s = tl.load(part_lse_ptr + row, mask=s_ok, other=float("-inf"))
    m_all = tl.maximum(tl.max(lse_s, axis=0), sink2)
    w = tl.exp2(lse_s - m_all)
    denom = tl.sum(w, axis=0) + tl.exp2(sink2 - m_all)

    offs_d = dc * BLOCK_DC + tl.arange(0, BLOCK_DC)
    d_ok = offs_d < D
    parts = tl.load(part_out_ptr + row[:, None] * D + offs_d[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    out = tl.sum(parts * w[:, None], axis=0) / denom
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=d_ok)
    if dc == 0:
        tl.store(lse_ptr + b * stride_lb + h, (m_all + tl.log2(denom)) * LN2_C)


# ---------------------------------------------------------------------------------------------
# Planning: tiles and split count, pure functions of the shapes and the SM count
# ---------------------------------------------------------------------------------------------


def _block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def _tiles_for(block_h: int, head_dim: int, itemsize: int) -> TileConfig:
    """Tiles for a head block. The [block_h, head_dim] fp32 accumulator lives in registers:
    - up to 32 x 512 elements: one program, 8 warps (64 per thread) or 4 for smaller ones;
    - 64 x 512 (V4 at full occupancy): two programs each own 256 output columns (DV split) with a
      single warpgroup, so both products run as M=64 wgmma without duplicating Q K^T across
      warpgroups.
    fp32 inputs (a checking mode) use smaller tiles so Q and two KV stages fit in shared memory."""
    block_k = 32
    if itemsize > 2:
        block_h, block_k = min(block_h, 32), 16
    acc = block_h * _block_d(head_dim)
    if acc > 32 * 512:
        # 64 gathered rows per step, two stages: fastest in the H200 tile sweep (docs/kernels.md).
        return TileConfig(block_h, 64, num_warps=4, num_stages=2, dv_split=2)
    return TileConfig(block_h, block_k, num_warps=8 if acc == 32 * 512 else 4, num_stages=2)


def head_batched_tiles(heads: int, head_dim: int = 512, itemsize: int = 2) -> TileConfig:
    """Tiles of the head-batched kernel at full occupancy: up to 64 heads per program, so each
    gathered row is read from HBM once per sequence and the M=64 products can use Hopper's wgmma."""
    return _tiles_for(min(64, max(16, triton.next_power_of_2(heads))), head_dim, itemsize)


def candidate_tiles(heads: int, head_dim: int, itemsize: int) -> list[TileConfig]:
    """The tiles the default plan chooses among: the full head block (for 64 heads: one
    warpgroup per half of the output columns), for 64 heads also whole rows on two warpgroups
    (no second gather of each row, no duplicated Q K^T; fastest when its programs alone fill the
    SMs, H200 sweep in docs/kernels.md), and 16-head blocks of 32 or 64 gathered rows (more,
    shorter programs at batch 1-8; 64 rows halve the split count, so the fp32 partials, where
    the index list is long)."""
    full = head_batched_tiles(heads, head_dim, itemsize)
    tiles = [full]
    if full.dv_split == 2:
        tiles.append(TileConfig(full.block_h, full.block_k, num_warps=8, num_stages=full.num_stages))
    if full.block_h > 16:
        small = _tiles_for(16, head_dim, itemsize)
        tiles.append(small)
        if itemsize <= 2:  # fp32 tiles stay small to fit shared memory (_tiles_for)
            tiles.append(dataclasses.replace(small, block_k=64))
    return tiles


# Rough costs on an H100/H200-class GPU, used only to rank plans against each other: a weighted
# least-squares fit (6% RMS relative error, 13% at worst) to the 77 H200 timings of the candidate
# tiles in docs/kernels.md (the plan-candidate run and the 2026-12-03 plan check, combine
# launched with PDL; rotating inputs larger than L2). At decode sizes a program is latency-bound:
# after the first KV block each one waits for its indices and then the rows they name. The fit
# leaves one warpgroup's products at 0 (hidden behind that wait; a free fit made them negative)
# and puts the combine's fixed cost mostly into the programs'.
_ITER_US = 0.98  # each KV block after a program's first: index load, then the dependent gather
_ROW_US = 0.0334  # per gathered row of every block, the first included (whole 1 KB rows)
_PRODUCT_US = {4: 0.0, 8: 1.62}  # per 64 heads x 64 rows of Q K^T + P V, by warps per program
_PROGRAM_US = 4.03  # a program's fixed cost: launch share, the first block's wait
_PROGRAM_US_PER_KB = 0.0087  # its Q tile in and its output tile out
_COMBINE_US = 0.13  # the combine kernel, beyond what the programs' fixed cost covers
_PARTIAL_BYTES_PER_US = 1.33e6  # fp32 partials: written by the splits, read by the combine
_BYTES_PER_US = 4.0e6  # HBM bandwidth, 4 TB/s: a floor for the KV traffic
_SMEM_BYTES = 228 * 1024  # shared memory per SM (sm_90)


def _programs_per_sm(tiles: TileConfig, head_dim: int, itemsize: int) -> int:
    """How many programs of these tiles share an SM, by shared memory: the Q tile plus the
    pipelined KV tiles (whole rows: a DV-split program loads both halves for Q K^T)."""
    width = _block_d(head_dim) * itemsize
    smem = tiles.block_h * width + tiles.num_stages * tiles.block_k * width
    return max(1, _SMEM_BYTES // smem)


def estimated_us(batch, heads, topk, head_dim, itemsize, num_sms, tiles: TileConfig, splits: int) -> float:
    """Waves of programs x per-program latency, bounded below by HBM traffic; splitting adds the
    fp32 partials and the combine."""
    n_blocks = triton.cdiv(max(topk, 1), tiles.block_k)
    blocks_per_split = triton.cdiv(n_blocks, splits)
    head_blocks = triton.cdiv(heads, tiles.block_h)
    programs = batch * head_blocks * tiles.dv_split * splits
    waves = triton.cdiv(programs, num_sms * _programs_per_sm(tiles, head_dim, itemsize))
    # A DV-split program does all of Q K^T but half of P V.
    products = tiles.block_k * tiles.block_h / 64**2 * (0.5 + 0.5 / tiles.dv_split)
    rows_us = tiles.block_k * _ROW_US
    block_us = _ITER_US + rows_us + products * _PRODUCT_US.get(tiles.num_warps, _PRODUCT_US[8])
    out_bytes = tiles.block_h * head_dim // tiles.dv_split * (4 if splits > 1 else itemsize)
    program_us = _PROGRAM_US + rows_us + (tiles.block_h * head_dim * itemsize + out_bytes) / 1024 * _PROGRAM_US_PER_KB
    compute = waves * (program_us + (blocks_per_split - 1) * block_us)
    time = max(compute, batch * topk * head_dim * itemsize / _BYTES_PER_US)
    if splits > 1:
        partial_bytes = batch * head_blocks * splits * tiles.block_h * (head_dim + 1) * 4
        time += _COMBINE_US + partial_bytes / _PARTIAL_BYTES_PER_US
    return time


def _split_candidates(batch: int, heads: int, topk: int, num_sms: int, tiles: TileConfig) -> list[int]:
    """Split counts worth ranking for these tiles: only 1 when batch x head blocks already fills
    the SMs (partials would only add traffic) or the index list is one block; otherwise every
    distinct count of whole KV blocks per split up to MAX_SPLITS (none leaves a split empty)."""
    n_blocks = triton.cdiv(max(topk, 1), tiles.block_k)
    if batch * triton.cdiv(heads, tiles.block_h) * tiles.dv_split >= num_sms or n_blocks == 1:
        return [1]
    return sorted({triton.cdiv(n_blocks, triton.cdiv(n_blocks, s)) for s in range(1, min(n_blocks, MAX_SPLITS) + 1)})


@functools.lru_cache(maxsize=None)
def choose_plan(
    batch: int, heads: int, topk: int, num_sms: int, head_dim: int = 512, itemsize: int = 2
) -> tuple[TileConfig, int]:
    """Tiles and split count of the default path: a pure function of the shapes and the SM count
    (CUDA-graph safe), the pair with the lowest estimated time. Memoised: ranking every candidate
    takes ~0.2-0.8 ms of Python, which eager calls would otherwise pay per layer."""
    shape = (batch, heads, topk, num_sms, head_dim, itemsize)
    plans = [(tiles, _best_splits(*shape, tiles)) for tiles in candidate_tiles(heads, head_dim, itemsize)]
    # min keeps the first of equal estimates: the candidates' order breaks ties, as _best_splits
    # breaks them towards fewer splits.
    return min(plans, key=lambda plan: estimated_us(batch, heads, topk, head_dim, itemsize, num_sms, *plan))


def choose_tiles(batch: int, heads: int, topk: int, num_sms: int, head_dim: int = 512, itemsize: int = 2) -> TileConfig:
    """The default plan's tiles (choose_plan)."""
    return choose_plan(batch, heads, topk, num_sms, head_dim, itemsize)[0]


def choose_num_splits(
    batch: int,
    heads: int,
    topk: int,
    num_sms: int,
    head_dim: int = 512,
    itemsize: int = 2,
    tiles: TileConfig | None = None,
) -> int:
    """The default plan's split count, or with `tiles` given the best split count for those tiles."""
    if tiles is None:
        return choose_plan(batch, heads, topk, num_sms, head_dim, itemsize)[1]
    return _best_splits(batch, heads, topk, num_sms, head_dim, itemsize, tiles)


@functools.lru_cache(maxsize=None)
def _best_splits(batch, heads, topk, num_sms, head_dim, itemsize, tiles: TileConfig) -> int:
    costs = [
        (estimated_us(batch, heads, topk, head_dim, itemsize, num_sms, tiles, splits), splits)
        for splits in _split_candidates(batch, heads, topk, num_sms, tiles)
    ]
    return min(costs)[1]


# The fused combine keeps one LSE and one arrival counter per column part; a head block has at
# most two parts (TileConfig.dv_split).
MAX_DV_SPLIT = 2


def num_fused_counters(batch: int, heads: int) -> int:
    """int32 arrival counters at the front of a fused-combine workspace: one per (sequence, head
    block, column part) needs at most batch x heads x MAX_DV_SPLIT whatever the tiles, so one
    workspace serves any tiles and split count at this batch and head count. Rounded up to 32
    (128 bytes) to keep the partials behind them aligned."""
    return -(-batch * heads * MAX_DV_SPLIT // 32) * 32


def workspace_numel(batch: int, heads: int, head_dim: int, num_splits: int, fused_combine: bool = False) -> int:
    """fp32 elements of split-K scratch: partial outputs [B, S, H, D] then partial LSEs [B, S, H].
    With fused_combine: the arrival counters (num_fused_counters, int32 bits), then the partial
    outputs [B, S, H, D], then partial LSEs per column part [B, S, H, dv_split] (room for
    MAX_DV_SPLIT parts)."""
    if fused_combine:
        return num_fused_counters(batch, heads) + batch * num_splits * heads * (head_dim + MAX_DV_SPLIT)
    return batch * num_splits * heads * (head_dim + 1)


def sparse_mla_workspace(
    batch: int, heads: int, head_dim: int, topk: int, device, dtype: torch.dtype = torch.bfloat16,
    fused_combine: bool = False,
) -> torch.Tensor:
    """Scratch for the default path at these shapes (activation dtype `dtype`), to allocate before
    a CUDA-graph capture and pass as `workspace`. May be empty when one split suffices.

    fused_combine=True: scratch for sparse_mla_decode_split_k(..., fused_combine=True) at the
    default split count (sized even when that count is 1), zero-filled because the arrival
    counters must start at 0; every call leaves them at 0 again. Use it for one batch and head
    count (the per-bucket pattern) and only with fused_combine=True: the two-kernel path would
    write partials over the counters."""
    device = torch.device(device)
    itemsize = dtype.itemsize
    splits = choose_num_splits(batch, heads, topk, device_sm_count(device), head_dim, itemsize)
    if fused_combine:
        numel = workspace_numel(batch, heads, head_dim, splits, fused_combine=True)
        return torch.zeros(numel, dtype=torch.float32, device=device)
    numel = workspace_numel(batch, heads, head_dim, splits) if splits > 1 else 0
    return torch.empty(numel, dtype=torch.float32, device=device)


def fused_counters(workspace: torch.Tensor, batch: int, heads: int) -> torch.Tensor:
    """The int32 arrival counters of a fused-combine workspace (all 0 between calls)."""
    return workspace[: num_fused_counters(batch, heads)].view(torch.int32)


# ---------------------------------------------------------------------------------------------
# Python entry points
# ---------------------------------------------------------------------------------------------


def _check(q, kv_cache, indices, sink) -> None:
    check_sparse_mla_inputs(q, kv_cache, indices, sink)
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"sparse_mla_decode (triton): q must be bf16, fp16 or fp32, got {q.dtype}")
    if kv_cache.dtype != q.dtype:
        raise ValueError(f"sparse_mla_decode (triton): kv_cache dtype {kv_cache.dtype} differs from q dtype {q.dtype}")


def _kv_strides(kv_cache: torch.Tensor) -> tuple:
    # Global row g lives at slot g // rows, row g % rows: any slot/row strides work.
    return kv_cache.shape[1], kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2)


def _flat_rows(kv_cache: torch.Tensor) -> bool:
    """Whether global row g is simply at g * row stride (true for a contiguous cache)."""
    return kv_cache.shape[0] == 1 or kv_cache.stride(0) == kv_cache.shape[1] * kv_cache.stride(1)


def _new_outputs(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    return out, lse


def sparse_mla_decode_simt(q, kv_cache, indices, sink, scale, block_k: int = 16, num_warps: int = 4):
    """Baseline: one program per (sequence, head), no tensor cores. Returns (out, lse)."""
    _check(q, kv_cache, indices, sink)
    batch, heads, head_dim = q.shape
    out, lse = _new_outputs(q)
    if batch == 0:
        return out, lse
    rows_per_slot, *kv_strides = _kv_strides(kv_cache)
    _simt_kernel[(heads, batch)](
        q, kv_cache, indices, sink, out, lse,
        indices.shape[1], head_dim, rows_per_slot, float(scale) * LOG2E,
        *q.stride(), *kv_strides,
        *indices.stride(), sink.stride(0),
        out.stride(0), out.stride(1), lse.stride(0),
        BLOCK_K=block_k, BLOCK_D=_block_d(head_dim), FLAT_ROWS=_flat_rows(kv_cache), num_warps=num_warps,
    )
    return out, lse


# The fused combine loads this many splits' tiles per step: one program merges every partial of
# its block, so its speed is the bytes it keeps in flight.
COMBINE_SPLITS_PER_STEP = 2


def _fused_combine_columns(tiles: TileConfig, head_dim: int) -> int:
    """Output columns the fused combine merges per chunk, sized by registers (Triton 3.6, sm_90,
    checked with ptxas). A column part of at most 64 fp32 per thread (the small head blocks of
    batch 1-4, whose main loop leaves registers free) is one chunk: 16x32 tiles then use 248
    registers without spilling. Larger parts (64-head blocks) go in chunks of 32 per thread,
    which spill no more than the main loop does; bigger chunks spill."""
    block_dv = _block_d(head_dim) // tiles.dv_split
    per_thread = 32 * tiles.num_warps  # fp32 elements per register across the program's threads
    if tiles.block_h * block_dv <= 64 * per_thread:
        return block_dv
    return max(16, 32 * per_thread // tiles.block_h)


def _launch_head_batched(
    q, kv_cache, indices, sink, scale, tiles, num_splits, blocks_per_split, out, lse, part_out, part_lse, counters=None,
    launch_dependents=False,
):
    """counters (int32) given: split-K with the combine fused into the split programs.
    launch_dependents: the next kernel (the combine, launched with PDL) may start early."""
    batch, heads, head_dim = q.shape
    rows_per_slot, *kv_strides = _kv_strides(kv_cache)
    grid = (triton.cdiv(heads, tiles.block_h) * tiles.dv_split, num_splits, batch)
    fused = counters is not None
    _head_batched_kernel[grid](
        q, kv_cache, indices, sink, out, lse, part_out, part_lse, counters,
        heads, indices.shape[1], head_dim, rows_per_slot, blocks_per_split, float(scale) * LOG2E,
        *q.stride(), *kv_strides,
        *indices.stride(), sink.stride(0),
        out.stride(0), out.stride(1), lse.stride(0),
        BLOCK_H=tiles.block_h, BLOCK_K=tiles.block_k, BLOCK_D=_block_d(head_dim), DV_SPLIT=tiles.dv_split,
        FLAT_ROWS=_flat_rows(kv_cache), SPLIT=part_out is not None, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        FUSED_COMBINE=fused,
        BLOCK_DC=_fused_combine_columns(tiles, head_dim) if fused else 1, SPLITS_PER_STEP=COMBINE_SPLITS_PER_STEP,
        LAUNCH_DEPENDENTS=launch_dependents, PREFETCH=tiles.prefetch,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )


def sparse_mla_decode_head_batched(q, kv_cache, indices, sink, scale, tiles: TileConfig | None = None):
    """One program per (sequence, head block) over the whole index list. Returns (out, lse)."""
    _check(q, kv_cache, indices, sink)
    batch, heads, head_dim = q.shape
    tiles = tiles or head_batched_tiles(heads, head_dim, q.element_size())
    out, lse = _new_outputs(q)
    if batch == 0:
        return out, lse
    n_blocks = triton.cdiv(indices.shape[1], tiles.block_k)
    _launch_head_batched(q, kv_cache, indices, sink, scale, tiles, 1, max(n_blocks, 1), out, lse, None, None)
    return out, lse


def _check_workspace(workspace, numel, batch, heads, head_dim, num_splits, device, fused_combine=False) -> None:
    if workspace.dtype != torch.float32 or workspace.device != device or not workspace.is_contiguous():
        raise ValueError(
            f"sparse_mla_decode: workspace must be a contiguous fp32 tensor on {device}, got "
            f"{workspace.dtype} on {workspace.device}"
        )
    if workspace.numel() < numel:
        how = "sparse_mla_workspace(..., fused_combine=True)" if fused_combine else "sparse_mla_workspace"
        raise ValueError(
            f"sparse_mla_decode: workspace holds {workspace.numel()} fp32 elements, {num_splits} splits at "
            f"B={batch}, H={heads}, D={head_dim} need {numel} (allocate it with {how})"
        )


def _split_scratch(workspace, batch, heads, head_dim, num_splits, device):
    numel = workspace_numel(batch, heads, head_dim, num_splits)
    if workspace is None:
        workspace = torch.empty(numel, dtype=torch.float32, device=device)
    else:
        _check_workspace(workspace, numel, batch, heads, head_dim, num_splits, device)
    n_out = batch * num_splits * heads * head_dim
    return workspace[:n_out], workspace[n_out:numel]


def _fused_scratch(workspace, batch, heads, head_dim, num_splits, device):
    """(counters int32, partial outputs, partial LSEs) of a fused-combine workspace; a per-call
    one when workspace is None (only its counters need zeroing)."""
    numel = workspace_numel(batch, heads, head_dim, num_splits, fused_combine=True)
    if workspace is None:
        workspace = torch.empty(numel, dtype=torch.float32, device=device)
        fused_counters(workspace, batch, heads).zero_()
    else:
        _check_workspace(workspace, numel, batch, heads, head_dim, num_splits, device, fused_combine=True)
    n_counters = num_fused_counters(batch, heads)
    n_out = batch * num_splits * heads * head_dim
    return (
        fused_counters(workspace, batch, heads),
        workspace[n_counters : n_counters + n_out],
        workspace[n_counters + n_out : numel],
    )


def sparse_mla_decode_split_k(
    q,
    kv_cache,
    indices,
    sink,
    scale,
    num_splits: int | None = None,
    workspace=None,
    tiles: TileConfig | None = None,
    fused_combine: bool = False,
    pdl: bool = False,
):
    """Split-K path: partial outputs per split into fp32 scratch, then the LSE combine, always
    (even with one split). num_splits defaults to choose_num_splits. Returns (out, lse).

    pdl=True (Hopper and later): the combine is launched as a programmatic dependent of the split
    kernel, so its launch overlaps the splits' work and it waits on the device for their partials
    (also inside a CUDA graph). No effect under the interpreter, which has no grids to overlap.

    fused_combine=True: one launch, the last split program of each block does the combine. Its
    workspace (sparse_mla_workspace(..., fused_combine=True), or one allocated per call when None)
    holds arrival counters that must be 0 at the start; each call leaves them at 0."""
    _check(q, kv_cache, indices, sink)
    batch, heads, head_dim = q.shape
    topk = indices.shape[1]
    num_sms = device_sm_count(q.device)
    tiles = tiles or choose_tiles(batch, heads, topk, num_sms, head_dim, q.element_size())
    if num_splits is None:
        num_splits = choose_num_splits(batch, heads, topk, num_sms, head_dim, q.element_size(), tiles)
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"sparse_mla_decode: num_splits must be in [1, {MAX_SPLITS}], got {num_splits}")
    if pdl and fused_combine:
        raise ValueError("sparse_mla_decode: pdl=True launches the separate combine; fused_combine=True has none")
    if pdl and q.is_cuda and torch.cuda.get_device_capability(q.device)[0] < 9:
        raise ValueError(f"sparse_mla_decode: pdl=True needs compute capability 9.0 or later, {q.device} has less")
    out, lse = _new_outputs(q)
    if batch == 0:
        return out, lse
    # Whole KV blocks per split; with more splits than blocks the trailing splits are empty.
    blocks_per_split = max(1, triton.cdiv(triton.cdiv(topk, tiles.block_k), num_splits))
    if fused_combine:
        counters, part_out, part_lse = _fused_scratch(workspace, batch, heads, head_dim, num_splits, q.device)
        _launch_head_batched(
            q, kv_cache, indices, sink, scale, tiles, num_splits, blocks_per_split, out, lse, part_out, part_lse, counters
        )
        return out, lse
    part_out, part_lse = _split_scratch(workspace, batch, heads, head_dim, num_splits, q.device)
    pdl = pdl and not interpreting()
    _launch_head_batched(
        q, kv_cache, indices, sink, scale, tiles, num_splits, blocks_per_split, out, lse, part_out, part_lse,
        launch_dependents=pdl,
    )
    block_s = triton.next_power_of_2(num_splits)
    block_dc = max(16, min(_block_d(head_dim), 4096 // block_s))
    _combine_kernel[(triton.cdiv(head_dim, block_dc), heads, batch)](
        part_out, part_lse, sink, out, lse,
        heads, head_dim, num_splits,
        sink.stride(0), out.stride(0), out.stride(1), lse.stride(0),
        BLOCK_S=block_s, BLOCK_DC=block_dc, WAIT_FOR_SPLITS=pdl, num_warps=4,
        **({"launch_pdl": True} if pdl else {}),
    )
    return out, lse


def sparse_mla_decode_triton(q, kv_cache, indices, sink, scale, workspace=None):
    """Default path: tiles and split count from the shapes (choose_plan); one split runs the
    head-batched kernel alone, several run split-K with the combine, launched as a programmatic
    dependent where the GPU has it (0.3-1 us less per call on the H200). Returns (out, lse)."""
    _check(q, kv_cache, indices, sink)
    batch, heads, head_dim = q.shape
    topk = indices.shape[1]
    tiles, num_splits = choose_plan(batch, heads, topk, device_sm_count(q.device), head_dim, q.element_size())
    if num_splits == 1:
        return sparse_mla_decode_head_batched(q, kv_cache, indices, sink, scale, tiles)
    return sparse_mla_decode_split_k(
        q, kv_cache, indices, sink, scale, num_splits, workspace, tiles, pdl=launches_dependents(q.device)
    )
