"""The one place for CUDA-event and CUDA-graph timing of the GPU kernel benchmarks (medians,
rotating inputs, copy bandwidth)."""
from __future__ import annotations

import statistics
from typing import Callable, Sequence

import torch

from kernels.cuda_graph import capture


def median_time_us(fn: Callable[..., object], input_sets: Sequence[tuple], warmup: int = 10, reps: int = 100) -> float:
    """Median device time of fn(*inputs) in microseconds, cycling through input_sets so that
    repeated calls do not hit a warm L2 (give enough sets to exceed its size)."""
    for i in range(warmup):
        fn(*input_sets[i % len(input_sets)])
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        args = input_sets[i % len(input_sets)]
        starts[i].record()
        fn(*args)
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends))


def graphs_of(fn: Callable[..., object], input_sets: Sequence[tuple]) -> list[torch.cuda.CUDAGraph]:
    """One CUDA graph per input set, each replaying fn on that set (fn warmed up once, on the first)."""
    graphs = []
    for i, args in enumerate(input_sets):
        graph, _ = capture(lambda: fn(*args), warmup=1 if i == 0 else 0)
        graphs.append(graph)
    return graphs


def graph_time_us(fn: Callable[..., object], input_sets: Sequence[tuple]) -> float:
    """Median time of replaying one CUDA graph per input set (no launch overhead)."""
    return median_time_us(lambda g: g.replay(), [(g,) for g in graphs_of(fn, input_sets)])


def chained_time_us(fn: Callable[..., object], input_sets: Sequence[tuple], reps: int = 20) -> float:
    """Time per call of one CUDA graph that calls fn on every input set in turn: calls back to
    back as in a decode step (no graph launch per call, each kernel's ramp and tail included)."""
    graph = graphs_of(lambda: [fn(*args) for args in input_sets], [()])[0]
    return median_time_us(graph.replay, [()], warmup=3, reps=reps) / len(input_sets)


def copy_bandwidth_gbs(nbytes: int = 2 << 30, reps: int = 20) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read plus bytes written."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    us = median_time_us(lambda: dst.copy_(src), [()], warmup=3, reps=reps)
    return 2 * src.numel() * src.element_size() / (us * 1e-6) / 1e9


def rotation_count(bytes_per_set: int, l2_bytes: int | None = None) -> int:
    """How many input sets to rotate through so that their total is at least 4x the L2."""
    if l2_bytes is None:
        l2_bytes = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20)
    return max(2, min(64, -(-4 * l2_bytes // max(1, bytes_per_set))))
