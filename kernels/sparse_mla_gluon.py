"""Sparse MLA decode on Hopper tensor cores with an explicit gather pipeline (Gluon).

Semantics: kernels/sparse_mla.py. The Triton head-batched kernel (sparse_mla_triton.py) keeps
one gathered KV block in flight: Triton's software pipeline loads a block's indices, waits for
them, then issues the block's gather, so at large batches each block costs its gather latency
plus its two products. This kernel writes the schedule out by hand in Gluon, Triton's
lower-level dialect:

- a ring of STAGES shared-memory buffers of BLOCK_N gathered rows, filled by cp.async, so
  STAGES - 1 gathers are in flight while the tensor cores work on the oldest one;
- the indices of a block are loaded one iteration before its gather is issued, so no gather
  waits for its own indices;
- Q stays in shared memory for the whole program; S = Q K^T and O += P V are warpgroup MMAs
  (wgmma) reading K and V from the same gathered rows (they are one row in MLA);
- two warpgroups: each owns half of the output columns (O is 64 x 512 fp32, 128 registers per
  thread) and half of each block's scores; the row max and the P tile cross between them
  through layout conversions the compiler lowers to shared memory.

One program per (64-head block, split, sequence). With one split it finishes the softmax with
the sink and writes out and lse; with several it writes the same fp32 partials as the Triton
split kernel (normalised by their own sum, base-2 LSE) and sparse_mla_triton's combine kernel
merges them. sm_90 only (wgmma), bf16 or fp16, heads a multiple of 64, head dim 128-512.
"""
from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma

from kernels import sparse_mla_triton as smt
from kernels.sparse_mla_plan import MAX_SPLITS, WGMMA_BLOCK_N, WGMMA_STAGES, blocks_per_split, wgmma_splits
from kernels.sparse_mla_triton import _row_offsets  # a Triton function: Gluon kernels call them as they are
from kernels.triton_util import num_sms

BLOCK_H = 64  # one wgmma M tile: four warps of 16 rows
NUM_WARPS = 8  # two warpgroups, side by side along the output columns
LOG2E = 1.4426950408889634
# Globals read inside kernels must be constexpr.
LOG2E_C = gl.constexpr(LOG2E)
LN2_C = gl.constexpr(0.6931471805599453)

_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}
# cp.async into shared memory: `async_load` since Triton 3.7, `async_copy_global_to_shared` before.
_async_load = getattr(cp, "async_load", None) or cp.async_copy_global_to_shared
# A CTA-wide barrier: `barrier` since Triton 3.7, `thread_barrier` before.
_cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier


