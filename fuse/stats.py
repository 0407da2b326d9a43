"""What a runner counts: compiles, graph breaks, recompiles, captures, fallbacks, and where its
start-up time went."""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch
from torch._dynamo.utils import counters

# Phases of a start, in the order they happen: loading an artifact (fuse/artifact.py), compiling
# the custom ops' kernels ahead (fuse/precompile.py), then per bucket its first calls and its
# capture, then saving the artifact.
START_PHASES = (
    "artifact load", "kernel compiles ahead", "waiting for compile workers", "first calls", "warm-up and capture", "artifact save",
)
# Parts of the first calls, from torch's own compile timers: Dynamo's tracing, the backend (which
# includes waiting for kernel compiles), and the autotuning of Inductor's kernels (at their first run).
COMPILE_PHASES = ("dynamo", "backend compile or cache load", "kernel compile", "autotune")
# torch's timers (torch._dynamo.utils.compilation_time_metrics keys) behind the last two.
KERNEL_COMPILE_TIMERS = ("async_compile.wait", "async_compile.precompile")
AUTOTUNE_TIMERS = (
    "CachingAutotuner.benchmark_all_configs", "CachingAutotuner.coordinate_descent_tuning",
    "CachingAutotuner.combo_sequential_autotune",
)  # and every "*_template_autotuning" (max-autotune's choice of GEMM templates)


@dataclass
class RunnerStats:
    compiles: int = 0  # graphs Dynamo compiled (all in warm-up, unless a recompile happened)
    # Graphs Inductor and AOTAutograd compiled rather than loaded from their caches, and Triton
    # cache entries the custom ops wrote (a kernel or its launcher compiled, an autotune run):
    # all 0 in a start from a matching artifact or a warm cache.
    inductor_compiles: int = 0
    aot_compiles: int = 0
    triton_compiles: int = 0
    kernels_compiled_ahead: int = 0  # Triton compiles (or disk-cache loads) submitted before the first calls
    compile_workers: int = 0  # worker processes that compiled the step's graphs into the caches (fuse/compile_workers.py)
    compile_workers_started: int = 0  # worker processes started: those not counted above failed, with a warning
    # Per compile worker that reached its end: seconds per phase (fuse/compile_workers.py WORKER_PHASES).
    compile_worker_seconds: list[dict[str, float]] = field(default_factory=list)
    compile_worker_peak_bytes: int = 0  # the largest CUDA allocator peak among them (their contexts besides)
    graph_breaks: int = 0
    recompiles: int = 0  # compiles after warm-up (lenient mode only; strict mode raises)
    captured: list[int] = field(default_factory=list)  # buckets replayed from a CUDA graph
    fallbacks: dict[int, str] = field(default_factory=dict)  # bucket -> why it runs without a graph
    warmup_seconds: dict[int, float] = field(default_factory=dict)
    # Seconds per START_PHASES entry, summed over buckets, and per COMPILE_PHASES entry (torch's
    # timers, which may overlap each other and so are not clipped to the first calls).
    start_seconds: dict[str, float] = field(default_factory=dict)

    @contextlib.contextmanager
    def phase(self, name: str, device: torch.device):
        """Adds the block's wall time, its device work finished, to start_seconds[name]."""
        start = time.perf_counter()
        try:
            yield
        finally:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            self.add_seconds({name: time.perf_counter() - start})

    def add_seconds(self, seconds: dict[str, float]) -> None:
        """Adds each entry to start_seconds."""
        for name, value in seconds.items():
            self.start_seconds[name] = self.start_seconds.get(name, 0.0) + value

    @contextlib.contextmanager
    def counting_compiles(self):
        """Adds the compiles, graph breaks and compile-timer seconds of the block."""
        compiles0, breaks0 = dynamo_totals()
        backend0 = compile_counts()
        timers0 = compile_timer_totals()
        try:
            yield
        finally:
            compiles1, breaks1 = dynamo_totals()
            self.compiles += compiles1 - compiles0
            self.graph_breaks += breaks1 - breaks0
            backend1 = compile_counts()
            self.inductor_compiles += backend1["inductor"] - backend0["inductor"]
            self.aot_compiles += backend1["aot_autograd"] - backend0["aot_autograd"]
            self.add_seconds({name: total - timers0[name] for name, total in compile_timer_totals().items()})

    def describe_start(self) -> str | None:
        t = self.start_seconds
        if not t:
            return None
        compile_part = ", ".join(f"{name} {t[name]:.1f} s" for name in COMPILE_PHASES if name in t)
        phases = [
            f"{name} {t[name]:.1f} s" + (f" (torch's compile timers: {compile_part})" if name == "first calls" and compile_part else "")
            for name in START_PHASES
            if name in t
        ]
        return "start: " + ", ".join(phases)


def dynamo_totals() -> tuple[int, int]:
    """(graphs Dynamo compiled, graph breaks) in this process so far."""
    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def compile_counts() -> dict[str, int]:
    """Graphs Inductor and AOTAutograd compiled in this process so far rather than loaded from
    their caches (cache misses and bypasses)."""
    inductor, aot = counters["inductor"], counters["aot_autograd"]
    return {
        "inductor": inductor["fxgraph_cache_miss"] + inductor["fxgraph_cache_bypass"],
        "aot_autograd": aot["autograd_cache_miss"] + aot["autograd_cache_bypass"],
    }


def compile_timer_totals() -> dict[str, float]:
    """Seconds per COMPILE_PHASES entry in this process so far: a frame's compile
    (`_compile.compile_inner`) is Dynamo's tracing and guards plus the backend
    (`OutputGraph.call_user_compiler`: AOTAutograd and Inductor, cache hits included), of which
    "kernel compile" is the wait for Inductor's generated kernels (Triton on CUDA, C++ on the
    CPU) to compile or load; "autotune" is Inductor's kernels' autotuning. The custom ops'
    Triton compiles and autotuning have no torch timer: they are part of the first calls."""
    from torch._dynamo.utils import compilation_time_metrics

    total = lambda key: sum(compilation_time_metrics.get(key, ()))  # noqa: E731
    backend = total("OutputGraph.call_user_compiler")
    autotune = sum(total(key) for key in AUTOTUNE_TIMERS) + sum(
        sum(times) for key, times in list(compilation_time_metrics.items()) if key.endswith("_template_autotuning")
    )
    return {
        "dynamo": total("_compile.compile_inner") - backend, "backend compile or cache load": backend,
        "kernel compile": sum(total(key) for key in KERNEL_COMPILE_TIMERS), "autotune": autotune,
    }
