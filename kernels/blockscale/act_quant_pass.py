"""The act_quant pre-pass on the device (semantics: kernels/blockscale/ref.py's act_quant): rows
of activations -> e4m3 values (1 byte a value) and one fp32 scale per 128, bit for bit the
reference's. The block-scaled linear runs it from more than a few rows, the block-scaled experts
once per token; both read the e4m3 values back, so the rounding runs once per value and every
reader moves 1 byte a value.

`values_order` says how the values are stored (VALUE_ORDERS): "e4m3" as they are; for the FP4
experts' tensor-core products (kernels/moe/scaled_gluon.py) in the order in which a thread of
that product holds them in its instruction registers, so that a step moves no value between
registers:
- "mma" (mma.sync, fp16 operands): as fp16 (every e4m3 value is one, exactly), each 8 inputs
  4h + 2n + s at position 4s + 2h + n, so that one 16-byte load fills a thread's registers, with
  no conversion, byte permute or move a step;
- "wgmma" (Hopper's warpgroup instruction, e4m3 operands read from shared memory): as e4m3, each
  32 inputs 8t + 2j + s at position 16s + 4t + j, the k-slots at which that product's decoded
  weights hold the same inputs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.blockscale.device import act_quant_rows
from kernels.blockscale.ref import FP8_BLOCK
from kernels.dependent_launch import dependent_options, wait_for_predecessor

BLOCKS_PER_PROGRAM = 8  # 128-blocks a program quantises (a row of V4-Flash's 4096 in four programs)
VALUE_ORDERS = ("e4m3", "mma", "wgmma")


@triton.jit
def store_values(row_ptr, ks, values, mask, ORDER: tl.constexpr):
    """Quantised values (e4m3-rounded fp32) of inputs ks into a row in ORDER (VALUE_ORDERS): e4m3
    at ks; "mma": fp16 at ks with its three low bits rotated right by one; "wgmma": e4m3 at ks
    with its five low bits (t, j, s) placed as (s, t, j)."""
    if ORDER == "mma":
        at = (ks & ~7) | ((ks >> 1) & 3) | ((ks & 1) << 2)
        tl.store(row_ptr + at, values.to(tl.float16), mask=mask)
    elif ORDER == "wgmma":
        at = (ks & ~31) | ((ks & 1) << 4) | (((ks >> 3) & 3) << 2) | ((ks >> 1) & 3)
        tl.store(row_ptr + at, values.to(tl.float8e4nv), mask=mask)
    else:
        tl.store(row_ptr + ks, values.to(tl.float8e4nv), mask=mask)


@triton.jit
def act_quant_program(x_ptr, values_ptr, scales_ptr, row, chunk, K_BLOCKS, stride_xm, POW2: tl.constexpr, BLOCKS: tl.constexpr,
                      ORDER: tl.constexpr):
    """act_quant of 128-blocks [chunk * BLOCKS, (chunk + 1) * BLOCKS) of one row: values [M, K]
    (store_values) and fp32 scales [M, K_BLOCKS]."""
    row = row.to(tl.int64)
    blocks = chunk * BLOCKS + tl.arange(0, BLOCKS)
    ok = blocks < K_BLOCKS
    ks = blocks[:, None] * 128 + tl.arange(0, 128)[None, :]
    x = tl.load(x_ptr + row * stride_xm + ks, mask=ok[:, None], other=0.0).to(tl.float32)
    values, scale = act_quant_rows(x, POW2)
    store_values(values_ptr + row * K_BLOCKS * 128, ks, values, ok[:, None], ORDER)
    tl.store(scales_ptr + row * K_BLOCKS + blocks, scale, mask=ok)


@triton.jit
def _act_quant_kernel(
    x_ptr, values_ptr, scales_ptr,
    K_BLOCKS, stride_xm,
    POW2: tl.constexpr, BLOCKS: tl.constexpr, ORDER: tl.constexpr,
    DEPENDENT: tl.constexpr = False,
):
    wait_for_predecessor(DEPENDENT)
    act_quant_program(x_ptr, values_ptr, scales_ptr, tl.program_id(0), tl.program_id(1), K_BLOCKS, stride_xm, POW2, BLOCKS,
                      ORDER)


def in_value_order(values: torch.Tensor, order: str) -> torch.Tensor:
    """Plain-torch reference of the orders: e4m3 values [.., K] (K a multiple of 32) as `order`
    stores them (the module's docstring)."""
    if order == "e4m3":
        return values.to(torch.float8_e4m3fn)
    i = torch.arange(8 if order == "mma" else 32, device=values.device)
    if order == "mma":  # input 4h + 2n + s at 4s + 2h + n
        at, dtype = 4 * (i & 1) + 2 * (i >> 2) + ((i >> 1) & 1), torch.float16
    else:  # input 8t + 2j + s at 16s + 4t + j
        at, dtype = 16 * (i & 1) + 4 * (i >> 3) + ((i >> 1) & 3), torch.float8_e4m3fn
    placed = torch.empty(values.shape, dtype=dtype, device=values.device)
    placed.view(-1, i.numel())[:, at] = values.reshape(-1, i.numel()).to(dtype)
    return placed


def values_buffer(m: int, k: int, order: str, device: torch.device) -> torch.Tensor:
    """Where quantised values [m, k] go in `order`: fp16 for "mma", else e4m3."""
    if order not in VALUE_ORDERS:
        raise ValueError(f"act_quant: values_order must be one of {VALUE_ORDERS}, got {order!r}")
    return torch.empty((m, k), dtype=torch.float16 if order == "mma" else torch.float8_e4m3fn, device=device)


def act_quant_launch(rows: torch.Tensor, values_order: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """What a launch of act_quant_program needs for rows [M, K]: the rows (copied only where K is
    not contiguous: the programs read each row's blocks at unit stride), the values and scales
    buffers it fills, and its programs a row."""
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m, k = rows.shape
    values = values_buffer(m, k, values_order, rows.device)
    scales = torch.empty((m, k // FP8_BLOCK), dtype=torch.float32, device=rows.device)
    return rows, values, scales, triton.cdiv(k // FP8_BLOCK, BLOCKS_PER_PROGRAM)


def act_quant_triton(rows: torch.Tensor, pow2: bool = True, values_order: str = "e4m3") -> tuple[torch.Tensor, torch.Tensor]:
    """rows [M, K] (K a multiple of 128, any strides) -> (e4m3 values [M, K], fp32 scales [M, K / 128]),
    bit for bit ref.act_quant's; the values stored in `values_order` (the module's docstring)."""
    rows, values, scales, chunks = act_quant_launch(rows, values_order)
    if rows.shape[0]:
        _act_quant_kernel[(rows.shape[0], chunks)](rows, values, scales, scales.shape[1], rows.stride(0), POW2=pow2,
                                                   BLOCKS=BLOCKS_PER_PROGRAM, ORDER=values_order,
                                                   **dependent_options(rows.device))
    return values, scales
