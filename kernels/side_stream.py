"""Work issued beside the current stream: a fork and a join that CUDA-graph capture records as two
branches of the graph, so that a small product can run while a kernel that leaves SMs idle (the
routed experts at small batches) runs on the current stream."""
from __future__ import annotations

from contextvars import ContextVar
from typing import Callable, TypeVar

import torch

S = TypeVar("S", torch.Tensor, list[torch.Tensor])
T = TypeVar("T")

_SIDE_STREAMS: dict[tuple[int, int], list[torch.cuda.Stream]] = {}
# Devices whose run_beside is issuing its side work now. Which work is side work follows from the
# calls, not from stream identity: torch hands streams out of a small pool in turn, so a stream
# made elsewhere (a capture's warm-up stream, a server's own) can be this module's side stream.
_ISSUING_SIDE_WORK: ContextVar[frozenset[int]] = ContextVar("issuing_side_work", default=frozenset())


def side_stream(device_index: int, priority: int = 0, current: torch.cuda.Stream | None = None) -> torch.cuda.Stream:
    """A side stream of the device of that priority (CUDA's: 0 the default, lower numbers first)
    other than `current`, made on first use (a warm-up call, before any capture). Where the
    current stream is the one made first (torch's stream pool came round to it), another."""
    streams = _SIDE_STREAMS.setdefault((device_index, priority), [])
    for stream in streams:
        if stream != current:
            return stream
    stream = torch.cuda.Stream(device_index, priority=priority)
    while stream == current:  # the pool's next stream differs from the current one
        stream = torch.cuda.Stream(device_index, priority=priority)
    streams.append(stream)
    return stream


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def in_side_work(device: torch.device) -> bool:
    """Whether work issued now on `device` is run_beside's side work (it runs beside the current
    stream's work, so the two must not share scratch such as split-K counters)."""
    return device.type == "cuda" and _index(device) in _ISSUING_SIDE_WORK.get()


def run_beside(side_work: Callable[[], S], main_work: Callable[[], T], device: torch.device, priority: int = 0) -> tuple[S, T]:
    """(side_work(), main_work()): on CUDA side_work is issued on the device's side stream (of
    `priority`), after everything issued so far on the current stream, and main_work on the
    current stream; the current stream then waits for the side stream, so whatever is issued next
    sees both results (side_work returns a tensor or a list of them). Elsewhere, and inside
    another run_beside's side work (one side stream a device: its scratch is per role), the two
    run one after the other."""
    if device.type != "cuda" or in_side_work(device):
        return side_work(), main_work()
    index = _index(device)
    main = torch.cuda.current_stream(device)
    side = side_stream(index, priority, current=main)
    side.wait_stream(main)
    issuing = _ISSUING_SIDE_WORK.set(_ISSUING_SIDE_WORK.get() | {index})
    try:
        with torch.cuda.stream(side):
            side_result = side_work()
    finally:
        _ISSUING_SIDE_WORK.reset(issuing)
    main_result = main_work()
    main.wait_stream(side)
    # Freed by its caller on the current stream: its block must not go back to the side stream's
    # pool before the current stream is done with it.
    for tensor in side_result if isinstance(side_result, (list, tuple)) else (side_result,):
        tensor.record_stream(main)
    return side_result, main_result
