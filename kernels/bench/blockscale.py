"""GPU benchmark of the block-scaled FP8 product (`v4::blockscale_linear`) at V4-Flash's FP8
shapes: the fused wq_a + wkv (4096 -> 1024 + 512), wq_b (1024 -> 32768), wo_b (8192 -> 4096) and
the shared expert's w1 / w3 (4096 -> 2048) and w2 (2048 -> 4096), for batches 1, 16 and 64, ue8m0
scales, bf16 activations, with the product the op runs (`cuda_product`) named.

Beside it, each product of the same semantics with its own plan: the Triton kernel, the Gluon
product (kernels/blockscale/gluon.py, Plan.product "mma": the codes converted straight into the
tensor-core fragments) and at one row the GEMV (kernels/blockscale/gemv.py); a failure to compile
or match is reported in its column, not timed. And the same weights dequantised to bf16 (exact:
e4m3 times a power of two) through the `kernels.linear` Triton decode kernel and through cuBLAS
(`F.linear`): what the FP8 format saves over a bf16 copy of the checkpoint. Every variant is
checked first (the FP8 products against `blockscale_linear_reference`, the bf16 ones against an
fp64 product of their operands). Times are chained: one CUDA graph calls the variant on every
rotating weight set (sets together > 4x L2, so weights come from memory), time per call, as calls
run back to back in a decode step. Bandwidth counts the bytes a call must move: weight, scales,
activations and output."""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from kernels.bench.tables import markdown_table
from kernels.bench.timing import chained_time_us, rotation_count
from kernels.blockscale import blockscale_linear, blockscale_linear_reference, dequantize_fp8_weight, quantize_fp8_weight
from kernels.blockscale.gemv import BLOCK_N as GEMV_COLUMNS
from kernels.blockscale.gemv import OP_MAX_WEIGHT_BYTES as GEMV_MAX_BYTES
from kernels.blockscale.gemv import blockscale_gemv
from kernels.blockscale.gluon import blockscale_linear_mma, plan_mma
from kernels.blockscale.op import cuda_product
from kernels.blockscale.triton import Plan, blockscale_linear_triton, plan_launch
from kernels.linear import linear
from kernels.triton_util import converts_e4m3, num_sms

# name: (N, K)
SHAPES = {
    "wq_a+wkv (fused)": (1536, 4096), "wq_b": (32768, 1024), "wo_b": (4096, 8192), "shared w1/w3": (2048, 4096),
    "shared w2": (4096, 2048),
}
BATCHES = (1, 2, 8, 16, 64)
TOLERANCE = 8e-3  # max error relative to the output scale: bf16 output rounding, fp32 sums
TARGETS = {1: 0.70, 64: 0.60}  # the FP8 kernel's share of the copy bandwidth to reach
# The op's products (cuda_product's names) as the candidate columns name them.
PRODUCT_NAMES = {"triton": "Triton", "mma": "mma", "gemv": "GEMV"}


def relative_error(y: torch.Tensor, expected: torch.Tensor) -> float:
    return ((y.double() - expected.double()).abs().max() / expected.double().abs().max()).item()


def check(label: str, batch: int, name: str, y: torch.Tensor, expected: torch.Tensor) -> None:
    err = relative_error(y, expected)
    if err > TOLERANCE:
        raise AssertionError(f"{label} B={batch} {name}: relative error {err:.2e} > {TOLERANCE}")


def op_product(batch: int, q: torch.Tensor, scale: torch.Tensor, e4m3_gpu: bool) -> str:
    """The candidate column of the product the op runs for `batch` rows of this weight."""
    return PRODUCT_NAMES[cuda_product(batch, q, scale, e4m3_gpu)]


def describe_plan(plan: Plan) -> str:
    quant = "pre-pass" if plan.x_quantized else "in-kernel"
    return f"{plan.block_m}x{plan.block_n} {plan.product}, split {plan.split}, x {quant}"


def candidates(batch: int, n: int, k: int, sms: int) -> dict[str, tuple[str, Callable]]:
    """The products of the op's semantics timed beside it, each with its launch shape in words:
    the Triton kernel and the Gluon mma product with their own plans, and at one row the GEMV."""
    found = {
        "Triton": (describe_plan(plan_launch(batch, n, k, sms, e4m3=converts_e4m3(torch.device("cuda")))), blockscale_linear_triton),
        "mma": (describe_plan(plan_mma(batch, n, k, sms)), blockscale_linear_mma),
    }
    if batch == 1:
        found["GEMV"] = (f"{GEMV_COLUMNS} columns, K whole", blockscale_gemv)
    return found


def candidate_cells(label: str, batch: int, product: Callable, args: list, nbytes: int, op_us: float, rate) -> tuple[list[str], float]:
    """A product's time, bandwidth and speedup over the op; a failure to compile or match in place
    of the time (the table still lists every shape). Also its bytes per us (0 on failure)."""
    x, q, scale = args[0]
    try:
        check(label, batch, "candidate", product(x, q, scale), blockscale_linear_reference(x, q, scale))
        us = chained_time_us(product, args)
    except Exception as error:  # noqa: BLE001 - reported in the table
        return [f"fails: {type(error).__name__}: {str(error).splitlines()[0][:100]}", "-", "-"], 0.0
    return [f"{us:.1f}", rate(nbytes, us), f"{op_us / us:.2f}x"], nbytes / us / 1e3


