"""Launch facts shared by the Triton paths."""
from __future__ import annotations

import contextlib
import contextvars
import os

import torch

# Under TRITON_INTERPRET=1 (tests on a CPU) there is no SM count; plans use this one instead.
INTERPRETER_NUM_SMS = 8
# sm_90's opt-in maximum per program: the plans' assumption where the device cannot say.
SM90_SHARED_MEMORY_PER_BLOCK = 227 * 1024
# A split of K takes at least this many 128-blocks, so its pipeline is full most of the time.
MIN_BLOCKS_PER_SPLIT = 4


def triton_version() -> str | None:
    """Triton's version; None where it is not installed."""
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def interpreting() -> bool:
    """Whether Triton kernels run in its interpreter (TRITON_INTERPRET=1): no grids, no launch options."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return INTERPRETER_NUM_SMS


def shared_memory_per_block(device: torch.device) -> int:
    """Bytes of shared memory one program may use (opt-in maximum); sm_90's under the interpreter."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return getattr(props, "shared_memory_per_block_optin", 0) or SM90_SHARED_MEMORY_PER_BLOCK
    return SM90_SHARED_MEMORY_PER_BLOCK


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs would default to TF32 on tensor cores; keep them exact like the reference.
    return "ieee" if dtype == torch.float32 else "tf32"


def converts_e4m3(device: torch.device) -> bool:
    """Whether Gluon kernels on `device` can use the hardware's e4m3 <-> f16 conversions: a CUDA
    GPU of sm_89 or newer, not the interpreter (which runs no Gluon kernel)."""
    return device.type == "cuda" and not interpreting() and torch.cuda.get_device_capability(device) >= (8, 9)


# Cleared inside `plain_launches()`; read where a kernel is launched (or captured into a graph).
_DEPENDENT_LAUNCHES = contextvars.ContextVar("dependent_launches", default=True)


@contextlib.contextmanager
def plain_launches():
    """Within it, the kernels launched here (and captured into CUDA graphs) are plain launches,
    not programmatic dependents: what dependent launch saves, measured side by side
    (`fuse bench --variants fuse,fuse-no-pdl`)."""
    token = _DEPENDENT_LAUNCHES.set(False)
    try:
        yield
    finally:
        _DEPENDENT_LAUNCHES.reset(token)


def launches_dependents(device: torch.device) -> bool:
    """Whether kernels on `device` launch as programmatic dependents: a Hopper-or-later GPU (not
    the interpreter), a Triton with the grid-dependency primitives, outside `plain_launches()`."""
    if not _DEPENDENT_LAUNCHES.get():
        return False
    if device.type != "cuda" or interpreting() or torch.cuda.get_device_capability(device)[0] < 9:
        return False
    import triton.language as tl

    return hasattr(tl.extra.cuda, "gdc_wait") and hasattr(tl.extra.cuda, "gdc_launch_dependents")
