"""Work issued beside the current stream: a fork and a join that CUDA-graph capture records as two
branches of the graph, so that a small product can run while a kernel that leaves SMs idle (the
routed experts at small batches) runs on the current stream."""
from __future__ import annotations

from typing import Callable, TypeVar

import torch

S = TypeVar("S", torch.Tensor, list[torch.Tensor])
T = TypeVar("T")

_SIDE_STREAMS: dict[tuple[int, int], torch.cuda.Stream] = {}


def side_stream(device_index: int, priority: int = 0) -> torch.cuda.Stream:
    """The device's side stream of that priority (CUDA's: 0 the default, lower numbers first),
    created on first use (a warm-up call, before any capture)."""
    key = (device_index, priority)
    if key not in _SIDE_STREAMS:
        _SIDE_STREAMS[key] = torch.cuda.Stream(device_index, priority=priority)
    return _SIDE_STREAMS[key]


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def on_side_stream(device: torch.device) -> bool:
    """Whether work issued now on `device` goes to a side stream (inside run_beside's side_work)."""
    if device.type != "cuda":
        return False
    current = torch.cuda.current_stream(device)
    return any(current == stream for (i, _), stream in _SIDE_STREAMS.items() if i == _index(device))


def run_beside(side_work: Callable[[], S], main_work: Callable[[], T], device: torch.device, priority: int = 0) -> tuple[S, T]:
    """(side_work(), main_work()): on CUDA side_work is issued on the device's side stream (of
    `priority`), after everything issued so far on the current stream, and main_work on the
    current stream; the current stream then waits for the side stream, so whatever is issued next
    sees both results (side_work returns a tensor or a list of them). Elsewhere the two run one
    after the other."""
    if device.type != "cuda":
        return side_work(), main_work()
    main = torch.cuda.current_stream(device)
    side = side_stream(_index(device), priority)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        side_result = side_work()
    main_result = main_work()
    main.wait_stream(side)
    # Freed by its caller on the current stream: its block must not go back to the side stream's
    # pool before the current stream is done with it.
    for tensor in side_result if isinstance(side_result, (list, tuple)) else (side_result,):
        tensor.record_stream(main)
    return side_result, main_result
