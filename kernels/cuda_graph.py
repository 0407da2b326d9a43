"""CUDA-graph capture, one way for every caller: warm up off the capture, then capture one call."""
from __future__ import annotations

from typing import Callable

import torch


def capture(
    fn: Callable[[], object], *, pool=None, warmup: int = 1, capture_error_mode: str = "global"
) -> tuple[torch.cuda.CUDAGraph, object]:
    """Run fn() `warmup` times on a side stream (compiles, autotunes and allocates outside the
    capture, as torch recommends), synchronise, then capture one call of fn into a new graph, in
    the memory pool `pool` if given. Returns the graph and fn's output from the capture: the
    tensors each replay writes. `capture_error_mode` as torch.cuda.graph takes it ("thread_local"
    where other threads make CUDA calls during the capture, e.g. a communicator's watchdog)."""
    if warmup:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                fn()
        torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, capture_error_mode=capture_error_mode):
        out = fn()
    return graph, out
