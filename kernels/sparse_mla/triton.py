"""Triton implementations of sparse MLA decode (semantics: kernels/sparse_mla/ref.py).

Three kernels compute the same thing:

- simt: one program per (sequence, head) with CUDA-core dot products. Every gathered row is
  fetched once per head (64x for V4), which makes it the baseline to beat.
- head_batched: one program per (sequence, block of heads). Each KV tile of `block_k` gathered
  rows is loaded once and feeds two tensor-core products, S = Q K^T and O += P V, with an online
  softmax in fp32. The 512-wide head dim is one tile (Triton splits the products into MMA steps),
  except that a 64-head block splits its output columns between two programs (plan.py).
- split_k: head_batched with the index list cut into `num_splits` contiguous pieces. Each
  program writes its normalised partial output and base-2 LSE to fp32 scratch; the combine
  kernel (common.py) merges the pieces with log-sum-exp and adds the sink. This fills the GPU
  when batch x head-blocks is far below the SM count.

`sparse_mla_decode_triton` is the Triton plan: tiles and split count from kernels/sparse_mla/plan.py,
pure functions of the shapes and the SM count (so one CUDA-graph capture per batch bucket stays
valid), and no combine when one split suffices. Softmax runs in base 2: scores carry
scale * log2(e).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.sparse_mla.common import (
    LN2_C,
    LOG2E,
    LOG2E_C,
    _check,
    _flat_rows,
    _load_indices,
    _new_outputs,
    _offsets_of,
    _split_scratch,
    launch_combine,
)
from kernels.sparse_mla.plan import (
    MAX_SPLITS,
    TileConfig,
    _block_d,
    blocks_per_split,
    choose_num_splits,
    choose_plan,
    head_batched_tiles,
)
from kernels.triton_util import interpreting, launches_dependents
from kernels.triton_util import num_sms as device_sm_count


# ---------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------


@triton.jit
def _row_offsets(idx_row_ptr, offs_k, k_end, stride_ik, rows_per_slot, stride_slot, stride_row, FLAT_ROWS: tl.constexpr):
    """_offsets_of(indices[offs_k]); offs_k >= k_end is masked."""
    idx = _load_indices(idx_row_ptr, offs_k, k_end, stride_ik)
    return _offsets_of(idx, rows_per_slot, stride_slot, stride_row, FLAT_ROWS)


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
def _softmax_and_pv(s, kv, valid, m_i, l_i, acc, scale_log2, DOT_PRECISION: tl.constexpr):
    """A block's scores S = Q K^T [BLOCK_H, BLOCK_K] into the running softmax, and acc += P V on
    this program's columns of the block's rows kv."""
    p, alpha, m_i, l_i = _online_softmax_step(s * scale_log2, valid, m_i, l_i)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(kv.dtype), kv, acc, input_precision=DOT_PRECISION)
    return acc, m_i, l_i


@triton.jit
def _head_batched_kernel(
    q_ptr, kv_ptr, idx_ptr, sink_ptr, out_ptr, lse_ptr, part_out_ptr, part_lse_ptr,
    H, K, D, rows_per_slot, blocks_per_split, scale_log2,
    stride_qb, stride_qh, stride_qd,
    stride_slot, stride_row, stride_d,
    stride_ib, stride_ik, stride_sink,
    stride_ob, stride_oh, stride_lb,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, DV_SPLIT: tl.constexpr,
    FLAT_ROWS: tl.constexpr, SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    LAUNCH_DEPENDENTS: tl.constexpr = False,
    WAIT_FOR_PREDECESSOR: tl.constexpr = False,
):
    """Program (head block x column part, split, sequence).

    DV_SPLIT=2: two programs share a head block, each computing all of S = Q K^T (from its own
    half of the columns plus the other half) but P V only for its own half, which halves the
    accumulator and lets one warpgroup own a 64-head tile. SPLIT=False: the only split, writes out
    and lse. SPLIT=True: writes the partial output (normalised by its own sum, zeros when the split
    has no valid index) and its base-2 LSE (-inf when empty) to the fp32 scratch. WAIT_FOR_PREDECESSOR:
    launched with PDL after whatever ran before it (sparse_mla_decode_split_k's overlap_launch)."""
    BLOCK_DV: tl.constexpr = BLOCK_D // DV_SPLIT
    if LAUNCH_DEPENDENTS:
        # Let the combine launch now: its programs wait on the device until this grid is done.
        tl.extra.cuda.gdc_launch_dependents()
    if WAIT_FOR_PREDECESSOR:
        # Launched as a programmatic dependent of the kernel before it: nothing that kernel may
        # have written (q, the indices, the cache) is read before it is done.
        tl.extra.cuda.gdc_wait()
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

    acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    k_begin = split * blocks_per_split * BLOCK_K
    k_end = tl.minimum(k_begin + blocks_per_split * BLOCK_K, K)
    idx_row_ptr = idx_ptr + b * stride_ib
    for start in range(k_begin, k_end, BLOCK_K):
        offs_k = start + tl.arange(0, BLOCK_K)
        row_off, valid = _row_offsets(
            idx_row_ptr, offs_k, k_end, stride_ik, rows_per_slot, stride_slot, stride_row, FLAT_ROWS
        )
        kv = _load_rows(kv_ptr, row_off, valid, offs_dv, dv_ok, stride_d)
        s = tl.dot(q, tl.trans(kv), input_precision=DOT_PRECISION)  # [BLOCK_H, BLOCK_K] fp32
        if DV_SPLIT == 2:
            kv_other = _load_rows(kv_ptr, row_off, valid, offs_do, do_ok, stride_d)
            s = tl.dot(q_other, tl.trans(kv_other), s, input_precision=DOT_PRECISION)
        acc, m_i, l_i = _softmax_and_pv(s, kv, valid, m_i, l_i, acc, scale_log2, DOT_PRECISION)

    if SPLIT:
        # l_i >= 1 whenever any index was valid (the max term is exp2(0)); the floor only keeps an
        # empty split at out = 0 and lse = -inf + finite = -inf, never 0/0.
        l_safe = tl.maximum(l_i, 1e-30)
        row = (b * tl.num_programs(1) + split) * H + offs_h  # scratch is [B, splits, H, D]
        tl.store(
            part_out_ptr + row[:, None] * D + offs_dv[None, :], acc / l_safe[:, None],
            mask=h_ok[:, None] & dv_ok[None, :],
        )
        if part == 0:
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


# ---------------------------------------------------------------------------------------------
# Python entry points
# ---------------------------------------------------------------------------------------------


def _kv_strides(kv_cache: torch.Tensor) -> tuple:
    # Global row g lives at slot g // rows, row g % rows: any slot/row strides work.
    return kv_cache.shape[1], kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2)


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


