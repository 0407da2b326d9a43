"""Gluon products of the block-scaled routed experts (kernels/moe/scaled.py, product "mma"): FP4
weights (e2m1 codes two a byte, low nibble first, one ue8m0 or fp32 scale per 32 inputs) decoded
into the registers of the tensor-core instruction (mma.sync m16n8k16: fp16 operands, fp32
accumulation). The routing, the activations' quantisation, the split-K arrival, the SwiGLU
epilogue and the combine are scaled.py's.

At decode a routed expert is a grouped GEMV: the time goes to moving and decoding the codes, so
both are laid out for the instruction rather than for the dot of a generic tile.

- Every pipeline stage's bytes (codes, their scales, the activations and their scales: one or
  two 128-input blocks) reach shared memory by cp.async, 16 bytes a thread and whole sectors,
  STAGES - 1 stages ahead of the one multiplied. With two blocks a stage a weight row's codes
  move 128 contiguous bytes at a time, its two 64-byte runs on neighbouring threads (WIDE_BLOCKS).
  Reading the fragments straight from global memory (4 bytes a thread, half of each sector)
  kept the L1 busy and left nothing in flight while a step computed.
- The instruction's K order within a 32-input scale group is free as long as the weights and
  the activations share it. Thread q of a quad takes inputs [8q, 8q + 8) of every group: 4 bytes
  of codes a row (one 32-bit shared-memory read), which its A fragment holds as k-slots
  {2q, 2q+1, 2q+8, 2q+9} of the group's two 16-wide steps, and the same 8 activation values (one
  128-bit read) for its B fragment. The shared-memory swizzles keep those reads free of bank
  conflicts; `convert_layout(..., assert_trivial=True)` checks when it compiles that no value
  moves between threads.
- Gate/up program (segment, w1 or w3, 64 of a 128-column tile's columns, K split): 4 warps, each
  16 of the 64 columns; the instruction's N is 8 of the segment's pairs at a time. Its partials
  go to a scratch; the last of the tile's programs to arrive (four a split: w1 and w3, two
  halves each) sums them in split order and runs the epilogue on the whole activation block.
  One program for both matrices over 128 columns held four accumulators' worth of registers,
  two programs an SM, and measured 1.1x slower. The down product: 64 columns, K whole.
- Decoding: a byte's two codes become the high bytes of two fp16 values (sign to bit 15,
  exponent and mantissa bits to bits 11..9: 2^-14 times the code's value, exact, the subnormal
  0.5 included) by shifts, masks and byte permutes, no conversion instruction; the 2^14 is
  undone once, on the product's sums. A ue8m0 scale is its byte shifted into an fp32's exponent
  field, two instructions (Triton's integer casts packed the bytes into 16-bit halves and back:
  244 instructions a step against 203, sm_90).
- The activations arrive quantised as fp16 in fragment order (kernels/blockscale/act_quant_pass.py:
  the e4m3 values exactly, each 8 in the order a thread's registers take them), written so by the
  quantisation of x and by the gate/up epilogue: one 16-byte read fills a step's B fragments,
  with no conversion, byte permute or move (against e4m3 bytes converted in the loop: 1.03x,
  1.09x, 1.07x faster at batch 1, 16, 64 on an H100; docs/results.md).
- Each group's product is scaled by its weight scales in fp32, each 128 inputs by the
  activations' scales: scaled.py's arithmetic in another summation order.

On Hopper the same programs can multiply on the warpgroup instruction (`ScaledTiles.product`
"wgmma": wgmma m64n8k32, e4m3 operands, one per scale group): each code decoded to the e4m3
byte of 2^-6 times its value (7 instructions for 8 codes against 11 for fp16), A from those
registers, B the group's activations straight from shared memory, stored in the order the
decoding leaves the codes' k-slots (act_quant_pass.py's "wgmma").

The op takes it on sm_89 or newer (the Triton products elsewhere); CUDA only (inline PTX: no
interpreter path).
"""
from __future__ import annotations

import dataclasses

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait
from triton.language.extra.cuda import gdc_wait

from kernels.arrival import arrives_last
from kernels.blockscale.ref import FP4_BLOCK, FP8_BLOCK
from kernels.dependent_launch import dependent_options, wait_for_predecessor
from kernels.gluon_compat import async_load, barrier
from kernels.moe.ref import SharedExpertWeights
from kernels.moe.scaled import (
    SEGMENT_ROWS, UP_BLOCK_N, ScaledLaunch, ScaledTiles, choose_scaled_tiles, gate_up_epilogue,
    partial_rows, prepare_launch, scaled_experts, summed_partials,
)
from kernels.triton_util import MIN_BLOCKS_PER_SPLIT, converts_e4m3, launches_dependents

