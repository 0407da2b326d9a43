"""GPU benchmark of the decode-shaped projections (`v4::linear`) against cuBLAS (`F.linear`), at
the bench preset's shapes that cuBLAS splits over K: the fused x projection (1600 x 4096),
`wo_b` (4096 x 8192) and the shared expert's w1/w3 (4096 x 4096), bf16, for every batch bucket.

Both run one CUDA graph per rotating weight set (sets together > 4x L2), so the time is device
time with the weights read from memory. Kernels per call are counted from the profiler: cuBLAS's
split-K adds a reduce kernel. Bandwidth counts the weight bytes (x and y are L2-sized). Every
case is checked against an fp64 product before it is timed."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from kernels.benchutil import graph_time_us, markdown_table, rotation_count
from kernels.linear import linear

SHAPES = {"x projection": (1600, 4096), "wo_b": (4096, 8192), "shared w1/w3": (4096, 4096)}
BATCHES = (1, 2, 4, 8, 16, 32, 64)
TOLERANCE = 8e-3  # max error relative to the output scale: bf16 output rounding, fp32 sums


def kernels_per_call(fn, args) -> int:
    fn(*args)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn(*args)
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def run(copy_gbs: float) -> str:
    rows_out = []
    worst = {}
    for label, (n, k) in SHAPES.items():
        weight_bytes = n * k * 2
        weights = [(torch.randn(n, k, device="cuda") * k**-0.5).to(torch.bfloat16) for _ in range(rotation_count(weight_bytes))]
        for batch in BATCHES:
            sets = [(torch.randn(batch, k, device="cuda").to(torch.bfloat16), w) for w in weights]
            x, w = sets[0]
            expected = (x.double() @ w.double().t()).float()
            for name, fn in (("triton", linear), ("cublas", F.linear)):
                err = ((fn(x, w).float() - expected).abs().max() / expected.abs().max()).item()
                if err > TOLERANCE:
                    raise AssertionError(f"{label} B={batch} {name}: relative error {err:.2e} > {TOLERANCE}")
            ours, theirs = graph_time_us(linear, sets), graph_time_us(F.linear, sets)
            worst[label] = max(worst.get(label, 0.0), ours / theirs)
            rows_out.append([
                label, f"{n} x {k}", batch, f"{ours:.1f}", f"{theirs:.1f}", f"{theirs / ours:.2f}x",
                kernels_per_call(linear, sets[0]), kernels_per_call(F.linear, sets[0]),
                f"{weight_bytes / ours / 1e3:.0f} ({100 * weight_bytes / ours / 1e3 / copy_gbs:.0f}%)",
            ])
    header = ["projection", "N x K", "B", "v4::linear us", "cuBLAS us", "speed-up", "kernels (ours)", "kernels (cuBLAS)", "ours GB/s (% copy)"]
    verdict = ", ".join(f"{label}: worst {ratio:.2f}x cuBLAS's time" for label, ratio in worst.items())
    return (
        "## Decode projections (`v4::linear` vs cuBLAS, bf16)\n\n"
        "One CUDA graph per rotating weight set; every case matched an fp64 product within "
        f"{TOLERANCE:g} of the output scale first.\n\n" + markdown_table(header, rows_out) + f"\n\n{verdict}.\n"
    )
