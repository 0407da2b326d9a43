"""Triton y[:, g] = x[:, g] W[g]^T for at most 64 rows of x (semantics: kernels/linear/ref.py), one
launch for every group g.

Program (p, g) owns output columns [p * BLOCK_N, (p + 1) * BLOCK_N) of group g for every row: it loops over K in
BLOCK_K steps, loading the rows' [BLOCK_M, BLOCK_K] tile (L2-resident, shared by all programs)
and its own [BLOCK_N, BLOCK_K] strip of the weight (read once from memory, the bytes that
matter), and accumulates their product in fp32 with tl.dot. BLOCK_N is small (16 or 32) so that
even N = 1600 gives ~100 programs; a deep software pipeline (num_stages) keeps enough weight
bytes in flight per program to run near copy bandwidth without splitting K.

The tile sizes come from a short autotune keyed by (row tile, N, K): it runs when a shape is
first seen, which under `compile_decode` is warm-up, before any graph capture. Its choices are
kept in Triton's on-disk cache, so a later process (a warm start) loads them instead of timing
the configurations again, provided it compiles with the same toolchain: the cache key includes
the ptxas version, which Inductor switches to torch's own the first time it compiles a kernel in
the process, so a caller that also uses Inductor should make that switch before the first call.
Under the interpreter (TRITON_INTERPRET=1, tests on a CPU) one fixed configuration runs instead.

One row whose column strips would leave SMs idle (N / 16 programs per group, fewer than the SMs:
the fused x projection, 1536-2048 x 4096, at batch 1) takes a GEMV instead: strips of 4-8 columns
so every SM gets programs, fp32 multiply-adds on CUDA cores with the sum over K deferred to the
end, and the next strip of K loaded while the current one is summed (Triton does not pipeline
loads that feed no dot). Where the strips fill the GPU the dot kernel is as fast.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
import triton.testing

from kernels.dependent_launch import dependent_options, wait_for_predecessor
from kernels.linear.ref import MAX_ROWS, upcasts_weight
from kernels.triton_util import dot_precision, interpreting, num_sms


@triton.jit
def _linear_kernel(
    x_ptr, w_ptr, out_ptr,
    rows, N, K,
    stride_xm, stride_xg, stride_wg, stride_wn, stride_om, stride_og,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
    DEPENDENT: tl.constexpr = False,
):
    wait_for_predecessor(DEPENDENT)
    group = tl.program_id(1).to(tl.int64)
    x_ptr += group * stride_xg
    w_ptr += group * stride_wg
    out_ptr += group * stride_og
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row = tl.arange(0, BLOCK_M)
    ks = tl.arange(0, BLOCK_K)
    col_ok = cols < N
    row_ok = row < rows
    x_tile = x_ptr + row[:, None] * stride_xm + ks[None, :]
    w_tile = w_ptr + cols.to(tl.int64)[:, None] * stride_wn + ks[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + ks) < K
        x = tl.load(x_tile + k0, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_tile + k0, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
    out = out_ptr + row[:, None] * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, out_ptr,
    N, K,
    stride_xg, stride_wg, stride_wn, stride_og,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DEPENDENT: tl.constexpr = False,
):
    wait_for_predecessor(DEPENDENT)
    group = tl.program_id(1).to(tl.int64)
    x_ptr += group * stride_xg
    w_ptr += group * stride_wg
    out_ptr += group * stride_og
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    w_tile = w_ptr + cols.to(tl.int64)[:, None] * stride_wn + ks[None, :]
    # Per-lane partial sums, reduced once after the loop: no shuffles inside it.
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    w = tl.load(w_tile, mask=col_ok[:, None] & (ks < K)[None, :], other=0.0)
    for k0 in range(BLOCK_K, K + BLOCK_K, BLOCK_K):
        # Issue the next strip's loads before this strip's multiply-adds (one strip in flight).
        w_next = tl.load(w_tile + k0, mask=col_ok[:, None] & ((k0 + ks) < K)[None, :], other=0.0)
        x = tl.load(x_ptr + (k0 - BLOCK_K) + ks, mask=(k0 - BLOCK_K + ks) < K, other=0.0)
        acc += x.to(tl.float32)[None, :] * w.to(tl.float32)
        w = w_next
    tl.store(out_ptr + cols, tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty), mask=col_ok)


# Strips of 16 or 32 columns, 128 or 256 values of K per step, 3-5 steps in flight.
_CONFIGS = [
    triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s)
    for n, k, w, s in [
        (16, 256, 4, 4), (16, 256, 4, 5), (16, 128, 4, 5), (32, 256, 4, 4), (32, 128, 4, 5), (32, 256, 8, 3),
    ]
]


def _short_bench(kernel_call, quantiles):
    """5 ms of warm-up and 20 of timing per configuration (Triton's default is 25 + 100): a start
    tunes every projection shape at every row tile."""
    return triton.testing.do_bench(kernel_call, warmup=5, rep=20, quantiles=quantiles)


_linear_autotuned = triton.autotune(
    configs=_CONFIGS, key=["BLOCK_M", "N", "K"], do_bench=_short_bench, cache_results=True
)(_linear_kernel)
_INTERPRETER_CONFIG = {"BLOCK_N": 16, "BLOCK_K": 32}

# 4 columns x 1024 of K on 4 warps is the x projection's best tile; shorter K tiles and 8-column
# strips leave the autotuner room at other shapes.
_GEMV_CONFIGS = [
    triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=1)
    for n, k, w in [(4, 1024, 4), (4, 512, 4), (8, 1024, 8), (8, 512, 4)]
]
_gemv_autotuned = triton.autotune(
    configs=_GEMV_CONFIGS, key=["N", "K"], do_bench=_short_bench, cache_results=True
)(_gemv_kernel)
_INTERPRETER_GEMV_CONFIG = {"BLOCK_N": 4, "BLOCK_K": 32}
# The dot kernel's narrowest strip: with fewer strips per group than SMs, one row takes the GEMV.
_DOT_MIN_BLOCK_N = 16


def row_tile(rows: int) -> int:
    """Rows per program: the power of two >= rows, at least 16 (tl.dot's smallest tile)."""
    return max(16, triton.next_power_of_2(rows))


def takes_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """For one row: whether the dot kernel's narrowest strips would leave SMs without a program."""
    return weight.shape[0] * triton.cdiv(weight.shape[1], _DOT_MIN_BLOCK_N) < num_sms(x.device)


def linear_triton(x: torch.Tensor, weight: torch.Tensor, one_row_gemv: bool | None = None) -> torch.Tensor:
    """x [M, G, K] (M <= MAX_ROWS) and weight [G, N, K] -> [M, G, N] in x's dtype, fp32 accumulation:
    out[:, g] = x[:, g] @ weight[g]^T. K must be contiguous in both. Allocates only the output
    (CUDA-graph safe). one_row_gemv: None lets `takes_gemv` choose between the GEMV and the dot
    kernel for one row; True or False forces it (benchmarks). An fp32 x with a half weight
    (`upcasts_weight`) takes one row, always through the GEMV, whose math is fp32 throughout."""
    rows, groups, k = x.shape
    n = weight.shape[1]
    if rows > MAX_ROWS:
        raise ValueError(f"linear (triton): at most {MAX_ROWS} rows, got {rows}")
    if upcasts_weight(x, weight):
        if rows > 1 or one_row_gemv is False:
            raise ValueError(f"linear (triton): an fp32 x with a {weight.dtype} weight takes one row, through the GEMV; "
                             f"got {rows} rows, one_row_gemv={one_row_gemv}")
        one_row_gemv = True
    if x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError("linear (triton): x and weight must be contiguous along K")
    out = torch.empty((rows, groups, n), dtype=x.dtype, device=x.device)
    if rows == 0 or n == 0 or groups == 0:
        return out
    if rows == 1 and (takes_gemv(x, weight) if one_row_gemv is None else one_row_gemv):
        _launch_gemv(x, weight, out)
        return out
    args = (x, weight, out, rows, n, k, x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), out.stride(0), out.stride(1))
    meta = dict(BLOCK_M=row_tile(rows), PRECISION=dot_precision(x.dtype))
    if interpreting():
        grid = (triton.cdiv(n, _INTERPRETER_CONFIG["BLOCK_N"]), groups)
        _linear_kernel[grid](*args, **meta, **_INTERPRETER_CONFIG)
    else:
        _linear_autotuned[lambda cfg: (triton.cdiv(n, cfg["BLOCK_N"]), groups)](*args, **meta, **dependent_options(x.device))
    return out


def _launch_gemv(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> None:
    _, groups, k = x.shape
    n = weight.shape[1]
    args = (x, weight, out, n, k, x.stride(1), weight.stride(0), weight.stride(1), out.stride(1))
    if interpreting():
        _gemv_kernel[(triton.cdiv(n, _INTERPRETER_GEMV_CONFIG["BLOCK_N"]), groups)](*args, **_INTERPRETER_GEMV_CONFIG)
    else:
        _gemv_autotuned[lambda cfg: (triton.cdiv(n, cfg["BLOCK_N"]), groups)](*args, **dependent_options(x.device))
