"""Gluon names that moved between the Triton versions the kernels support (3.6 and newer), for
the Gluon modules (imported only where a GPU runs them)."""
from __future__ import annotations

from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy

# cp.async into shared memory: `async_load` since Triton 3.7, `async_copy_global_to_shared` before.
async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
# A barrier of the executing warps (one partition's inside warp_specialize): `barrier` since
# Triton 3.7, `thread_barrier` before.
barrier = getattr(gl, "barrier", None) or gl.thread_barrier
