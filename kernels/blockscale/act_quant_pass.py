"""The act_quant pre-pass on the device (semantics: kernels/blockscale/ref.py's act_quant): rows
of activations -> e4m3 values (1 byte a value) and one fp32 scale per 128, bit for bit the
reference's. The block-scaled linear runs it from more than a few rows, the block-scaled experts
once per token; both read the e4m3 values back, so the rounding runs once per value and every
reader moves 1 byte a value.

In fragment order (the FP4 experts' tensor-core product, kernels/moe/scaled_gluon.py) the values
are stored as fp16 (every e4m3 value is one, exactly), each 8 inputs 4h + 2n + s at position
4s + 2h + n: the order in which a thread of that product holds them in its instruction registers,
so that one 16-byte load fills them, with no conversion, byte permute or move a step."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.blockscale.device import act_quant_rows
from kernels.blockscale.ref import FP8_BLOCK
from kernels.dependent_launch import dependent_options, wait_for_predecessor

BLOCKS_PER_PROGRAM = 8  # 128-blocks a program quantises (a row of V4-Flash's 4096 in four programs)


@triton.jit
def store_values(row_ptr, ks, values, mask, FRAGMENT_ORDER: tl.constexpr):
    """Quantised values (e4m3-rounded fp32) of inputs ks into a row: e4m3 at ks, or in fragment
    order fp16 at ks with its three low bits rotated right by one."""
    if FRAGMENT_ORDER:
        at = (ks & ~7) | ((ks >> 1) & 3) | ((ks & 1) << 2)
        tl.store(row_ptr + at, values.to(tl.float16), mask=mask)
    else:
        tl.store(row_ptr + ks, values.to(tl.float8e4nv), mask=mask)


@triton.jit
def act_quant_program(x_ptr, values_ptr, scales_ptr, row, chunk, K_BLOCKS, stride_xm, POW2: tl.constexpr, BLOCKS: tl.constexpr,
                      FRAGMENT_ORDER: tl.constexpr):
    """act_quant of 128-blocks [chunk * BLOCKS, (chunk + 1) * BLOCKS) of one row: values [M, K]
    (store_values) and fp32 scales [M, K_BLOCKS]."""
    row = row.to(tl.int64)
    blocks = chunk * BLOCKS + tl.arange(0, BLOCKS)
    ok = blocks < K_BLOCKS
    ks = blocks[:, None] * 128 + tl.arange(0, 128)[None, :]
    x = tl.load(x_ptr + row * stride_xm + ks, mask=ok[:, None], other=0.0).to(tl.float32)
    values, scale = act_quant_rows(x, POW2)
    store_values(values_ptr + row * K_BLOCKS * 128, ks, values, ok[:, None], FRAGMENT_ORDER)
    tl.store(scales_ptr + row * K_BLOCKS + blocks, scale, mask=ok)


@triton.jit
def _act_quant_kernel(
    x_ptr, values_ptr, scales_ptr,
    K_BLOCKS, stride_xm,
    POW2: tl.constexpr, BLOCKS: tl.constexpr, FRAGMENT_ORDER: tl.constexpr,
    DEPENDENT: tl.constexpr = False,
):
    wait_for_predecessor(DEPENDENT)
    act_quant_program(x_ptr, values_ptr, scales_ptr, tl.program_id(0), tl.program_id(1), K_BLOCKS, stride_xm, POW2, BLOCKS,
                      FRAGMENT_ORDER)


def in_fragment_order(values: torch.Tensor) -> torch.Tensor:
    """Plain-torch reference of the fragment order: values [.., K] (K a multiple of 8) as fp16,
    each 8 inputs 4h + 2n + s at position 4s + 2h + n."""
    i = torch.arange(8, device=values.device)
    h, n, s = i >> 2, (i >> 1) & 1, i & 1
    placed = torch.empty(values.shape, dtype=torch.float16, device=values.device)
    placed.view(-1, 8)[:, 4 * s + 2 * h + n] = values.reshape(-1, 8).half()
    return placed


def values_buffer(m: int, k: int, fragment_order: bool, device: torch.device) -> torch.Tensor:
    """Where quantised values [m, k] go: e4m3, or fp16 in fragment order."""
    return torch.empty((m, k), dtype=torch.float16 if fragment_order else torch.float8_e4m3fn, device=device)


def act_quant_launch(rows: torch.Tensor, fragment_order: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """What a launch of act_quant_program needs for rows [M, K]: the rows (copied only where K is
    not contiguous: the programs read each row's blocks at unit stride), the values and scales
    buffers it fills, and its programs a row."""
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m, k = rows.shape
    values = values_buffer(m, k, fragment_order, rows.device)
    scales = torch.empty((m, k // FP8_BLOCK), dtype=torch.float32, device=rows.device)
    return rows, values, scales, triton.cdiv(k // FP8_BLOCK, BLOCKS_PER_PROGRAM)


def act_quant_triton(rows: torch.Tensor, pow2: bool = True, fragment_order: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """rows [M, K] (K a multiple of 128, any strides) -> (e4m3 values [M, K], fp32 scales [M, K / 128]),
    bit for bit ref.act_quant's; with fragment_order the values as fp16 in fragment order (the
    module's docstring)."""
    rows, values, scales, chunks = act_quant_launch(rows, fragment_order)
    if rows.shape[0]:
        _act_quant_kernel[(rows.shape[0], chunks)](rows, values, scales, scales.shape[1], rows.stride(0), POW2=pow2,
                                                   BLOCKS=BLOCKS_PER_PROGRAM, FRAGMENT_ORDER=fragment_order,
                                                   **dependent_options(rows.device))
    return values, scales
