"""GPU benchmark of what a kernel launch costs inside a CUDA graph: a chain of CHAIN dependent
tiny kernels (each adds one to every element of a buffer the one before it wrote) captured in one
graph, the replay's time over the chain's length. The kernels' own work is a few hundred bytes a
program, so the time is the launch: one kernel draining and the next starting. That is what a
fusion that removes a kernel from a decode step wins back, beside the bytes it saves.

Programs a kernel: 1, one per SM and eight per SM. Launched plainly and, where the GPU has
programmatic dependent launch (Hopper and later: kernels/triton_util.py's launches_dependents),
as programmatic dependents: each kernel waits on the device for its predecessor before its load
(`gdc_wait`) and lets its successor launch once it has loaded (`gdc_launch_dependents`). The
chain's result is checked (every element equal to the chain's length) before it is timed."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.bench.tables import markdown_table
from kernels.bench.timing import graphs_of, median_time_us
from kernels.triton_util import launches_dependents, num_sms

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
        + markdown_table(header, rows) + "\n"
    )
