"""The custom ops' Triton kernels of every bucket, compiled in parallel before the first calls.

The buckets' first calls would compile each kernel variant at its first launch, one at a time.
Instead the eager step of each bucket runs once on fake tensors (torch's FakeTensorMode: nothing
executes, the model's caches are not touched) while kernels/precompile.py records its custom-op
calls; their kernels are then compiled side by side (kernels.precompile.compile_ahead) and the
first calls find them in memory. The fake step runs one block of each kind only: blocks alike
launch the same kernels, and fake tensors cost about as much Python per op as real ones."""
from __future__ import annotations

import warnings
from typing import Callable, Iterable

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from fuse.padding import padding_rows
from fuse.step import layer_kinds
from kernels.precompile import OpCall, compile_ahead, record_op_calls


def distinct_blocks(model) -> list[torch.nn.Module]:
    """The first block of each kind (fuse.step.layer_kinds): blocks alike launch the same kernel
    variants (a variant only a later block of a kind launched would compile at its first launch)."""
    return [model.layers[kind[0]] for kind in layer_kinds(model)]


def bucket_op_calls(model, sizes: tuple[int, ...], step: Callable | None = None) -> dict[OpCall, set[tuple[int | None, int]]]:
    """The distinct custom-op calls of one eager step per bucket size (`step`, default
    model.step, called with `layers=` one block per kind), on fake tensors, each with where it
    was made: (the index of the block's kind in layer_kinds, or None outside the blocks; the
    bucket size). A step that cannot run on fake tensors gives the calls recorded before it
    stopped, with a warning (compiling ahead only saves time; the first calls compile the rest)."""
    step = step or model.step
    blocks = distinct_blocks(model)
    inputs = [padding_rows(model, size) for size in sizes]
    with FakeTensorMode(allow_non_fake_inputs=True), record_op_calls() as recorded:
        try:
            for size, step_inputs in zip(sizes, inputs):
                recorded.where = (None, size)
                step(*step_inputs, layers=[_recorded_at(recorded, (kind, size), block) for kind, block in enumerate(blocks)])
        except Exception as error:  # noqa: BLE001
            warnings.warn(f"compiling kernels ahead: the step did not run on fake tensors ({type(error).__name__}: "
                          f"{str(error).splitlines()[0][:200]}); the first calls compile what was not recorded")
    return recorded.calls


def _recorded_at(recorder: record_op_calls, where: tuple[int, int], block: Callable) -> Callable:
    """`block`, the calls it makes recorded as made at `where`."""
    def run(*args):
        outside, recorder.where = recorder.where, where
        try:
            return block(*args)
        finally:
            recorder.where = outside

    return run


def compile_op_calls(calls: Iterable[OpCall], workers: int | None) -> int:
    """Compile every Triton kernel the recorded calls launch, `workers` at a time; the number of
    compiles submitted. For calls on a GPU (elsewhere the ops run their references)."""
    return compile_ahead([call.replay for call in calls], workers)