def verdict(shares: dict[int, list[float]]) -> str:
    """The worst share of the copy bandwidth per batch against its target."""
    return ", ".join(
        f"B={batch}: worst {100 * min(shares[batch]):.0f}% of copy bandwidth (target {100 * target:.0f}%)"
        for batch, target in TARGETS.items() if batch in shares
    )


def run(copy_gbs: float) -> str:
    rows_out = []
    fractions: dict[str, dict[int, list[float]]] = {}
    names = ("Triton", "mma", "GEMV")
    for label, (n, k) in SHAPES.items():
        fp8_sets, bf16_sets = [], []
        for _ in range(rotation_count(n * k)):
            q, scale = quantize_fp8_weight(torch.randn(n, k, device="cuda") * k**-0.5)
            fp8_sets.append((q, scale))
        for q, scale in fp8_sets[: rotation_count(2 * n * k)]:
            bf16_sets.append(dequantize_fp8_weight(q, scale).to(torch.bfloat16))
        scale_bytes = fp8_sets[0][1].numel() * fp8_sets[0][1].element_size()
        for batch in BATCHES:
            xs = [torch.randn(batch, k, device="cuda").to(torch.bfloat16) for _ in range(max(len(fp8_sets), len(bf16_sets)))]
            fp8_args = [(x, q, s) for x, (q, s) in zip(xs, fp8_sets)]
            bf16_args = [(x, w) for x, w in zip(xs, bf16_sets)]
            x, q, scale = fp8_args[0]
            check(label, batch, "fp8 op", blockscale_linear(x, q, scale), blockscale_linear_reference(x, q, scale))
            x, w = bf16_args[0]
            expected = x.double() @ w.double().t()
            check(label, batch, "bf16 triton", linear(x, w, impl="triton"), expected)
            check(label, batch, "bf16 cublas", F.linear(x, w), expected)

            io_bytes = batch * k * 2 + batch * n * 2
            fp8_bytes, bf16_bytes = n * k + scale_bytes + io_bytes, 2 * n * k + io_bytes
            times = {
                "fp8": chained_time_us(blockscale_linear, fp8_args),
                "bf16 triton": chained_time_us(lambda x, w: linear(x, w, impl="triton"), bf16_args),
                "bf16 cublas": chained_time_us(F.linear, bf16_args),
            }

            def rate(nbytes: int, us: float) -> str:
                gbs = nbytes / us / 1e3
                return f"{gbs:.0f} ({100 * gbs / copy_gbs:.0f}%)"

            fractions.setdefault("op", {}).setdefault(batch, []).append(fp8_bytes / times["fp8"] / 1e3 / copy_gbs)
            runs = op_product(batch, q, scale, converts_e4m3(x.device))
            row = [label, f"{n} x {k}", batch, runs, f"{times['fp8']:.1f}", rate(fp8_bytes, times["fp8"])]
            found = candidates(batch, n, k, num_sms(x.device))
            for name in names:
                if name not in found:
                    row += ["-"] * 4
                    continue
                plan, product = found[name]
                cells, gbs = candidate_cells(label, batch, product, fp8_args, fp8_bytes, times["fp8"], rate)
                fractions.setdefault(name, {}).setdefault(batch, []).append(gbs / copy_gbs)
                row += [plan, *cells]
            rows_out.append(row + [
                f"{times['bf16 triton']:.1f}", rate(bf16_bytes, times["bf16 triton"]),
                f"{times['bf16 cublas']:.1f}", rate(bf16_bytes, times["bf16 cublas"]),
            ])
    header = ["projection", "N x K", "B", "FP8 op runs", "FP8 op us", "FP8 op GB/s (% copy)"]
    for name in names:
        header += [f"{name} plan", f"{name} us", f"{name} GB/s (% copy)", f"{name} speedup"]
    header += ["bf16 triton us", "bf16 triton GB/s (% copy)", "bf16 cuBLAS us", "bf16 cuBLAS GB/s (% copy)"]
    verdicts = "\n".join(f"{'FP8 op' if name == 'op' else name}: {verdict(shares)}." for name, shares in fractions.items())
    return (
        "## Block-scaled FP8 products (`v4::blockscale_linear` vs bf16 Triton and cuBLAS)\n\n"
        "Chained: one CUDA graph calling the variant on every rotating weight set, time per call. Bytes: "
        "weight (+ scales) + activations + output; bf16 variants read the same weights dequantised (twice the "
        f"bytes). Every case matched its reference within {TOLERANCE:g} of the output scale first (a product "
        "that did not is reported instead of timed). 'FP8 op': `v4::blockscale_linear` as the model calls it "
        f"(on sm_89+ the GEMV at one row of at most {GEMV_MAX_BYTES / 2**20:g} MiB of weights, else the Triton "
        "kernel; 'FP8 op runs' names it). Beside it each product of the "
        "same semantics with its own plan and its 'speedup' (the op's time over its own): 'Triton' "
        "(kernels/blockscale/triton.py), 'mma' (kernels/blockscale/gluon.py), 'GEMV' (one row: "
        "kernels/blockscale/gemv.py, K never split).\n\n"
        + markdown_table(header, rows_out)
        + f"\n\n{verdicts}\n"
    )
