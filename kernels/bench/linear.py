"""GPU benchmark of the decode-shaped projections (`v4::grouped_linear`) against cuBLAS, at the
bench preset's shapes that cuBLAS splits over K: the fused x projection (1600 x 4096), `wo_b`
(4096 x 8192) and the shared expert's w1/w3 (4096 x 4096), and the grouped output projection
`wo_a` (8 groups of 1024 x 4096; cuBLAS: einsum's batched GEMM plus the copy to the [B, G * N]
layout `wo_b` reads), bf16, for every batch bucket; and V4's exact LM head (129280 x 4096, fp32
weight and rows), which the op leaves to cuBLAS, with the GEMV beside it at one row.

Both run one CUDA graph per rotating weight set (sets together > 4x L2), so the time is device
time with the weights read from memory, plus one graph launch per call; "chained" times one graph
that calls every set in turn, per call: calls back to back as a decode step runs them. At B=1 the
one-row kernel the routing did not pick (`takes_gemv`) is chained too. Kernels per call are
counted from the profiler: cuBLAS's split-K adds a reduce kernel. Bandwidth counts the weight bytes (x and y are L2-sized). Every
case is checked against an fp64 product before it is timed."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.bench.tables import markdown_table
from kernels.bench.timing import chained_time_us, graph_time_us, kernel_launches, rotation_count
from kernels.linear import grouped_linear, grouped_linear_reference, linear
from kernels.linear.triton import linear_triton, takes_gemv

# name: (groups, N, K, dtype); one group is a plain projection
SHAPES = {
    "x projection": (1, 1600, 4096, torch.bfloat16), "wo_b": (1, 4096, 8192, torch.bfloat16),
    "shared w1/w3": (1, 4096, 4096, torch.bfloat16), "wo_a (grouped)": (8, 1024, 4096, torch.bfloat16),
    "LM head (fp32)": (1, 129280, 4096, torch.float32),
}
BATCHES = (1, 2, 4, 8, 16, 32, 64)
TOLERANCE = 8e-3  # max error relative to the output scale: bf16 output rounding, fp32 sums


def kernels_per_call(fn, args) -> int:
    return len(kernel_launches(fn, [args]))


def run(copy_gbs: float) -> str:
    rows_out = []
    worst = {}
    for label, (groups, n, k, dtype) in SHAPES.items():
        weight_bytes = groups * n * k * dtype.itemsize
        weights = [
            (torch.randn(groups, n, k, device="cuda") * k**-0.5).to(dtype).squeeze(0)
            for _ in range(rotation_count(weight_bytes))
        ]
        if groups == 1:
            ours_fn, cublas_fn = linear, F.linear
        else:
            ours_fn = lambda x, w: grouped_linear(x, w).flatten(1)  # noqa: E731
            cublas_fn = lambda x, w: grouped_linear_reference(x, w).flatten(1)  # noqa: E731
        reference_weight = weights[0].double()  # the first set's, which every batch checks against
        for batch in BATCHES:
            shape = (batch, k) if groups == 1 else (batch, groups, k)
            sets = [(torch.randn(shape, device="cuda").to(dtype), w) for w in weights]
            x, w = sets[0]
            expected = cublas_fn(x.double(), reference_weight).float()
            for name, fn in (("triton", ours_fn), ("cublas", cublas_fn)):
                err = ((fn(x, w).float() - expected).abs().max() / expected.abs().max()).item()
                if err > TOLERANCE:
                    raise AssertionError(f"{label} B={batch} {name}: relative error {err:.2e} > {TOLERANCE}")
            ours, theirs = graph_time_us(ours_fn, sets), graph_time_us(cublas_fn, sets)
            worst[label] = max(worst.get(label, 0.0), ours / theirs)
            other_kernel = "-"
            if batch == 1:  # the one-row kernel the routing did not pick, chained like the others
                takes = takes_gemv(x.view(1, groups, k), w.view(groups, n, k))
                other = lambda x, w: linear_triton(x.view(1, groups, k), w.view(groups, n, k), one_row_gemv=not takes)  # noqa: E731
                err = ((other(x, w).float().view_as(expected) - expected).abs().max() / expected.abs().max()).item()
                if err > TOLERANCE:
                    raise AssertionError(f"{label} B=1 other one-row kernel: relative error {err:.2e}")
                other_kernel = f"{chained_time_us(other, sets):.1f} ({'dot' if takes else 'GEMV'})"
            rows_out.append([
                label, f"{groups} x {n} x {k}", batch, f"{ours:.1f}", f"{theirs:.1f}", f"{theirs / ours:.2f}x",
                f"{chained_time_us(ours_fn, sets):.1f}", f"{chained_time_us(cublas_fn, sets):.1f}", other_kernel,
                kernels_per_call(ours_fn, sets[0]), kernels_per_call(cublas_fn, sets[0]),
                f"{weight_bytes / ours / 1e3:.0f} ({100 * weight_bytes / ours / 1e3 / copy_gbs:.0f}%)",
            ])
    header = [
        "projection", "G x N x K", "B", "ours us", "cuBLAS us", "speed-up", "chained: ours us", "chained: cuBLAS us",
        "chained: the other one-row kernel us", "kernels (ours)", "kernels (cuBLAS)", "ours GB/s (% copy)",
    ]
    verdict = ", ".join(f"{label}: worst {ratio:.2f}x cuBLAS's time" for label, ratio in worst.items())
    return (
        "## Decode projections (`v4::grouped_linear` vs cuBLAS; bf16, the LM head fp32)\n\n"
        "One CUDA graph per rotating weight set ('ours', 'cuBLAS': each replay carries a graph launch); "
        "'chained': one graph calling every set in turn, time per call, as calls run in a step. At B=1 "
        "the one-row kernel the routing did not pick (GEMV or dot kernel), chained. Every case matched "
        f"an fp64 product within {TOLERANCE:g} of the output scale first.\n\n" + markdown_table(header, rows_out) + f"\n\n{verdict}.\n"
    )
