"""GPU benchmark of what a kernel launch costs inside a CUDA graph: a chain of CHAIN dependent
tiny kernels (each adds one to every element of a buffer the one before it wrote) captured in one
graph, the replay's time over the chain's length. The kernels' own work is a few hundred bytes a
program, so the time is the launch: one kernel draining and the next starting. That is what a
fusion that removes a kernel from a decode step wins back, beside the bytes it saves.

Programs a kernel: 1, one per SM and eight per SM. Launched plainly and, where the GPU has
programmatic dependent launch (Hopper and later: kernels/triton_util.py's launches_dependents),
as programmatic dependents: each kernel waits on the device for its predecessor before its load
(`gdc_wait`) and lets its successor launch once it has loaded (`gdc_launch_dependents`). The
chain's result is checked (every element equal to the chain's length) before it is timed.

Then the same for real kernels: V4-Flash's FP8 products of one layer at batch 1, one after another
in a graph, as plain launches (kernels.triton_util.plain_launches) and as the op launches them,
programmatic dependents that load their first weight bytes before they wait."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.bench.blockscale import TOLERANCE
from kernels.bench.tables import markdown_table
from kernels.bench.timing import graphs_of, interleaved_graph_times_us, median_time_us, rotation_count
from kernels.blockscale import blockscale_linear, blockscale_linear_reference, quantize_fp8_weight
from kernels.triton_util import launches_dependents, num_sms, plain_launches

CHAIN = 200  # kernels a graph
BLOCK = 256  # elements a program


@triton.jit
def _add_one_kernel(x_ptr, n, BLOCK: tl.constexpr, DEPENDENT: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    if DEPENDENT:
        tl.extra.cuda.gdc_wait()  # the predecessor's writes are visible from here
    v = tl.load(x_ptr + offs, mask=offs < n)
    if DEPENDENT:
        tl.extra.cuda.gdc_launch_dependents()
    tl.store(x_ptr + offs, v + 1, mask=offs < n)


def chain_us_per_kernel(programs: int, dependent: bool) -> float:
    """Time per kernel of a graph of CHAIN launches of `programs` programs each."""
    x = torch.zeros(programs * BLOCK, device="cuda")
    options = {"launch_pdl": True} if dependent else {}

    def chain():
        for _ in range(CHAIN):
            _add_one_kernel[(programs,)](x, x.numel(), BLOCK=BLOCK, DEPENDENT=dependent, **options)

    graph = graphs_of(chain, [()])[0]
    x.zero_()
    graph.replay()
    torch.cuda.synchronize()
    if not bool((x == CHAIN).all()):
        raise AssertionError(f"launch cost ({programs} programs, dependent={dependent}): the chain's sum is wrong")
    return median_time_us(graph.replay, [()], warmup=3, reps=20) / CHAIN


def run(copy_gbs: float) -> str:
    del copy_gbs  # launches, not bytes
    sms = num_sms(torch.device("cuda"))
    pdl = launches_dependents(torch.device("cuda"))
    rows = []
    for programs in (1, sms, 8 * sms):
        plain = chain_us_per_kernel(programs, dependent=False)
        dependent = chain_us_per_kernel(programs, dependent=True) if pdl else None
        rows.append([programs, f"{plain:.2f}", f"{dependent:.2f}" if pdl else "n/a",
                     f"{plain / dependent:.2f}x" if pdl else "n/a"])
    header = ["programs a kernel", "plain launch us a kernel", "programmatic dependent us a kernel", "speed-up"]
    return (
        f"## A kernel launch inside a CUDA graph\n\nA graph of {CHAIN} dependent kernels (each adds one to "
        f"a buffer, {BLOCK} elements a program), time per kernel; the chain's sum checked first. "
        "'programmatic dependent': launched with PDL, waiting on the device for the kernel before it.\n\n"
        + markdown_table(header, rows) + "\n\n" + (layer_products_table() if pdl else "")
    )


# V4-Flash's FP8 products of a layer (N, K): wq_a+wkv, wq_b, wo_b, shared w1/w3, shared w2.
LAYER_FP8_PRODUCTS = ((1536, 4096), (32768, 1024), (4096, 8192), (2048, 4096), (4096, 2048))


def layer_products_table() -> str:
    """A layer's FP8 products at batch 1 chained in a graph, plain against dependent launches."""
    def products(xs, weights):
        return [blockscale_linear(xs[k], w, s) for (w, s), (_, k) in zip(weights, LAYER_FP8_PRODUCTS)]

    def plain(xs, weights):
        with plain_launches():
            return products(xs, weights)

    xs = {k: torch.randn(1, k, device="cuda").bfloat16() for _, k in LAYER_FP8_PRODUCTS}
    layer_bytes = sum(n * k for n, k in LAYER_FP8_PRODUCTS)
    sets = [(xs, [quantize_fp8_weight(torch.randn(n, k, device="cuda") * k**-0.5) for n, k in LAYER_FP8_PRODUCTS])
            for _ in range(rotation_count(layer_bytes))]
    for way in (products, plain):
        for got, (w, s), (_, k) in zip(way(*sets[0]), sets[0][1], LAYER_FP8_PRODUCTS):
            want = blockscale_linear_reference(xs[k], w, s)
            if (got.float() - want.float()).abs().max() > TOLERANCE * want.float().abs().max():
                raise AssertionError(f"launch cost: the FP8 product {tuple(w.shape)} does not match its reference")
    times = interleaved_graph_times_us({"plain": plain, "dependent": products}, sets)
    rows = [[len(LAYER_FP8_PRODUCTS), f"{times['plain']:.1f}", f"{times['dependent']:.1f}",
             f"{times['plain'] / times['dependent']:.2f}x"]]
    header = ["products", "plain launches us", "programmatic dependents us", "speed-up"]
    return (
        "A layer's FP8 products at batch 1 (N x K: " + ", ".join(f"{n} x {k}" for n, k in LAYER_FP8_PRODUCTS)
        + ") one after another in a CUDA graph, the op's kernels as plain launches and as programmatic "
        f"dependents (the default on this GPU); {len(sets)} weight sets rotated past the L2, one graph each, "
        "the two ways replayed in turn (median of rounds); each product checked against its reference first.\n\n"
        + markdown_table(header, rows) + "\n"
    )
