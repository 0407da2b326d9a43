"""The one place for timing, shared by the kernel benchmarks and the step benchmarks: CUDA events
and graphs (medians, rotating inputs, copy bandwidth) and wall-clock samples with their spread."""
from __future__ import annotations

import collections
import statistics
import time
from dataclasses import dataclass
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


def interleaved_graph_times_us(ways: dict[str, Callable[..., object]], input_sets: Sequence[tuple], rounds: int = 5,
                               reps: int = 40) -> dict[str, float]:
    """Each way's graph_time_us, measured side by side: `rounds` rounds that time every way in
    turn (`reps` replays each), the median of the rounds' medians per way. Ways a few us apart
    measured one after another differ by the clock and cache drift between them; in turns, the
    drift falls on every way alike."""
    graphs = {name: [(g,) for g in graphs_of(fn, input_sets)] for name, fn in ways.items()}
    samples: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(rounds):
        for name, replays in graphs.items():
            samples[name].append(median_time_us(lambda g: g.replay(), replays, warmup=len(replays), reps=reps))
    return {name: statistics.median(values) for name, values in samples.items()}


def chained_time_us(fn: Callable[..., object], input_sets: Sequence[tuple], reps: int = 20) -> float:
    """Time per call of one CUDA graph that calls fn on every input set in turn: calls back to
    back as in a decode step (no graph launch per call, each kernel's ramp and tail included)."""
    graph = graphs_of(lambda: [fn(*args) for args in input_sets], [()])[0]
    return median_time_us(graph.replay, [()], warmup=3, reps=reps) / len(input_sets)


def kernel_launches(fn: Callable[..., object], input_sets: Sequence[tuple], calls: int = 1) -> list[tuple[str, float]]:
    """Every kernel launch of `calls` calls of fn (cycling through input_sets, after one call of
    warm-up), as (kernel name, device time in microseconds), from the profiler."""
    from torch.profiler import ProfilerActivity, profile

    fn(*input_sets[0])
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(calls):
            fn(*input_sets[i % len(input_sets)])
        torch.cuda.synchronize()
    return [(event.name, getattr(event, "device_time", None) or event.cuda_time)  # torch renamed it
            for event in prof.events() if event.device_type == torch.autograd.DeviceType.CUDA]


def kernel_times_us(fn: Callable[..., object], input_sets: Sequence[tuple], calls: int = 20) -> dict[str, float]:
    """Where a call's device time goes: each kernel fn launches (by name, its launches summed) and
    its device time per call in microseconds, slowest first, over `calls` calls (kernel_launches)."""
    totals: collections.Counter[str] = collections.Counter()
    for name, us in kernel_launches(fn, input_sets, calls):
        totals[name] += us
    return {name: us / calls for name, us in totals.most_common()}


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


def _on_cuda(inputs: Sequence[object]) -> bool:
    return any(isinstance(t, torch.Tensor) and t.is_cuda for t in inputs)


def call_ms(fn: Callable[..., object], *inputs) -> float:
    """Wall time of one fn(*inputs) in ms, device-synchronised before and after on CUDA: the
    host's launch and the wait for the result included."""
    cuda = _on_cuda(inputs)
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn(*inputs)
    if cuda:
        torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - start)


def back_to_back_ms(fn: Callable[..., object], inputs: tuple, steps: int) -> float:
    """Time per call in ms of `steps` calls issued back to back, as a serving loop that keeps the
    GPU fed issues them: the host launches a call while the GPU still runs the one before, so a
    call costs its GPU time (CUDA events bracket the calls). Wall time off the GPU."""
    if not _on_cuda(inputs):
        start = time.perf_counter()
        for _ in range(steps):
            fn(*inputs)
        return 1e3 * (time.perf_counter() - start) / steps
    first, last = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    first.record()
    for _ in range(steps):
        fn(*inputs)
    last.record()
    last.synchronize()
    return first.elapsed_time(last) / steps


# A spread (max / min) above this over repeats of the same call means the machine was busy.
NOISY_SPREAD = 1.5


@dataclass(frozen=True)
class Samples:
    """Repeated timings of one thing, in ms."""

    values: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    @property
    def low(self) -> float:
        return min(self.values)

    @property
    def high(self) -> float:
        return max(self.values)

    @property
    def spread(self) -> float:
        return self.high / self.low if self.low > 0 else float("inf")

    @property
    def noisy(self) -> bool:
        return self.spread > NOISY_SPREAD

    def __str__(self) -> str:
        return f"{self.median:.2f} ms ({self.low:.2f}-{self.high:.2f})"

    def to_dict(self) -> dict:
        return {"median": self.median, "min": self.low, "max": self.high, "samples": len(self.values)}


def wall_samples(fn: Callable[..., object], *inputs, steps: int = 10, warmup: int = 2) -> Samples:
    """`steps` synchronised wall times of fn(*inputs) (`call_ms`) after `warmup` untimed calls."""
    for _ in range(warmup):
        fn(*inputs)
    return Samples(tuple(call_ms(fn, *inputs) for _ in range(steps)))
