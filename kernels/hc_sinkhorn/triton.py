"""Triton mHC split + Sinkhorn (semantics: kernels/hc_sinkhorn/ref.py) in one kernel.

Each program takes BLOCK_B tokens. It loads their mixes, writes pre and post, and keeps the
[BLOCK_B, HC, HC] combination matrices in registers from the softmax through every row and column
normalisation: a row sum is a reduction over the last axis, a column sum over the middle one, so
no step has to go through memory. Math is fp32 throughout, divisions rounded as torch's. hc and
the iteration count are compile-time constants (the model uses one pair). The launch depends on B
and those only and allocates nothing but the outputs, so the op can be captured in a CUDA graph.

The hc=4 helpers below (_sinkhorn4 and the ones around it) hold each matrix cell as its own value;
the mHC boundary's kernel (kernels/hc_mix/triton.py) runs its Sinkhorn with them.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.hc_sinkhorn.ref import check_hc_inputs

# 256 matrix cells per program (16 tokens at hc=4) over 2 warps: a few cells per thread, so each
# of the 2 * ITERS sums is a short in-register add plus warp shuffles, and B=128 fills 8 programs.
# 16-128 cells per program time the same on the H200 (docs/kernels.md): the rounds' chain sets it.
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
):
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


@triton.jit
def _softmax4(a, b, c, d, eps):
    """One row's softmax plus eps, max subtracted first."""
    top = tl.maximum(tl.maximum(a, b), tl.maximum(c, d))
    a = tl.exp(a - top)
    b = tl.exp(b - top)
    c = tl.exp(c - top)
    d = tl.exp(d - top)
    total = a + b + c + d
    return _div(a, total) + eps, _div(b, total) + eps, _div(c, total) + eps, _div(d, total) + eps


@triton.jit
def _norm4(a, b, c, d, eps):
    # Four cells of one row or column over their sum plus eps: one approximate reciprocal times
    # each cell (a few ulp from the rounded quotients), the shortest dependent chain.
    r = 1.0 / (a + b + c + d + eps)
    return a * r, b * r, c * r, d * r


@triton.jit
def _sinkhorn4(
    c00, c01, c02, c03, c10, c11, c12, c13, c20, c21, c22, c23, c30, c31, c32, c33,
    eps, ITERS: tl.constexpr,
):
    """The rounds after the row softmax on the 16 cells of a 4x4 matrix held as separate values:
    a column step, then iters - 1 rounds of a row and a column step."""
    c00, c10, c20, c30 = _norm4(c00, c10, c20, c30, eps)
    c01, c11, c21, c31 = _norm4(c01, c11, c21, c31, eps)
    c02, c12, c22, c32 = _norm4(c02, c12, c22, c32, eps)
    c03, c13, c23, c33 = _norm4(c03, c13, c23, c33, eps)
    for _ in range(ITERS - 1):
        c00, c01, c02, c03 = _norm4(c00, c01, c02, c03, eps)
        c10, c11, c12, c13 = _norm4(c10, c11, c12, c13, eps)
        c20, c21, c22, c23 = _norm4(c20, c21, c22, c23, eps)
        c30, c31, c32, c33 = _norm4(c30, c31, c32, c33, eps)
        c00, c10, c20, c30 = _norm4(c00, c10, c20, c30, eps)
        c01, c11, c21, c31 = _norm4(c01, c11, c21, c31, eps)
        c02, c12, c22, c32 = _norm4(c02, c12, c22, c32, eps)
        c03, c13, c23, c33 = _norm4(c03, c13, c23, c33, eps)
    return c00, c01, c02, c03, c10, c11, c12, c13, c20, c21, c22, c23, c30, c31, c32, c33


@triton.jit
def _comb_logit(mixes_row, base_ptr, cell, stride_mc, stride_base, scale_comb, token_ok):
    m = tl.load(mixes_row + (8 + cell) * stride_mc, mask=token_ok, other=0.0)
    return m * scale_comb + tl.load(base_ptr + (8 + cell) * stride_base)


@triton.jit
def _comb_row_softmax(mixes_row, base_ptr, row, stride_mc, stride_base, scale_comb, token_ok, eps):
    """Row `row` of the combination matrix: its four logits through _softmax4."""
    return _softmax4(
        _comb_logit(mixes_row, base_ptr, 4 * row, stride_mc, stride_base, scale_comb, token_ok),
        _comb_logit(mixes_row, base_ptr, 4 * row + 1, stride_mc, stride_base, scale_comb, token_ok),
        _comb_logit(mixes_row, base_ptr, 4 * row + 2, stride_mc, stride_base, scale_comb, token_ok),
        _comb_logit(mixes_row, base_ptr, 4 * row + 3, stride_mc, stride_base, scale_comb, token_ok),
        eps,
    )


@triton.jit
def _store_cells(out, c00, c01, c02, c03, c10, c11, c12, c13, c20, c21, c22, c23, c30, c31, c32, c33, mask):
    """The 16 cells of a 4x4 matrix, row major from `out`."""
    tl.store(out + 0, c00, mask=mask)
    tl.store(out + 1, c01, mask=mask)
    tl.store(out + 2, c02, mask=mask)
    tl.store(out + 3, c03, mask=mask)
    tl.store(out + 4, c10, mask=mask)
    tl.store(out + 5, c11, mask=mask)
    tl.store(out + 6, c12, mask=mask)
    tl.store(out + 7, c13, mask=mask)
    tl.store(out + 8, c20, mask=mask)
    tl.store(out + 9, c21, mask=mask)
    tl.store(out + 10, c22, mask=mask)
    tl.store(out + 11, c23, mask=mask)
    tl.store(out + 12, c30, mask=mask)
    tl.store(out + 13, c31, mask=mask)
    tl.store(out + 14, c32, mask=mask)
    tl.store(out + 15, c33, mask=mask)


@triton.jit
def _hc4_pre_post(mixes_row, scale_ptr, base_ptr, stride_mc, stride_scale, stride_base, token_ok, eps):
    """pre and post [BLOCK_B, 4] of the tokens whose mixes start at mixes_row [BLOCK_B]: elementwise, no sums."""
    lanes = tl.arange(0, 4)
    scale_pre = tl.load(scale_ptr)
    scale_post = tl.load(scale_ptr + stride_scale)
    m_pre = tl.load(mixes_row[:, None] + lanes[None, :] * stride_mc, mask=token_ok[:, None], other=0.0)
    pre = _sigmoid(m_pre * scale_pre + tl.load(base_ptr + lanes * stride_base)[None, :]) + eps
    m_post = tl.load(mixes_row[:, None] + (4 + lanes)[None, :] * stride_mc, mask=token_ok[:, None], other=0.0)
    post = 2.0 * _sigmoid(m_post * scale_post + tl.load(base_ptr + (4 + lanes) * stride_base)[None, :])
    return pre, post


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
        num_warps=NUM_WARPS,
    )
    return pre, post, comb
