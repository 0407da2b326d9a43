"""Arrival of split work: the programs that each write a part of a tile (a split of K, a slice
of a token's reduction) count their arrival on a counter, and the last to arrive combines the
parts. The counters live in one zeroed buffer per device and role (side work or not); every
last arrival sets its counter back to zero, so no launch needs a memset."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.side_stream import in_side_work

COUNTER_SLOTS = 4096  # arrival counters per device and role (split_counters)

_COUNTERS: dict[tuple[torch.device, bool], torch.Tensor] = {}


def split_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """Arrival counters of split tiles, zero between launches (the last program of a tile resets
    its own). One buffer per device and per role (the side work of kernels/side_stream.py's
    run_beside, which runs beside the rest, or the rest), made outside any CUDA-graph capture so
    that captured calls share it too; split-K calls of one role must therefore not run
    concurrently (run_beside never runs side work beside side work). A capture that finds no
    buffer (or a call with more tiles than it holds) gets a zeroed buffer of its own, whose memset
    the graph then records."""
    key = (device, in_side_work(device))
    counters = _COUNTERS.get(key)
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if counters is None and not capturing:
        counters = _COUNTERS[key] = torch.zeros(COUNTER_SLOTS, dtype=torch.int32, device=device)
    if counters is None or tiles > counters.numel():
        return torch.zeros(tiles, dtype=torch.int32, device=device)
    return counters


@triton.jit
def arrives_last(counter, PARTS: tl.constexpr):
    """Count this program's arrival once its part is written: whether it is the last of the
    PARTS (which then combines them, reading the others' writes with .cg, and sets the counter
    back to zero with tl.atomic_xchg)."""
    tl.debug_barrier()  # every thread's part is written before the arrival is counted
    return tl.atomic_add(counter, 1, sem="acq_rel") == PARTS - 1
