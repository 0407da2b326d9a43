"""Triton routed experts on block-scaled weights (semantics: kernels/moe/ref.py with `scales`): FP4
(e2m1 codes packed two per byte, one scale per 32 inputs) or FP8 (e4m3, one scale per 128 x 128
block), scales ue8m0 or fp32. A grouped GEMV at decode batches, CUDA-graph safe (no host sync,
no data-dependent shape).

Pipeline, all on the device (steps 1 and 2 in one launch, route_and_quantise, at decode):

1. act_quant(x): the shared pre-pass of kernels/blockscale/act_quant_pass.py (e4m3 values and one
   fp32 scale per 128 inputs), once per token, shared by all of its picks.
2. Route: the pairs of kernels/moe/triton.py's route_pairs, in segments of SEGMENT_ROWS rows: at
   decode every expert's pairs fit one segment, so one program per (expert, N tile) reads that
   strip of the expert's weights once, however many tokens picked it.
3. Gate/up: per (segment, 128 columns of the intermediate), both products over the model width,
   rounded to x's dtype, the clamped SwiGLU times the routing weight in fp32, rounded again, then
   act_quant of that: the tile is one activation block wide, so the epilogue holds whole blocks.
   Stored per pair: e4m3 values and one scale per 128. With few experts picked the model width
   is split among programs; the last of a tile to arrive sums the partials in split order and
   runs the epilogue (kernels/arrival.py's counters).
4. Down: per (segment, N tile of the model width), the product over the intermediate, rounded to
   x's dtype, stored per pair.
5. Combine: kernels/moe/triton.py's combine_pairs (fp32, pick order).

The products multiply the e4m3 activations (converted to fp16 on load) with the weights' codes
in registers (FP4: e2m1 codes as fp16, 2^-14 times their values, the 2^14 folded into the weight
scales; FP8: e4m3 converted to fp16): both are exact in fp16 and their products exact in fp32.
Each weight scale group (32 inputs for FP4, 128 for FP8) is one fp16 dot with fp32 accumulation
(FP4: two of 16 inputs, the bytes' low codes against the even inputs and high codes against the odd;
FP4 with ue8m0 scales, the MX format, instead one `tl.dot_scaled` per 128 inputs),
scaled in fp32 by its weight scale; each 128-input step by the activations' scale. act_quant,
the e4m3 rounding and the e2m1 and scale decoding are the shared arithmetic of
kernels/blockscale/device.py. Results differ from the reference by summation order only, and by
what that does to the roundings the semantics prescribe. A program takes its segment's pairs 16
at a time (CHUNK_ROWS): an expert with one token pays 16 rows of matrix work, and the rare one
with more re-reads its strip from L2. With K split, a program stores every chunk's partials and
counts its arrival once; the last to arrive sums and finishes each chunk.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.arrival import arrives_last, split_counters
from kernels.blockscale.act_quant_pass import (
    BLOCKS_PER_PROGRAM, act_quant_launch, act_quant_program, act_quant_triton, store_values, values_buffer,
)
from kernels.blockscale.device import act_quant_rows, e2m1_pairs_to_fp16, weight_scale_to_fp32
from kernels.blockscale.ref import FP4_BLOCK, FP8_BLOCK
from kernels.dependent_launch import dependent_options, wait_for_predecessor
from kernels.moe.ref import SharedExpertWeights, check_shared_expert
from kernels.moe.shared import shared_expert_triton
from kernels.moe.triton import (
    PROGRAMS_PER_SM, UP_PROGRAMS_PER_SM, PairBlocks, _route_pairs_kernel, _routed_swiglu, _widest_tile, combine_pairs,
    route_pairs, routes_in_one_program, routing_launch,
)
from kernels.side_stream import run_beside
from kernels.triton_util import MIN_BLOCKS_PER_SPLIT, num_sms

# Rows of a routing segment: every expert with at most this many pairs is one segment.
SEGMENT_ROWS = 64
# Rows of a segment a program multiplies at a time (the dot's narrow side; rows beyond read the
# expert's strip again, from L2). One chunk shape keeps every launch's registers at what 16 rows
# need: a 64-row tile in the same kernel made every launch pay its registers and spills.
CHUNK_ROWS = 16
# The gate/up N tile: one activation block, so that its epilogue quantises whole blocks of h.
UP_BLOCK_N = FP8_BLOCK
ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
PRODUCTS = ("dot_scaled", "codes", "mma", "wgmma")
TRITON_PRODUCTS = PRODUCTS[:2]
# Device-side constants (Triton reads module globals only as constexprs): activation blocks and
# FP8 weight blocks are 128 wide, FP4 scale groups 32.
ACT_BLOCK = tl.constexpr(FP8_BLOCK)
FP4_GROUP = tl.constexpr(FP4_BLOCK)
CHUNK = tl.constexpr(CHUNK_ROWS)


@dataclass(frozen=True)
class ScaledTiles:
    """Launch shape: the down product's N tile (the gate/up tile is fixed: UP_BLOCK_N), how many
    ways the gate/up product splits K, and how FP4 weights are multiplied (`product`, one of
    PRODUCTS): "dot_scaled" (with ue8m0 scales: `tl.dot_scaled`, else as "codes"), "codes" (the
    codes decoded here, then an fp16 dot), "mma" (kernels/moe/scaled_gluon.py: decoded into
    the tensor-core instruction's registers; FP4 only) or "wgmma" (the same on Hopper's warpgroup
    instruction: codes decoded to e4m3, the activations read from shared memory; sm_90 only)."""

    down_block_n: int
    num_warps: int = 4
    num_stages: int = 3  # Triton's pipeline stages; the Gluon products' steps in shared memory
    product: str = "dot_scaled"
    up_split: int = 1  # K of the gate/up product split this many ways (few experts picked)
    # The Gluon products' 128-input blocks a pipeline stage: with 2 each weight row's codes are
    # read 128 contiguous bytes at a time (64-byte runs a row leave DRAM bandwidth unused).
    blocks_per_stage: int = 1
    # The Gluon down product launched as a programmatic dependent of the gate/up (Hopper and
    # later): its launch and first weight copies overlap the gate/up's last programs.
    dependent_launch: bool = True
    # The Gluon products' programs an SM holds: each thread's registers are bounded to its share
    # (65536 / (programs_per_sm * 128)); the gate/up K split keeps its programs in one such wave.
    programs_per_sm: int = 4


@functools.lru_cache(maxsize=None)
def choose_scaled_tiles(num_pairs: int, num_experts: int, dim: int, inter: int, num_sms: int) -> ScaledTiles:
    """At decode few experts are picked and each must be spread over many SMs. The down N tile:
    the widest of 128, 64, 32 that still gives every SM PROGRAMS_PER_SM programs. The gate/up
    tile is fixed (one activation block of h), so where its tiles leave SMs without
    UP_PROGRAMS_PER_SM programs K is split, each split at least MIN_BLOCKS_PER_SPLIT blocks."""
    active = max(1, min(num_pairs, num_experts))
    up_tiles = active * max(1, inter // UP_BLOCK_N)
    blocks = dim // FP8_BLOCK
    most = blocks // MIN_BLOCKS_PER_SPLIT
    split = min(triton.cdiv(UP_PROGRAMS_PER_SM * num_sms, up_tiles), most)
    down_block_n = _widest_tile(dim, active, num_sms, (128, 64, 32), PROGRAMS_PER_SM)
    return ScaledTiles(down_block_n=down_block_n, up_split=max(1, split))


# ---------------------------------------------------------------------------------------------
# Device helpers
# ---------------------------------------------------------------------------------------------


@triton.jit
def _scaled_product(
    a_ptr, a_scale_ptr, a_row, row_ok, stride_am, stride_as,
    w_ptr, s_ptr, offs_n, stride_wn, stride_wk, stride_sn, stride_sk,
    k_begin, k_end,
    W_FP4: tl.constexpr, S_E8M0: tl.constexpr, MX: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """[BLOCK_M, BLOCK_N] fp32 over inputs [k_begin, k_end): rows a_row of the quantised activations
    (e4m3 values [rows, K], converted to fp16 on load, and one scale per 128) times weight rows
    offs_n (w_ptr, s_ptr at the expert), dequantised on the fly: per weight scale group one fp16
    dot, scaled by the weight scales; per 128 inputs the sum of its groups scaled by the
    activation scales. With MX, FP4 codes with ue8m0 scales (the microscaling format) take one
    `tl.dot_scaled` per 128 inputs instead: the packed codes and their scales with the e4m3
    values, Triton's own decoding of the format."""
    # The weight is the dot's first operand (N x K) and the rows its second (K x rows), so the few
    # rows of a segment take the dot's narrow side; the tile comes out transposed.
    a_rows = a_ptr + a_row[None, :].to(tl.int64) * stride_am
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k in range(k_begin, k_end, ACT_BLOCK):
        if MX and W_FP4 and S_E8M0:
            j = k // 2 + tl.arange(0, ACT_BLOCK // 2)
            packed = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + j[None, :] * stride_wk)
            groups = k // FP4_GROUP + tl.arange(0, ACT_BLOCK // FP4_GROUP)
            s = tl.load(s_ptr + offs_n[:, None] * stride_sn + groups[None, :] * stride_sk)
            a = tl.load(a_rows + k + tl.arange(0, ACT_BLOCK)[:, None], mask=row_ok[None, :], other=0.0)
            part = tl.dot_scaled(packed, s, "e2m1", a, None, "e4m3")
        else:
            part = _group_products(a_rows, row_ok, w_ptr, s_ptr, offs_n, stride_wn, stride_wk, stride_sn, stride_sk,
                                   k, W_FP4, S_E8M0, BLOCK_M, BLOCK_N)
        a_scale = tl.load(a_scale_ptr + a_row * stride_as + k // ACT_BLOCK, mask=row_ok, other=0.0)
        acc += part * a_scale[None, :]
    return tl.trans(acc)


@triton.jit
def _group_products(
    a_rows, row_ok, w_ptr, s_ptr, offs_n, stride_wn, stride_wk, stride_sn, stride_sk, k,
    W_FP4: tl.constexpr, S_E8M0: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """The 128 inputs from k of _scaled_product, one fp16 dot per weight scale group."""
    GROUP: tl.constexpr = FP4_GROUP if W_FP4 else ACT_BLOCK
    part = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for g in tl.static_range(ACT_BLOCK // GROUP):
        kg = k + g * GROUP
        if W_FP4:
            # A byte's low codes are the even inputs, its high codes the odd ones: one dot each,
            # so the codes are used where they are decoded (no interleave).
            j = kg // 2 + tl.arange(0, GROUP // 2)
            packed = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + j[None, :] * stride_wk)
            low, high = e2m1_pairs_to_fp16(packed)
            evens = a_rows + kg + 2 * tl.arange(0, GROUP // 2)[:, None]
            a_even = tl.load(evens, mask=row_ok[None, :], other=0.0).to(tl.float16)
            a_odd = tl.load(evens + 1, mask=row_ok[None, :], other=0.0).to(tl.float16)
            product = tl.dot(high, a_odd, tl.dot(low, a_even))
            s = tl.load(s_ptr + offs_n * stride_sn + (kg // FP4_GROUP) * stride_sk)
        else:
            offs_k = kg + tl.arange(0, GROUP)
            a = tl.load(a_rows + offs_k[:, None], mask=row_ok[None, :], other=0.0)
            w = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :] * stride_wk)
            product = tl.dot(w.to(tl.float16), a.to(tl.float16))
            s = tl.load(s_ptr + (offs_n // ACT_BLOCK) * stride_sn + (kg // ACT_BLOCK) * stride_sk)
        part += product * weight_scale_to_fp32(s, S_E8M0, W_FP4)[:, None]
    return part


@triton.jit
def _segment_rows(sorted_pair_ptr, segment, first, rows, SEGMENT: tl.constexpr):
    """The real-row mask of rows [first, first + CHUNK) of a segment and their pair indices."""
    offs = first + tl.arange(0, CHUNK)
    row_ok = offs < rows
    pair = tl.load(sorted_pair_ptr + segment * SEGMENT + offs, mask=row_ok, other=0)
    return row_ok, pair


# ---------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------


@triton.jit
def _gate_up_chunk(
    xq_ptr, xs_ptr, w1_ptr, s1_ptr, w3_ptr, s3_ptr, sorted_pair_ptr, segment, first, rows, tile_n, split, dim,
    stride_w1n, stride_w1k, stride_s1n, stride_s1k,
    stride_w3n, stride_w3k, stride_s3n, stride_s3k,
    PAIRS_PER_TOKEN: tl.constexpr, W_FP4: tl.constexpr, S_E8M0: tl.constexpr, MX: tl.constexpr,
    SEGMENT: tl.constexpr, SPLIT: tl.constexpr,
):
    """Gate and up [CHUNK, 128] fp32 of a segment's rows [first, first + CHUNK) over this
    program's K split; with their pairs, tokens, real-row mask and columns."""
    BLOCK_N: tl.constexpr = ACT_BLOCK
    row_ok, pair = _segment_rows(sorted_pair_ptr, segment, first, rows, SEGMENT)
    token = pair // PAIRS_PER_TOKEN
    offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    blocks_in = dim // ACT_BLOCK
    per_split = tl.cdiv(blocks_in, SPLIT) * ACT_BLOCK
    k_begin = split * per_split
    k_end = tl.minimum(k_begin + per_split, dim)
    gate = _scaled_product(
        xq_ptr, xs_ptr, token, row_ok, dim, blocks_in,
        w1_ptr, s1_ptr, offs_n, stride_w1n, stride_w1k, stride_s1n, stride_s1k,
        k_begin, k_end, W_FP4, S_E8M0, MX, CHUNK, BLOCK_N,
    )
    up = _scaled_product(
        xq_ptr, xs_ptr, token, row_ok, dim, blocks_in,
        w3_ptr, s3_ptr, offs_n, stride_w3n, stride_w3k, stride_s3n, stride_s3k,
        k_begin, k_end, W_FP4, S_E8M0, MX, CHUNK, BLOCK_N,
    )
    return gate, up, pair, token, row_ok, offs_n


# The split-K steps, no layout-bound operation in them: the Gluon products (kernels/moe/
# scaled_gluon.py) call them as well.
@triton.jit
def partial_rows(partial_ptr, pair, offs_n, split, split_stride, inter, matrix):
    """Where the scratch [SPLIT, pairs, 2, inter] holds split `split`'s partial rows of the pairs,
    columns offs_n, of `matrix` (0: gate, 1: up)."""
    return partial_ptr + split * split_stride + (pair.to(tl.int64)[:, None] * 2 + matrix) * inter + offs_n[None, :]


@triton.jit
def store_partials(gate, up, partial_ptr, pair, row_ok, offs_n, split, split_stride, inter):
    """This split's partial gate and up rows into the scratch."""
    tl.store(partial_rows(partial_ptr, pair, offs_n, split, split_stride, inter, 0), gate, mask=row_ok[:, None])
    tl.store(partial_rows(partial_ptr, pair, offs_n, split, split_stride, inter, 1), up, mask=row_ok[:, None])


@triton.jit
def summed_partials(partial_ptr, pair, row_ok, offs_n, split_stride, inter, SPLIT: tl.constexpr):
    """The gate and up rows summed over the splits, in split order."""
    gate = _load_partial(partial_ptr, pair, row_ok, offs_n, 0, split_stride, inter, 0)
    up = _load_partial(partial_ptr, pair, row_ok, offs_n, 0, split_stride, inter, 1)
    for s in range(1, SPLIT):
        gate += _load_partial(partial_ptr, pair, row_ok, offs_n, s, split_stride, inter, 0)
        up += _load_partial(partial_ptr, pair, row_ok, offs_n, s, split_stride, inter, 1)
    return gate, up


@triton.jit
def _load_partial(partial_ptr, pair, row_ok, offs_n, split, split_stride, inter, matrix):
    # .cg: other programs wrote the scratch; read it from L2, not a stale L1 line
    return tl.load(partial_rows(partial_ptr, pair, offs_n, split, split_stride, inter, matrix), mask=row_ok[:, None],
                   other=0.0, cache_modifier=".cg")


@triton.jit
def gate_up_epilogue(
    gate, up, x_ptr, route_w_ptr, hq_ptr, hs_ptr, token, pair, row_ok, offs_n, tile_n, inter, swiglu_limit,
    PICKS: tl.constexpr, PAIRS_PER_TOKEN: tl.constexpr, HAS_LIMIT: tl.constexpr, POW2: tl.constexpr,
    ORDER: tl.constexpr,
):
    """The tile's weighted SwiGLU, rounded to x's dtype, act_quant'ed into hq (in ORDER:
    store_values) and hs."""
    h = _routed_swiglu(gate, up, x_ptr, route_w_ptr, token, pair, row_ok, swiglu_limit, PICKS, PAIRS_PER_TOKEN, HAS_LIMIT)
    h = h.to(x_ptr.dtype.element_ty).to(tl.float32)  # rounded to x's dtype, as the reference
    hq, hs = act_quant_rows(h, POW2)  # the tile is one whole activation block of each row
    pair = pair.to(tl.int64)
    store_values(hq_ptr + pair[:, None] * inter, offs_n[None, :], hq, row_ok[:, None], ORDER)
    tl.store(hs_ptr + pair * (inter // ACT_BLOCK) + tile_n, hs, mask=row_ok)


@triton.jit
def _scaled_gate_up_kernel(
    x_ptr, xq_ptr, xs_ptr, w1_ptr, s1_ptr, w3_ptr, s3_ptr, route_w_ptr, hq_ptr, hs_ptr,
    sorted_pair_ptr, block_expert_ptr, block_rows_ptr, partial_ptr, counter_ptr,
    split_stride, dim, inter, swiglu_limit,
    stride_w1e, stride_w1n, stride_w1k, stride_s1e, stride_s1n, stride_s1k,
    stride_w3e, stride_w3n, stride_w3k, stride_s3e, stride_s3n, stride_s3k,
    PICKS: tl.constexpr, PAIRS_PER_TOKEN: tl.constexpr, HAS_LIMIT: tl.constexpr, POW2: tl.constexpr,
    W_FP4: tl.constexpr, S_E8M0: tl.constexpr, MX: tl.constexpr, SEGMENT: tl.constexpr, SPLIT: tl.constexpr,
    DEPENDENT: tl.constexpr = False,
):
    wait_for_predecessor(DEPENDENT)
    pid = tl.program_id(0)
    split = tl.program_id(1)
    tiles_n = inter // ACT_BLOCK
    segment = pid // tiles_n
    tile_n = pid % tiles_n
    expert = tl.load(block_expert_ptr + segment)
    if expert < 0:  # an unused segment: no weight is read
        return
    rows = tl.load(block_rows_ptr + segment)
    expert = expert.to(tl.int64)
    w1_ptr += expert * stride_w1e
    s1_ptr += expert * stride_s1e
    w3_ptr += expert * stride_w3e
    s3_ptr += expert * stride_s3e
    for first in range(0, rows, CHUNK):
        gate, up, pair, token, row_ok, offs_n = _gate_up_chunk(
            xq_ptr, xs_ptr, w1_ptr, s1_ptr, w3_ptr, s3_ptr, sorted_pair_ptr, segment, first, rows, tile_n, split, dim,
            stride_w1n, stride_w1k, stride_s1n, stride_s1k, stride_w3n, stride_w3k, stride_s3n, stride_s3k,
            PAIRS_PER_TOKEN, W_FP4, S_E8M0, MX, SEGMENT, SPLIT,
        )
        if SPLIT == 1:
            gate_up_epilogue(gate, up, x_ptr, route_w_ptr, hq_ptr, hs_ptr, token, pair, row_ok, offs_n, tile_n,
                             inter, swiglu_limit, PICKS, PAIRS_PER_TOKEN, HAS_LIMIT, POW2, "e4m3")
        else:
            store_partials(gate, up, partial_ptr, pair, row_ok, offs_n, split, split_stride, inter)
    if SPLIT > 1:
        # One arrival for all of the program's chunks; the last of the tile sums each chunk's partials.
        counter = counter_ptr + segment * tiles_n + tile_n
        if arrives_last(counter, SPLIT):
            offs_n = tile_n * ACT_BLOCK + tl.arange(0, ACT_BLOCK)
            for first in range(0, rows, CHUNK):
                row_ok, pair = _segment_rows(sorted_pair_ptr, segment, first, rows, SEGMENT)
                gate, up = summed_partials(partial_ptr, pair, row_ok, offs_n, split_stride, inter, SPLIT)
                gate_up_epilogue(gate, up, x_ptr, route_w_ptr, hq_ptr, hs_ptr, pair // PAIRS_PER_TOKEN, pair, row_ok,
                                 offs_n, tile_n, inter, swiglu_limit, PICKS, PAIRS_PER_TOKEN, HAS_LIMIT, POW2, "e4m3")
            tl.atomic_xchg(counter, 0)


@triton.jit
def _scaled_down_kernel(
    hq_ptr, hs_ptr, w2_ptr, s2_ptr, y_ptr,
    sorted_pair_ptr, block_expert_ptr, block_rows_ptr,
    dim, inter,
    stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk, stride_ym,
    W_FP4: tl.constexpr, S_E8M0: tl.constexpr, MX: tl.constexpr, SEGMENT: tl.constexpr, BLOCK_N: tl.constexpr,
    DEPENDENT: tl.constexpr = False,
):
    wait_for_predecessor(DEPENDENT)
    pid = tl.program_id(0)
    tiles_n = dim // BLOCK_N
    segment = pid // tiles_n
    tile_n = pid % tiles_n
    expert = tl.load(block_expert_ptr + segment)
    if expert < 0:
        return
    rows = tl.load(block_rows_ptr + segment)
    expert = expert.to(tl.int64)
    w2_ptr += expert * stride_we
    s2_ptr += expert * stride_se
    offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    for first in range(0, rows, CHUNK):
        row_ok, pair = _segment_rows(sorted_pair_ptr, segment, first, rows, SEGMENT)
        acc = _scaled_product(
            hq_ptr, hs_ptr, pair, row_ok, inter, inter // ACT_BLOCK,
            w2_ptr, s2_ptr, offs_n, stride_wn, stride_wk, stride_sn, stride_sk,
            0, inter, W_FP4, S_E8M0, MX, CHUNK, BLOCK_N,
        )
        y_ptrs = y_ptr + pair[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None])


# ---------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------


def _kernel_scale(scale: torch.Tensor) -> torch.Tensor:
    """ue8m0 scales as their bytes (Triton has no e8m0 type); fp32 ones as they are."""
    return scale.view(torch.uint8) if scale.dtype == torch.float8_e8m0fnu else scale


def _check_formats(x, expert_ids, w1, w2, w3, scales) -> None:
    if x.dtype not in ACT_DTYPES:
        raise ValueError(f"moe_experts: x must be one of {ACT_DTYPES}, got {x.dtype}")
    if expert_ids.dtype.is_floating_point:
        raise ValueError(f"moe_experts: expert_ids must be integer, got {expert_ids.dtype}")
    if w1.dtype != w3.dtype or scales[0].dtype != scales[2].dtype:
        raise ValueError(
            f"moe_experts: w1 and w3 must share a format, got {w1.dtype} / {w3.dtype} with scales {scales[0].dtype} / {scales[2].dtype}"
        )
    for name, w in (("w1", w1), ("w2", w2), ("w3", w3)):
        if w.stride(-1) != 1:
            raise ValueError(f"moe_experts: {name} must be contiguous along its inputs")


@dataclass(frozen=True)
class ScaledLaunch:
    """What the launches of one call share, whichever kernels compute the products: the
    quantised activations, the pairs grouped by expert, the buffers between the kernels and the
    gate/up product's K split (with its scratch and arrival counters)."""

    xq: torch.Tensor  # act_quant(x): e4m3 values [B, D] (fp16 in fragment order for the Gluon product)
    xs: torch.Tensor  # and their scales [B, D / 128]
    segments: PairBlocks
    route_w: torch.Tensor  # routing weights, flat fp32
    hq: torch.Tensor  # act_quant of the weighted SwiGLU: [pairs, I], as xq
    hs: torch.Tensor  # fp32 [pairs, I / 128]
    y: torch.Tensor  # each pair's down product [pairs, D], x's dtype
    scales: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # as the kernels read them (_kernel_scale)
    split: int
    partials: torch.Tensor  # [split, pairs, 2, I] fp32 where split > 1
    counters: torch.Tensor
    picks: int
    pairs_per_token: int


@triton.jit
def _route_and_quant_kernel(
    ids_ptr, shift_ptr, sorted_pair_ptr, block_expert_ptr, block_rows_ptr,
    num_pairs, num_experts, num_blocks, shared_expert,
    x_ptr, values_ptr, scales_ptr, K_BLOCKS, stride_xm, CHUNKS,
    BLOCK_M: tl.constexpr, PAIRS: tl.constexpr, EXPERTS: tl.constexpr, BLOCKS_PER_STEP: tl.constexpr,
    PICKS: tl.constexpr, PAIRS_PER_TOKEN: tl.constexpr, POW2: tl.constexpr, BLOCKS: tl.constexpr,
    ORDER: tl.constexpr,
    DEPENDENT: tl.constexpr = False,
):
    """Program 0 routes the pairs (_route_pairs_kernel); program 1 + r * CHUNKS + c quantises
    chunk c of x's row r (act_quant_program): two independent steps, one launch."""
    wait_for_predecessor(DEPENDENT)
    pid = tl.program_id(0)
    if pid == 0:
        _route_pairs_kernel(ids_ptr, shift_ptr, sorted_pair_ptr, block_expert_ptr, block_rows_ptr,
                            num_pairs, num_experts, num_blocks, shared_expert,
                            BLOCK_M, PAIRS, EXPERTS, BLOCKS_PER_STEP, PICKS, PAIRS_PER_TOKEN)
    else:
        act_quant_program(x_ptr, values_ptr, scales_ptr, (pid - 1) // CHUNKS, (pid - 1) % CHUNKS, K_BLOCKS, stride_xm,
                          POW2, BLOCKS, ORDER)


def route_and_quantise(x: torch.Tensor, expert_ids: torch.Tensor, num_experts: int, block_m: int, shared_expert: int,
                       pow2: bool, values_order: str = "e4m3") -> tuple[PairBlocks, torch.Tensor, torch.Tensor]:
    """route_pairs(expert_ids, ...) and act_quant_triton(x, pow2, values_order), bit for bit, in
    one launch where the routing is one program's (at decode: one kernel less a layer); else the
    two calls."""
    if not routes_in_one_program(expert_ids, shared_expert):
        return (route_pairs(expert_ids, num_experts, block_m, "auto", shared_expert),
                *act_quant_triton(x, pow2, values_order))
    blocks, route_args, route_meta = routing_launch(expert_ids, num_experts, block_m, shared_expert)
    x, values, scales, chunks = act_quant_launch(x, values_order)
    _route_and_quant_kernel[(1 + x.shape[0] * chunks,)](
        *route_args, x, values, scales, scales.shape[1], x.stride(0), chunks,
        **route_meta, POW2=pow2, BLOCKS=BLOCKS_PER_PROGRAM, ORDER=values_order, num_warps=4,
        **dependent_options(x.device),
    )
    return blocks, values, scales


def prepare_launch(x, expert_ids, expert_weights, w1, scales, shared_expert, pow2, tiles, partial_tiles=False,
                   values_order="e4m3") -> ScaledLaunch:
    """The routing, the activations' quantisation and the buffers of one call (batch > 0);
    partial_tiles: the gate/up scratch and arrival counters even without a K split;
    values_order: how xq and hq are stored (kernels/blockscale/act_quant_pass.py): e4m3, or in
    the order the Gluon product reads them ("mma", "wgmma")."""
    batch, dim = x.shape
    picks = expert_ids.shape[1]
    pairs_per_token = picks + (shared_expert >= 0)
    num_experts, inter = w1.shape[:2]
    num_pairs = batch * pairs_per_token
    segments, xq, xs = route_and_quantise(x, expert_ids, num_experts, SEGMENT_ROWS, shared_expert, pow2, values_order)
    k_blocks = dim // FP8_BLOCK
    per_split = triton.cdiv(k_blocks, min(max(1, tiles.up_split), k_blocks))
    split = triton.cdiv(k_blocks, per_split)  # no split left without blocks
    hq = values_buffer(num_pairs, inter, values_order, x.device)
    partials, counters = hq, hq  # unused without a split or partial_tiles
    if split > 1 or partial_tiles:
        partials = torch.empty((split, num_pairs, 2, inter), dtype=torch.float32, device=x.device)
        counters = split_counters(x.device, segments.num_blocks * (inter // UP_BLOCK_N))
    return ScaledLaunch(
        xq=xq, xs=xs, segments=segments,
        route_w=expert_weights.reshape(-1).to(torch.float32).contiguous(),
        hq=hq, hs=torch.empty((num_pairs, inter // FP8_BLOCK), dtype=torch.float32, device=x.device),
        y=torch.empty((num_pairs, dim), dtype=x.dtype, device=x.device),
        scales=tuple(_kernel_scale(s) for s in scales), split=split, partials=partials, counters=counters,
        picks=picks, pairs_per_token=pairs_per_token,
    )


def scaled_experts(x, expert_ids, w1, w2, w3, scales, shared_expert, tiles, prepare, launch_products,
                   choose_tiles=choose_scaled_tiles, shared_weights: SharedExpertWeights | None = None,
                   pow2: bool = True, swiglu_limit: float = 0.0, shared_after_routing: bool = True) -> torch.Tensor:
    """The steps every product path shares around its launches: checks, tiles (the product's
    `choose_tiles` unless given), `prepare(ids, tiles)` (the routing and quantisation:
    prepare_launch), `launch_products(run, tiles)` (the gate/up and down kernels, filling run.y),
    and the combine. With `shared_weights` (a shared expert of its own format) its products run
    on a side stream beside the launches (kernels/side_stream.py: at small batches the routed
    experts leave SMs idle) and the combine adds its output last. The side stream forks after
    the routing (`shared_after_routing`), whose few programs would otherwise wait for SMs behind
    the shared expert's first product. [B, D] fp32."""
    _check_formats(x, expert_ids, w1, w2, w3, scales)
    check_shared_expert(shared_expert, w1.shape[0])
    batch, dim = x.shape
    out = torch.empty((batch, dim), dtype=torch.float32, device=x.device)
    pairs_per_token = expert_ids.shape[1] + (shared_expert >= 0)
    if batch == 0 or pairs_per_token == 0:
        out.zero_()
        return out if shared_weights is None else out.add_(shared_expert_triton(x, shared_weights, swiglu_limit, pow2))
    if tiles is None:
        tiles = choose_tiles(batch * pairs_per_token, w1.shape[0], dim, w1.shape[1], num_sms(x.device))
    ids = expert_ids.contiguous()
    shared = None
    if shared_weights is None:
        run = prepare(ids, tiles)
        launch_products(run, tiles)
    elif shared_after_routing:
        run = prepare(ids, tiles)
        shared, _ = run_beside(lambda: shared_expert_triton(x, shared_weights, swiglu_limit, pow2),
                               lambda: launch_products(run, tiles), x.device)
    else:
        def routed() -> ScaledLaunch:
            run = prepare(ids, tiles)
            launch_products(run, tiles)
            return run

        shared, run = run_beside(lambda: shared_expert_triton(x, shared_weights, swiglu_limit, pow2), routed, x.device)
    return combine_pairs(run.y, ids, out, w1.shape[0], pairs_per_token, addend=shared)


def moe_experts_scaled_triton(
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
    shared_weights: SharedExpertWeights | None = None,
    shared_after_routing: bool = True,
) -> torch.Tensor:
    """Weighted sum of each token's block-scaled experts, [B, D] fp32 (arguments as
    moe_experts_reference with `scales`; shapes checked by check_moe_inputs). Expert ids outside
    [0, E) contribute nothing. `tiles` overrides choose_scaled_tiles (tuning and tests); its
    product "mma" is kernels/moe/scaled_gluon.py's. shared_after_routing: scaled_experts'."""

    def prepare(ids: torch.Tensor, tiles: ScaledTiles) -> ScaledLaunch:
        if tiles.product not in TRITON_PRODUCTS:
            raise ValueError(f"moe_experts (triton): product must be one of {TRITON_PRODUCTS}, got {tiles.product!r}")
        return prepare_launch(x, ids, expert_weights, w1, scales, shared_expert, pow2, tiles)

    def launch_products(run: ScaledLaunch, tiles: ScaledTiles) -> None:
        num_experts, inter = w1.shape[:2]
        dim = x.shape[1]
        segments = run.segments
        s1, s2, s3 = run.scales
        launch = dict(num_warps=tiles.num_warps, num_stages=tiles.num_stages, **dependent_options(x.device))
        mx = tiles.product == "dot_scaled"
        _scaled_gate_up_kernel[(segments.num_blocks * (inter // UP_BLOCK_N), run.split)](
            x, run.xq, run.xs, w1, s1, w3, s3, run.route_w, run.hq, run.hs,
            segments.sorted_pair, segments.block_expert, segments.block_rows, run.partials, run.counters,
            run.hq.shape[0] * 2 * inter, dim, inter, float(swiglu_limit),
            *w1.stride(), *s1.stride(), *w3.stride(), *s3.stride(),
            PICKS=run.picks, PAIRS_PER_TOKEN=run.pairs_per_token, HAS_LIMIT=swiglu_limit > 0, POW2=pow2,
            W_FP4=w1.dtype == torch.uint8, S_E8M0=s1.dtype == torch.uint8, MX=mx, SEGMENT=SEGMENT_ROWS, SPLIT=run.split,
            **launch,
        )
        _scaled_down_kernel[(segments.num_blocks * (dim // tiles.down_block_n),)](
            run.hq, run.hs, w2, s2, run.y,
            segments.sorted_pair, segments.block_expert, segments.block_rows,
            dim, inter,
            *w2.stride(), *s2.stride(), run.y.stride(0),
            W_FP4=w2.dtype == torch.uint8, S_E8M0=s2.dtype == torch.uint8, MX=mx, SEGMENT=SEGMENT_ROWS,
            BLOCK_N=tiles.down_block_n, **launch,
        )

    return scaled_experts(x, expert_ids, w1, w2, w3, scales, shared_expert, tiles, prepare, launch_products,
                          shared_weights=shared_weights, pow2=pow2, swiglu_limit=swiglu_limit,
                          shared_after_routing=shared_after_routing)
