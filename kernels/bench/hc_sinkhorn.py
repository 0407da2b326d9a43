"""GPU benchmark of the mHC split + Sinkhorn kernel at V4's hc=4 and 20 iterations: the kernel
with one token per thread (opt-in) against the default, the general kernel (a program's tokens
spread over two warps, sums as cross-thread reductions), and the general kernel with fewer
matrix cells per program (fewer cells per thread, more programs), for every batch bucket and 128.

Both run inside one CUDA graph per rotating input set; the call is latency-bound (kilobytes of
data), so the time is what a decode step pays for it. Each is checked against the plain-torch
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
# (label, keyword arguments of hc_split_sinkhorn_triton); the default first.
VARIANTS = [
    (f"general {CELLS_PER_PROGRAM} cells w{NUM_WARPS} (default)", {}),
    ("one token per thread", {"per_token": True}),
    ("general, approximate division", {"exact_division": False}),
    ("general 128 cells w2", {"cells_per_program": 128, "num_warps": 2}),
    ("general 64 cells w2", {"cells_per_program": 64, "num_warps": 2}),
    ("general 32 cells w1", {"cells_per_program": 32, "num_warps": 1}),
    ("general 16 cells w1", {"cells_per_program": 16, "num_warps": 1}),
]


def run(copy_gbs: float) -> str:
    width = (2 + HC) * HC
    rows = []
    for batch in BATCHES:
        sets = [
            (torch.randn(batch, width, device="cuda"), torch.rand(3, device="cuda") + 0.5, torch.randn(width, device="cuda"))
            for _ in range(SETS)
        ]
        want = hc_split_sinkhorn_reference(*sets[0], HC, ITERS, EPS)
        times = []
        for label, kwargs in VARIANTS:
            fn = lambda m, s, b, kwargs=kwargs: hc_split_sinkhorn_triton(m, s, b, HC, ITERS, EPS, **kwargs)  # noqa: E731
            for got, expected in zip(fn(*sets[0]), want):
                err = ((got - expected).abs().max() / expected.abs().max()).item()
                if err > TOLERANCE:
                    raise AssertionError(f"hc_split_sinkhorn B={batch} {label}: relative error {err:.2e}")
            times.append(graph_time_us(fn, sets))
        rows.append([batch] + [f"{t:.1f} ({times[0] / t:.2f}x)" for t in times])
    header = ["B"] + [f"{label} us (speed-up)" for label, _ in VARIANTS]
    return (
        f"## mHC split + Sinkhorn (hc={HC}, {ITERS} iterations, fp32)\n\n"
        "One CUDA graph per input set; every variant matched the plain-torch reference first. "
        "Speed-up against the default.\n\n"
        + markdown_table(header, rows) + "\n"
    )
