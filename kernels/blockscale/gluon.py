"""Gluon block-scaled FP8 linear (Plan.product "mma" of kernels/blockscale/triton.py; semantics:
kernels/blockscale/ref.py): e4m3 weight codes converted straight into the registers of the
tensor-core instruction (mma.sync m16n8k16: fp16 operands, fp32 accumulation), with no trip
through shared memory.

At decode the product is a GEMV over a few rows: the time goes to moving and converting the
weight bytes, so they are laid out for the instruction rather than for the dot of a generic tile.

- One weight scale covers 128 x 128 inputs, so the instruction's K order within a 128-block is
  free as long as the weights and the activations share it. Thread q of a quad takes inputs
  [32q, 32q + 32) of every block: 32 bytes of codes a row (two 16-byte loads), which its A
  fragments hold as k-slots {2q, 2q+1, 2q+8, 2q+9} of the block's eight 16-wide steps, and the
  same 32 activations of each token for its B fragments. `convert_layout(..., assert_trivial=True)`
  checks when it compiles that no value moves between threads.
- Program (row tile of 8, 16 or 32 rows, 128 or 64 output columns, K split): 4 warps, each 16 of
  every 64 columns; the instruction's N is 8 of the tile's rows (tokens) at a time. Row tiles of
  one column strip are launched next to each other, so a strip read for several tiles comes from
  L2 after the first.
- Codes and activations become fp16 by the hardware's e4m3x2 -> f16x2 conversion (exact). The
  block's product is taken in fp32, times the block's weight scale and each row's activation scale,
  and added to the fp32 accumulator: the Triton kernel's arithmetic in another summation order.
- Activations: from up to IN_KERNEL_QUANT_MAX_ROWS rows every program quantises its own (act_quant
  bit for bit: kernels/blockscale/device.py's arithmetic and the hardware's rounding to e4m3), from
  more the pre-pass's e4m3 values are read.
- Up to 16 rows a program issues the loads of two 128-blocks (Plan.blocks_per_step) before their
  products: at decode a split holds a few blocks, and each wait for memory is then shared by two.
- Split K as the Triton kernel's (`write_tile`).

sm_89 or newer (the e4m3 conversions); CUDA only (Gluon: no interpreter path).
"""
from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from kernels.blockscale.device import act_scale, divide_and_clamp, weight_scale_to_fp32
from kernels.blockscale.ref import FP8_BLOCK
from kernels.blockscale.triton import (
    IN_KERNEL_QUANT_MAX_ROWS, Plan, launch_rows, prepare_launch, split_where_idle, write_tile,
)
from kernels.dependent_launch import dependent_options, wait_for_predecessor
from kernels.triton_util import interpreting, num_sms

WARPS = 4
STEP = FP8_BLOCK  # inputs per step: one weight-scale block, one activation block
COLUMN_TILES = (64, 128)  # output columns a program: 16 or 32 a warp
TOKEN_TILES = (8, 16, 32)  # rows a program: the instruction's N, once to four times
# K is split until every SM has this many programs (each keeps a block or two of bytes in flight).
PROGRAMS_PER_SM = 2
MIN_BLOCKS_PER_SPLIT = 2
# 128-blocks whose loads a program issues before their products, up to 16 rows: a split of few
# blocks (most at decode) then waits for memory fewer times. Above, the wider tiles' registers
# leave no room for a second block.
BLOCKS_PER_STEP = 2
BLOCK_K = gl.constexpr(STEP)


@gluon.constexpr_function
def mma_layout() -> gl.NVMMADistributedLayout:
    return gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, 8])


