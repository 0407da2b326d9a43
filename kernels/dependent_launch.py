"""Programmatic dependent launch for this package's Triton kernels (Hopper and later).

A kernel launched as a programmatic dependent may start while the kernel before it in the stream
still runs: its launch and its programs' start overlap the predecessor's tail instead of
following it (about 0.4 us a kernel in a CUDA graph: `python -m kernels.bench --only
launch_cost`). Each kernel calls `wait_for_predecessor(DEPENDENT)` before it touches memory that
another kernel may write or read (its inputs, outputs, counters and workspaces): from there the
predecessor has finished and its writes are visible. It then lets its own successor launch, so
a chain of such kernels overlaps launch by launch. Parameters (weights, scales, norm weights)
may be read before the wait: no kernel writes them during a step.

`dependent_options(device)` gives a launch its keywords: DEPENDENT and launch_pdl where
`launches_dependents(device)` (kernels/triton_util.py), nothing elsewhere (the kernel then runs
as a plain launch with DEPENDENT=False)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_util import launches_dependents


@triton.jit
def wait_for_predecessor(DEPENDENT: tl.constexpr):
    if DEPENDENT:
        tl.extra.cuda.gdc_wait()  # the predecessor has finished and its writes are visible
        tl.extra.cuda.gdc_launch_dependents()  # the successor may launch; it waits in turn


def dependent_options(device: torch.device) -> dict:
    """The launch keywords of a kernel that calls wait_for_predecessor(DEPENDENT)."""
    return {"DEPENDENT": True, "launch_pdl": True} if launches_dependents(device) else {}
