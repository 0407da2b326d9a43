"""GPU benchmark of the router's product: fp32 rows times its bf16 weight (V4-Flash: 256 experts x
4096), exact in fp32 as the official gate computes it. `linear` (the `v4::grouped_linear` op: the
fp32 GEMV at one row, the library's product at more) against what runs without the op: cuBLAS's fp32 product of the weight upcast every call. The
ways are timed in turn (interleaved graph replays, median of rounds) on rotating inputs; kernels
per call from the profiler. Each way is checked against an fp64 product first."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.bench.linear import BATCHES, kernels_per_call
from kernels.bench.tables import markdown_table
from kernels.bench.timing import interleaved_graph_times_us
from kernels.linear import linear

EXPERTS, DIM = 256, 4096
TOLERANCE = 1e-5  # relative to the output scale: fp32 sums in another order (bf16 rows: ~1e-3)
SETS = 8  # rotating inputs: the weight is 2 MB, L2-resident in every way alike


def run(copy_gbs: float) -> str:
    del copy_gbs  # the product is L2- and latency-bound; no bandwidth column
    ways = {"op": linear, "cuBLAS of the upcast": lambda x, w: F.linear(x, w.float())}
    rows_out = []
    for batch in BATCHES:
        sets = [(torch.randn(batch, DIM, device="cuda"), (torch.randn(EXPERTS, DIM, device="cuda") * DIM**-0.5).bfloat16())
                for _ in range(SETS)]
        x, w = sets[0]
        expected = F.linear(x.double(), w.double())
        for name, fn in ways.items():
            err = ((fn(x, w).double() - expected).abs().max() / expected.abs().max()).item()
            if err > TOLERANCE:
                raise AssertionError(f"router B={batch} {name}: relative error {err:.2e} > {TOLERANCE}")
        times = interleaved_graph_times_us(ways, sets)
        ours, theirs = times["op"], times["cuBLAS of the upcast"]
        rows_out.append([batch, f"{ours:.1f}", f"{theirs:.1f}", f"{theirs / ours:.2f}x",
                         kernels_per_call(ways["op"], sets[0]), kernels_per_call(ways["cuBLAS of the upcast"], sets[0])])
    header = ["B", "op us", "cuBLAS of the upcast us", "speed-up", "kernels (op)", "kernels (cuBLAS)"]
    return (
        f"## The router's product (fp32 rows x bf16 weight, {EXPERTS} x {DIM})\n\n"
        "One CUDA graph per input set, the two ways replayed in turn (median of rounds). 'op': `linear` "
        "(one row: the fp32 GEMV; more: "
        "the library's product); 'cuBLAS of the upcast': `F.linear(x, w.float())`, the weight upcast "
        f"every call. Both matched an fp64 product within {TOLERANCE:g} of the output scale first.\n\n"
        + markdown_table(header, rows_out) + "\n"
    )
