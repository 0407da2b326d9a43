"""What the Triton and Gluon sparse-MLA kernels share (semantics: kernels/sparse_mla/ref.py): the
input checks, the index loads and their row offsets, the outputs and the split-K scratch, and the
combine kernel that merges the splits' partials (normalised by their own sums, base-2 LSEs) and
adds the sink. Softmax runs in base 2: scores carry scale * log2(e).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.sparse_mla.plan import _block_d, workspace_numel
from kernels.sparse_mla.ref import check_sparse_mla_inputs

LOG2E = 1.4426950408889634
# Globals read inside kernels must be constexpr.
LOG2E_C = tl.constexpr(LOG2E)
LN2_C = tl.constexpr(0.6931471805599453)


@triton.jit
def _load_indices(idx_row_ptr, offs_k, k_end, stride_ik):
    """indices[offs_k], -1 where offs_k >= k_end."""
    return tl.load(idx_row_ptr + offs_k * stride_ik, mask=offs_k < k_end, other=-1)


@triton.jit
def _offsets_of(idx, rows_per_slot, stride_slot, stride_row, FLAT_ROWS: tl.constexpr):
    """Element offsets of the KV rows named by idx (global row numbers; -1 masked: offset 0,
    valid False). FLAT_ROWS: slots are evenly strided (stride_slot = rows_per_slot *
    stride_row), so row g sits at g * stride_row; otherwise g is split into (slot, row) first."""
    valid = idx >= 0
    row = tl.where(valid, idx, 0)
    if FLAT_ROWS:
        row_off = row.to(tl.int64) * stride_row
    else:
        slot = row // rows_per_slot
        row_off = slot.to(tl.int64) * stride_slot + (row - slot * rows_per_slot).to(tl.int64) * stride_row
    return row_off, valid


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


def _check(q, kv_cache, indices, sink) -> None:
    check_sparse_mla_inputs(q, kv_cache, indices, sink)
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"sparse_mla_decode (triton): q must be bf16, fp16 or fp32, got {q.dtype}")
    if kv_cache.dtype != q.dtype:
        raise ValueError(f"sparse_mla_decode (triton): kv_cache dtype {kv_cache.dtype} differs from q dtype {q.dtype}")


def _flat_rows(kv_cache: torch.Tensor) -> bool:
    """Whether global row g is simply at g * row stride (true for a contiguous cache)."""
    return kv_cache.shape[0] == 1 or kv_cache.stride(0) == kv_cache.shape[1] * kv_cache.stride(1)


def _new_outputs(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    return out, lse


def _check_workspace(workspace, numel, batch, heads, head_dim, num_splits, device) -> None:
    if workspace.dtype != torch.float32 or workspace.device != device or not workspace.is_contiguous():
        raise ValueError(
            f"sparse_mla_decode: workspace must be a contiguous fp32 tensor on {device}, got "
            f"{workspace.dtype} on {workspace.device}"
        )
    if workspace.numel() < numel:
        raise ValueError(
            f"sparse_mla_decode: workspace holds {workspace.numel()} fp32 elements, {num_splits} splits at "
            f"B={batch}, H={heads}, D={head_dim} need {numel} (allocate it with sparse_mla_workspace)"
        )


def _split_scratch(workspace, batch, heads, head_dim, num_splits, device):
    numel = workspace_numel(batch, heads, head_dim, num_splits)
    if workspace is None:
        workspace = torch.empty(numel, dtype=torch.float32, device=device)
    else:
        _check_workspace(workspace, numel, batch, heads, head_dim, num_splits, device)
    n_out = batch * num_splits * heads * head_dim
    return workspace[:n_out], workspace[n_out:numel]


def launch_combine(part_out, part_lse, sink, out, lse, num_splits: int, pdl: bool = False) -> None:
    """Merge the splits' partials ([B, splits, H, D] and [B, splits, H] fp32) into out and lse.
    pdl: launched as a programmatic dependent of the split kernel, which must allow it."""
    batch, heads, head_dim = out.shape
    block_s = triton.next_power_of_2(num_splits)
    block_dc = max(16, min(_block_d(head_dim), 4096 // block_s))
    _combine_kernel[(triton.cdiv(head_dim, block_dc), heads, batch)](
        part_out, part_lse, sink, out, lse,
        heads, head_dim, num_splits,
        sink.stride(0), out.stride(0), out.stride(1), lse.stride(0),
        BLOCK_S=block_s, BLOCK_DC=block_dc, WAIT_FOR_SPLITS=pdl, num_warps=4,
        **({"launch_pdl": True} if pdl else {}),
    )