def _launch_head_batched(
    q, kv_cache, indices, sink, scale, tiles, num_splits, blocks_per_split, out, lse, part_out, part_lse,
    launch_dependents=False, wait_for_predecessor=False,
):
    """launch_dependents: the next kernel (the combine, launched with PDL) may start early.
    wait_for_predecessor: this kernel is launched with PDL itself and waits on the device for the
    kernel before it."""
    batch, heads, head_dim = q.shape
    rows_per_slot, *kv_strides = _kv_strides(kv_cache)
    grid = (triton.cdiv(heads, tiles.block_h) * tiles.dv_split, num_splits, batch)
    _head_batched_kernel[grid](
        q, kv_cache, indices, sink, out, lse, part_out, part_lse,
        heads, indices.shape[1], head_dim, rows_per_slot, blocks_per_split, float(scale) * LOG2E,
        *q.stride(), *kv_strides,
        *indices.stride(), sink.stride(0),
        out.stride(0), out.stride(1), lse.stride(0),
        BLOCK_H=tiles.block_h, BLOCK_K=tiles.block_k, BLOCK_D=_block_d(head_dim), DV_SPLIT=tiles.dv_split,
        FLAT_ROWS=_flat_rows(kv_cache), SPLIT=part_out is not None, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        LAUNCH_DEPENDENTS=launch_dependents, WAIT_FOR_PREDECESSOR=wait_for_predecessor,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        **({"launch_pdl": True} if wait_for_predecessor else {}),
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
    _launch_head_batched(q, kv_cache, indices, sink, scale, tiles, 1, max(n_blocks, 1), out, lse, None, None,
                         wait_for_predecessor=launches_dependents(q.device))
    return out, lse


def sparse_mla_decode_split_k(
    q,
    kv_cache,
    indices,
    sink,
    scale,
    num_splits: int | None = None,
    workspace=None,
    tiles: TileConfig | None = None,
    pdl: bool = False,
    overlap_launch: bool = False,
):
    """Split-K path: partial outputs per split into fp32 scratch, then the LSE combine, always
    (even with one split). tiles and num_splits default to the default plan's (choose_plan; given
    tiles, the best split count for them). Returns (out, lse).

    pdl=True (Hopper and later): the combine is launched as a programmatic dependent of the split
    kernel, so its launch overlaps the splits' work and it waits on the device for their partials
    (also inside a CUDA graph). No effect under the interpreter, which has no grids to overlap.
    overlap_launch=True (Hopper and later): the split kernel too is launched as a programmatic
    dependent, of whatever kernel precedes it, and waits on the device for it before its first
    load (and so before any write), so its launch overlaps that kernel's tail."""
    _check(q, kv_cache, indices, sink)
    batch, heads, head_dim = q.shape
    topk = indices.shape[1]
    num_sms = device_sm_count(q.device)
    if tiles is None:
        tiles, planned_splits = choose_plan(batch, heads, topk, num_sms, head_dim, q.element_size())
        num_splits = planned_splits if num_splits is None else num_splits
    elif num_splits is None:
        num_splits = choose_num_splits(batch, heads, topk, num_sms, head_dim, q.element_size(), tiles)
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"sparse_mla_decode: num_splits must be in [1, {MAX_SPLITS}], got {num_splits}")
    for name, wanted in (("pdl", pdl), ("overlap_launch", overlap_launch)):
        if wanted and q.is_cuda and torch.cuda.get_device_capability(q.device)[0] < 9:
            raise ValueError(f"sparse_mla_decode: {name}=True needs compute capability 9.0 or later, {q.device} has less")
    out, lse = _new_outputs(q)
    if batch == 0:
        return out, lse
    overlap_launch = overlap_launch and not interpreting()
    split_blocks = blocks_per_split(topk, tiles.block_k, num_splits)
    part_out, part_lse = _split_scratch(workspace, batch, heads, head_dim, num_splits, q.device)
    pdl = pdl and not interpreting()
    _launch_head_batched(
        q, kv_cache, indices, sink, scale, tiles, num_splits, split_blocks, out, lse, part_out, part_lse,
        launch_dependents=pdl, wait_for_predecessor=overlap_launch,
    )
    launch_combine(part_out, part_lse, sink, out, lse, num_splits, pdl)
    return out, lse


def sparse_mla_decode_triton(q, kv_cache, indices, sink, scale, workspace=None):
    """The Triton plan: tiles and split count from the shapes (choose_plan); one split runs the
    head-batched kernel alone, several run split-K with the combine. Where the GPU has
    programmatic dependent launch, the combine starts while the splits run and the split kernel
    while the kernel before it finishes. Returns (out, lse)."""
    _check(q, kv_cache, indices, sink)
    batch, heads, head_dim = q.shape
    tiles, num_splits = choose_plan(batch, heads, indices.shape[1], device_sm_count(q.device), head_dim, q.element_size())
    if num_splits == 1:
        return sparse_mla_decode_head_batched(q, kv_cache, indices, sink, scale, tiles)
    overlap = launches_dependents(q.device)
    return sparse_mla_decode_split_k(
        q, kv_cache, indices, sink, scale, num_splits, workspace, tiles, pdl=overlap, overlap_launch=overlap
    )