@gluon.constexpr_function
def codes_layout(block_n: int) -> gl.DistributedLinearLayout:
    """[block_n columns, 128 inputs] of e4m3 codes: thread (r, q) of warp w holds inputs 32q + i
    (i < 32, in consecutive registers: 16-byte loads) of weight rows 16w + r and + 8, every 64 rows."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [0, 16], [8, 0]] + [[64 << i, 0] for i in range((block_n // 64).bit_length() - 1)],
        lane_bases=[[0, 32], [0, 64], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[block_n, STEP],
    )


@gluon.constexpr_function
def values_layout(tokens: int) -> gl.DistributedLinearLayout:
    """[128 inputs, tokens] of activations: thread (r, q) holds inputs 32q + i (i < 32, in
    consecutive registers) of token r, every 8 tokens; every warp the same."""
    return gl.DistributedLinearLayout(
        reg_bases=[[1, 0], [2, 0], [4, 0], [8, 0], [16, 0]] + [[0, 8 << i] for i in range((tokens // 8).bit_length() - 1)],
        lane_bases=[[32, 0], [64, 0], [0, 1], [0, 2], [0, 4]],
        warp_bases=[[0, 0], [0, 0]], block_bases=[], shape=[STEP, tokens],
    )


@gluon.jit
def _eight(t):
    """[.., 2, 2, 2] -> its eight [..] slices, in one fixed order (weights and activations alike)."""
    a, b = gl.split(t)
    a0, a1 = gl.split(a)
    b0, b1 = gl.split(b)
    s0, s1 = gl.split(a0)
    s2, s3 = gl.split(a1)
    s4, s5 = gl.split(b0)
    s6, s7 = gl.split(b1)
    return s0, s1, s2, s3, s4, s5, s6, s7


@gluon.jit
def _step(w, v, acc, MMA: gl.constexpr):
    """acc + w [N, 16] (fp16) times v [16, T] (fp16), the operands already where the
    instruction's fragments want them."""
    a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    b_op: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    return mma_v2(gl.convert_layout(w, a_op, assert_trivial=True), gl.convert_layout(v, b_op, assert_trivial=True), acc)


@gluon.jit
def _fp8_block_product(codes, values, BLOCK_N: gl.constexpr, TOKENS: gl.constexpr):
    """codes [BLOCK_N, 128] (codes_layout) times values [128, TOKENS] (values_layout), both fp16:
    fp32 [BLOCK_N, TOKENS] (mma_layout). Input 32q + 4t + 2h + n goes to step t, k-slot
    8h + 2q + n, so that each thread's fragments are the registers it loaded."""
    MMA: gl.constexpr = mma_layout()
    w = codes.reshape([BLOCK_N, 4, 8, 2, 2]).permute(0, 3, 1, 4, 2).reshape([BLOCK_N, 16, 2, 2, 2])
    v = values.reshape([4, 8, 2, 2, TOKENS]).permute(2, 0, 3, 4, 1).reshape([16, TOKENS, 2, 2, 2])
    w0, w1, w2, w3, w4, w5, w6, w7 = _eight(w)
    v0, v1, v2, v3, v4, v5, v6, v7 = _eight(v)
    acc = _step(w0, v0, gl.zeros([BLOCK_N, TOKENS], gl.float32, MMA), MMA)
    acc = _step(w1, v1, acc, MMA)
    acc = _step(w2, v2, acc, MMA)
    acc = _step(w3, v3, acc, MMA)
    acc = _step(w4, v4, acc, MMA)
    acc = _step(w5, v5, acc, MMA)
    acc = _step(w6, v6, acc, MMA)
    return _step(w7, v7, acc, MMA)


@gluon.jit
def _block_operands(block, w_ptrs, s_row, v_ptrs, token_ok, xs_ptr, acc_tokens, acc_ok, stride_sk, K_BLOCKS,
                    X_QUANTIZED: gl.constexpr, BLOCK_M: gl.constexpr):
    """The loads of one 128-block of K: the tile's codes and weight scale (as stored), and the
    activations: the pre-pass's e4m3 values and scales, or x as it is (its scales then found by
    _accumulate_block; zeros here)."""
    k0 = block * BLOCK_K
    codes = gl.load(w_ptrs + k0)
    w_scale = gl.load(s_row + block * stride_sk)
    values = gl.load(v_ptrs + k0, mask=token_ok[None, :], other=0.0)
    if X_QUANTIZED:
        x_scale = gl.load(xs_ptr + acc_tokens * K_BLOCKS + block, mask=acc_ok, other=0.0)
    else:
        x_scale = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(0, mma_layout()))
    return codes, w_scale, values, x_scale


