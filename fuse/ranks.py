"""The ranks a command runs on: one process, or, where torchrun started it, one rank of a model
split across the processes it started (docs/parallel.md). Every rank runs the command; rank 0
writes its outputs, with what every rank measured gathered to it."""
from __future__ import annotations

import datetime
import os

import torch

from model.parallel import ONE_PROCESS, Parallel


def launched_world_size() -> int:
    """How many ranks torchrun started (1 where it did not start this process)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def launched_ranks(device: str) -> tuple[Parallel, str]:
    """(the rank layout, this rank's device). Under torchrun (WORLD_SIZE > 1) it joins the
    process group torchrun set up (NCCL on CUDA, with one GPU per local rank; gloo on the CPU);
    otherwise it is one process on `device`."""
    if launched_world_size() == 1:
        return ONE_PROCESS, device
    import torch.distributed as dist

    if device.startswith("cuda"):
        local = int(os.environ.get("LOCAL_RANK", "0"))
        device = f"cuda:{local}"
        torch.cuda.set_device(local)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo", timeout=datetime.timedelta(minutes=30))
    return Parallel.from_process_group(), device


def gather_to_first(parallel: Parallel, value) -> list | None:
    """Every rank's `value` (picklable) on rank 0, in rank order; None on the other ranks."""
    if parallel.world_size == 1:
        return [value]
    import torch.distributed as dist

    values = [None] * parallel.world_size if parallel.rank == 0 else None
    dist.gather_object(value, values, dst=dist.get_global_rank(parallel.control_group, 0), group=parallel.control_group)
    return values


def on_every_rank(parallel: Parallel, holds: bool) -> bool:
    """Whether `holds` is true on every rank. For a choice made from what a rank finds on its own
    (whether an fp32 copy fits in its memory) that decides which steps, and so which
    collectives, it runs next: every rank must make the same one."""
    if parallel.world_size == 1:
        return holds
    import torch.distributed as dist

    flags = [None] * parallel.world_size
    dist.all_gather_object(flags, bool(holds), group=parallel.control_group)
    return all(flags)
