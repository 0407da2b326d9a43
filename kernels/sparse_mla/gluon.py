"""Sparse MLA decode on Hopper tensor cores, warp-specialised (Gluon).

Semantics: kernels/sparse_mla/ref.py. One program per (64-head block, split, sequence) runs three
partitions of four warps, which hand work to each other through shared memory and mbarriers:

- a producer gathers each block of BLOCK_N cache rows with cp.async into a ring of STAGES
  buffers (each block's indices loaded a block before its addresses are computed, so no gather
  waits on an index load), marks a buffer ready when its rows land, and refills it once both
  warpgroups below have released it;
- the scores warpgroup keeps Q in shared memory and computes S = Q K^T for the whole block as one
  warpgroup-MMA chain (Q read from shared memory once per block), the online softmax and P; it
  passes P (16-bit) and the running sum's rescale factor to the other warpgroup through a
  double-buffered shared tile, then computes O += P V for the first half of the output columns;
- the second warpgroup rescales its accumulator and computes O += P V for the other half of the
  columns, reading P from shared memory, while the scores warpgroup moves on to the next block.

So the gathers never wait on the products, and half of P V overlaps the next block's scores.

With one split the program finishes the softmax with the sink and writes out and lse; with
several it writes the same fp32 partials as the Triton split kernel (normalised by their own sum,
base-2 LSE) and the combine kernel (common.py) merges them. sm_90 only (wgmma), bf16 or fp16,
heads a multiple of 64, head dim 128-512.
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, warpgroup_mma

# _load_indices and _offsets_of are Triton functions: Gluon kernels call them as they are.
from kernels.dependent_launch import dependent_options, wait_for_predecessor
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
    MAX_SPLITS, WGMMA_BLOCK_N, WGMMA_HEAD_DIMS, WGMMA_STAGES, blocks_per_split, wgmma_splits,
)
from kernels.gluon_compat import async_load, barrier
from kernels.triton_util import launches_dependents, num_sms

BLOCK_H = 64  # one wgmma M tile: a warpgroup of four 16-row warps
NUM_WARPS = 4  # the scores warpgroup, the default partition
# Registers per thread of the workers (setmaxnreg): the second warpgroup holds a 64 x D/2 fp32
# accumulator (fewer spill it), the producer addresses and the next block's indices in flight
# (64 spill at D=512); the scores warpgroup gets the rest.
WORKER_REGS = (168, 72)
PRODUCER_THREADS = gl.constexpr(4 * 32)  # each thread arrives on a buffer's mbarrier when its copies land

# Rows of 16-byte pieces, a warp per row, over four warps: the producer's gathers and Q's load.
ROWS_LAYOUT = gl.constexpr(
    gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[1, 32], warps_per_cta=[4, 1], order=[1, 0])
)

_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}


@gluon.jit
def _gather_rows(
    kv_ptr, idx_row_ptr, kv_smem, kv_ready, kv_free, k_begin, k_end, n_blocks, rows_per_slot,
    stride_ik, stride_slot, stride_row,
    D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, FLAT_ROWS: gl.constexpr,
):
    """Producer: block i's rows into buffer i % STAGES; every thread's copies arrive on kv_ready.
    Indices are loaded a block ahead of their use: a gather's addresses never wait on a load."""
    offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, ROWS_LAYOUT))
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ROWS_LAYOUT))
    idx = _load_indices(idx_row_ptr, k_begin + offs_n, k_end, stride_ik)
    row_off, valid = _offsets_of(idx, rows_per_slot, stride_slot, stride_row, FLAT_ROWS)
    idx = _load_indices(idx_row_ptr, k_begin + BLOCK_N + offs_n, k_end, stride_ik)
    for i in range(n_blocks):
        stage = i % STAGES
        # Both warpgroups are done with the block this buffer held (nothing to wait for at first).
        mbarrier.wait(kv_free.index(stage), ((i // STAGES) + 1) & 1, pred=i >= STAGES)
        async_load(kv_smem.index(stage), kv_ptr + row_off[:, None] + offs_d[None, :], mask=valid[:, None])
        cp.mbarrier_arrive(kv_ready.index(stage), increment_count=False)
        row_off, valid = _offsets_of(idx, rows_per_slot, stride_slot, stride_row, FLAT_ROWS)
        idx = _load_indices(idx_row_ptr, k_begin + (i + 2) * BLOCK_N + offs_n, k_end, stride_ik)


@gluon.jit
def _scores_and_first_half(
    q_smem, kv_smem, p_smem, alpha_smem, scale_smem, kv_ready, kv_free, p_ready, p_free, scale_ready,
    idx_row_ptr, sink_ptr, out_ptr, lse_ptr, part_out_ptr, part_lse_ptr, b, hb, split, n_splits, H,
    k_begin, k_end, n_blocks, stride_ik, stride_sink, stride_ob, stride_oh, stride_lb, scale_log2,
    D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, SPLIT: gl.constexpr,
):
    """Scores warpgroup: S, the online softmax, P for both warpgroups, O for columns [0, D/2)."""
    HEADS: gl.constexpr = 64
    DH: gl.constexpr = D // 2
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, DH, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    offs_n_s = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    cur_idx = _load_indices(idx_row_ptr, k_begin + offs_n_s, k_end, stride_ik)
    acc = gl.zeros([HEADS, DH], gl.float32, o_layout)
    m_i = gl.full([HEADS], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([HEADS], gl.float32, gl.SliceLayout(1, s_layout))
    s_zero = gl.zeros([HEADS, BLOCK_N], gl.float32, s_layout)
    for i in range(n_blocks):
        stage = i % STAGES
        pb = i % 2
        next_idx = _load_indices(idx_row_ptr, k_begin + (i + 1) * BLOCK_N + offs_n_s, k_end, stride_ik)
        mbarrier.wait(kv_ready.index(stage), (i // STAGES) & 1)
        fence_async_shared()  # the gathered rows, written through cp.async, to the tensor cores' proxy
        kv = kv_smem.index(stage)
        s = warpgroup_mma(q_smem, kv.permute((1, 0)), s_zero, use_acc=False)
        s = gl.where((cur_idx >= 0)[None, :], s * scale_log2, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        m_ref = gl.where(m_new == float("-inf"), 0.0, m_new)  # no valid score yet: keep p, alpha finite
        alpha = gl.exp2(m_i - m_ref)
        p = gl.exp2(s - m_ref[:, None])
        l_i = l_i * alpha + gl.sum(p, axis=1)
        m_i = m_new
        p16 = p.to(dtype)
        # The other warpgroup is done with the P tile it read two blocks ago.
        mbarrier.wait(p_free.index(pb), ((i // 2) + 1) & 1, pred=i >= 2)
        p_smem.index(pb).store(p16)
        alpha_smem.index(pb).store(alpha)
        fence_async_shared()
        barrier()  # every thread's part stored before the one arrive
        mbarrier.arrive(p_ready.index(pb), count=1)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        acc = warpgroup_mma(gl.convert_layout(p16, p_layout), kv.slice(0, DH, dim=1), acc)
        barrier()
        mbarrier.arrive(kv_free.index(stage), count=1)
        cur_idx = next_idx

    offs_h = hb * HEADS + gl.arange(0, HEADS, layout=gl.SliceLayout(1, o_layout))
    offs_d = gl.arange(0, DH, layout=gl.SliceLayout(0, o_layout))
    m_o = gl.convert_layout(m_i, gl.SliceLayout(1, o_layout))
    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
    if SPLIT:
        # As the Triton split kernel: l >= 1 once any index was valid; the floor keeps an empty
        # split at out = 0 and lse = -inf.
        l_safe = gl.maximum(l_o, 1e-30)
        scale = 1.0 / l_safe
    else:
        sink2 = gl.load(sink_ptr + offs_h * stride_sink).to(gl.float32) * LOG2E_C
        m_all = gl.maximum(m_o, sink2)
        w = gl.exp2(m_o - m_all)
        denom = l_o * w + gl.exp2(sink2 - m_all)
        scale = w / denom
    scale_smem.store(scale)
    barrier()
    mbarrier.arrive(scale_ready, count=1)
    if SPLIT:
        row = (b * n_splits + split) * H + offs_h
        gl.store(part_out_ptr + row[:, None] * D + offs_d[None, :], acc * scale[:, None])
        gl.store(part_lse_ptr + row, m_o + gl.log2(l_safe))
    else:
        gl.store(out_ptr + b * stride_ob + offs_h[:, None] * stride_oh + offs_d[None, :], (acc * scale[:, None]).to(dtype))
        gl.store(lse_ptr + b * stride_lb + offs_h, (m_all + gl.log2(denom)) * LN2_C)


@gluon.jit
def _second_half(
    kv_smem, p_smem, alpha_smem, scale_smem, kv_ready, kv_free, p_ready, p_free, scale_ready,
    out_ptr, part_out_ptr, b, hb, split, n_splits, H, n_blocks, stride_ob, stride_oh,
    D: gl.constexpr, STAGES: gl.constexpr, SPLIT: gl.constexpr,
):
    """Second warpgroup: O for columns [D/2, D) from the P tiles the scores warpgroup passes."""
    HEADS: gl.constexpr = 64
    DH: gl.constexpr = D // 2
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, DH, 16])
    row_layout: gl.constexpr = gl.SliceLayout(1, o_layout)
    acc = gl.zeros([HEADS, DH], gl.float32, o_layout)
    for i in range(n_blocks):
        stage = i % STAGES
        pb = i % 2
        mbarrier.wait(kv_ready.index(stage), (i // STAGES) & 1)
        mbarrier.wait(p_ready.index(pb), (i // 2) & 1)
        fence_async_shared()
        acc = acc * alpha_smem.index(pb).load(row_layout)[:, None]
        acc = warpgroup_mma(p_smem.index(pb), kv_smem.index(stage).slice(DH, DH, dim=1), acc)
        barrier()
        mbarrier.arrive(p_free.index(pb), count=1)
        mbarrier.arrive(kv_free.index(stage), count=1)
    mbarrier.wait(scale_ready, 0)
    scale = scale_smem.load(row_layout)
    offs_h = hb * HEADS + gl.arange(0, HEADS, layout=row_layout)
    offs_d = DH + gl.arange(0, DH, layout=gl.SliceLayout(0, o_layout))
    if SPLIT:
        row = (b * n_splits + split) * H + offs_h
        gl.store(part_out_ptr + row[:, None] * D + offs_d[None, :], acc * scale[:, None])
    else:
        out = (acc * scale[:, None]).to(out_ptr.dtype.element_ty)
        gl.store(out_ptr + b * stride_ob + offs_h[:, None] * stride_oh + offs_d[None, :], out)


@gluon.jit
def _sparse_mla_wgmma_kernel(
    q_ptr, kv_ptr, idx_ptr, sink_ptr, out_ptr, lse_ptr, part_out_ptr, part_lse_ptr,
    H, K, rows_per_slot, blocks_per_split, scale_log2,
    stride_qb, stride_qh, stride_slot, stride_row, stride_ib, stride_ik, stride_sink,
    stride_ob, stride_oh, stride_lb,
    D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    Q_SMEM: gl.constexpr, KV_SMEM: gl.constexpr, P_SMEM: gl.constexpr,
    FLAT_ROWS: gl.constexpr, SPLIT: gl.constexpr,
    SECOND_HALF_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, DEPENDENT: gl.constexpr = False,
):
    wait_for_predecessor(DEPENDENT)
    HEADS: gl.constexpr = 64
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    hb = gl.program_id(0)
    split = gl.program_id(1)
    n_splits = gl.num_programs(1)
    b = gl.program_id(2).to(gl.int64)

    q_smem = gl.allocate_shared_memory(dtype, [HEADS, D], Q_SMEM)
    kv_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], KV_SMEM)
    p_smem = gl.allocate_shared_memory(dtype, [2, HEADS, BLOCK_N], P_SMEM)
    rows_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    alpha_smem = gl.allocate_shared_memory(gl.float32, [2, HEADS], rows_layout)
    scale_smem = gl.allocate_shared_memory(gl.float32, [HEADS], rows_layout)
    kv_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    p_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    p_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    scale_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for j in gl.static_range(STAGES):
        mbarrier.init(kv_ready.index(j), count=PRODUCER_THREADS)
        mbarrier.init(kv_free.index(j), count=2)  # one arrive per warpgroup
    for j in gl.static_range(2):
        mbarrier.init(p_ready.index(j), count=1)
        mbarrier.init(p_free.index(j), count=1)
    mbarrier.init(scale_ready, count=1)

    # Q in shared memory before the partitions start.
    offs_d_q = gl.arange(0, D, layout=gl.SliceLayout(0, ROWS_LAYOUT))
    offs_h_q = hb * HEADS + gl.arange(0, HEADS, layout=gl.SliceLayout(1, ROWS_LAYOUT))
    async_load(q_smem, q_ptr + b * stride_qb + offs_h_q[:, None] * stride_qh + offs_d_q[None, :])
    cp.commit_group()
    cp.wait_group(0)
    fence_async_shared()
    barrier()

    k_begin = split * blocks_per_split * BLOCK_N
    k_end = gl.minimum(k_begin + blocks_per_split * BLOCK_N, K)
    n_blocks = gl.cdiv(k_end - k_begin, BLOCK_N)
    idx_row_ptr = idx_ptr + b * stride_ib
    gl.warp_specialize(
        [
            (_scores_and_first_half, (
                q_smem, kv_smem, p_smem, alpha_smem, scale_smem, kv_ready, kv_free, p_ready, p_free, scale_ready,
                idx_row_ptr, sink_ptr, out_ptr, lse_ptr, part_out_ptr, part_lse_ptr, b, hb, split, n_splits, H,
                k_begin, k_end, n_blocks, stride_ik, stride_sink, stride_ob, stride_oh, stride_lb, scale_log2,
                D, BLOCK_N, STAGES, SPLIT,
            )),
            (_second_half, (
                kv_smem, p_smem, alpha_smem, scale_smem, kv_ready, kv_free, p_ready, p_free, scale_ready,
                out_ptr, part_out_ptr, b, hb, split, n_splits, H, n_blocks, stride_ob, stride_oh,
                D, STAGES, SPLIT,
            )),
            (_gather_rows, (
                kv_ptr, idx_row_ptr, kv_smem, kv_ready, kv_free, k_begin, k_end, n_blocks, rows_per_slot,
                stride_ik, stride_slot, stride_row, D, BLOCK_N, STAGES, FLAT_ROWS,
            )),
        ],
        [4, 4],  # warps of the second warpgroup and of the producer
        [SECOND_HALF_REGS, PRODUCER_REGS],
    )


def kernel_constants(head_dim: int, block_n: int, stages: int, gl_dtype) -> dict:
    """The kernel's shape and layout constexprs (shared with kernels.bench.resource_usage)."""
    return dict(
        D=head_dim, BLOCK_N=block_n, STAGES=stages,
        Q_SMEM=gl.NVMMASharedLayout.get_default_for([BLOCK_H, head_dim], gl_dtype),
        KV_SMEM=gl.NVMMASharedLayout.get_default_for([block_n, head_dim], gl_dtype),
        P_SMEM=gl.NVMMASharedLayout.get_default_for([BLOCK_H, block_n], gl_dtype),
        SECOND_HALF_REGS=WORKER_REGS[0], PRODUCER_REGS=WORKER_REGS[1],
    )


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
    if head_dim not in WGMMA_HEAD_DIMS:
        raise ValueError(f"sparse_mla_decode (wgmma): head dim must be one of {WGMMA_HEAD_DIMS}, got {head_dim}")
    if q.stride(2) != 1 or kv_cache.stride(2) != 1:
        raise ValueError("sparse_mla_decode (wgmma): q and kv_cache need a contiguous last dimension")


def launch_wgmma(
    q, kv_cache, indices, sink, scale, num_splits, out, lse, part_out=None, part_lse=None,
    block_n: int = WGMMA_BLOCK_N, stages: int = WGMMA_STAGES,
):
    """Launch the kernel; with part_out/part_lse (fp32 [B, splits, H, D] / [B, splits, H]) it
    writes partials for the combine kernel (common.py) instead of out and lse."""
    batch, heads, head_dim = q.shape
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"sparse_mla_decode (wgmma): num_splits must be in [1, {MAX_SPLITS}], got {num_splits}")
    if block_n not in (16, 32, 64) or not 2 <= stages <= 8:
        raise ValueError(f"sparse_mla_decode (wgmma): block_n must be 16, 32 or 64 and stages 2-8, got {block_n}, {stages}")
    rows_per_slot = kv_cache.shape[1]
    gl_dtype = _GL_DTYPES[q.dtype]
    split = part_out is not None
    _sparse_mla_wgmma_kernel[(heads // BLOCK_H, num_splits, batch)](
        q, kv_cache, indices, sink, out, lse,
        part_out if split else out, part_lse if split else lse,
        heads, indices.shape[1], rows_per_slot, blocks_per_split(indices.shape[1], block_n, num_splits),
        float(scale) * LOG2E,
        q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1), indices.stride(0), indices.stride(1),
        sink.stride(0), out.stride(0), out.stride(1), lse.stride(0),
        **kernel_constants(head_dim, block_n, stages, gl_dtype),
        FLAT_ROWS=_flat_rows(kv_cache), SPLIT=split,
        num_warps=NUM_WARPS, **dependent_options(q.device),
    )


def sparse_mla_decode_wgmma(
    q, kv_cache, indices, sink, scale, num_splits: int | None = None, workspace=None,
    block_n: int = WGMMA_BLOCK_N, stages: int = WGMMA_STAGES,
):
    """This kernel alone at one split; at more, its partials merged by the Triton combine kernel.
    num_splits None: the default path's rule (plan.wgmma_splits), at any batch.
    workspace: as for triton.sparse_mla_decode_split_k. Returns (out, lse)."""
    _check(q, kv_cache, indices, sink)
    check_wgmma_inputs(q, kv_cache)
    batch, heads, head_dim = q.shape
    if num_splits is None:
        num_splits = wgmma_splits(
            batch, heads, indices.shape[1], num_sms(q.device), head_dim, q.element_size(),
            torch.cuda.get_device_capability(q.device), min_head_blocks=1, min_topk=1,
        ) or 1
    out, lse = _new_outputs(q)
    if batch == 0:
        return out, lse
    if num_splits == 1:
        launch_wgmma(q, kv_cache, indices, sink, scale, 1, out, lse, block_n=block_n, stages=stages)
        return out, lse
    part_out, part_lse = _split_scratch(workspace, batch, heads, head_dim, num_splits, q.device)
    launch_wgmma(q, kv_cache, indices, sink, scale, num_splits, out, lse, part_out, part_lse, block_n, stages)
    launch_combine(part_out, part_lse, sink, out, lse, num_splits, pdl=launches_dependents(q.device))
    return out, lse