@gluon.jit
def _accumulate_block(acc, codes, w_scale, values, x_scale, SCALE_E8M0: gl.constexpr, POW2: gl.constexpr,
                      X_QUANTIZED: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr):
    """acc plus one block's product (_block_operands' loads) times its weight and activation scales."""
    if not X_QUANTIZED:
        x = values.to(gl.float32)
        scale = act_scale(gl.max(gl.abs(x), axis=0), POW2)
        # act_quant's rounding is the hardware's (to nearest even, saturating at the clamp).
        values = divide_and_clamp(x, scale[None, :], POW2).to(gl.float8e4nv)
        x_scale = gl.convert_layout(scale, gl.SliceLayout(0, mma_layout()))
    w_scale = weight_scale_to_fp32(w_scale, SCALE_E8M0, False)
    block_sum = _fp8_block_product(codes.to(gl.float16), values.to(gl.float16), BLOCK_N, BLOCK_M)
    return acc + block_sum * (x_scale * w_scale)[None, :]


@gluon.jit
def _mma_linear_kernel(
    x_ptr, xq_ptr, xs_ptr, w_ptr, s_ptr, out_ptr, partial_ptr, counter_ptr,
    M, N, K_BLOCKS, BLOCKS_PER_SPLIT,
    stride_xm, stride_wn, stride_sn, stride_sk, stride_om,
    SCALE_E8M0: gl.constexpr, POW2: gl.constexpr, X_QUANTIZED: gl.constexpr, SPLIT: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCKS_PER_STEP: gl.constexpr, DEPENDENT: gl.constexpr = False,
):
    wait_for_predecessor(DEPENDENT)
    pid_m = gl.program_id(0)
    pid_n = gl.program_id(1)
    pid_k = gl.program_id(2)
    MMA: gl.constexpr = mma_layout()
    CODES: gl.constexpr = codes_layout(BLOCK_N)
    VALUES: gl.constexpr = values_layout(BLOCK_M)
    col0 = pid_n * BLOCK_N
    w_cols = col0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, CODES))
    w_ptrs = w_ptr + w_cols.to(gl.int64)[:, None] * stride_wn + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, CODES))[None, :]
    tokens = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, VALUES))
    token_ok = tokens < M
    inputs = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(1, VALUES))
    if X_QUANTIZED:
        v_ptrs = xq_ptr + tokens.to(gl.int64)[None, :] * (K_BLOCKS * BLOCK_K) + inputs[:, None]
    else:
        v_ptrs = x_ptr + tokens.to(gl.int64)[None, :] * stride_xm + inputs[:, None]
    acc_tokens = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, MMA))
    acc_ok = acc_tokens < M
    s_row = s_ptr + (col0 // BLOCK_K) * stride_sn  # the tile lies in one 128-row block of scales
    acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, MMA)
    first = pid_k * BLOCKS_PER_SPLIT
    last = gl.minimum(first + BLOCKS_PER_SPLIT, K_BLOCKS)
    if BLOCKS_PER_STEP == 2:
        # Both blocks' loads are issued before either product: twice the bytes in flight a warp.
        for block in range(first, last - 1, 2):
            c0, s0, v0, x0 = _block_operands(block, w_ptrs, s_row, v_ptrs, token_ok, xs_ptr, acc_tokens, acc_ok,
                                             stride_sk, K_BLOCKS, X_QUANTIZED, BLOCK_M)
            c1, s1, v1, x1 = _block_operands(block + 1, w_ptrs, s_row, v_ptrs, token_ok, xs_ptr, acc_tokens, acc_ok,
                                             stride_sk, K_BLOCKS, X_QUANTIZED, BLOCK_M)
            acc = _accumulate_block(acc, c0, s0, v0, x0, SCALE_E8M0, POW2, X_QUANTIZED, BLOCK_N, BLOCK_M)
            acc = _accumulate_block(acc, c1, s1, v1, x1, SCALE_E8M0, POW2, X_QUANTIZED, BLOCK_N, BLOCK_M)
        if (last - first) % 2 == 1:
            c0, s0, v0, x0 = _block_operands(last - 1, w_ptrs, s_row, v_ptrs, token_ok, xs_ptr, acc_tokens, acc_ok,
                                             stride_sk, K_BLOCKS, X_QUANTIZED, BLOCK_M)
            acc = _accumulate_block(acc, c0, s0, v0, x0, SCALE_E8M0, POW2, X_QUANTIZED, BLOCK_N, BLOCK_M)
    else:
        for block in range(first, last):
            c0, s0, v0, x0 = _block_operands(block, w_ptrs, s_row, v_ptrs, token_ok, xs_ptr, acc_tokens, acc_ok,
                                             stride_sk, K_BLOCKS, X_QUANTIZED, BLOCK_M)
            acc = _accumulate_block(acc, c0, s0, v0, x0, SCALE_E8M0, POW2, X_QUANTIZED, BLOCK_N, BLOCK_M)

    cols = col0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, MMA))
    mask = (cols < N)[:, None] & acc_ok[None, :]
    out_ptrs = out_ptr + acc_tokens[None, :] * stride_om + cols[:, None]
    counter = counter_ptr + pid_m * gl.num_programs(1) + pid_n
    write_tile(acc, out_ptrs, partial_ptr + acc_tokens[None, :] * N + cols[:, None], mask, counter, pid_k, M * N, SPLIT)


