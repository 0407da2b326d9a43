"""GPU benchmark of the mHC split + Sinkhorn kernel at V4's hc=4 and 20 iterations: the kernel
with one token per thread (opt-in) against the default, the general kernel (a program's tokens
spread over two warps, sums as cross-thread reductions), for every batch bucket and 128.

Both run inside one CUDA graph per rotating input set; the call is latency-bound (kilobytes of
data), so the time is what a decode step pays for it. Each is checked against the plain-torch
reference first."""
from __future__ import annotations

import torch

from kernels.benchutil import graph_time_us, markdown_table
from kernels.hc_sinkhorn import hc_split_sinkhorn_reference
from kernels.hc_sinkhorn_triton import hc_split_sinkhorn_triton

HC, ITERS, EPS = 4, 20, 1e-6
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128)
SETS = 8
TOLERANCE = 1e-4  # relative; fp32 against fp32 in another summation order


def run(copy_gbs: float) -> str:
    width = (2 + HC) * HC
    rows = []
    for batch in BATCHES:
        sets = [
            (torch.randn(batch, width, device="cuda"), torch.rand(3, device="cuda") + 0.5, torch.randn(width, device="cuda"))
            for _ in range(SETS)
        ]
        times = {}
        for per_token in (True, False):
            fn = lambda m, s, b, per_token=per_token: hc_split_sinkhorn_triton(m, s, b, HC, ITERS, EPS, per_token)  # noqa: E731
            for got, want in zip(fn(*sets[0]), hc_split_sinkhorn_reference(*sets[0], HC, ITERS, EPS)):
                err = ((got - want).abs().max() / want.abs().max()).item()
                if err > TOLERANCE:
                    raise AssertionError(f"hc_split_sinkhorn B={batch} per_token={per_token}: relative error {err:.2e}")
            times[per_token] = graph_time_us(fn, sets)
        rows.append([batch, f"{times[True]:.1f}", f"{times[False]:.1f}", f"{times[False] / times[True]:.2f}x"])
    header = ["B", "one token per thread us", "general kernel us", "speed-up"]
    return (
        f"## mHC split + Sinkhorn (hc={HC}, {ITERS} iterations, fp32)\n\n"
        "One CUDA graph per input set; both kernels matched the plain-torch reference first.\n\n"
        + markdown_table(header, rows) + "\n"
    )
