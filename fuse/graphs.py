"""Per-bucket warm-up and CUDA-graph capture into one shared pool, with a fallback per bucket.

Every compile, Triton JIT and autotune happens in a bucket's first call, outside any capture. A
bucket whose capture fails runs without a graph (compiled, else eager) and says why; the other
buckets are unaffected. A model split across ranks instead stops on every rank with the error of
a rank whose compile or capture failed (its ranks must run the same collectives in the same
order: fuse/step.py's agreed_call)."""
from __future__ import annotations

import contextlib
import gc
import logging
import time
import traceback
from dataclasses import dataclass
from typing import Callable, ContextManager

import torch
import torch._dynamo

from fuse.padding import Inputs, padding_rows
from fuse.stats import RunnerStats
from fuse.step import StepFn, agreed_call, decode_mode, split_ranks
from kernels.cuda_graph import capture

log = logging.getLogger("fuse")


def supports_graphs(device: torch.device) -> bool:
    return device.type == "cuda"


@dataclass
class Bucket:
    size: int
    inputs: Inputs  # preallocated: a call copies its batch in and pads the rest
    run: Callable[[], torch.Tensor]  # the step on `inputs`; a graph's output is overwritten by the next replay
    graph: torch.cuda.CUDAGraph | None = None


def build_buckets(
    step: StepFn, model, sizes: tuple[int, ...], use_graphs: bool, stats: RunnerStats, eager: StepFn,
    progress: bool = True, first_call: Callable[[int], ContextManager] | None = None,
) -> dict[int, Bucket]:
    """Warm up (and with `use_graphs` capture) one bucket per size, largest first so that the
    smaller graphs reuse the shared pool's memory. `eager` is the last resort of a bucket whose
    graph and compiled run both fail; `first_call(size)` wraps each bucket's first call (where
    it compiles)."""
    first_call = first_call or (lambda size: contextlib.nullcontext())
    pool = torch.cuda.graph_pool_handle() if use_graphs and model.device.type == "cuda" else None
    buckets: dict[int, Bucket] = {}
    # Dynamo keeps one cache entry per (layer kind, shape) on a shared code object.
    with _compile_settings(8 * (len(sizes) + 1)), decode_mode(), stats.counting_compiles():
        for size in sorted(sizes, reverse=True):
            start = time.perf_counter()
            buckets[size] = _build_bucket(size, step, model, use_graphs, pool, stats, eager, first_call)
            if pool is not None and size in stats.fallbacks:
                # torch raises from a failed capture's end before the allocator stops recording
                # into its pool, and no call undoes that: later buckets capture into a new pool.
                pool = torch.cuda.graph_pool_handle()
            stats.warmup_seconds[size] = time.perf_counter() - start
            if progress:
                how = "graph" if size in stats.captured else stats.fallbacks.get(size, "no graph")
                log.warning("fuse: bucket %3d ready in %6.1f s (%s)", size, stats.warmup_seconds[size], how)
    return buckets


def _build_bucket(size: int, step: StepFn, model, use_graphs: bool, pool, stats: RunnerStats, eager: StepFn, first_call) -> Bucket:
    inputs = padding_rows(model, size)
    with stats.phase("first calls", model.device), first_call(size):
        # compile (or check the eager path) now, not on the first request
        agreed_call(model, f"the first call (compile) of bucket {size}", lambda: step(*inputs))
    if not use_graphs:
        return Bucket(size, inputs, run=lambda: step(*inputs))
    ranks = split_ranks(model)
    if ranks is not None:
        # Split across ranks: the graph holds the step's collectives; every rank captures, or
        # every rank stops with the error of one that could not (no rank falls back alone).
        # Another thread (the communicator's watchdog) may query the device during the capture.
        with stats.phase("warm-up and capture", model.device):
            graph, output = agreed_call(
                model, f"the capture of bucket {size}", lambda: capture(lambda: step(*inputs), pool=pool, capture_error_mode="thread_local")
            )
        ranks.agree(f"the capture of bucket {size}")
        stats.captured.append(size)
        return Bucket(size, inputs, run=_replay(graph, output), graph=graph)
    reason = None
    try:
        with stats.phase("warm-up and capture", model.device):
            graph, output = capture(lambda: step(*inputs), pool=pool)
    except Exception as error:  # noqa: BLE001 - this bucket runs without a graph; the others are unaffected
        reason = f"capture failed: {type(error).__name__}: {error}".splitlines()[0][:300]
        traceback.clear_frames(error.__traceback__)  # the tensors its frames hold, whoever keeps the error
    if reason is not None:
        # Outside the except block, so that the error's traceback, and the tensors its frames
        # held, are gone: what the failed capture allocated (out of memory, say) goes back to
        # the device for the other buckets and for this bucket's run without a graph.
        if model.device.type == "cuda":
            torch.cuda.synchronize(model.device)
            gc.collect()
            torch.cuda.empty_cache()
        log.warning("fuse: bucket %d falls back to running without a CUDA graph (%s)", size, reason)
        try:
            step(*inputs)
            stats.fallbacks[size] = reason + ("; runs compiled without a graph" if step != eager else "; runs eager without a graph")
            return Bucket(size, inputs, run=lambda: step(*inputs))
        except Exception as second:  # noqa: BLE001
            stats.fallbacks[size] = reason + f"; compiled run failed too ({type(second).__name__}); runs eager"
            return Bucket(size, inputs, run=lambda: eager(*inputs))
    stats.captured.append(size)
    return Bucket(size, inputs, run=_replay(graph, output), graph=graph)


def _replay(graph: torch.cuda.CUDAGraph, output: torch.Tensor) -> Callable[[], torch.Tensor]:
    def replay() -> torch.Tensor:
        graph.replay()
        return output

    return replay


def _compile_settings(limit: int):
    """Dynamo's settings while the buckets compile: room for `limit` recompiles, and what the
    process compiled before left out of the trace. Left to Dynamo, a size or a float that differs
    between two compiles of one frame (a second decoder of other widths in the process) becomes
    symbolic: the custom ops' float arguments refuse a symbolic float (softmax scales, epsilons),
    and a width traced symbolic gives other graphs than a fresh process traces (the compile
    workers': their graphs then miss the cache here). The batch is marked dynamic explicitly."""
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    constants = {"specialize_float": True} if hasattr(config, "specialize_float") else {}
    return config.patch({name: max(getattr(config, name), limit), "automatic_dynamic_shapes": False, **constants})
