"""One warm-up + capture helper for CUDA graphs, shared by the runner, tests and benchmarks."""
from __future__ import annotations

from typing import Callable

import torch


def capture(fn: Callable[[], object], *, pool=None, warmup: int = 1) -> tuple[torch.cuda.CUDAGraph, object]:
    """Run fn() `warmup` times on a side stream (as torch recommends), then capture one call into
    a new graph (in `pool` if given): (graph, what fn returned during capture)."""
    if warmup:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                fn()
        torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        output = fn()
    return graph, output
