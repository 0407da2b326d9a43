"""Triton mHC split + Sinkhorn (semantics: kernels/hc_sinkhorn/ref.py) in one kernel.

Each program takes BLOCK_B tokens. It loads their mixes, writes pre and post, and keeps the
[BLOCK_B, HC, HC] combination matrices in registers from the softmax through every row and column
normalisation: a row sum is a reduction over the last axis, a column sum over the middle one, so
no step has to go through memory. Math is fp32 throughout, divisions rounded as torch's. hc and
the iteration count are compile-time constants (the model uses one pair). The launch depends on B
and those only and allocates nothing but the outputs, so the op can be captured in a CUDA graph.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.dependent_launch import dependent_options, wait_for_predecessor
from kernels.hc_sinkhorn.ref import check_hc_inputs

# 256 matrix cells per program (16 tokens at hc=4) over 2 warps: a few cells per thread, so each
# of the 2 * ITERS sums is a short in-register add plus warp shuffles, and B=128 fills 8 programs.
# Smaller programs are no faster: the rounds' dependent chain sets the time.
CELLS_PER_PROGRAM = 256
NUM_WARPS = 2
SUPPORTED_HC = (1, 2, 4, 8)


@triton.jit
def _div(x, y):
    # IEEE round-to-nearest, as torch divides; `/` on fp32 lowers to the 2-ulp div.full. tl.div_rn
    # does not broadcast, so the operands are broadcast first.
    x, y = tl.broadcast(x, y)
    return tl.div_rn(x, y)


@triton.jit
def _sigmoid(x):
    # exp of -|x| only, so no intermediate overflows for large negative x
    e = tl.exp(-tl.abs(x))
    return _div(tl.where(x >= 0, 1.0, e), 1.0 + e)


@triton.jit
def _hc_split_sinkhorn_kernel(
    mixes_ptr, scale_ptr, base_ptr,
    pre_ptr, post_ptr, comb_ptr,
    batch, eps,
    stride_mb, stride_mc, stride_scale, stride_base,
    HC: tl.constexpr, ITERS: tl.constexpr, BLOCK_B: tl.constexpr,
    DEPENDENT: tl.constexpr = False,
):
    wait_for_predecessor(DEPENDENT)
    tokens = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    token_ok = tokens < batch
    tokens = tokens.to(tl.int64)
    lanes = tl.arange(0, HC)
    mixes_row = mixes_ptr + tokens[:, None] * stride_mb  # [BLOCK_B, 1]

    scale_pre = tl.load(scale_ptr)
    scale_post = tl.load(scale_ptr + stride_scale)
    scale_comb = tl.load(scale_ptr + 2 * stride_scale)

    # pre and post: columns [0, HC) and [HC, 2*HC) of mixes and base
    m_pre = tl.load(mixes_row + lanes[None, :] * stride_mc, mask=token_ok[:, None], other=0.0)
    b_pre = tl.load(base_ptr + lanes * stride_base)
    pre = _sigmoid(m_pre * scale_pre + b_pre[None, :]) + eps
    m_post = tl.load(mixes_row + (HC + lanes)[None, :] * stride_mc, mask=token_ok[:, None], other=0.0)
    b_post = tl.load(base_ptr + (HC + lanes) * stride_base)
    post = 2.0 * _sigmoid(m_post * scale_post + b_post[None, :])

    # comb logits: cell (i, j) is column 2*HC + i*HC + j
    cells = lanes[:, None] * HC + lanes[None, :]  # [HC, HC]
    m_comb = tl.load(
        mixes_ptr + tokens[:, None, None] * stride_mb + (2 * HC + cells)[None, :, :] * stride_mc,
        mask=token_ok[:, None, None],
        other=0.0,
    )
    b_comb = tl.load(base_ptr + (2 * HC + cells) * stride_base)
    logits = m_comb * scale_comb + b_comb[None, :, :]

    # Row softmax (max subtracted), then column, then iters - 1 rounds of row and column
    # normalisation; masked tokens hold zeros and stay finite.
    exps = tl.exp(logits - tl.max(logits, axis=2)[:, :, None])
    comb = _div(exps, tl.sum(exps, axis=2)[:, :, None]) + eps
    comb = _div(comb, tl.sum(comb, axis=1)[:, None, :] + eps)
    for _ in range(ITERS - 1):
        comb = _div(comb, tl.sum(comb, axis=2)[:, :, None] + eps)
        comb = _div(comb, tl.sum(comb, axis=1)[:, None, :] + eps)

    vec_offsets = tokens[:, None] * HC + lanes[None, :]
    tl.store(pre_ptr + vec_offsets, pre, mask=token_ok[:, None])
    tl.store(post_ptr + vec_offsets, post, mask=token_ok[:, None])
    tl.store(comb_ptr + tokens[:, None, None] * (HC * HC) + cells[None, :, :], comb, mask=token_ok[:, None, None])


def hc_split_sinkhorn_triton(
    mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int, iters: int, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pre [B, hc], post [B, hc], comb [B, hc, hc]), contiguous fp32, for hc a power of two up
    to 8. Arguments as `hc_split_sinkhorn_reference` (fp32, any strides); one kernel launch."""
    if hc not in SUPPORTED_HC:
        raise ValueError(f"hc_split_sinkhorn (triton): hc must be one of {SUPPORTED_HC}, got {hc}")
    check_hc_inputs(mixes, scale, base, hc, iters)  # also when the op is called directly
    batch = mixes.shape[0]
    pre = torch.empty((batch, hc), dtype=torch.float32, device=mixes.device)
    post = torch.empty((batch, hc), dtype=torch.float32, device=mixes.device)
    comb = torch.empty((batch, hc, hc), dtype=torch.float32, device=mixes.device)
    if batch == 0:
        return pre, post, comb
    block_b = CELLS_PER_PROGRAM // (hc * hc)
    _hc_split_sinkhorn_kernel[(triton.cdiv(batch, block_b),)](
        mixes, scale, base,
        pre, post, comb,
        batch, eps,
        mixes.stride(0), mixes.stride(1), scale.stride(0), base.stride(0),
        HC=hc, ITERS=iters, BLOCK_B=block_b,
        num_warps=NUM_WARPS, **dependent_options(mixes.device),
    )
    return pre, post, comb
