"""The attention input's products at V4-Flash widths (kernels.linear.linears_beside): one after
another on one stream against the products after the first on the side stream, and the op's
choice between the two, for a ratio-4 layer (fp32 compressors 2560 x 4096, FP8 x projection
1536 x 4096, bf16 index weights 64 x 4096) and a ratio-128 layer (fp32 1024 x 4096 and the FP8
x projection)."""
from __future__ import annotations

import torch

from kernels.bench.tables import markdown_table
from kernels.bench.timing import interleaved_graph_times_us
from kernels.blockscale.ref import quantize_fp8_weight
from kernels.linear import linears_beside
from kernels.linear.op import run_products

DIM = 4096
BATCHES = (1, 16, 64)
SETS = 8  # inputs rotated, one graph each
LAYERS = {"ratio 4": (2560, True), "ratio 128": (1024, False)}  # fp32 rows, with the bf16 index weights


def layer_products(fp32_rows: int, with_index: bool, generator: torch.Generator):
    fp32 = torch.randn(fp32_rows, DIM, device="cuda", generator=generator) * DIM**-0.5
    fp8, fp8_scale = quantize_fp8_weight(torch.randn(1536, DIM, device="cuda", generator=generator) * DIM**-0.5)
    weights, scales = [fp32, fp8], [None, fp8_scale]
    if with_index:
        weights.append((torch.randn(64, DIM, device="cuda", generator=generator) * DIM**-0.5).to(torch.bfloat16))
        scales.append(None)
    return weights, scales


def run(copy_gbs: float) -> str:
    generator = torch.Generator("cuda").manual_seed(0)
    rows = []
    for layer, (fp32_rows, with_index) in LAYERS.items():
        weights, scales = layer_products(fp32_rows, with_index, generator)
        for batch in BATCHES:
            sets = []
            for _ in range(SETS):
                x = torch.randn(batch, DIM, device="cuda", generator=generator).to(torch.bfloat16)
                sets.append(([x.float()] + [x] * (len(weights) - 1),))
            ways = {
                "one stream": lambda inputs: run_products(inputs, weights, scales, True, beside=False),
                "side stream": lambda inputs: run_products(inputs, weights, scales, True, beside=True),
                "op": lambda inputs: linears_beside(inputs, weights, scales),
            }
            expected = ways["one stream"](*sets[0])
            for name, way in ways.items():
                if not all(torch.equal(a, b) for a, b in zip(way(*sets[0]), expected)):
                    raise AssertionError(f"linears_beside {layer} B={batch}: {name} differs from the products one by one")
            us = interleaved_graph_times_us(ways, sets)
            rows.append([layer, len(weights), batch, *(f"{t:.1f}" for t in us.values()),
                         f"{us['one stream'] / us['side stream']:.2f}x", f"{us['one stream'] / us['op']:.2f}x"])
            print(f"linears_beside {layer} B={batch}: " + ", ".join(f"{k} {v:.1f} us" for k, v in us.items()), flush=True)
    table = markdown_table(["layer", "products", "B", "one stream graph us", "side stream graph us", "op graph us",
                            "side stream speedup", "op speedup"], rows)
    return (
        "## Products of the attention input beside each other (`v4::linears_beside`)\n\n"
        "Every way matched the products run one by one bit for bit before timing. One CUDA graph per input set, "
        f"{SETS} sets rotated; the ways timed in turn, median of 5 rounds. 'one stream': the products one after "
        "another; 'side stream': the first (fp32) on the current stream, the others beside it; 'op': `linears_beside`, "
        "which takes the side stream where at least two products follow the first.\n\n" + table + "\n"
    )
