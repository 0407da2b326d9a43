"""CUDA-graph capture for the GPU tests of the custom ops."""
from __future__ import annotations

import torch


def capture(fn):
    """Warm fn up on a side stream (as torch recommends), then capture one call: (graph, output)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out
