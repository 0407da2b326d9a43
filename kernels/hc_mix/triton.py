"""Triton mHC boundary (semantics: kernels/hc_mix/ref.py), hc = 4.

Slices: program (s, t) of the first kernel owns slice s of SLICE values of the flattened copies
[hc * D] (one copy h, a range of d) for TOKENS tokens. With a write-back it forms the new copies
there (post_h * out + sum_i comb[i, h] * copy_i, rounded to the copies' dtype) and stores them; it
then multiplies the slice by the matching [24, SLICE] block of fn (loaded once for its tokens) and
stores 24 partial mixes and the slice's sum of squares per token. At D = 4096 that is 64 slices:
fn's 1.5 MB is read by 64 programs at once instead of by the 24 rows Inductor's reduction gives
a program each.

Finish, per token: add the token's partials, scale the mixes by the inverse RMS, run split +
Sinkhorn on values held by every thread (each of the 2 * iters steps is four sums of four, one
approximate reciprocal per row or column and four products, no cross-thread traffic), form the
pre-weighted sum of the copies and its RMSNorm. Up to ONE_LAUNCH_MAX_BATCH tokens the slices
kernel runs it itself: each token's slices are programs of their own and the last of them to
arrive (an arrival counter, as the split products use) finishes the token, so a boundary is one
launch. Larger batches take a second kernel, one program a token, which keeps fn's block shared
by TOKENS tokens in the first. Math is fp32; shapes depend on B only, only outputs and a small
workspace are allocated (CUDA-graph safe).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.arrival import arrives_last, split_counters
from kernels.dependent_launch import dependent_options, wait_for_predecessor
from kernels.hc_mix.ref import KERNEL_HC as HC, SLICE, tiles
from kernels.hc_sinkhorn.triton import _div, _sigmoid

WIDTH = (2 + HC) * HC  # mixes per token: pre, post, comb
PARTS = 32  # partial sums per token and slice: the 24 mixes, the sum of squares, padding
TOKENS = 4  # tokens per program of the first kernel where a second finishes: fn's block is loaded once for them
# Batches whose boundary is one launch (the slices' last arrival finishes each token): a token a
# program re-reads fn's block per token, which small batches pay less for than a second launch.
ONE_LAUNCH_MAX_BATCH = 4
# Warps of the second kernel. Every warp runs the Sinkhorn chain on values all threads hold, so
# warps that share a scheduler slow it down; 4 still spread the pre-weighted sum over D.
FINISH_WARPS = 4


# hc=4 helpers: each cell of a token's 4x4 matrix is a value of its own, so every row or column
# sum is three adds in one thread.
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


@triton.jit
def _hc_mix_slices_kernel(
    streams_ptr, out_ptr, post_ptr, comb_ptr, fn_ptr, new_ptr, part_ptr,
    batch, stride_sb, stride_sh, stride_ob, stride_fn,
    # FINISH only: the last of a token's slices to arrive finishes it (_finish_token's arguments)
    counter_ptr, mixes_ptr, scale_ptr, base_ptr, weight_ptr, x_ptr, post_out_ptr, comb_out_ptr,
    stride_cb, stride_ch, stride_scale, stride_base, hc_eps, hc_norm_eps, norm_eps,
    D: tl.constexpr, WRITE_BACK: tl.constexpr, FINISH: tl.constexpr, ITERS: tl.constexpr,
    HC: tl.constexpr, WIDTH: tl.constexpr, PARTS: tl.constexpr, SLICE: tl.constexpr, TOKENS: tl.constexpr,
    DEPENDENT: tl.constexpr = False,
):
    s = tl.program_id(0)
    k = s * SLICE + tl.arange(0, SLICE)  # flattened [hc * D] index
    h = (s * SLICE) // D
    d = k - h * D
    rows = tl.arange(0, PARTS)
    fn = tl.load(fn_ptr + rows[:, None] * stride_fn + k[None, :], mask=(rows < WIDTH)[:, None], other=0.0).to(tl.float32)
    wait_for_predecessor(DEPENDENT)  # fn is a parameter, loaded while the kernel before drains
    SLICES: tl.constexpr = HC * D // SLICE
    for i in tl.static_range(TOKENS):
        token = tl.program_id(1) * TOKENS + i
        if token < batch:
            t = token.to(tl.int64)
            if WRITE_BACK:
                mixed = tl.zeros([SLICE], dtype=tl.float32)
                for src in tl.static_range(HC):
                    weight = tl.load(comb_ptr + t * HC * HC + src * HC + h)
                    mixed += weight * tl.load(streams_ptr + t * stride_sb + src * stride_sh + d).to(tl.float32)
                out = tl.load(out_ptr + t * stride_ob + d).to(tl.float32)
                new = (tl.load(post_ptr + t * HC + h) * out + mixed).to(new_ptr.dtype.element_ty)
                tl.store(new_ptr + t * HC * D + k, new)
                x = new.to(tl.float32)
            else:
                x = tl.load(streams_ptr + t * stride_sb + h * stride_sh + d).to(tl.float32)
            # The GEMV in fn's dtype, as the reference casts the copies to it first.
            dots = tl.sum(fn * x.to(fn_ptr.dtype.element_ty).to(tl.float32)[None, :], axis=1)
            parts = tl.where(rows == WIDTH, tl.sum(x * x, axis=0), dots)
            tl.store(part_ptr + (t * SLICES + s) * PARTS + rows, parts)
    if FINISH:  # TOKENS = 1: program (s, t) holds token t
        counter = counter_ptr + tl.program_id(1)
        if arrives_last(counter, SLICES):
            _finish_token(
                tl.program_id(1).to(tl.int64), part_ptr, mixes_ptr, new_ptr if WRITE_BACK else streams_ptr,
                scale_ptr, base_ptr, weight_ptr, x_ptr, post_out_ptr, comb_out_ptr,
                stride_cb, stride_ch, stride_scale, stride_base, hc_eps, hc_norm_eps, norm_eps,
                D, SLICES, ITERS, HC, WIDTH, PARTS,
            )
            tl.atomic_xchg(counter, 0)


@triton.jit
def _hc_mix_finish_kernel(
    part_ptr, mixes_ptr, copies_ptr, scale_ptr, base_ptr, weight_ptr,
    x_ptr, post_ptr, comb_ptr,
    stride_cb, stride_ch, stride_scale, stride_base,
    hc_eps, hc_norm_eps, norm_eps,
    D: tl.constexpr, SLICES: tl.constexpr, ITERS: tl.constexpr,
    HC: tl.constexpr, WIDTH: tl.constexpr, PARTS: tl.constexpr,
    DEPENDENT: tl.constexpr = False,
):
    wait_for_predecessor(DEPENDENT)
    _finish_token(
        tl.program_id(0).to(tl.int64), part_ptr, mixes_ptr, copies_ptr, scale_ptr, base_ptr, weight_ptr,
        x_ptr, post_ptr, comb_ptr, stride_cb, stride_ch, stride_scale, stride_base, hc_eps, hc_norm_eps, norm_eps,
        D, SLICES, ITERS, HC, WIDTH, PARTS,
    )


@triton.jit
def _finish_token(
    t, part_ptr, mixes_ptr, copies_ptr, scale_ptr, base_ptr, weight_ptr,
    x_ptr, post_ptr, comb_ptr,
    stride_cb, stride_ch, stride_scale, stride_base,
    hc_eps, hc_norm_eps, norm_eps,
    D: tl.constexpr, SLICES: tl.constexpr, ITERS: tl.constexpr,
    HC: tl.constexpr, WIDTH: tl.constexpr, PARTS: tl.constexpr,
):
    """Token t's mixes from its slices' partials, its post, comb and normed sublayer input."""
    # The copies and the norm weight are loaded first: their latency passes while the partials
    # are summed and the Sinkhorn chain runs (a program's work is one long dependent chain).
    # .cg: other programs wrote the copies and the partials; read them from L2, not a stale L1 line.
    lanes = tl.arange(0, HC)
    d = tl.arange(0, D)  # D is a power of two (kernels.hc_mix.ref.tiles): one unmasked range
    copies = tl.load(copies_ptr + t * stride_cb + lanes[:, None] * stride_ch + d[None, :], cache_modifier=".cg")
    norm_weight = tl.load(weight_ptr + d)
    cols = tl.arange(0, PARTS)
    parts = tl.load(part_ptr + (t * SLICES + tl.arange(0, SLICES))[:, None] * PARTS + cols[None, :], cache_modifier=".cg")
    sums = tl.sum(parts, axis=0)
    mean_square = tl.sum(tl.where(cols == WIDTH, sums, 0.0), axis=0) / (HC * D)
    mixes = sums * tl.math.rsqrt(mean_square + hc_norm_eps)
    # Every thread needs every mix: through the workspace (this program's own writes, so a
    # barrier makes them visible) rather than 24 cross-thread extractions.
    tl.store(mixes_ptr + t * PARTS + cols, mixes)
    tl.debug_barrier()

    token = t + tl.arange(0, 1)  # the helpers take [tokens]-shaped rows
    ok = token >= 0
    row = mixes_ptr + token * PARTS
    pre, post = _hc4_pre_post(row, scale_ptr, base_ptr, 1, stride_scale, stride_base, ok, hc_eps)
    tl.store(post_ptr + token[:, None] * HC + lanes[None, :], post)
    s = tl.load(scale_ptr + 2 * stride_scale)
    c00, c01, c02, c03 = _comb_row_softmax(row, base_ptr, 0, 1, stride_base, s, ok, hc_eps)
    c10, c11, c12, c13 = _comb_row_softmax(row, base_ptr, 1, 1, stride_base, s, ok, hc_eps)
    c20, c21, c22, c23 = _comb_row_softmax(row, base_ptr, 2, 1, stride_base, s, ok, hc_eps)
    c30, c31, c32, c33 = _comb_row_softmax(row, base_ptr, 3, 1, stride_base, s, ok, hc_eps)
    c00, c01, c02, c03, c10, c11, c12, c13, c20, c21, c22, c23, c30, c31, c32, c33 = _sinkhorn4(
        c00, c01, c02, c03, c10, c11, c12, c13, c20, c21, c22, c23, c30, c31, c32, c33, hc_eps, ITERS
    )
    _store_cells(comb_ptr + token * 16, c00, c01, c02, c03, c10, c11, c12, c13, c20, c21, c22, c23, c30, c31, c32, c33, ok)

    # The sublayer input: the pre-weighted sum of the copies, rounded to their dtype, then RMSNorm.
    x = tl.sum(tl.reshape(pre, (HC, 1)) * copies.to(tl.float32), axis=0)
    x = x.to(x_ptr.dtype.element_ty).to(tl.float32)
    inv_rms = tl.math.rsqrt(tl.sum(x * x, axis=0) / D + norm_eps)
    tl.store(x_ptr + t * D + d, (norm_weight * (x * inv_rms)).to(x_ptr.dtype.element_ty))


def hc_mix_triton(
    streams: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, norm_weight: torch.Tensor,
    iters: int, hc_eps: float, hc_norm_eps: float, norm_eps: float,
    out: torch.Tensor | None = None, post: torch.Tensor | None = None, comb: torch.Tensor | None = None,
    one_launch: bool | None = None,
) -> tuple[torch.Tensor, ...]:
    """(new streams or None, normed x [B, D], post [B, 4], comb [B, 4, 4]); with out/post/comb the
    write-back first (hc_post_pre_norm), without it hc_pre_norm. Shapes as checked by
    kernels.hc_mix.ref.check_hc_mix_inputs; D a multiple of SLICE with 4 * D / SLICE a power of two.
    The Sinkhorn steps divide by one approximate reciprocal per row or column (a few ulp from the
    rounded quotients: _norm4 above). one_launch: the slices kernel finishes every token itself
    (default: up to ONE_LAUNCH_MAX_BATCH tokens) instead of a second kernel."""
    batch, hc, dim = streams.shape
    if hc != HC or not tiles(dim):
        raise ValueError(f"hc_mix (triton): needs hc = {HC} and D a multiple of {SLICE} with 4 * D / {SLICE} a power of two, got hc={hc}, D={dim}")
    if streams.stride(-1) != 1 or fn.stride(-1) != 1 or (out is not None and out.stride(-1) != 1):
        raise ValueError("hc_mix (triton): streams, out and fn must be contiguous along their last dimension")
    write_back = out is not None
    device = streams.device
    x = torch.empty((batch, dim), dtype=streams.dtype, device=device)
    post_out = torch.empty((batch, HC), dtype=torch.float32, device=device)
    comb_out = torch.empty((batch, HC, HC), dtype=torch.float32, device=device)
    new = torch.empty((batch, HC, dim), dtype=streams.dtype, device=device) if write_back else None
    if batch == 0:
        return new, x, post_out, comb_out
    if one_launch is None:
        one_launch = batch <= ONE_LAUNCH_MAX_BATCH
    slices = HC * dim // SLICE
    part = torch.empty((batch, slices, PARTS), dtype=torch.float32, device=device)
    mixes = torch.empty((batch, PARTS), dtype=torch.float32, device=device)
    if write_back:
        post, comb = post.contiguous(), comb.contiguous()
    copies = new if write_back else streams
    # What finishing a token reads besides its partials, the mixes' workspace and the copies, and writes.
    finish_rest = (scale, base, norm_weight, x, post_out, comb_out,
                   copies.stride(0), copies.stride(1), scale.stride(0), base.stride(0), hc_eps, hc_norm_eps, norm_eps)
    tokens = 1 if one_launch else TOKENS
    _hc_mix_slices_kernel[(slices, triton.cdiv(batch, tokens))](
        streams, out if write_back else streams, post if write_back else scale, comb if write_back else scale,
        fn, new if write_back else x, part,
        batch, streams.stride(0), streams.stride(1), out.stride(0) if write_back else 0, fn.stride(0),
        split_counters(device, batch) if one_launch else part, mixes, *finish_rest,
        D=dim, WRITE_BACK=write_back, FINISH=one_launch, ITERS=iters, HC=HC, WIDTH=WIDTH, PARTS=PARTS, SLICE=SLICE,
        TOKENS=tokens, num_warps=4, **dependent_options(device),
    )
    if not one_launch:
        _hc_mix_finish_kernel[(batch,)](
            part, mixes, copies, *finish_rest, D=dim, SLICES=slices, ITERS=iters, HC=HC, WIDTH=WIDTH, PARTS=PARTS, num_warps=FINISH_WARPS,
            **dependent_options(device),
        )
    return new, x, post_out, comb_out
