"""CUDA-graph capture, one way for every caller: warm up off the capture, then capture one call."""
from __future__ import annotations

import contextlib
from typing import Callable

import torch


def capture(
    fn: Callable[[], object], *, pool=None, warmup: int = 1, capture_error_mode: str = "global"
) -> tuple[torch.cuda.CUDAGraph, object]:
    """Run fn() `warmup` times on a side stream (compiles, autotunes and allocates outside the
    capture, as torch recommends), synchronise, then capture one call of fn into a new graph, in
    the memory pool `pool` if given. Returns the graph and fn's output from the capture: the
    tensors each replay writes. `capture_error_mode` as torch.cuda.graph takes it ("thread_local"
    where other threads make CUDA calls during the capture, e.g. a communicator's watchdog).
    A capture that fails raises, with the caller's stream current again (`_abandon`); its pool
    cannot take another capture (torch still counts it as recording): capture into a new one."""
    if warmup:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                fn()
        torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.current_stream()
    pool = torch.cuda.graph_pool_handle() if pool is None else pool  # its id, for _abandon
    try:
        with torch.cuda.graph(graph, pool=pool, capture_error_mode=capture_error_mode):
            out = fn()
    except BaseException:
        _abandon(graph, pool, stream)
        raise
    return graph, out


def _abandon(graph: torch.cuda.CUDAGraph, pool, stream: torch.cuda.Stream) -> None:
    """Undo what a failed capture left behind. When the capture is invalidated (a synchronising
    call inside it, say), torch.cuda.graph's exit raises from capture_end before the caching
    allocator stops recording into the graph's pool and before the caller's stream is current
    again: later allocations would be routed to the dead capture, later work would run on the
    capture's stream. Ending the recording does not make the pool usable again: torch refuses
    a new capture into it ("already recording"), hence a new pool after a failure."""
    if torch.cuda.is_current_stream_capturing():
        with contextlib.suppress(RuntimeError):
            graph.capture_end()  # ends the stream's capture, then raises for the invalid graph
    with contextlib.suppress(RuntimeError):  # raises where capture_end got that far itself
        torch._C._cuda_endAllocateToPool(stream.device_index, pool)
    torch.cuda.set_stream(stream)
