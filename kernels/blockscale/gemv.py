"""One row of the block-scaled FP8 linear as a GEMV on the CUDA cores (semantics:
kernels/blockscale/ref.py), with K never split.

At batch 1 the small products (6-16 MB) take 7-10 us in the tensor-core kernels whatever their
tiles: to give every SM work they split K, and the split's arrival (partials written, a counter
counted, the last program summing them) is a chain of memory round trips after the weights are
read. Here a program owns BLOCK_N output columns over the whole of K, so a wide weight alone fills
the GPU and the sum ends in the registers of the program that made it:

- Per BLOCK_K inputs: the row's activation blocks quantised (act_quant's arithmetic, bit for bit:
  kernels/blockscale/device.py), each value times its block's activation scale and the columns'
  weight scale (one 128 x 128 scale block covers all BLOCK_N columns, BLOCK_N dividing 128), then
  one fp32 multiply-add per weight code into per-lane partial sums, reduced once after the loop.
  With ue8m0 scales every factor is a power of two and every product exact up to fp32 rounding
  of the sums: the reference's arithmetic in another summation order.
- The next BLOCK_K inputs' codes are loaded before this step's multiply-adds (Triton pipelines
  only loads that feed a dot). The first step's codes are loaded before the kernel waits for
  its predecessor (a programmatic dependent: kernels/dependent_launch.py), so their latency
  passes while that kernel drains.

FP8 weights, one row, K a multiple of 128. The interpreter runs it (tests on a CPU). The op
(kernels/blockscale/op.py) runs it at one row for weights of up to OP_MAX_WEIGHT_BYTES
(`takes_rows`)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.blockscale.device import act_quant_rows, weight_scale_to_fp32
from kernels.blockscale.ref import FP8_BLOCK, SCALE_DTYPES
from kernels.dependent_launch import dependent_options, wait_for_predecessor
from kernels.triton_util import interpreting

BLOCK_N = 4  # output columns a program: V4-Flash's narrowest FP8 product (1536) in 384 programs
MAX_BLOCK_K = 1024  # inputs a step: 4 KB of codes a program in flight
WARPS = 8  # measured against 4 (H100, one row): 1536 x 4096 5.9 us against 6.3, 4096 x 2048 level
# FP8 weight bytes (N * K) up to which the op runs this kernel at one row: measured faster than its tensor-core products up to this size at V4-Flash's FP8 shapes, slower above.
OP_MAX_WEIGHT_BYTES = 8 * 2**20


@triton.jit
def _blockscale_gemv_kernel(
    x_ptr, w_ptr, s_ptr, out_ptr,
    N, K, stride_wn, stride_sn, stride_sk,
    SCALE_E8M0: tl.constexpr, POW2: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DEPENDENT: tl.constexpr = False,
):
    col0 = tl.program_id(0) * BLOCK_N
    cols = col0 + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    blocks = tl.arange(0, BLOCK_K // 128)
    w_tile = w_ptr + cols.to(tl.int64)[:, None] * stride_wn + ks[None, :]
    s_row = s_ptr + (col0 // 128) * stride_sn  # the columns' one row of weight scales
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    w = tl.load(w_tile, mask=col_ok[:, None], other=0.0)
    wait_for_predecessor(DEPENDENT)  # x and out from here; the weight is a parameter
    for k0 in range(BLOCK_K, K + BLOCK_K, BLOCK_K):
        w_next = tl.load(w_tile + k0, mask=col_ok[:, None] & ((k0 + ks) < K)[None, :], other=0.0)
        k = k0 - BLOCK_K
        x = tl.load(x_ptr + k + ks).to(tl.float32)
        xq, xs = act_quant_rows(tl.reshape(x, (BLOCK_K // 128, 128)), POW2)
        ws = weight_scale_to_fp32(tl.load(s_row + (k // 128 + blocks) * stride_sk), SCALE_E8M0, False)
        x_scaled = tl.reshape(xq * (xs * ws)[:, None], (BLOCK_K,))
        acc += w.to(tl.float32) * x_scaled[None, :]
        w = w_next
    tl.store(out_ptr + cols, tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty), mask=col_ok)


def takes_rows(rows: int, weight: torch.Tensor, scale: torch.Tensor) -> bool:
    """Whether the op runs this kernel for `rows` rows of `weight` on a GPU with the e4m3
    conversions (from shapes and dtypes only): one row of an FP8 weight of 1 to
    OP_MAX_WEIGHT_BYTES bytes, contiguous along K (a multiple of 128), with ue8m0 or fp32 scales."""
    n, k = weight.shape
    return (rows == 1 and weight.dtype == torch.float8_e4m3fn and 0 < n * k <= OP_MAX_WEIGHT_BYTES
            and k % FP8_BLOCK == 0 and weight.stride(-1) == 1 and scale.dtype in SCALE_DTYPES)


def step_inputs(k: int) -> int:
    """Inputs a step: the largest power of two up to MAX_BLOCK_K that divides K (a multiple of 128)."""
    step = MAX_BLOCK_K
    while k % step:
        step //= 2
    return step


def blockscale_gemv(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, pow2: bool = True,
    block_n: int = BLOCK_N, block_k: int | None = None, warps: int = WARPS,
) -> torch.Tensor:
    """act_quant(x) @ dequantised(weight)^T in x's dtype (blockscale_linear_reference) for one row:
    x [..., K] with one row in all, an FP8 weight [N, K] contiguous along K with its 128 x 128
    block scales (ue8m0 or fp32). block_n (a power of two dividing 128), block_k (a multiple of
    128 dividing K; default `step_inputs(K)`) and warps override the launch shape (tuning)."""
    rows = x.reshape(-1, x.shape[-1])
    n, k = weight.shape
    if rows.shape[0] != 1:
        raise ValueError(f"blockscale_gemv: one row of x, got {rows.shape[0]}")
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"blockscale_gemv: FP8 (e4m3) weights, got {weight.dtype}")
    if k == 0 or k % FP8_BLOCK or weight.stride(-1) != 1:
        raise ValueError(f"blockscale_gemv: K ({k}) must be a positive multiple of {FP8_BLOCK}, the weight contiguous along it")
    if rows.shape[1] != k:
        raise ValueError(f"blockscale_gemv: x has {rows.shape[1]} inputs, the weight {k}")
    step = block_k if block_k is not None else step_inputs(k)
    if block_n < 1 or 128 % block_n or step < FP8_BLOCK or step % FP8_BLOCK or k % step:
        raise ValueError(f"blockscale_gemv: block_n ({block_n}) must divide 128 and block_k ({step}) be a multiple of 128 dividing K ({k})")
    row = rows[0].contiguous()
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    e8m0 = scale.dtype == torch.float8_e8m0fnu
    _blockscale_gemv_kernel[(triton.cdiv(n, block_n),)](
        row, weight, scale.view(torch.uint8) if e8m0 else scale, out, n, k, weight.stride(0), scale.stride(0), scale.stride(1),
        SCALE_E8M0=e8m0, POW2=pow2, BLOCK_N=block_n, BLOCK_K=step, **({} if interpreting() else {"num_warps": warps}),
        **dependent_options(x.device),
    )
    return out.view(*x.shape[:-1], n)