WARPS = 4
STEP = FP8_BLOCK  # inputs per step: one activation block, four FP4 scale groups
# Output columns per down program: twice the programs of 128 for the few experts picked at batch 1.
DOWN_N = 64
# Columns per gate/up program, of one of w1 and w3: a program of both over the tile's 128 took
# twice the registers (two programs an SM instead of four) and measured 1.1x slower at every batch.
GATE_UP_N = 64
GATE_UP_PARTS = 2 * UP_BLOCK_N // GATE_UP_N  # programs of a tile and split: w1 and w3, each in parts
# Programs an SM (`ScaledTiles.programs_per_sm`) a launch may bound its registers for: at most 255
# registers a thread, at least 64.
PROGRAMS_PER_SM_RANGE = (2, 8)
# Steps in shared memory at a time (STAGES - 1 copied ahead of the one multiplied),
# `ScaledTiles.num_stages` of these products: about 5 KB a step, four programs an SM (as their
# registers allow). Programs in one wave (few experts picked) take the shallow pipeline; where
# they fill several waves the deep one, with the gate/up K split in two (H100, 256 experts:
# batch 16 537.7 -> 495.8 us, batch 64 1213.9 -> 1165.7; at batch 1 both deeper and split
# measured slower). Ten stages take more registers than four programs an SM leave.
PIPELINE_STAGES = 4
DEEP_PIPELINE_STAGES = 8
# Two blocks a stage where every K range holds an even count of them (`ScaledTiles.
# blocks_per_stage`): each weight row's codes are then read 128 contiguous bytes at a time, where
# 64-byte runs a row left DRAM bandwidth unused (a read-only kernel of the same pattern: 78% of
# copy bandwidth at 64 bytes, 105% at 128; the product 1.09x, 1.09x, 1.08x faster at batches 1,
# 16, 64 on an H100). Three such stages measured best at every batch (two to five swept).
WIDE_BLOCKS = 2
WIDE_STAGES = 3
# The instruction's N: pairs of a segment taken at a time (wider tiles would raise every
# program's registers for the few segments with more pairs).
TOKENS_PER_STEP = 8
# Device-side constants (Gluon reads module globals only as constexprs).
TOKENS = gl.constexpr(TOKENS_PER_STEP)
DOWN_BLOCK_N = gl.constexpr(DOWN_N)
GATE_UP_BLOCK_N = gl.constexpr(UP_BLOCK_N)  # one activation block of h, as scaled.py's
PART_N = gl.constexpr(GATE_UP_N)
UP_PARTS = gl.constexpr(GATE_UP_PARTS)
SEGMENT = gl.constexpr(SEGMENT_ROWS)
BLOCK_K = gl.constexpr(STEP)
FP4_GROUP = gl.constexpr(FP4_BLOCK)
# A byte's two e2m1 codes -> fp16 of 2^-14 times their values: each code's sign and three bits
# placed in a byte as an fp16's high byte, the low byte zero (pack 4: four bytes in $4; low codes
# to $0, $1, high codes to $2, $3, in byte order).
_E2M1_TO_FP16 = gl.constexpr("""{
.reg .b32 l, h, t, z;
mov.b32 z, 0;
shl.b32 t, $4, 4;
and.b32 t, t, 0x80808080;
shl.b32 l, $4, 1;
and.b32 l, l, 0x0E0E0E0E;
or.b32 l, l, t;
shr.b32 t, $4, 3;
and.b32 t, t, 0x0E0E0E0E;
and.b32 h, $4, 0x80808080;
or.b32 h, h, t;
prmt.b32 $0, l, z, 0x1404;
prmt.b32 $1, l, z, 0x3424;
prmt.b32 $2, h, z, 0x1404;
prmt.b32 $3, h, z, 0x3424;
}""")
@gluon.constexpr_function
def mma_layout(wgmma: bool = False) -> gl.NVMMADistributedLayout:
    """The products' accumulators: mma.sync's, or the warpgroup instruction's (its K one scale
    group of e4m3). Either way a warp holds 16 rows of a program's 64."""
    if wgmma:
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, TOKENS_PER_STEP, FP4_BLOCK])
    return gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, 8])


