"""Triton block-scaled products (semantics: kernels/blockscale/ref.py): y = act_quant(x) W^T for an
FP8 or FP4 weight with its block scales, at decode batch sizes.

Decode reads the whole weight for a few rows, so the kernel is built around streaming every
weight byte once with all SMs busy:

- Program (n, s, m) owns BLOCK_N output columns of one tile of BLOCK_M rows and the s-th of
  SPLIT equal runs of K's 128-blocks. N tiles alone give every SM a program for wide weights;
  narrow ones (few N tiles) split K as well (`plan_launch`).
- Per 128-block of K: the rows' activation scale and e4m3 values (act_quant's, bit for bit: the
  shared arithmetic of kernels/blockscale/device.py); then, per weight-scale group of that block
  (the whole block for FP8, four groups of 32 for FP4), the weight codes times those values in one
  fp16 `tl.dot` with fp32 accumulation, times the weight scales of each column. The block sum
  times the rows' activation scales is added to the fp32 accumulator.
- fp16 operands hold e4m3 values and e2m1 values (2^-14 times them, the 2^14 folded into the
  weight scales) exactly, their products are exact in fp32, and every scale is applied in fp32
  after the dot, so the result differs from the reference (operands
  dequantised to fp32, one product) in summation order only. The same dtype runs under
  TRITON_INTERPRET=1, whose bf16 dot is wrong.
- FP8 weights on a GPU with e4m3 tensor cores (sm_89 or newer) take an e4m3 x e4m3 dot instead,
  as the official FP8 GEMM does: no conversion of the codes, each 128-block's products summed by
  the tensor cores with fewer bits than fp32 (held to 0.008 of the output's scale), then scaled
  and added in fp32. The fp16 dot stays the product for FP4 weights and under the interpreter.
- Split K: each program writes its fp32 partial tile to a scratch buffer and counts its arrival;
  the last program of a tile sums the partials in split order (deterministic whichever program
  arrives last), writes the output and sets the counter back to zero for the next launch (no
  memset per call: kernels/arrival.py `split_counters`). Nothing syncs with the host and
  every allocation depends on shapes only, so a call can be captured in a CUDA graph.

Activations are quantised once by the act_quant pre-pass (kernels/blockscale/act_quant_pass.py:
e4m3 values and fp32 scales, 1 byte a value) from more than IN_KERNEL_QUANT_MAX_ROWS rows, and by
every program otherwise (`plan_launch` says why).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from kernels.blockscale.act_quant_pass import act_quant_triton
from kernels.blockscale.device import act_scale, quantize_e4m3, unpack_e2m1, weight_scale_to_fp32
from kernels.blockscale.ref import FP4_BLOCK, FP8_BLOCK
from kernels.arrival import arrives_last, split_counters
from kernels.dependent_launch import dependent_options, wait_for_predecessor
from kernels.triton_util import MIN_BLOCKS_PER_SPLIT, converts_e4m3, interpreting, num_sms


@triton.jit
def _weight_codes(w_ptr, cols, col_ok, k, stride_wn, SUB_K: tl.constexpr, FP4: tl.constexpr):
    """Columns `cols` x inputs [k, k + SUB_K) of the weight without their scales: e4m3 codes as
    stored, e2m1 codes as fp16 (exact: 2^-14 times their values, which the FP4 scales undo). FP4
    rows hold two codes a byte, low nibble first."""
    starts = cols.to(tl.int64)[:, None] * stride_wn
    if FP4:
        packed = tl.load(w_ptr + starts + (k // 2 + tl.arange(0, SUB_K // 2))[None, :], mask=col_ok[:, None], other=0)
        return unpack_e2m1(packed)
    else:
        return tl.load(w_ptr + starts + (k + tl.arange(0, SUB_K))[None, :], mask=col_ok[:, None], other=0.0)


@triton.jit
def _product(w, xq, PRODUCT: tl.constexpr):
    """w [N, K] (weight codes) times xq [K, M] (e4m3 values): fp32 [N, M] by a tensor-core dot, as
    PRODUCT says (PRODUCTS): fp16 (e4m3 and e2m1 values are exact in fp16, their products in fp32),
    or e4m3 (FP8 weights, on the GPU: no conversion, but the tensor cores add each product group
    with fewer bits than fp32)."""
    if PRODUCT == 0:
        return tl.dot(w.to(tl.float16), xq.to(tl.float16))
    else:
        return tl.dot(w, xq.to(tl.float8e4nv))


@triton.jit
def _blockscale_linear_kernel(
    x_ptr, xq_ptr, xs_ptr, w_ptr, s_ptr, out_ptr, partial_ptr, counter_ptr,
    M, N, K_BLOCKS, BLOCKS_PER_SPLIT,
    stride_xm, stride_wn, stride_sn, stride_sk, stride_om,
    FP4: tl.constexpr, SCALE_E8M0: tl.constexpr, POW2: tl.constexpr, X_QUANTIZED: tl.constexpr,
    SUB_K: tl.constexpr, SCALE_ROWS: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRODUCT: tl.constexpr,
    DEPENDENT: tl.constexpr = False,
):
    wait_for_predecessor(DEPENDENT)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    sub = tl.arange(0, SUB_K)
    # The weight is the dot's first operand (columns x K), the rows its second (K x rows): the
    # tile is out^T, so the few rows take the dot's narrow dimension.
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    first = pid_k * BLOCKS_PER_SPLIT
    last = tl.minimum(first + BLOCKS_PER_SPLIT, K_BLOCKS)
    for block in range(first, last):
        k0 = block * 128
        if X_QUANTIZED:
            x_scale = tl.load(xs_ptr + rows * K_BLOCKS + block, mask=row_ok, other=1.0)
        else:
            x_block = tl.load(
                x_ptr + rows[None, :] * stride_xm + (k0 + tl.arange(0, 128))[:, None], mask=row_ok[None, :], other=0.0
            ).to(tl.float32)
            x_scale = act_scale(tl.max(tl.abs(x_block), axis=0), POW2)
        block_sum = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for part in tl.static_range(128 // SUB_K):
            k = k0 + part * SUB_K
            if X_QUANTIZED:
                xq = tl.load(xq_ptr + rows[None, :] * K_BLOCKS * 128 + (k + sub)[:, None], mask=row_ok[None, :], other=0.0)
            else:
                if SUB_K == 128:
                    x_part = x_block
                else:
                    x_part = tl.load(
                        x_ptr + rows[None, :] * stride_xm + (k + sub)[:, None], mask=row_ok[None, :], other=0.0
                    ).to(tl.float32)
                xq = quantize_e4m3(x_part, x_scale[None, :], POW2)
            w = _weight_codes(w_ptr, cols, col_ok, k, stride_wn, SUB_K, FP4)
            w_scale = tl.load(s_ptr + (cols // SCALE_ROWS) * stride_sn + (k // SUB_K) * stride_sk, mask=col_ok, other=0)
            w_scale = weight_scale_to_fp32(w_scale, SCALE_E8M0, FP4)
            block_sum += _product(w, xq, PRODUCT) * w_scale[:, None]
        acc += block_sum * x_scale[None, :]

    mask = col_ok[:, None] & row_ok[None, :]
    out_ptrs = out_ptr + rows[None, :] * stride_om + cols[:, None]
    counter = counter_ptr + pid_m * tl.num_programs(0) + pid_n
    write_tile(acc, out_ptrs, partial_ptr + rows[None, :] * N + cols[:, None], mask, counter, pid_k, M * N, SPLIT)


# No layout-bound operation in it: the Gluon product (kernels/blockscale/gluon.py) calls it too.
@triton.jit
def write_tile(acc, out_ptrs, partial_ptrs, mask, counter, split, split_stride, SPLIT: tl.constexpr):
    """The fp32 tile `acc` into the output, or with K split, this split's partial into the scratch
    (partial_ptrs: the tile's first split, split_stride apart) and, from the last program of the
    tile to arrive, the partials summed in split order (deterministic whichever arrives last)
    into the output, the arrival counter set back to zero for the next launch."""
    if SPLIT == 1:
        tl.store(out_ptrs, acc.to(out_ptrs.dtype.element_ty), mask=mask)
    else:
        tl.store(partial_ptrs + split * split_stride, acc, mask=mask)
        if arrives_last(counter, SPLIT):
            total = tl.load(partial_ptrs, mask=mask, other=0.0, cache_modifier=".cg")
            for s in range(1, SPLIT):
                total += tl.load(partial_ptrs + s * split_stride, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(out_ptrs, total.to(out_ptrs.dtype.element_ty), mask=mask)
            tl.atomic_xchg(counter, 0)


# From more rows than this the activations are quantised once by the pre-pass: each program's
# x tile is then 1 byte a value instead of 2-4, and the amax, division and rounding, which per
# program cost as much as the weight's decoding at 64 rows, run once per value instead of once
# per value and N tile. Up to it, every program quantises its own tile: the values are a few
# KB of L2 reads per program and the launch the pre-pass would add is most of a small product's
# time at batch 1 (both HBM reads are the same: x stays in L2).
IN_KERNEL_QUANT_MAX_ROWS = 16
# How `_product` multiplies (Plan.product); "mma" is kernels/blockscale/gluon.py's product.
PRODUCTS = {"fp16": 0, "e4m3": 1}
MAX_BLOCK_M = 64


@dataclass(frozen=True)
class Plan:
    """Launch shape: rows and columns per program, K's 128-blocks split `split` ways
    (`blocks_per_split` each), whether a pre-pass quantises the activations, and how the product
    is computed (a key of PRODUCTS, "e4m3" for FP8 weights on a GPU only; or "mma", the Gluon
    product of kernels/blockscale/gluon.py)."""

    block_m: int
    block_n: int
    split: int
    blocks_per_split: int
    x_quantized: bool
    num_warps: int = 4
    num_stages: int = 4
    product: str = "fp16"
    blocks_per_step: int = 1  # mma: 128-blocks of K whose loads are issued together (1 or 2)


def plan_launch(rows: int, n: int, k: int, sms: int, e4m3: bool = False) -> Plan:
    """Tiles for `rows` x [n, k]: all rows in one tile up to 64 (the weight read once), 32 columns
    a program up to 16 rows (more programs for narrow weights) and 64 above (a program's x tile
    costs no more L2 reads than its weight strip); K split when the tiles leave SMs idle; the
    product an fp16 dot (`_product`).

    With `e4m3` (FP8 weights on a GPU that has the e4m3 dot) the product is the e4m3 dot, with
    the tiles that measured fastest for it at V4-Flash's FP8 shapes (`python -m kernels.bench
    --only blockscale_plans`): 128 columns and 8 warps up to 16 rows; above, 64 columns and 4
    warps, or 128 and 8 where 128-column tiles alone fill every SM."""
    block_m = min(MAX_BLOCK_M, max(16, triton.next_power_of_2(rows)))
    x_quantized = rows > IN_KERNEL_QUANT_MAX_ROWS
    if not e4m3:
        plan = Plan(block_m, 64 if x_quantized else 32, 1, k // FP8_BLOCK, x_quantized)
    else:
        wide = not x_quantized or triton.cdiv(n, 128) >= sms
        plan = Plan(block_m, 128 if wide else 64, 1, k // FP8_BLOCK, x_quantized, num_warps=8 if wide else 4, product="e4m3")
    return split_where_idle(plan, rows, n, k, sms)


def split_where_idle(plan: Plan, rows: int, n: int, k: int, sms: int, programs_per_sm: int = 1,
                     min_blocks: int = MIN_BLOCKS_PER_SPLIT) -> Plan:
    """`plan` with K split when its tiles leave SMs idle: enough splits to give every SM
    `programs_per_sm` programs, each at least `min_blocks` blocks of K."""
    tiles = triton.cdiv(n, plan.block_n) * triton.cdiv(rows, plan.block_m)
    wanted = programs_per_sm * sms
    split = 1 if tiles >= wanted else max(1, min(triton.cdiv(wanted, tiles), k // FP8_BLOCK // min_blocks))
    return split_plan(plan, k, split)


def split_plan(plan: Plan, k: int, split: int) -> Plan:
    """`plan` with K split `split` ways (tests and benchmarks)."""
    k_blocks = k // FP8_BLOCK
    per_split = triton.cdiv(k_blocks, split)
    return replace(plan, split=triton.cdiv(k_blocks, per_split), blocks_per_split=per_split)


@dataclass(frozen=True)
class LinearLaunch:
    """What a launch of either product takes besides x's rows and the output (launch_rows'), made
    on the host from shapes only: the pre-pass's e4m3 values and fp32 scales (the rows again
    without it: unused), the weight scales (ue8m0 as their bytes) and the split-K scratch and
    counters (the output again without a split: unused)."""

    xq: torch.Tensor
    xs: torch.Tensor
    scale_bits: torch.Tensor
    scale_e8m0: bool
    partials: torch.Tensor
    counters: torch.Tensor


def launch_rows(x: torch.Tensor, weight: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x as rows [M, K] with unit stride along K, and the empty output [M, N] in x's dtype."""
    if weight.stride(-1) != 1:
        raise ValueError(f"blockscale_linear ({name}): the weight must be contiguous along its inputs")
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    return rows, torch.empty((rows.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)


def prepare_launch(rows: torch.Tensor, out: torch.Tensor, scale: torch.Tensor, pow2: bool, plan: Plan) -> LinearLaunch:
    """The buffers of a launch of `plan` on rows -> out (launch_rows')."""
    m, n = out.shape
    e8m0 = scale.dtype == torch.float8_e8m0fnu
    xq, xs = act_quant_triton(rows, pow2) if plan.x_quantized else (rows, rows)
    partials, counters = out, out
    if plan.split > 1:
        partials = torch.empty((plan.split, m, n), dtype=torch.float32, device=rows.device)
        counters = split_counters(rows.device, triton.cdiv(n, plan.block_n) * triton.cdiv(m, plan.block_m))
    return LinearLaunch(xq, xs, scale.view(torch.uint8) if e8m0 else scale, e8m0, partials, counters)


def blockscale_linear_triton(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, pow2: bool = True, plan: Plan | None = None
) -> torch.Tensor:
    """act_quant(x) @ dequantised(weight)^T in x's dtype (see blockscale_linear_reference); inputs
    as `check_blockscale_inputs` takes them, the weight contiguous along K. plan: `plan_launch`'s
    unless given (tests, benchmarks); its product one of PRODUCTS (kernels/blockscale/gluon.py
    runs "mma")."""
    rows, out = launch_rows(x, weight, "triton")
    m, n, k = out.shape[0], out.shape[1], rows.shape[1]
    if m == 0 or n == 0:
        return out.view(*x.shape[:-1], n)
    fp4 = weight.dtype == torch.uint8
    if plan is None:
        plan = plan_launch(m, n, k, num_sms(x.device), e4m3=not fp4 and converts_e4m3(x.device))
    if plan.product not in PRODUCTS:
        raise ValueError(f"blockscale_linear (triton): product {plan.product!r} is not one of {sorted(PRODUCTS)}")
    if plan.product == "e4m3" and (fp4 or interpreting()):
        raise ValueError("blockscale_linear (triton): the e4m3 product takes FP8 weights on a GPU")
    run = prepare_launch(rows, out, scale, pow2, plan)
    launch = {} if interpreting() else {"num_warps": plan.num_warps, "num_stages": plan.num_stages}
    _blockscale_linear_kernel[(triton.cdiv(n, plan.block_n), plan.split, triton.cdiv(m, plan.block_m))](
        rows, run.xq, run.xs, weight, run.scale_bits, out, run.partials, run.counters,
        m, n, k // FP8_BLOCK, plan.blocks_per_split,
        rows.stride(0), weight.stride(0), scale.stride(0), scale.stride(1), out.stride(0),
        FP4=fp4, SCALE_E8M0=run.scale_e8m0, POW2=pow2, X_QUANTIZED=plan.x_quantized,
        SUB_K=FP4_BLOCK if fp4 else FP8_BLOCK, SCALE_ROWS=1 if fp4 else FP8_BLOCK, SPLIT=plan.split,
        BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, PRODUCT=PRODUCTS[plan.product], **launch, **dependent_options(x.device),
    )
    return out.view(*x.shape[:-1], n)