@gluon.jit
def _sparse_mla_wgmma_kernel(
    q_ptr, kv_ptr, idx_ptr, sink_ptr, out_ptr, lse_ptr, part_out_ptr, part_lse_ptr,
    H, K, rows_per_slot, blocks_per_split, scale_log2,
    stride_qb, stride_qh, stride_slot, stride_row, stride_ib, stride_ik, stride_sink,
    stride_ob, stride_oh, stride_lb,
    D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    Q_SMEM: gl.constexpr, KV_SMEM: gl.constexpr,
    FLAT_ROWS: gl.constexpr, SPLIT: gl.constexpr,
):
    HEADS: gl.constexpr = 64
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    # Accumulators: warps [4, 2] put warpgroup w on columns [w * N / 2, (w + 1) * N / 2).
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, BLOCK_N // 2, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, D // 2, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    # Gathers: 16-byte pieces, a warp per row, 8 warps over the rows of a block.
    g_layout: gl.constexpr = gl.BlockedLayout(
        size_per_thread=[1, 8], threads_per_warp=[1, 32], warps_per_cta=[8, 1], order=[1, 0]
    )

    hb = gl.program_id(0)
    split = gl.program_id(1)
    b = gl.program_id(2).to(gl.int64)

    q_smem = gl.allocate_shared_memory(dtype, [HEADS, D], Q_SMEM)
    kv_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], KV_SMEM)

    offs_d_g = gl.arange(0, D, layout=gl.SliceLayout(0, g_layout))
    offs_h_g = hb * HEADS + gl.arange(0, HEADS, layout=gl.SliceLayout(1, g_layout))
    _async_load(q_smem, q_ptr + b * stride_qb + offs_h_g[:, None] * stride_qh + offs_d_g[None, :])

    k_begin = split * blocks_per_split * BLOCK_N
    k_end = gl.minimum(k_begin + blocks_per_split * BLOCK_N, K)
    n_blocks = gl.cdiv(k_end - k_begin, BLOCK_N)
    idx_row_ptr = idx_ptr + b * stride_ib
    offs_n_g = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, g_layout))
    offs_n_s = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))

    # Prologue: the first STAGES - 1 gathers (Q rides in the first group).
    for j in gl.static_range(STAGES - 1):
        row_off, valid = _row_offsets(
            idx_row_ptr, k_begin + j * BLOCK_N + offs_n_g, k_end, stride_ik, rows_per_slot, stride_slot, stride_row,
            FLAT_ROWS,
        )
        _async_load(kv_smem.index(j), kv_ptr + row_off[:, None] + offs_d_g[None, :], mask=valid[:, None])
        cp.commit_group()
    # Indices one step ahead: the next gather's rows, and this block's validity in score layout.
    next_off, next_valid = _row_offsets(
        idx_row_ptr, k_begin + (STAGES - 1) * BLOCK_N + offs_n_g, k_end, stride_ik, rows_per_slot, stride_slot,
        stride_row, FLAT_ROWS,
    )
    cur_idx = gl.load(idx_row_ptr + (k_begin + offs_n_s) * stride_ik, mask=k_begin + offs_n_s < k_end, other=-1)

    acc = gl.zeros([HEADS, D], gl.float32, o_layout)
    m_i = gl.full([HEADS], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([HEADS], gl.float32, gl.SliceLayout(1, s_layout))
    s_zero = gl.zeros([HEADS, BLOCK_N], gl.float32, s_layout)
    for i in range(n_blocks):
        # Block i has landed for this thread; the fence hands its writes to the tensor cores'
        # proxy and the barrier waits for every thread's part (and for both warpgroups to be
        # done with the buffer the next gather overwrites).
        cp.wait_group(STAGES - 2)
        fence_async_shared()
        _cta_barrier()

        _async_load(
            kv_smem.index((i + STAGES - 1) % STAGES), kv_ptr + next_off[:, None] + offs_d_g[None, :],
            mask=next_valid[:, None],
        )
        cp.commit_group()
        next_off, next_valid = _row_offsets(
            idx_row_ptr, k_begin + (i + STAGES) * BLOCK_N + offs_n_g, k_end, stride_ik, rows_per_slot, stride_slot,
            stride_row, FLAT_ROWS,
        )
        offs_k_next = k_begin + (i + 1) * BLOCK_N + offs_n_s
        next_idx = gl.load(idx_row_ptr + offs_k_next * stride_ik, mask=offs_k_next < k_end, other=-1)

        kv = kv_smem.index(i % STAGES)
        s = warpgroup_mma(q_smem, kv.permute((1, 0)), s_zero, use_acc=False)
        s = gl.where((cur_idx >= 0)[None, :], s * scale_log2, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        m_ref = gl.where(m_new == float("-inf"), 0.0, m_new)  # no valid score yet: keep p, alpha finite
        alpha = gl.exp2(m_i - m_ref)
        p = gl.exp2(s - m_ref[:, None])
        l_i = l_i * alpha + gl.sum(p, axis=1)
        m_i = m_new
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout), kv, acc)
        cur_idx = next_idx
    cp.wait_group(0)  # the gathers past the end are empty, but must not outlive the program

    offs_h = hb * HEADS + gl.arange(0, HEADS, layout=gl.SliceLayout(1, o_layout))
    offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
    m_o = gl.convert_layout(m_i, gl.SliceLayout(1, o_layout))
    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
    if SPLIT:
        # As the Triton split kernel: l >= 1 once any index was valid; the floor keeps an empty
        # split at out = 0 and lse = -inf.
        l_safe = gl.maximum(l_o, 1e-30)
        row = (b * gl.num_programs(1) + split) * H + offs_h
        gl.store(part_out_ptr + row[:, None] * D + offs_d[None, :], acc / l_safe[:, None])
        gl.store(part_lse_ptr + row, m_o + gl.log2(l_safe))
    else:
        sink2 = gl.load(sink_ptr + offs_h * stride_sink).to(gl.float32) * LOG2E_C
        m_all = gl.maximum(m_o, sink2)
        w = gl.exp2(m_o - m_all)
        denom = l_o * w + gl.exp2(sink2 - m_all)
        out = acc * (w / denom)[:, None]
        gl.store(out_ptr + b * stride_ob + offs_h[:, None] * stride_oh + offs_d[None, :], out.to(dtype))
        gl.store(lse_ptr + b * stride_lb + offs_h, (m_all + gl.log2(denom)) * LN2_C)