@gluon.constexpr_function
def values_order(wgmma: bool) -> str:
    """How the product reads the quantised activations (kernels/blockscale/act_quant_pass.py)."""
    return "wgmma" if wgmma else "mma"


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
def scales_layout(block_n: int) -> gl.DistributedLinearLayout:
    """[block_n rows, 4 groups] of weight scales: each thread holds the 4 groups of the rows its
    accumulator holds (the rows of SliceLayout(1, mma_layout())), in consecutive registers."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [8, 0]] + [[64 << i, 0] for i in range((block_n // 64).bit_length() - 1)],
        lane_bases=[[0, 0], [0, 0], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[block_n, 4],
    )


@gluon.constexpr_function
def values_layout(tokens: int) -> gl.DistributedLinearLayout:
    """[128 positions, tokens] of activations (fp16 in fragment order): thread (r, q) holds
    positions 32g + 8q + p (p < 8, every group g; p in consecutive registers: 128-bit loads) of
    token r, every 8 tokens; every warp the same."""
    return gl.DistributedLinearLayout(
        reg_bases=[[1, 0], [2, 0], [4, 0], [32, 0], [64, 0]] + [[0, 8 << i] for i in range((tokens // 8).bit_length() - 1)],
        lane_bases=[[8, 0], [16, 0], [0, 1], [0, 2], [0, 4]],
        warp_bases=[[0, 0], [0, 0]], block_bases=[], shape=[STEP, tokens],
    )


@gluon.constexpr_function
def copy_layout(vector: int, lanes_per_row: int) -> gl.BlockedLayout:
    """Copies into shared memory: `vector` consecutive elements a thread (16 bytes at most),
    `lanes_per_row` threads a row, warps stacked over the rows."""
    return gl.BlockedLayout(size_per_thread=[1, vector], threads_per_warp=[32 // lanes_per_row, lanes_per_row],
                            warps_per_cta=[WARPS, 1], order=[1, 0])


@gluon.constexpr_function
def codes_copy_layout(blocks: int, block_n: int) -> gl.DistributedLinearLayout:
    """Copies of a stage's codes [blocks * block_n, 64 bytes] (its blocks' rows stacked): 16
    bytes a thread, the `blocks` 64-byte runs of a weight row on consecutive threads (one run of
    64 * blocks bytes in memory), then rows across threads, warps and registers."""
    row_bits = [[1 << i, 0] for i in range(block_n.bit_length() - 1)]
    lanes = [[0, 16], [0, 32]] + ([[block_n, 0]] if blocks == 2 else [])
    spare = 5 - len(lanes)
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8]] + row_bits[spare + 2:],
        lane_bases=lanes + row_bits[:spare], warp_bases=row_bits[spare:spare + 2], block_bases=[],
        shape=[blocks * block_n, STEP // 2],
    )


@gluon.constexpr_function
def epilogue_layout(block_n: int = 128) -> gl.BlockedLayout:
    """[pairs, block_n columns]: a row's columns across a warp, block_n / 32 a thread."""
    return gl.BlockedLayout(size_per_thread=[1, block_n // 32], threads_per_warp=[1, 32], warps_per_cta=[WARPS, 1], order=[1, 0])


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
    (2^-14 times the values). Byte 16g + 4q + 2h + n holds inputs 32g + 8q + 4h + 2n (low nibble)
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
    """Activations [128, TOKENS] (values_layout, fp16 in fragment order) -> the four groups' B
    fragments [32, TOKENS] fp16: input 32g + 8q + 4h + 2n + s at k-slot 16s + 8h + 2q + n, as
    _weight_groups."""
    b_op: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    # Position 4s + 2h + n of a thread's 8 holds input 4h + 2n + s: the register pair of each
    # 16-wide step (h = 0, 1) is consecutive.
    v = values.reshape([4, 4, 2, 2, 2, TOKENS]).permute(0, 2, 3, 1, 4, 5).reshape([4, 32, TOKENS])
    v0, v1, v2, v3 = _groups(v.permute(1, 2, 0).reshape([32, TOKENS, 2, 2]))
    return (gl.convert_layout(v0, b_op, assert_trivial=True), gl.convert_layout(v1, b_op, assert_trivial=True),
            gl.convert_layout(v2, b_op, assert_trivial=True), gl.convert_layout(v3, b_op, assert_trivial=True))


# Four ue8m0 bytes ($4) -> the fp32s 2^(e - 127) ($0..$3, in byte order): each byte shifted into
# the exponent field and masked there (255, NaN's byte, becomes infinity; 0 becomes 0 where it
# is 2^-127).
_E8M0_TO_SCALE = gl.constexpr("{\n.reg .b32 t;\n" + "".join(
    f"{'shl' if i < 3 else 'shr'}.b32 t, $4, {23 - 8 * i if i < 3 else 1};\nand.b32 ${i}, t, 0x7F800000;\n" for i in range(4)
) + "}")
# The decoded codes are 2^-14 times their values: a product's sums are scaled back once, at its end.
CODES_UNSCALE = gl.constexpr(16384.0)


@gluon.jit
def _code_scale(s, S_E8M0: gl.constexpr):
    """Loaded weight scales as fp32: ue8m0 byte e is 2^(e - 127), the fp32 with exponent field e
    (one asm call a row: its four groups are consecutive registers, scales_layout)."""
    if S_E8M0:
        return gl.inline_asm_elementwise(_E8M0_TO_SCALE, "=r,=r,=r,=r,r", [s], dtype=gl.float32, is_pure=True, pack=4)
    else:
        return s


@gluon.jit
def _group_product(w, v, s, BLOCK_N: gl.constexpr, TOKENS: gl.constexpr, MMA: gl.constexpr):
    """One scale group's product [BLOCK_N, TOKENS] fp32, times the columns' weight scales s."""
    return mma_v2(w, v, gl.zeros([BLOCK_N, TOKENS], gl.float32, MMA)) * s[:, None]


@gluon.jit
def _block_product(codes, v0, v1, v2, v3, scales, S_E8M0: gl.constexpr, BLOCK_N: gl.constexpr, TOKENS: gl.constexpr):
    """128 inputs of one weight: its four groups' products, each times its weight scales
    (scales: [BLOCK_N, 4] as stored, scales_layout)."""
    MMA: gl.constexpr = mma_layout()
    s = _code_scale(scales, S_E8M0)
    s0, s1, s2, s3 = _groups(s.reshape([BLOCK_N, 2, 2]))
    w0, w1, w2, w3 = _weight_groups(codes, BLOCK_N, MMA)
    rows: gl.constexpr = gl.SliceLayout(1, MMA)
    block = _group_product(w0, v0, gl.convert_layout(s0, rows, assert_trivial=True), BLOCK_N, TOKENS, MMA)
    block += _group_product(w1, v1, gl.convert_layout(s1, rows, assert_trivial=True), BLOCK_N, TOKENS, MMA)
    block += _group_product(w2, v2, gl.convert_layout(s2, rows, assert_trivial=True), BLOCK_N, TOKENS, MMA)
    block += _group_product(w3, v3, gl.convert_layout(s3, rows, assert_trivial=True), BLOCK_N, TOKENS, MMA)
    return block


# A byte's two e2m1 codes -> the e4m3 bytes of 2^-6 times their values (sign to bit 7, exponent
# and mantissa bits to bits 4..2: exact, the subnormal 0.5 included; pack 4: four bytes in $2,
# the low codes to $0 and the high codes to $1, in byte order).
_E2M1_TO_E4M3 = gl.constexpr("""{
.reg .b32 t, u;
shl.b32 t, $2, 4;
and.b32 t, t, 0x80808080;
shl.b32 u, $2, 2;
and.b32 u, u, 0x1C1C1C1C;
or.b32 $0, u, t;
shr.b32 t, $2, 2;
and.b32 t, t, 0x1C1C1C1C;
and.b32 u, $2, 0x80808080;
or.b32 $1, u, t;
}""")
# The decoded e4m3 codes are 2^-6 times their values.
E4M3_CODES_UNSCALE = gl.constexpr(64.0)


@gluon.jit
def _e4m3_weight_group(packed, BLOCK_N: gl.constexpr, MMA: gl.constexpr):
    """One scale group's codes [BLOCK_N, 16 bytes] -> the warpgroup instruction's A operand
    [BLOCK_N, 32] e4m3. Byte 4t + j holds inputs 8t + 2j (low nibble) and + 1 (high); the operand
    takes nibble s at k-slot 16s + 4t + j, so that each of the two registers a 4-byte run decodes
    into holds 4 consecutive k-slots (the activations wait in shared memory in that order)."""
    a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=4)
    low, high = gl.inline_asm_elementwise(
        _E2M1_TO_E4M3, "=r,=r,r", [packed], dtype=(gl.float8e4nv, gl.float8e4nv), is_pure=True, pack=4
    )
    w = gl.join(low, high).reshape([BLOCK_N, 4, 4, 2])  # (row, t, j, s)
    w = w.permute(0, 3, 1, 2).reshape([BLOCK_N, 32])  # (row, slot 16s + 4t + j)
    return gl.convert_layout(w, a_op, assert_trivial=True)


@gluon.jit
def _wgmma_block_product(codes, values_smem, tile, scales, S_E8M0: gl.constexpr, BLOCK_N: gl.constexpr,
                         TOKENS: gl.constexpr):
    """_block_product on the warpgroup instruction: each group's codes decoded to e4m3 and
    multiplied by its activations, rows [(tile + g) * TOKENS, + TOKENS) of values_smem (a step's
    [TOKENS, 32] tiles stacked), all four in flight at once, then each times its weight scales."""
    MMA: gl.constexpr = mma_layout(True)
    rows: gl.constexpr = gl.SliceLayout(1, MMA)
    s = _code_scale(scales, S_E8M0)
    s0, s1, s2, s3 = _groups(s.reshape([BLOCK_N, 2, 2]))
    c0, c1, c2, c3 = _groups(codes.reshape([BLOCK_N, 4, 16]).permute(0, 2, 1).reshape([BLOCK_N, 16, 2, 2]))
    zero = gl.zeros([BLOCK_N, TOKENS], gl.float32, MMA)
    # Each group decoded just before its instruction, so the next decoding overlaps it.
    w0 = _e4m3_weight_group(c0, BLOCK_N, MMA)
    p0 = warpgroup_mma(w0, values_smem.slice(tile * TOKENS, TOKENS).permute((1, 0)), zero, use_acc=False, is_async=True)
    w1 = _e4m3_weight_group(c1, BLOCK_N, MMA)
    p1 = warpgroup_mma(w1, values_smem.slice((tile + 1) * TOKENS, TOKENS).permute((1, 0)), zero, use_acc=False, is_async=True)
    w2 = _e4m3_weight_group(c2, BLOCK_N, MMA)
    p2 = warpgroup_mma(w2, values_smem.slice((tile + 2) * TOKENS, TOKENS).permute((1, 0)), zero, use_acc=False, is_async=True)
    w3 = _e4m3_weight_group(c3, BLOCK_N, MMA)
    p3 = warpgroup_mma(w3, values_smem.slice((tile + 3) * TOKENS, TOKENS).permute((1, 0)), zero, use_acc=False, is_async=True)
    p0, p1, p2, p3 = warpgroup_mma_wait(0, deps=[p0, p1, p2, p3])
    block = p0 * gl.convert_layout(s0, rows, assert_trivial=True)[:, None]
    block += p1 * gl.convert_layout(s1, rows, assert_trivial=True)[:, None]
    block += p2 * gl.convert_layout(s2, rows, assert_trivial=True)[:, None]
    block += p3 * gl.convert_layout(s3, rows, assert_trivial=True)[:, None]
    return block


@gluon.jit
def _issue_weights(stage, codes_smem, scales_smem, w_ptr, s_ptr, code_offs, scale_offs, step, live, BLOCKS: gl.constexpr):
    """Start the weight copies of step `step` (BLOCKS 128-input blocks from the program's first)
    into slot `stage`: the codes (one copy for the blocks: each row's run of 64 * BLOCKS bytes)
    and a block at a time their scales. `live` false (a step past the end) copies nothing and
    fills the slot with zeros; None: the step is known to exist, no mask. Offsets in 32 bits (an
    expert's weight is under 2 GB), added to the pointers here."""
    first = step * BLOCKS
    async_load(codes_smem.index(stage), w_ptr + (code_offs + first * (BLOCK_K // 2)), mask=live)
    for b in gl.static_range(BLOCKS):
        async_load(scales_smem.index(stage * BLOCKS + b), s_ptr + (scale_offs + (first + b) * 4), mask=live)


@gluon.jit
def _issue_values(stage, values_smem, a_scale_smem, a_ptr, a_scale_ptr, value_offs, value_ok, a_scale_offs, a_scale_ok,
                  step, live, BLOCKS: gl.constexpr, WGMMA: gl.constexpr):
    """Start the copies of step `step`'s activations and their scales into slot `stage` (`live`
    as _issue_weights'), then close the step's copy group (with whatever weight copies were
    started before). WGMMA: the step's values in one copy, a [TOKENS, 32] tile a scale group."""
    first = step * BLOCKS
    if live is not None:
        value_ok = value_ok & live
        a_scale_ok = a_scale_ok & live
    if WGMMA:
        async_load(values_smem.index(stage), a_ptr + (value_offs + first * BLOCK_K), mask=value_ok)
    for b in gl.static_range(BLOCKS):
        slot = stage * BLOCKS + b
        if not WGMMA:
            async_load(values_smem.index(slot), a_ptr + (value_offs + (first + b) * BLOCK_K), mask=value_ok)
        async_load(a_scale_smem.index(slot), a_scale_ptr + (a_scale_offs + first + b), mask=a_scale_ok)
    async_copy.commit_group()


@gluon.jit
def _stage_products(acc, stage, codes_smem, scales_smem, values_smem, a_scale_smem, S_E8M0: gl.constexpr,
                    BLOCK_N: gl.constexpr, TOKENS: gl.constexpr, BLOCKS: gl.constexpr, WGMMA: gl.constexpr):
    """acc plus the products of the step in slot `stage`: its BLOCKS blocks, each scaled by the
    activations' scales."""
    MMA: gl.constexpr = mma_layout(WGMMA)
    for b in gl.static_range(BLOCKS):
        a_scale = a_scale_smem.index(stage * BLOCKS + b).load(gl.SliceLayout(0, MMA))
        codes = codes_smem.index(stage).slice(b * BLOCK_N, BLOCK_N).load(codes_layout(BLOCK_N))
        scales = scales_smem.index(stage * BLOCKS + b).load(scales_layout(BLOCK_N))
        if WGMMA:
            block = _wgmma_block_product(codes, values_smem.index(stage), b * (BLOCK_K // FP4_GROUP), scales, S_E8M0,
                                         BLOCK_N, TOKENS)
        else:
            values = values_smem.index(stage * BLOCKS + b).permute([1, 0]).load(values_layout(TOKENS))
            v0, v1, v2, v3 = _value_groups(values, TOKENS, MMA)
            block = _block_product(codes, v0, v1, v2, v3, scales, S_E8M0, BLOCK_N, TOKENS)
        acc += block * a_scale[None, :]
    return acc


@gluon.jit
def _wait_for_step(STAGES: gl.constexpr, WGMMA: gl.constexpr):
    """Wait until every thread's copies of the step STAGES - 2 groups back have landed (and,
    for the warpgroup instruction, are visible to its reads of shared memory)."""
    async_copy.wait_group(STAGES - 2)
    if WGMMA:
        fence_async_shared()
    barrier()  # everyone's, and everyone is done reading the slot refilled next


@gluon.jit
def _refill_and_multiply(acc, step, stage, refill, codes_smem, scales_smem, values_smem, a_scale_smem, w_ptr, s_ptr,
                         code_offs, scale_offs, a_ptr, a_scale_ptr, value_offs, value_ok, a_scale_offs, a_scale_ok,
                         S_E8M0: gl.constexpr, BLOCK_N: gl.constexpr, TOKENS: gl.constexpr, STAGES: gl.constexpr,
                         BLOCKS: gl.constexpr, WGMMA: gl.constexpr):
    """One pipeline step that has a step STAGES - 1 ahead to copy: wait for `step`'s copies (slot
    `stage`), start the later step's into slot `refill` (the one `step - 1` read), then acc plus
    `step`'s products."""
    _wait_for_step(STAGES, WGMMA)
    later = step + STAGES - 1
    _issue_weights(refill, codes_smem, scales_smem, w_ptr, s_ptr, code_offs, scale_offs, later, None, BLOCKS)
    _issue_values(refill, values_smem, a_scale_smem, a_ptr, a_scale_ptr, value_offs, value_ok, a_scale_offs, a_scale_ok,
                  later, None, BLOCKS, WGMMA)
    return _stage_products(acc, stage, codes_smem, scales_smem, values_smem, a_scale_smem, S_E8M0, BLOCK_N, TOKENS, BLOCKS,
                           WGMMA)


@gluon.jit
def _fp4_products(
    a_ptr, a_scale_ptr, a_row, row_ok, stride_am, stride_as,
    w_ptr, s_ptr, col0, stride_wn, stride_sn, k_begin, k_end,
    S_E8M0: gl.constexpr, BLOCK_N: gl.constexpr, TOKENS: gl.constexpr, STAGES: gl.constexpr, BLOCKS: gl.constexpr,
    WAIT_FOR_VALUES: gl.constexpr, WGMMA: gl.constexpr,
):
    """[BLOCK_N, TOKENS] fp32: weight rows col0 + [0, BLOCK_N) (w_ptr, s_ptr at the expert) times
    the quantised activation rows a_row ([rows, K] in the product's order: fp16 "mma", or e4m3
    "wgmma" with WGMMA; one scale per 128; row_ok masks the padding) over inputs [k_begin, k_end),
    a multiple of BLOCKS * 128.
    Each step (BLOCKS blocks of 128 inputs) is copied into shared memory STAGES - 1 steps ahead
    of its products. WAIT_FOR_VALUES: launched as a programmatic dependent of the kernel that
    writes the activations; the first steps' weights are copied before waiting for it."""
    MMA: gl.constexpr = mma_layout(WGMMA)
    COPY_CODES: gl.constexpr = codes_copy_layout(BLOCKS, BLOCK_N)
    COPY_SCALES: gl.constexpr = copy_layout(4, 1)
    # A token's 128 values by 16 threads; WGMMA: a step's [TOKENS, 32] tiles stacked, 2 threads a row.
    COPY_VALUES: gl.constexpr = copy_layout(16, 2) if WGMMA else copy_layout(8, 16)
    COPY_ROWS: gl.constexpr = gl.SliceLayout(1, copy_layout(1, 1))
    # Swizzles that keep the fragments' reads free of bank conflicts (codes: a warp reads 4
    # bytes of 8 rows 64 bytes apart; values: 16 bytes of 2 tokens 256 bytes apart; each token's
    # runs of 32 values XORed by its index).
    CODES_SMEM: gl.constexpr = gl.SwizzledSharedLayout(16, 2, 4, [1, 0])
    VALUES_SMEM: gl.constexpr = gl.SwizzledSharedLayout(32, 1, 4, [1, 0])
    PLAIN_SMEM: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    ROWS_SMEM: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    # A stage's codes: its blocks' [BLOCK_N, 64] stacked as rows (the swizzle's period of 8 rows
    # divides BLOCK_N, so each block's view is the one-block layout); the rest a slot a block.
    codes_smem = gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCKS * BLOCK_N, BLOCK_K // 2], CODES_SMEM)
    scales_smem = gl.allocate_shared_memory(s_ptr.dtype.element_ty, [STAGES * BLOCKS, BLOCK_N, 4], PLAIN_SMEM)
    if WGMMA:  # the instruction's operand B: a [TOKENS, 32] tile a scale group, each its own
        GROUP_TILES: gl.constexpr = BLOCKS * (BLOCK_K // FP4_GROUP)
        TILE_SMEM: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=FP4_GROUP, element_bitwidth=8, rank=2)
        values_smem = gl.allocate_shared_memory(a_ptr.dtype.element_ty, [STAGES, GROUP_TILES * TOKENS, FP4_GROUP], TILE_SMEM)
    else:
        values_smem = gl.allocate_shared_memory(a_ptr.dtype.element_ty, [STAGES * BLOCKS, TOKENS, BLOCK_K], VALUES_SMEM)
    a_scale_smem = gl.allocate_shared_memory(gl.float32, [STAGES * BLOCKS, TOKENS], ROWS_SMEM)

    # Offsets of the first block, in the copies' layouts.
    first_block = k_begin // BLOCK_K  # offsets as multiples of a block's, so the copies stay 16 bytes wide
    stacked = gl.arange(0, BLOCKS * BLOCK_N, layout=gl.SliceLayout(1, COPY_CODES))  # block * BLOCK_N + row
    code_bytes = gl.arange(0, BLOCK_K // 2, layout=gl.SliceLayout(0, COPY_CODES))
    code_offs = ((col0 + stacked % BLOCK_N)[:, None] * stride_wn + (first_block + stacked // BLOCK_N)[:, None] * (BLOCK_K // 2)
                 + code_bytes[None, :])
    scale_rows = col0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, COPY_SCALES))
    scale_groups = first_block * 4 + gl.arange(0, 4, layout=gl.SliceLayout(0, COPY_SCALES))
    scale_offs = scale_rows[:, None] * stride_sn + scale_groups[None, :]
    if WGMMA:  # copy row r: token r % TOKENS, inputs 32 * (r // TOKENS) + [0, 32) of the step
        TILES_BY_TOKENS: gl.constexpr = copy_layout(1, TOKENS)
        tiles_by_tokens = gl.zeros([GROUP_TILES, TOKENS], gl.int32, TILES_BY_TOKENS)
        token_rows = gl.reshape(tiles_by_tokens + gl.convert_layout(a_row, gl.SliceLayout(0, TILES_BY_TOKENS))[None, :],
                                [GROUP_TILES * TOKENS])
        token_ok = gl.reshape(tiles_by_tokens + gl.convert_layout(row_ok.to(gl.int32), gl.SliceLayout(0, TILES_BY_TOKENS))[None, :],
                              [GROUP_TILES * TOKENS]) != 0
        tile_rows = gl.arange(0, GROUP_TILES * TOKENS, layout=gl.SliceLayout(1, COPY_VALUES))
        value_rows = gl.convert_layout(token_rows, gl.SliceLayout(1, COPY_VALUES))
        value_ok = gl.convert_layout(token_ok, gl.SliceLayout(1, COPY_VALUES))[:, None]
        value_inputs = gl.arange(0, FP4_GROUP, layout=gl.SliceLayout(0, COPY_VALUES))
        value_offs = (value_rows * stride_am + first_block * BLOCK_K + (tile_rows // TOKENS) * FP4_GROUP)[:, None] + value_inputs[None, :]
    else:
        value_rows = gl.convert_layout(a_row, gl.SliceLayout(1, COPY_VALUES))
        value_ok = gl.convert_layout(row_ok, gl.SliceLayout(1, COPY_VALUES))[:, None]
        value_inputs = first_block * BLOCK_K + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, COPY_VALUES))
        value_offs = value_rows[:, None] * stride_am + value_inputs[None, :]
    a_scale_ok = gl.convert_layout(row_ok, COPY_ROWS)
    a_scale_offs = gl.convert_layout(a_row, COPY_ROWS) * stride_as + first_block

    steps = (k_end - k_begin) // (BLOCKS * BLOCK_K)
    # The first steps' weights are copied before the activations: where the kernel before this
    # one writes them (WAIT_FOR_VALUES), the weights are in flight while it finishes.
    for ahead in gl.static_range(STAGES - 1):
        _issue_weights(ahead, codes_smem, scales_smem, w_ptr, s_ptr, code_offs, scale_offs, ahead, ahead < steps, BLOCKS)
        if not WAIT_FOR_VALUES:
            _issue_values(ahead, values_smem, a_scale_smem, a_ptr, a_scale_ptr, value_offs, value_ok, a_scale_offs,
                          a_scale_ok, ahead, ahead < steps, BLOCKS, WGMMA)
    if WAIT_FOR_VALUES:
        gdc_wait()  # the kernel before this one has finished and its writes are visible
        for ahead in gl.static_range(STAGES - 1):
            _issue_values(ahead, values_smem, a_scale_smem, a_ptr, a_scale_ptr, value_offs, value_ok, a_scale_offs,
                          a_scale_ok, ahead, ahead < steps, BLOCKS, WGMMA)
    acc = gl.zeros([BLOCK_N, TOKENS], gl.float32, MMA)
    # While steps remain to be copied ahead their copies need no `live` mask. Those steps go
    # STAGES at a time, each slot's index known when compiled (its shared-memory addresses
    # immediates, not computed a copy at a time), the rest one at a time; the last STAGES - 1
    # steps copy nothing (an empty group each keeps wait_group's count).
    refilled = gl.maximum(steps - (STAGES - 1), 0)
    rounds = refilled // STAGES
    for r in range(rounds):
        for s in gl.static_range(STAGES):
            acc = _refill_and_multiply(acc, r * STAGES + s, s, (s + STAGES - 1) % STAGES, codes_smem, scales_smem,
                                       values_smem, a_scale_smem, w_ptr, s_ptr, code_offs, scale_offs, a_ptr, a_scale_ptr,
                                       value_offs, value_ok, a_scale_offs, a_scale_ok, S_E8M0, BLOCK_N, TOKENS, STAGES, BLOCKS,
                                       WGMMA)
    for step in range(rounds * STAGES, refilled):
        acc = _refill_and_multiply(acc, step, step % STAGES, (step + STAGES - 1) % STAGES, codes_smem, scales_smem,
                                   values_smem, a_scale_smem, w_ptr, s_ptr, code_offs, scale_offs, a_ptr, a_scale_ptr,
                                   value_offs, value_ok, a_scale_offs, a_scale_ok, S_E8M0, BLOCK_N, TOKENS, STAGES, BLOCKS,
                                   WGMMA)
    for step in range(refilled, steps):
        _wait_for_step(STAGES, WGMMA)
        async_copy.commit_group()
        acc = _stage_products(acc, step % STAGES, codes_smem, scales_smem, values_smem, a_scale_smem, S_E8M0, BLOCK_N,
                              TOKENS, BLOCKS, WGMMA)
    async_copy.wait_group(0)  # no copy outlives the program's use of its shared memory
    barrier()
    if WGMMA:
        return acc * E4M3_CODES_UNSCALE
    return acc * CODES_UNSCALE


@gluon.jit
def _chunk_pairs(sorted_pair_ptr, segment, first, rows, LAYOUT: gl.constexpr):
    """Pairs [first, first + TOKENS) of a segment and their real-row mask, in LAYOUT (1-D)."""
    offs = first + gl.arange(0, TOKENS, layout=LAYOUT)
    row_ok = offs < rows
    pair = gl.load(sorted_pair_ptr + segment * SEGMENT + offs, mask=row_ok, other=0)
    return pair, row_ok


@gluon.jit
def _mma_gate_up_kernel(
    x_ptr, xq_ptr, xs_ptr, w1_ptr, s1_ptr, w3_ptr, s3_ptr, route_w_ptr, hq_ptr, hs_ptr,
    sorted_pair_ptr, block_expert_ptr, block_rows_ptr, partial_ptr, counter_ptr,
    split_stride, dim, inter, swiglu_limit,
    stride_w1e, stride_s1e, stride_w3e, stride_s3e, stride_wn, stride_sn,
    PICKS: gl.constexpr, PAIRS_PER_TOKEN: gl.constexpr, HAS_LIMIT: gl.constexpr, POW2: gl.constexpr,
    S_E8M0: gl.constexpr, SPLIT: gl.constexpr, STAGES: gl.constexpr, BLOCKS: gl.constexpr, WGMMA: gl.constexpr,
    DEPENDENT: gl.constexpr = False,
):
    """A program: one of w1 (even parts) or w3, PART_N of the tile's 128 columns, one K split
    (grid axis 1: split * UP_PARTS + part). Its partials go to the scratch [SPLIT, pairs, 2,
    inter]; the last of the tile's SPLIT * UP_PARTS programs to arrive sums them in split order
    and runs the epilogue on the whole activation block. DEPENDENT: a programmatic dependent that
    waits for the routing, then lets the down kernel launch (which reads the segments before it
    waits)."""
    wait_for_predecessor(DEPENDENT)
    pid = gl.program_id(0)
    part = gl.program_id(1) % UP_PARTS
    split = gl.program_id(1) // UP_PARTS
    tiles_n = inter // GATE_UP_BLOCK_N
    segment = pid // tiles_n
    tile_n = pid % tiles_n
    expert = gl.load(block_expert_ptr + segment)
    if expert >= 0:  # an unused segment reads no weight
        rows = gl.load(block_rows_ptr + segment)
        at = expert.to(gl.int64)
        if part % 2 == 0:
            w_ptr = w1_ptr + at * stride_w1e
            s_ptr = s1_ptr + at * stride_s1e
        else:
            w_ptr = w3_ptr + at * stride_w3e
            s_ptr = s3_ptr + at * stride_s3e
        per_split = gl.cdiv(dim // (BLOCKS * BLOCK_K), SPLIT) * (BLOCKS * BLOCK_K)
        k_begin = split * per_split
        k_end = gl.minimum(k_begin + per_split, dim)
        col0 = tile_n * GATE_UP_BLOCK_N + (part // 2) * PART_N
        PARTIAL: gl.constexpr = epilogue_layout(PART_N)
        part_cols = col0 + gl.arange(0, PART_N, layout=gl.SliceLayout(0, PARTIAL))
        # TOKENS pairs at a time: a segment with more (rare at decode) reads its strip again, from L2.
        for first in range(0, rows, TOKENS):
            pair, row_ok = _chunk_pairs(sorted_pair_ptr, segment, first, rows, gl.SliceLayout(1, PARTIAL))
            acc = _fp4_products(
                xq_ptr, xs_ptr, pair // PAIRS_PER_TOKEN, row_ok, dim, dim // BLOCK_K,
                w_ptr, s_ptr, col0, stride_wn, stride_sn, k_begin, k_end, S_E8M0, PART_N, TOKENS, STAGES, BLOCKS, False,
                WGMMA,
            )
            acc = gl.convert_layout(acc.permute(1, 0), PARTIAL)
            partial_at = partial_rows(partial_ptr, pair, part_cols, split, split_stride, inter, part % 2)  # w1: gate, w3: up
            gl.store(partial_at, acc, mask=row_ok[:, None])
        # scaled.py's split-K arrival, once for all of the program's chunks.
        counter = counter_ptr + segment * tiles_n + tile_n
        if arrives_last(counter, SPLIT * UP_PARTS):
            EPILOGUE: gl.constexpr = epilogue_layout()
            offs_n = tile_n * GATE_UP_BLOCK_N + gl.arange(0, GATE_UP_BLOCK_N, layout=gl.SliceLayout(0, EPILOGUE))
            for first in range(0, rows, TOKENS):
                pair, row_ok = _chunk_pairs(sorted_pair_ptr, segment, first, rows, gl.SliceLayout(1, EPILOGUE))
                gate, up = summed_partials(partial_ptr, pair, row_ok, offs_n, split_stride, inter, SPLIT)
                gate_up_epilogue(gate, up, x_ptr, route_w_ptr, hq_ptr, hs_ptr, pair // PAIRS_PER_TOKEN, pair, row_ok,
                                 offs_n, tile_n, inter, swiglu_limit, PICKS, PAIRS_PER_TOKEN, HAS_LIMIT, POW2,
                                 values_order(WGMMA))  # hq in the order the down product reads it
            gl.atomic_xchg(counter, 0)


@gluon.jit
def _mma_down_kernel(
    hq_ptr, hs_ptr, w2_ptr, s2_ptr, y_ptr, sorted_pair_ptr, block_expert_ptr, block_rows_ptr,
    dim, inter, stride_we, stride_wn, stride_se, stride_sn, stride_ym,
    S_E8M0: gl.constexpr, STAGES: gl.constexpr, BLOCKS: gl.constexpr, WGMMA: gl.constexpr, DEPENDENT: gl.constexpr,
):
    """A program: DOWN_BLOCK_N output columns of a segment's pairs, K whole. DEPENDENT: launched as
    a programmatic dependent of the gate/up kernel, whose routing inputs (the segments) finished
    before it started: the first weight steps are copied while the gate/up kernel finishes."""
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
            acc = _fp4_products(
                hq_ptr, hs_ptr, pair, row_ok, inter, inter // BLOCK_K,
                w2_ptr, s2_ptr, col0, stride_wn, stride_sn, 0, inter, S_E8M0, DOWN_BLOCK_N, TOKENS, STAGES, BLOCKS,
                DEPENDENT, WGMMA,
            )
            y = gl.convert_layout(acc.permute(1, 0), EPILOGUE)
            y_ptrs = y_ptr + pair.to(gl.int64)[:, None] * stride_ym + offs_n[None, :]
            gl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=row_ok[:, None])


def takes(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor,
          scales: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> bool:
    """Whether the op runs this product: FP4 experts whose widths are whole 128-blocks, laid out
    for the copies (_copyable), on a GPU of sm_89 or newer (not the interpreter)."""
    return (w1.dtype == torch.uint8 and _whole_blocks(x.shape[1], w1.shape[1]) and _copyable(w1, w2, w3, scales)
            and converts_e4m3(x.device))


def _copyable(w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, scales: tuple[torch.Tensor, ...]) -> bool:
    """The copies into shared memory move 16 bytes of a row of codes and a step's 4 scale groups
    at a time: rows contiguous, tensors 16-byte aligned (Triton proves no less for a pointer),
    rows 16 bytes apart (scales 4, one-byte scales 16), and w1 and w3 alike in row strides (one
    offset serves both)."""
    aligned = all(w.stride(-1) == 1 and w.data_ptr() % 16 == 0 and w.stride(1) % 16 == 0 for w in (w1, w2, w3))
    # One-byte scales' 4-byte copies need row strides Triton knows to be multiples of 4: it
    # proves divisibility of an integer argument by 16 only.
    scales_aligned = all(s.stride(-1) == 1 and s.data_ptr() % 16 == 0
                         and (s.stride(1) % 16 == 0 if s.element_size() == 1 else s.stride(1) * s.element_size() % 4 == 0)
                         for s in scales)
    return aligned and scales_aligned and w1.stride(1) == w3.stride(1) and scales[0].stride(1) == scales[2].stride(1)


def _whole_blocks(dim: int, inter: int) -> bool:
    """Widths the product tiles: 128-input steps both ways, gate/up tiles of 128 columns."""
    return dim % STEP == 0 and inter % UP_BLOCK_N == 0


def check_mma_inputs(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor,
                     scales: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
    """What the "mma" product takes: FP4 weights (uint8 codes), widths that are whole 128-blocks,
    rows laid out for the copies."""
    if not (w1.dtype == w2.dtype == w3.dtype == torch.uint8):
        raise ValueError(f"moe_experts (mma): the mma product takes FP4 experts, got {w1.dtype}, {w2.dtype}, {w3.dtype}")
    dim, inter = x.shape[1], w1.shape[1]
    if not _whole_blocks(dim, inter):
        raise ValueError(f"moe_experts (mma): dim ({dim}) and inter ({inter}) must be multiples of {STEP}")
    if not _copyable(w1, w2, w3, scales):
        raise ValueError(
            "moe_experts (mma): the weights and their scales must be contiguous along the inputs, 16-byte aligned, "
            "with rows 16 bytes apart (fp32 scales 4, one-byte scales 16) and w1 and w3 (and their scales) alike in row strides"
        )


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
    shared_weights: SharedExpertWeights | None = None,
    shared_after_routing: bool = True,
) -> torch.Tensor:
    """moe_experts_scaled_triton's result (same arguments) with the products of this module: FP4
    experts on a GPU. The down kernel is a programmatic dependent of the gate/up where the GPU
    allows (`ScaledTiles.dependent_launch`)."""
    check_mma_inputs(x, w1, w2, w3, scales)

    def prepare(ids: torch.Tensor, tiles: ScaledTiles) -> ScaledLaunch:
        if tiles.num_stages < 2:
            raise ValueError(f"moe_experts (mma): num_stages must be at least 2 (one step copied ahead), got {tiles.num_stages}")
        low, high = PROGRAMS_PER_SM_RANGE
        if not low <= tiles.programs_per_sm <= high:
            raise ValueError(f"moe_experts (mma): programs_per_sm must be in [{low}, {high}], got {tiles.programs_per_sm}")
        wgmma = tiles.product == "wgmma"
        if wgmma and not runs_wgmma(x.device):
            raise ValueError(f"moe_experts (mma): the wgmma product runs on sm_90 only, not on {x.device}")
        blocks = tiles.blocks_per_stage
        if wgmma and blocks != WIDE_BLOCKS:
            raise ValueError(f"moe_experts (mma): the wgmma product copies {WIDE_BLOCKS} blocks a stage, got {blocks}")
        if blocks != 1 and not (blocks == WIDE_BLOCKS and wide_stages_fit(x.shape[1], w1.shape[1], tiles.up_split)):
            raise ValueError(
                f"moe_experts (mma): blocks_per_stage must be 1, or {WIDE_BLOCKS} where they divide each K split's "
                f"{STEP}-input blocks (dim {x.shape[1]} in {tiles.up_split} splits, inter {w1.shape[1]}), got {blocks}"
            )
        return prepare_launch(x, ids, expert_weights, w1, scales, shared_expert, pow2, tiles, partial_tiles=True,
                              values_order=values_order(wgmma))

    def launch_products(run: ScaledLaunch, tiles: ScaledTiles) -> None:
        blocks = tiles.blocks_per_stage
        wgmma = tiles.product == "wgmma"
        # A thread's share of an SM's registers: unbounded, either tile took over 128 (three programs an SM).
        registers = {"maxnreg": 65536 // (tiles.programs_per_sm * WARPS * 32)}
        dependent = tiles.dependent_launch and launches_dependents(x.device)
        dim = x.shape[1]
        inter = w1.shape[1]
        segments = run.segments
        s1, s2, s3 = run.scales
        _mma_gate_up_kernel[(segments.num_blocks * (inter // UP_BLOCK_N), run.split * GATE_UP_PARTS)](
            x, run.xq, run.xs, w1, s1, w3, s3, run.route_w, run.hq, run.hs,
            segments.sorted_pair, segments.block_expert, segments.block_rows, run.partials, run.counters,
            run.hq.shape[0] * 2 * inter, dim, inter, float(swiglu_limit),
            w1.stride(0), s1.stride(0), w3.stride(0), s3.stride(0), w1.stride(1), s1.stride(1),
            PICKS=run.picks, PAIRS_PER_TOKEN=run.pairs_per_token, HAS_LIMIT=swiglu_limit > 0, POW2=pow2,
            S_E8M0=s1.dtype == torch.uint8, SPLIT=run.split, STAGES=tiles.num_stages, BLOCKS=blocks, WGMMA=wgmma,
            num_warps=WARPS, **registers, **dependent_options(x.device),
        )
        _mma_down_kernel[(segments.num_blocks * (dim // DOWN_N),)](
            run.hq, run.hs, w2, s2, run.y, segments.sorted_pair, segments.block_expert, segments.block_rows,
            dim, inter, w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1), run.y.stride(0),
            S_E8M0=s2.dtype == torch.uint8, STAGES=tiles.num_stages, BLOCKS=blocks, WGMMA=wgmma, DEPENDENT=dependent,
            num_warps=WARPS,
            **registers, **({"launch_pdl": True} if dependent else {}),
        )

    return scaled_experts(x, expert_ids, w1, w2, w3, scales, shared_expert, tiles, prepare, launch_products, choose_mma_tiles,
                          shared_weights=shared_weights, pow2=pow2, swiglu_limit=swiglu_limit,
                          shared_after_routing=shared_after_routing)


def runs_wgmma(device: torch.device) -> bool:
    """Whether the "wgmma" product runs on `device`: Hopper (compute capability 9.x) has the
    warpgroup instruction, later GPUs not."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


def wide_stages_fit(dim: int, inter: int, up_split: int) -> bool:
    """Whether stages of WIDE_BLOCKS blocks divide every K range: the gate/up product's splits of
    dim and the down product's inter."""
    return (dim // STEP) % (WIDE_BLOCKS * up_split) == 0 and (inter // STEP) % WIDE_BLOCKS == 0


def one_block_mma_tiles(num_pairs: int, num_experts: int, dim: int, inter: int, num_sms: int) -> ScaledTiles:
    """choose_scaled_tiles' down tile, one block a stage. Gate/up programs that fit one wave
    (`ScaledTiles.programs_per_sm` an SM): K split into the most equal parts that keep them in it, each
    at least MIN_BLOCKS_PER_SPLIT blocks (a second, part-filled wave measured slower: batch 1, 6
    experts: 1 way 58.4 us, 2 ways 61.2, 4 ways 60.1), the shallow pipeline. More programs than a
    wave: the deep pipeline and K split in two where the blocks allow (DEEP_PIPELINE_STAGES).
    A full wave of programs sharing the parts' K steps evenly (stream-K: pieces of one or two
    parts each, a scratch slot a piece) measured slower at batch 1: the gate/up kernel 33.7 us
    against 27.0 on an H100, and at batches 2 and 4 too. Its time grows with the experts picked
    (6, 7, 8 at batch 1: 27.0, 33.1, 35.0 us), not with the programs an SM holds."""
    tiles = choose_scaled_tiles(num_pairs, num_experts, dim, inter, num_sms)
    programs = max(1, min(num_pairs, num_experts)) * max(1, inter // UP_BLOCK_N) * GATE_UP_PARTS
    blocks = dim // STEP
    wave = tiles.programs_per_sm * num_sms
    if programs > wave:
        split = 2 if blocks % 2 == 0 and blocks // 2 >= MIN_BLOCKS_PER_SPLIT else 1
        return dataclasses.replace(tiles, up_split=split, num_stages=DEEP_PIPELINE_STAGES)
    split = max(1, min(wave // programs, blocks // MIN_BLOCKS_PER_SPLIT))
    split = next(s for s in range(split, 0, -1) if blocks % s == 0)
    return dataclasses.replace(tiles, up_split=split, num_stages=PIPELINE_STAGES)


def choose_mma_tiles(num_pairs: int, num_experts: int, dim: int, inter: int, num_sms: int) -> ScaledTiles:
    """one_block_mma_tiles' split, with WIDE_STAGES stages of WIDE_BLOCKS blocks where they
    divide every K range."""
    tiles = one_block_mma_tiles(num_pairs, num_experts, dim, inter, num_sms)
    if wide_stages_fit(dim, inter, tiles.up_split):
        return dataclasses.replace(tiles, blocks_per_stage=WIDE_BLOCKS, num_stages=WIDE_STAGES)
    return tiles
