"""GPU benchmark of the mHC split + Sinkhorn kernel at V4's hc=4 and 20 iterations, against the
plain-torch reference (each half-iteration its own kernels), for every batch bucket and 128.

Both run inside one CUDA graph per rotating input set; the call is latency-bound (kilobytes of
data), so the time is what a decode step pays for it. The kernel is checked against the
reference first."""
from __future__ import annotations

import torch

from kernels.bench.tables import markdown_table
from kernels.bench.timing import graph_time_us
from kernels.hc_sinkhorn.ref import hc_split_sinkhorn_reference
from kernels.hc_sinkhorn.triton import CELLS_PER_PROGRAM, NUM_WARPS, hc_split_sinkhorn_triton

HC, ITERS, EPS = 4, 20, 1e-6
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128)
SETS = 8
TOLERANCE = 1e-4  # relative; fp32 against fp32 in another summation order


def run(copy_gbs: float) -> str:
    del copy_gbs  # kilobytes per call: latency, not bandwidth
    width = (2 + HC) * HC
    kernel = lambda m, s, b: hc_split_sinkhorn_triton(m, s, b, HC, ITERS, EPS)  # noqa: E731
    reference = lambda m, s, b: hc_split_sinkhorn_reference(m, s, b, HC, ITERS, EPS)  # noqa: E731
    rows = []
    for batch in BATCHES:
        sets = [
            (torch.randn(batch, width, device="cuda"), torch.rand(3, device="cuda") + 0.5, torch.randn(width, device="cuda"))
            for _ in range(SETS)
        ]
        for got, expected in zip(kernel(*sets[0]), reference(*sets[0])):
            err = ((got - expected).abs().max() / expected.abs().max()).item()
            if err > TOLERANCE:
                raise AssertionError(f"hc_split_sinkhorn B={batch}: relative error {err:.2e}")
        ours, theirs = graph_time_us(kernel, sets), graph_time_us(reference, sets)
        rows.append([batch, f"{ours:.1f}", f"{theirs:.1f}", f"{theirs / ours:.1f}x"])
    header = ["B", f"Triton ({CELLS_PER_PROGRAM} cells per program, {NUM_WARPS} warps) us", "plain-torch reference us", "speed-up"]
    return (
        f"## mHC split + Sinkhorn (hc={HC}, {ITERS} iterations, fp32)\n\n"
        "One CUDA graph per input set; the kernel matched the plain-torch reference first.\n\n"
        + markdown_table(header, rows) + "\n"
    )