def check_wgmma_inputs(q: torch.Tensor, kv_cache: torch.Tensor) -> None:
    """Raise ValueError naming what this kernel cannot take (the Triton kernels take the rest)."""
    if q.dtype not in _GL_DTYPES:
        raise ValueError(f"sparse_mla_decode (wgmma): q must be bf16 or fp16, got {q.dtype}")
    if kv_cache.dtype != q.dtype:
        raise ValueError(f"sparse_mla_decode (wgmma): kv_cache dtype {kv_cache.dtype} differs from q dtype {q.dtype}")
    if not q.is_cuda or torch.cuda.get_device_capability(q.device)[0] != 9:
        raise ValueError(f"sparse_mla_decode (wgmma): needs a compute capability 9.x GPU (warpgroup MMA), got {q.device}")
    heads, head_dim = q.shape[1], q.shape[2]
    if heads % BLOCK_H:
        raise ValueError(f"sparse_mla_decode (wgmma): heads must be a multiple of {BLOCK_H}, got {heads}")
    if head_dim not in (128, 256, 512):
        raise ValueError(f"sparse_mla_decode (wgmma): head dim must be 128, 256 or 512, got {head_dim}")
    if q.stride(2) != 1 or kv_cache.stride(2) != 1:
        raise ValueError("sparse_mla_decode (wgmma): q and kv_cache need a contiguous last dimension")


def launch_wgmma(
    q, kv_cache, indices, sink, scale, num_splits, out, lse, part_out=None, part_lse=None,
    block_n: int = WGMMA_BLOCK_N, stages: int = WGMMA_STAGES,
):
    """Launch the kernel; with part_out/part_lse (fp32 [B, splits, H, D] / [B, splits, H]) it
    writes partials for sparse_mla_triton's combine instead of out and lse."""
    batch, heads, head_dim = q.shape
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"sparse_mla_decode (wgmma): num_splits must be in [1, {MAX_SPLITS}], got {num_splits}")
    if block_n not in (16, 32, 64) or not 2 <= stages <= 8:
        raise ValueError(f"sparse_mla_decode (wgmma): block_n must be 16, 32 or 64 and stages 2-8, got {block_n}, {stages}")
    rows_per_slot = kv_cache.shape[1]
    flat_rows = kv_cache.shape[0] == 1 or kv_cache.stride(0) == rows_per_slot * kv_cache.stride(1)
    gl_dtype = _GL_DTYPES[q.dtype]
    split = part_out is not None
    _sparse_mla_wgmma_kernel[(heads // BLOCK_H, num_splits, batch)](
        q, kv_cache, indices, sink, out, lse,
        part_out if split else out, part_lse if split else lse,
        heads, indices.shape[1], rows_per_slot, blocks_per_split(indices.shape[1], block_n, num_splits),
        float(scale) * LOG2E,
        q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1), indices.stride(0), indices.stride(1),
        sink.stride(0), out.stride(0), out.stride(1), lse.stride(0),
        D=head_dim, BLOCK_N=block_n, STAGES=stages,
        Q_SMEM=gl.NVMMASharedLayout.get_default_for([BLOCK_H, head_dim], gl_dtype),
        KV_SMEM=gl.NVMMASharedLayout.get_default_for([block_n, head_dim], gl_dtype),
        FLAT_ROWS=flat_rows, SPLIT=split,
        num_warps=NUM_WARPS,
    )


def sparse_mla_decode_wgmma(
    q, kv_cache, indices, sink, scale, num_splits: int | None = None, workspace=None,
    block_n: int = WGMMA_BLOCK_N, stages: int = WGMMA_STAGES,
):
    """This kernel alone at one split; at more, its partials merged by the Triton combine kernel.
    num_splits None: the default path's rule (sparse_mla_plan.wgmma_splits), at any batch.
    workspace: as for sparse_mla_triton.sparse_mla_decode_split_k. Returns (out, lse)."""
    smt._check(q, kv_cache, indices, sink)
    check_wgmma_inputs(q, kv_cache)
    batch, heads, head_dim = q.shape
    if num_splits is None:
        num_splits = wgmma_splits(
            batch, heads, indices.shape[1], num_sms(q.device), head_dim, q.element_size(),
            torch.cuda.get_device_capability(q.device), min_head_blocks=1, min_topk=1,
        ) or 1
    out, lse = smt._new_outputs(q)
    if batch == 0:
        return out, lse
    if num_splits == 1:
        launch_wgmma(q, kv_cache, indices, sink, scale, 1, out, lse, block_n=block_n, stages=stages)
        return out, lse
    part_out, part_lse = smt._split_scratch(workspace, batch, heads, head_dim, num_splits, q.device)
    launch_wgmma(q, kv_cache, indices, sink, scale, num_splits, out, lse, part_out, part_lse, block_n, stages)
    smt.launch_combine(part_out, part_lse, sink, out, lse, num_splits)
    return out, lse