def plan_mma(rows: int, n: int, k: int, sms: int) -> Plan:
    """Tiles of the mma product for `rows` x [n, k]: 8, 16 or 32 rows a program (64 as two tiles
    of 32), 128 columns (64 where the weight has no whole tiles of 128: per weight byte, a wider
    tile converts fewer activations and quantises them for more columns); K split until every SM
    has PROGRAMS_PER_SM programs; BLOCKS_PER_STEP blocks' loads at a time up to 16 rows."""
    block_m = min(TOKEN_TILES[-1], max(TOKEN_TILES[0], triton.next_power_of_2(rows)))
    block_n = COLUMN_TILES[-1] if n % COLUMN_TILES[-1] == 0 else COLUMN_TILES[0]
    plan = Plan(block_m, block_n, 1, k // FP8_BLOCK, rows > IN_KERNEL_QUANT_MAX_ROWS, num_warps=WARPS, product="mma",
                blocks_per_step=BLOCKS_PER_STEP if rows <= IN_KERNEL_QUANT_MAX_ROWS else 1)
    return split_where_idle(plan, rows, n, k, sms, PROGRAMS_PER_SM, MIN_BLOCKS_PER_SPLIT)


def check_mma_inputs(weight: torch.Tensor, plan: Plan) -> None:
    """What the mma product takes: FP8 weights whose rows fill the plan's column tiles, on a GPU."""
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"blockscale_linear (mma): the mma product takes FP8 (e4m3) weights, got {weight.dtype}")
    if (plan.product != "mma" or plan.block_n not in COLUMN_TILES or plan.block_m not in TOKEN_TILES
            or plan.num_warps != WARPS or plan.blocks_per_step not in (1, 2)):
        raise ValueError(f"blockscale_linear (mma): not a plan of the mma product: {plan}")
    if weight.shape[0] % plan.block_n:
        raise ValueError(f"blockscale_linear (mma): {weight.shape[0]} output columns are not whole tiles of {plan.block_n}")
    if interpreting():
        raise ValueError("blockscale_linear (mma): a Gluon kernel, which the Triton interpreter does not run")


def blockscale_linear_mma(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, pow2: bool = True, plan: Plan | None = None
) -> torch.Tensor:
    """blockscale_linear_triton's result (same arguments) by this module's product: FP8 weights
    on a GPU. plan: `plan_mma`'s unless given."""
    rows, out = launch_rows(x, weight, "mma")
    m, n, k = out.shape[0], out.shape[1], rows.shape[1]
    if plan is None:
        plan = plan_mma(max(m, 1), n, k, num_sms(x.device))
    check_mma_inputs(weight, plan)
    if m == 0 or n == 0:
        return out.view(*x.shape[:-1], n)
    run = prepare_launch(rows, out, scale, pow2, plan)
    # Row tiles first in the grid: the programs that share a column strip run side by side.
    _mma_linear_kernel[(triton.cdiv(m, plan.block_m), n // plan.block_n, plan.split)](
        rows, run.xq, run.xs, weight, run.scale_bits, out, run.partials, run.counters,
        m, n, k // FP8_BLOCK, plan.blocks_per_split,
        rows.stride(0), weight.stride(0), scale.stride(0), scale.stride(1), out.stride(0),
        SCALE_E8M0=run.scale_e8m0, POW2=pow2, X_QUANTIZED=plan.x_quantized, SPLIT=plan.split,
        BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCKS_PER_STEP=plan.blocks_per_step, num_warps=WARPS,
        **dependent_options(x.device),
    )
    return out.view(*x.shape[:-1], n)
