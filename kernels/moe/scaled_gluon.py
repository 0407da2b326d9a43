"""Gluon products of the block-scaled routed experts (kernels/moe/scaled.py, product "mma"): FP4
weights (e2m1 codes two a byte, low nibble first, one ue8m0 or fp32 scale per 32 inputs) decoded
straight into the registers of the tensor-core instruction (mma.sync m16n8k16: fp16 operands,
fp32 accumulation), with no trip through shared memory. The routing, the activations'
quantisation, the split-K arrival, the SwiGLU epilogue and the combine are scaled.py's.

At decode a routed expert is a grouped GEMV: the time goes to moving and decoding the codes, so
both are laid out for the instruction rather than for the dot of a generic tile.

- The instruction's K order within a 32-input scale group is free as long as the weights and
  the activations share it. Thread q of a quad takes inputs [8q, 8q + 8) of every group: 4 bytes
  of codes a row (one 32-bit load), which its A fragment holds as k-slots {2q, 2q+1, 2q+8, 2q+9}
  of the group's two 16-wide steps, and the same 8 activation values (one 64-bit load) for its B
  fragment. `convert_layout(..., assert_trivial=True)` checks when it compiles that no value
  moves between threads.
- Program (segment, 128 output columns, K split): 4 warps, each 16 of every 64 columns; the
  instruction's N is 8 of the segment's pairs at a time. Gate and up share the activations'
  loads and conversion. The down product (64 columns, K whole) issues the loads of two steps
  before their products: a step of its tile is few bytes, too few in flight at batch 1 otherwise.
  The gate/up product issues one step's (two weights' codes): two steps' measured slower.
- Decoding: a byte's two codes become e4m3 bytes (sign to bit 7, exponent and mantissa bits to
  bits 4..2: 2^-6 times the code's value, exact, the subnormal 0.5 included) in three or four
  integer operations per 4 codes, then the hardware's e4m3x2 -> f16x2 conversion. The 2^6 is
  folded into the weight scales' exponents. The activations (e4m3) convert the same way.
- Each group's product is scaled by its weight scales in fp32, each 128 inputs by the
  activations' scales: scaled.py's arithmetic in another summation order.

sm_80 or newer (the e4m3 conversion: sm_89); CUDA only (inline PTX: no interpreter path).
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from kernels.blockscale.ref import FP4_BLOCK, FP8_BLOCK
from kernels.moe.scaled import (
    SEGMENT_ROWS, UP_BLOCK_N, ScaledLaunch, ScaledTiles, arrives_last, gate_up_epilogue, prepare_launch, scaled_experts,
    store_partials, summed_partials,
)
from kernels.triton_util import converts_e4m3

WARPS = 4
STEP = FP8_BLOCK  # inputs per step: one activation block, four FP4 scale groups
# Output columns per down program: twice the programs of 128 for the few experts picked at batch 1.
DOWN_N = 64
# Steps of the down product whose loads are issued before their products: its tiles hold few
# bytes a step (64 rows of 64 bytes), and at batch 1 all of them together a step are ~12 KB an SM.
DOWN_STEPS_AHEAD = 2
# The instruction's N: pairs of a segment taken at a time (wider tiles would raise every
# program's registers for the few segments with more pairs).
TOKENS_PER_STEP = 8
# Device-side constants (Gluon reads module globals only as constexprs).
TOKENS = gl.constexpr(TOKENS_PER_STEP)
DOWN_BLOCK_N = gl.constexpr(DOWN_N)
DOWN_AHEAD = gl.constexpr(DOWN_STEPS_AHEAD)
GATE_UP_BLOCK_N = gl.constexpr(UP_BLOCK_N)  # one activation block of h, as scaled.py's
SEGMENT = gl.constexpr(SEGMENT_ROWS)
BLOCK_K = gl.constexpr(STEP)
FP4_GROUP = gl.constexpr(FP4_BLOCK)
# A byte's two e2m1 codes -> e4m3 bytes of 2^-6 times their values, then f16x2 (pack 4: four
# bytes in $4; low codes to $0, $1, high codes to $2, $3, in byte order).
_E2M1_TO_FP16 = gl.constexpr("""{
.reg .b32 lo, hi, s;
.reg .b16 l0, l1, h0, h1;
shl.b32 lo, $4, 2;
and.b32 lo, lo, 0x1C1C1C1C;
shl.b32 s, $4, 4;
and.b32 s, s, 0x80808080;
or.b32 lo, lo, s;
shr.b32 hi, $4, 2;
and.b32 hi, hi, 0x1C1C1C1C;
and.b32 s, $4, 0x80808080;
or.b32 hi, hi, s;
mov.b32 {l0, l1}, lo;
mov.b32 {h0, h1}, hi;
cvt.rn.f16x2.e4m3x2 $0, l0;
cvt.rn.f16x2.e4m3x2 $1, l1;
cvt.rn.f16x2.e4m3x2 $2, h0;
cvt.rn.f16x2.e4m3x2 $3, h1;
}""")
# Four e4m3 bytes ($2) -> f16x2 pairs of bytes (0, 2) in $0 and (1, 3) in $1: the pairs the
# instruction's fragment packs (_value_groups).
_E4M3_TO_FP16 = gl.constexpr("""{
.reg .b32 t;
.reg .b16 a0, a1;
prmt.b32 t, $2, 0, 0x3120;
mov.b32 {a0, a1}, t;
cvt.rn.f16x2.e4m3x2 $0, a0;
cvt.rn.f16x2.e4m3x2 $1, a1;
}""")


@gluon.constexpr_function
def mma_layout() -> gl.NVMMADistributedLayout:
    return gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, 8])


@gluon.constexpr_function
def codes_layout(block_n: int) -> gl.DistributedLinearLayout:
    """[block_n rows, 64 bytes] of codes (128 inputs): thread (r, q) of warp w holds bytes
    16g + 4q + j (j < 4, every group g) of rows 16w + r and + 8, every 64 rows; j in consecutive
    registers (32-bit loads)."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [0, 16], [0, 32], [8, 0]] + [[64 << i, 0] for i in range((block_n // 64).bit_length() - 1)],
        lane_bases=[[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[block_n, STEP // 2],
    )


@gluon.constexpr_function
def values_layout(tokens: int) -> gl.DistributedLinearLayout:
    """[128 inputs, tokens] of e4m3 activations: thread (r, q) holds inputs 32g + 8q + i (i < 8,
    every group g; i in consecutive registers: 64-bit loads) of token r, every 8 tokens; every
    warp the same."""
    return gl.DistributedLinearLayout(
        reg_bases=[[1, 0], [2, 0], [4, 0], [32, 0], [64, 0]] + [[0, 8 << i] for i in range((tokens // 8).bit_length() - 1)],
        lane_bases=[[8, 0], [16, 0], [0, 1], [0, 2], [0, 4]],
        warp_bases=[[0, 0], [0, 0]], block_bases=[], shape=[STEP, tokens],
    )


@gluon.constexpr_function
def epilogue_layout() -> gl.BlockedLayout:
    """[pairs, 128 columns]: a row's columns across a warp, 4 a thread."""
    return gl.BlockedLayout(size_per_thread=[1, 4], threads_per_warp=[1, 32], warps_per_cta=[WARPS, 1], order=[1, 0])


@gluon.jit
def _groups(t):
    """[.., 2, 2] -> its four [..] tensors in group order (the last two dims are g's bits)."""
    even, odd = gl.split(t)
    g0, g2 = gl.split(even)
    g1, g3 = gl.split(odd)
    return g0, g1, g2, g3


@gluon.jit
def _weight_groups(packed, BLOCK_N: gl.constexpr, MMA: gl.constexpr):
    """Codes [BLOCK_N, 64 bytes] (codes_layout) -> the four groups' A fragments [BLOCK_N, 32] fp16
    (2^-6 times the values). Byte 16g + 4q + 2h + n holds inputs 32g + 8q + 4h + 2n (low nibble)
    and + 1 (high); the fragment takes nibble s at k-slot 16s + 8h + 2q + n, so that the slot
    pairs (n = 0, 1) it packs in a register are the decoding's own f16x2 halves."""
    a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    low, high = gl.inline_asm_elementwise(
        _E2M1_TO_FP16, "=r,=r,=r,=r,r", [packed], dtype=(gl.float16, gl.float16), is_pure=True, pack=4
    )
    w = gl.join(low, high).reshape([BLOCK_N, 4, 4, 2, 2, 2])  # (row, g, q, h, n, s): byte 4q + 2h + n, nibble s
    w = w.permute(0, 1, 5, 3, 2, 4).reshape([BLOCK_N, 4, 32])  # (row, g, slot 16s + 8h + 2q + n)
    w0, w1, w2, w3 = _groups(w.permute(0, 2, 1).reshape([BLOCK_N, 32, 2, 2]))
    return (gl.convert_layout(w0, a_op, assert_trivial=True), gl.convert_layout(w1, a_op, assert_trivial=True),
            gl.convert_layout(w2, a_op, assert_trivial=True), gl.convert_layout(w3, a_op, assert_trivial=True))


@gluon.jit
def _value_groups(values, TOKENS: gl.constexpr, MMA: gl.constexpr):
    """Activations [128, TOKENS], e4m3 bytes (values_layout) -> the four groups' B fragments
    [32, TOKENS] fp16: input 32g + 8q + 4h + 2n + s at k-slot 16s + 8h + 2q + n, as _weight_groups."""
    b_op: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    v = gl.inline_asm_elementwise(_E4M3_TO_FP16, "=r,=r,r", [values], dtype=gl.float16, is_pure=True, pack=4)
    # Position 4h + 2s + n of a thread's 8 now holds input 4h + 2n + s (the asm's byte order).
    v = v.reshape([4, 4, 2, 2, 2, TOKENS]).permute(0, 3, 2, 1, 4, 5).reshape([4, 32, TOKENS])
    v0, v1, v2, v3 = _groups(v.permute(1, 2, 0).reshape([32, TOKENS, 2, 2]))
    return (gl.convert_layout(v0, b_op, assert_trivial=True), gl.convert_layout(v1, b_op, assert_trivial=True),
            gl.convert_layout(v2, b_op, assert_trivial=True), gl.convert_layout(v3, b_op, assert_trivial=True))


@gluon.jit
def _code_scale(s, S_E8M0: gl.constexpr):
    """Loaded weight scales as fp32 times 2^6 (undoing the decoded codes' 2^-6): ue8m0 byte e is
    2^(e - 127), so the product is the fp32 with exponent field e + 6 (normal for every byte, 0
    included; the 255 of NaN saturates to infinity)."""
    if S_E8M0:
        return (gl.minimum(s.to(gl.int32) + 6, 255) << 23).to(gl.float32, bitcast=True)
    else:
        return s * 64.0


@gluon.jit
def _group_product(w, v, s_ptrs, group, stride_sk, S_E8M0: gl.constexpr, BLOCK_N: gl.constexpr,
                   TOKENS: gl.constexpr, MMA: gl.constexpr):
    """One scale group's product [BLOCK_N, TOKENS] fp32, times the columns' weight scales."""
    s = _code_scale(gl.load(s_ptrs + group * stride_sk), S_E8M0)
    return mma_v2(w, v, gl.zeros([BLOCK_N, TOKENS], gl.float32, MMA)) * s[:, None]


@gluon.jit
def _code_pointers(w_ptr, col0, stride_wn, k_begin, BLOCK_N: gl.constexpr):
    """Codes of weight rows col0 + [0, BLOCK_N), inputs [k_begin, k_begin + 128) (codes_layout)."""
    CODES: gl.constexpr = codes_layout(BLOCK_N)
    cols = col0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, CODES))
    offs = k_begin // 2 + gl.arange(0, BLOCK_K // 2, layout=gl.SliceLayout(0, CODES))
    return w_ptr + cols.to(gl.int64)[:, None] * stride_wn + offs[None, :]


@gluon.jit
def _block_product(codes, v0, v1, v2, v3, s_ptrs, group, stride_sk,
                   S_E8M0: gl.constexpr, BLOCK_N: gl.constexpr, TOKENS: gl.constexpr):
    """128 inputs of one weight: its four groups' products, each times its weight scales."""
    MMA: gl.constexpr = mma_layout()
    w0, w1, w2, w3 = _weight_groups(codes, BLOCK_N, MMA)
    block = _group_product(w0, v0, s_ptrs, group, stride_sk, S_E8M0, BLOCK_N, TOKENS, MMA)
    block += _group_product(w1, v1, s_ptrs, group + 1, stride_sk, S_E8M0, BLOCK_N, TOKENS, MMA)
    block += _group_product(w2, v2, s_ptrs, group + 2, stride_sk, S_E8M0, BLOCK_N, TOKENS, MMA)
    block += _group_product(w3, v3, s_ptrs, group + 3, stride_sk, S_E8M0, BLOCK_N, TOKENS, MMA)
    return block


@gluon.jit
def _step_loads(code_ptrs, other_code_ptrs, value_ptrs, value_ok, a_scale_ptr, acc_rows, acc_ok, stride_as, k, k_begin,
                PAIRED: gl.constexpr):
    """The loads of the 128 inputs from k: the codes of the weight rows (and of the second
    weight's with PAIRED), the activations' e4m3 bytes and their scales."""
    step = k - k_begin
    codes = gl.load(code_ptrs + step // 2)
    if PAIRED:
        other_codes = gl.load(other_code_ptrs + step // 2)
    else:
        other_codes = codes
    values = gl.load(value_ptrs + step, mask=value_ok[None, :], other=0)
    a_scale = gl.load(a_scale_ptr + acc_rows * stride_as + k // BLOCK_K, mask=acc_ok, other=0.0)
    return codes, other_codes, values, a_scale


@gluon.jit
def _step_products(acc, acc_other, codes, other_codes, values, a_scale, k, s_ptrs, s_other_ptrs, stride_sk, stride_other_sk,
                   S_E8M0: gl.constexpr, BLOCK_N: gl.constexpr, TOKENS: gl.constexpr, PAIRED: gl.constexpr):
    """acc (and acc_other with PAIRED) plus the products of one step's loads (_step_loads)."""
    MMA: gl.constexpr = mma_layout()
    v0, v1, v2, v3 = _value_groups(values, TOKENS, MMA)
    group = k // FP4_GROUP
    acc += _block_product(codes, v0, v1, v2, v3, s_ptrs, group, stride_sk, S_E8M0, BLOCK_N, TOKENS) * a_scale[None, :]
    if PAIRED:
        block = _block_product(other_codes, v0, v1, v2, v3, s_other_ptrs, group, stride_other_sk, S_E8M0, BLOCK_N, TOKENS)
        acc_other += block * a_scale[None, :]
    return acc, acc_other


@gluon.jit
def _fp4_products(
    a_ptr, a_scale_ptr, a_row, row_ok, stride_am, stride_as,
    w_ptr, s_ptr, w_other_ptr, s_other_ptr, col0, stride_wn, stride_sn, stride_sk,
    stride_other_wn, stride_other_sn, stride_other_sk, k_begin, k_end,
    S_E8M0: gl.constexpr, BLOCK_N: gl.constexpr, TOKENS: gl.constexpr, PAIRED: gl.constexpr,
    STEPS_AHEAD: gl.constexpr,
):
    """[BLOCK_N, TOKENS] fp32 each: weight rows col0 + [0, BLOCK_N) (w_ptr, s_ptr at the expert) and,
    with PAIRED, the same rows of a second weight (w_other_ptr, s_other_ptr: gate and up share
    the activations) times the quantised activation rows a_row (e4m3 bytes [rows, K] and one
    scale per 128; row_ok masks the padding) over inputs [k_begin, k_end), a multiple of 128.
    The loads of STEPS_AHEAD steps (1 or 2) are issued before their products (no values carried
    across iterations: a carried tensor of bytes is kept a byte a register)."""
    MMA: gl.constexpr = mma_layout()
    VALUES: gl.constexpr = values_layout(TOKENS)
    code_ptrs = _code_pointers(w_ptr, col0, stride_wn, k_begin, BLOCK_N)
    other_code_ptrs = _code_pointers(w_other_ptr, col0, stride_other_wn, k_begin, BLOCK_N)
    value_rows = gl.convert_layout(a_row, gl.SliceLayout(0, VALUES))
    value_ok = gl.convert_layout(row_ok, gl.SliceLayout(0, VALUES))
    value_ptrs = (a_ptr + value_rows.to(gl.int64)[None, :] * stride_am
                  + (k_begin + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(1, VALUES)))[:, None])
    scale_cols = col0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, MMA))
    s_ptrs = s_ptr + scale_cols * stride_sn
    s_other_ptrs = s_other_ptr + scale_cols * stride_other_sn
    acc_rows = gl.convert_layout(a_row, gl.SliceLayout(0, MMA))
    acc_ok = gl.convert_layout(row_ok, gl.SliceLayout(0, MMA))
    acc = gl.zeros([BLOCK_N, TOKENS], gl.float32, MMA)
    acc_other = gl.zeros([BLOCK_N, TOKENS], gl.float32, MMA)
    first = k_begin
    if STEPS_AHEAD == 2:
        for k in range(k_begin, k_end - BLOCK_K, 2 * BLOCK_K):
            c0, o0, v0, a0 = _step_loads(code_ptrs, other_code_ptrs, value_ptrs, value_ok, a_scale_ptr, acc_rows, acc_ok,
                                         stride_as, k, k_begin, PAIRED)
            c1, o1, v1, a1 = _step_loads(code_ptrs, other_code_ptrs, value_ptrs, value_ok, a_scale_ptr, acc_rows, acc_ok,
                                         stride_as, k + BLOCK_K, k_begin, PAIRED)
            acc, acc_other = _step_products(acc, acc_other, c0, o0, v0, a0, k, s_ptrs, s_other_ptrs, stride_sk,
                                            stride_other_sk, S_E8M0, BLOCK_N, TOKENS, PAIRED)
            acc, acc_other = _step_products(acc, acc_other, c1, o1, v1, a1, k + BLOCK_K, s_ptrs, s_other_ptrs, stride_sk,
                                            stride_other_sk, S_E8M0, BLOCK_N, TOKENS, PAIRED)
        first = k_end - ((k_end - k_begin) // BLOCK_K) % 2 * BLOCK_K  # an odd last step, if any
    for k in range(first, k_end, BLOCK_K):
        c0, o0, v0, a0 = _step_loads(code_ptrs, other_code_ptrs, value_ptrs, value_ok, a_scale_ptr, acc_rows, acc_ok,
                                     stride_as, k, k_begin, PAIRED)
        acc, acc_other = _step_products(acc, acc_other, c0, o0, v0, a0, k, s_ptrs, s_other_ptrs, stride_sk,
                                        stride_other_sk, S_E8M0, BLOCK_N, TOKENS, PAIRED)
    return acc, acc_other


@gluon.jit
def _chunk_pairs(sorted_pair_ptr, segment, first, rows, LAYOUT: gl.constexpr):
    """Pairs [first, first + TOKENS) of a segment and their real-row mask, in LAYOUT (1-D)."""
    offs = first + gl.arange(0, TOKENS, layout=LAYOUT)
    row_ok = offs < rows
    pair = gl.load(sorted_pair_ptr + segment * SEGMENT + offs, mask=row_ok, other=0)
    return pair, row_ok


@gluon.jit
def _gate_up_chunk(
    xq_ptr, xs_ptr, w1_ptr, s1_ptr, w3_ptr, s3_ptr, sorted_pair_ptr, segment, first, rows, tile_n, split, dim,
    stride_w1n, stride_s1n, stride_s1k, stride_w3n, stride_s3n, stride_s3k,
    PAIRS_PER_TOKEN: gl.constexpr, S_E8M0: gl.constexpr, SPLIT: gl.constexpr,
):
    """Gate and up [TOKENS, 128] fp32 of TOKENS pairs of a segment from `first` over this
    program's K split, as [pairs, columns] in epilogue_layout(); with their pairs, tokens, real-row
    mask and columns (its slices)."""
    BLOCK_N: gl.constexpr = GATE_UP_BLOCK_N
    EPILOGUE: gl.constexpr = epilogue_layout()
    pair, row_ok = _chunk_pairs(sorted_pair_ptr, segment, first, rows, gl.SliceLayout(1, EPILOGUE))
    token = pair // PAIRS_PER_TOKEN
    per_split = gl.cdiv(dim // BLOCK_K, SPLIT) * BLOCK_K
    k_begin = split * per_split
    k_end = gl.minimum(k_begin + per_split, dim)
    col0 = tile_n * BLOCK_N
    gate, up = _fp4_products(
        xq_ptr, xs_ptr, token, row_ok, dim, dim // BLOCK_K,
        w1_ptr, s1_ptr, w3_ptr, s3_ptr, col0, stride_w1n, stride_s1n, stride_s1k, stride_w3n, stride_s3n, stride_s3k,
        k_begin, k_end, S_E8M0, BLOCK_N, TOKENS, True, 1,
    )
    gate = gl.convert_layout(gate.permute(1, 0), EPILOGUE)
    up = gl.convert_layout(up.permute(1, 0), EPILOGUE)
    offs_n = col0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, EPILOGUE))
    return gate, up, pair, token, row_ok, offs_n


@gluon.jit
def _mma_gate_up_kernel(
    x_ptr, xq_ptr, xs_ptr, w1_ptr, s1_ptr, w3_ptr, s3_ptr, route_w_ptr, hq_ptr, hs_ptr,
    sorted_pair_ptr, block_expert_ptr, block_rows_ptr, partial_ptr, counter_ptr,
    split_stride, dim, inter, swiglu_limit,
    stride_w1e, stride_w1n, stride_s1e, stride_s1n, stride_s1k,
    stride_w3e, stride_w3n, stride_s3e, stride_s3n, stride_s3k,
    PICKS: gl.constexpr, PAIRS_PER_TOKEN: gl.constexpr, HAS_LIMIT: gl.constexpr, POW2: gl.constexpr,
    S_E8M0: gl.constexpr, SPLIT: gl.constexpr,
):
    pid = gl.program_id(0)
    split = gl.program_id(1)
    tiles_n = inter // GATE_UP_BLOCK_N
    segment = pid // tiles_n
    tile_n = pid % tiles_n
    expert = gl.load(block_expert_ptr + segment)
    if expert >= 0:  # an unused segment reads no weight
        rows = gl.load(block_rows_ptr + segment)
        at = expert.to(gl.int64)
        w1_ptr += at * stride_w1e
        s1_ptr += at * stride_s1e
        w3_ptr += at * stride_w3e
        s3_ptr += at * stride_s3e
        # TOKENS pairs at a time: a segment with more (rare at decode) reads its strip again, from L2.
        for first in range(0, rows, TOKENS):
            gate, up, pair, token, row_ok, offs_n = _gate_up_chunk(
                xq_ptr, xs_ptr, w1_ptr, s1_ptr, w3_ptr, s3_ptr, sorted_pair_ptr, segment, first, rows, tile_n, split, dim,
                stride_w1n, stride_s1n, stride_s1k, stride_w3n, stride_s3n, stride_s3k, PAIRS_PER_TOKEN, S_E8M0, SPLIT,
            )
            if SPLIT == 1:
                gate_up_epilogue(gate, up, x_ptr, route_w_ptr, hq_ptr, hs_ptr, token, pair, row_ok, offs_n, tile_n,
                                 inter, swiglu_limit, PICKS, PAIRS_PER_TOKEN, HAS_LIMIT, POW2)
            else:
                store_partials(gate, up, partial_ptr, pair, row_ok, offs_n, split, split_stride, inter)
        if SPLIT > 1:
            # scaled.py's split-K arrival, once for all of the program's chunks.
            counter = counter_ptr + segment * tiles_n + tile_n
            if arrives_last(counter, SPLIT):
                EPILOGUE: gl.constexpr = epilogue_layout()
                offs_n = tile_n * GATE_UP_BLOCK_N + gl.arange(0, GATE_UP_BLOCK_N, layout=gl.SliceLayout(0, EPILOGUE))
                for first in range(0, rows, TOKENS):
                    pair, row_ok = _chunk_pairs(sorted_pair_ptr, segment, first, rows, gl.SliceLayout(1, EPILOGUE))
                    gate, up = summed_partials(partial_ptr, pair, row_ok, offs_n, split_stride, inter, SPLIT)
                    gate_up_epilogue(gate, up, x_ptr, route_w_ptr, hq_ptr, hs_ptr, pair // PAIRS_PER_TOKEN, pair, row_ok,
                                     offs_n, tile_n, inter, swiglu_limit, PICKS, PAIRS_PER_TOKEN, HAS_LIMIT, POW2)
                gl.atomic_xchg(counter, 0)


@gluon.jit
def _mma_down_kernel(
    hq_ptr, hs_ptr, w2_ptr, s2_ptr, y_ptr, sorted_pair_ptr, block_expert_ptr, block_rows_ptr,
    dim, inter, stride_we, stride_wn, stride_se, stride_sn, stride_sk, stride_ym,
    S_E8M0: gl.constexpr,
):
    pid = gl.program_id(0)
    tiles_n = dim // DOWN_BLOCK_N
    segment = pid // tiles_n
    tile_n = pid % tiles_n
    expert = gl.load(block_expert_ptr + segment)
    if expert >= 0:
        rows = gl.load(block_rows_ptr + segment)
        at = expert.to(gl.int64)
        w2_ptr += at * stride_we
        s2_ptr += at * stride_se
        EPILOGUE: gl.constexpr = epilogue_layout()
        col0 = tile_n * DOWN_BLOCK_N
        offs_n = col0 + gl.arange(0, DOWN_BLOCK_N, layout=gl.SliceLayout(0, EPILOGUE))
        for first in range(0, rows, TOKENS):
            pair, row_ok = _chunk_pairs(sorted_pair_ptr, segment, first, rows, gl.SliceLayout(1, EPILOGUE))
            acc, _ = _fp4_products(
                hq_ptr, hs_ptr, pair, row_ok, inter, inter // BLOCK_K,
                w2_ptr, s2_ptr, w2_ptr, s2_ptr, col0, stride_wn, stride_sn, stride_sk, stride_wn, stride_sn, stride_sk,
                0, inter, S_E8M0, DOWN_BLOCK_N, TOKENS, False, DOWN_AHEAD,
            )
            y = gl.convert_layout(acc.permute(1, 0), EPILOGUE)
            y_ptrs = y_ptr + pair.to(gl.int64)[:, None] * stride_ym + offs_n[None, :]
            gl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=row_ok[:, None])


def takes(x: torch.Tensor, w1: torch.Tensor) -> bool:
    """Whether the op runs this product: FP4 experts whose widths are whole 128-blocks, on a GPU
    with the e4m3 conversions (sm_89 or newer)."""
    return w1.dtype == torch.uint8 and _whole_blocks(x.shape[1], w1.shape[1]) and converts_e4m3(x.device)


def _whole_blocks(dim: int, inter: int) -> bool:
    """Widths the product tiles: 128-input steps both ways, gate/up tiles of 128 columns."""
    return dim % STEP == 0 and inter % UP_BLOCK_N == 0


def check_mma_inputs(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor) -> None:
    """What the "mma" product takes: FP4 weights (uint8 codes), widths that are whole 128-blocks
    and 64-column tiles."""
    if not (w1.dtype == w2.dtype == w3.dtype == torch.uint8):
        raise ValueError(f"moe_experts (mma): the mma product takes FP4 experts, got {w1.dtype}, {w2.dtype}, {w3.dtype}")
    dim, inter = x.shape[1], w1.shape[1]
    if not _whole_blocks(dim, inter):
        raise ValueError(f"moe_experts (mma): dim ({dim}) and inter ({inter}) must be multiples of {STEP}")


def moe_experts_scaled_mma(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    expert_weights: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    scales: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    swiglu_limit: float,
    shared_expert: int = -1,
    pow2: bool = True,
    tiles: ScaledTiles | None = None,
) -> torch.Tensor:
    """moe_experts_scaled_triton's result (same arguments) with the products of this module: FP4
    experts on a GPU."""
    check_mma_inputs(x, w1, w2, w3)

    def launch_products(ids: torch.Tensor, tiles: ScaledTiles) -> ScaledLaunch:
        run = prepare_launch(x, ids, expert_weights, w1, scales, shared_expert, pow2, tiles)
        dim = x.shape[1]
        inter = w1.shape[1]
        segments = run.segments
        s1, s2, s3 = run.scales
        _mma_gate_up_kernel[(segments.num_blocks * (inter // UP_BLOCK_N), run.split)](
            x, run.xq.view(torch.uint8), run.xs, w1, s1, w3, s3, run.route_w, run.hq, run.hs,
            segments.sorted_pair, segments.block_expert, segments.block_rows, run.partials, run.counters,
            run.hq.shape[0] * 2 * inter, dim, inter, float(swiglu_limit),
            w1.stride(0), w1.stride(1), *s1.stride(), w3.stride(0), w3.stride(1), *s3.stride(),
            PICKS=run.picks, PAIRS_PER_TOKEN=run.pairs_per_token, HAS_LIMIT=swiglu_limit > 0, POW2=pow2,
            S_E8M0=s1.dtype == torch.uint8, SPLIT=run.split, num_warps=WARPS,
        )
        _mma_down_kernel[(segments.num_blocks * (dim // DOWN_N),)](
            run.hq.view(torch.uint8), run.hs, w2, s2, run.y, segments.sorted_pair, segments.block_expert, segments.block_rows,
            dim, inter, w2.stride(0), w2.stride(1), *s2.stride(), run.y.stride(0),
            S_E8M0=s2.dtype == torch.uint8, num_warps=WARPS,
        )
        return run

    return scaled_experts(x, expert_ids, w1, w2, w3, scales, shared_expert, tiles, launch_products)
