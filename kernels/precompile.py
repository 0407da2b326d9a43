"""Compile the Triton kernels that a set of op calls will launch, in parallel, before they run.

A first call compiles each Triton kernel variant it launches where it launches it, one after
another, while Triton's compile (MLIR, LLVM, ptxas) releases the GIL and would run side by side.
Here the calls are recorded first (`record_op_calls`: the v4:: op calls of, say, one decode step
run on fake tensors), then replayed on empty tensors of the same layouts with every launch made a
compile-only warm-up, the compiles handed to a thread pool (Triton's own AsyncCompileMode). The
kernels land in each kernel's in-memory cache under the key the real launch computes (same
shapes, strides, dtypes and pointer alignment), so the real calls launch them without compiling.
An autotuned kernel compiles every config, as its first real call's benchmark would."""
from __future__ import annotations

import contextlib
import os
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, Mapping

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
from triton.runtime._async_compile import AsyncCompileMode
from triton.runtime.autotuner import Autotuner
from triton.runtime.jit import JITFunction

NAMESPACE = "v4"  # the custom ops of this package (kernels/*/op.py)


@dataclass(frozen=True)
class Layout:
    """What a launch's specialisation sees of a tensor: shape, strides, dtype, device and the
    offset into its storage (pointer alignment)."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    storage_offset: int

    @classmethod
    def of(cls, tensor: torch.Tensor) -> "Layout":
        return cls(tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype, tensor.device, tensor.storage_offset())

    def empty(self) -> torch.Tensor:
        """A tensor of this layout; integers zero, so that indices host code or a torch op of the
        replay reads are in range (no value matters to a compile)."""
        extent = self.storage_offset + 1 + sum((n - 1) * s for n, s in zip(self.shape, self.stride) if n > 0)
        size = extent if all(self.shape) else self.storage_offset
        base = torch.empty(size, dtype=self.dtype, device=self.device)
        if not (self.dtype.is_floating_point or self.dtype.is_complex):
            base.zero_()
        return base.as_strided(self.shape, self.stride, self.storage_offset)


@dataclass(frozen=True)
class OpCall:
    """One call of a v4:: op: the overload and its arguments, tensors as layouts (sequences of
    them as tuples)."""

    op: torch._ops.OpOverload
    args: tuple
    kwargs: tuple[tuple[str, object], ...]
    # Real tensors the op only reads (weights, say), by layout: the replay passes them instead of
    # allocating copies (a layer's experts would take gigabytes).
    stand_ins: Mapping[Layout, torch.Tensor] = field(default_factory=dict, compare=False, hash=False)

    @property
    def name(self) -> str:
        return self.op.name().split("::")[1]

    @property
    def key(self) -> str:
        """The call as text (the op, the layouts and values of its arguments): the same call
        recorded in another process has the same key."""
        return f"{self.op}{self.args!r}{self.kwargs!r}"

    def arguments(self, device: torch.device | None = None) -> tuple[list, dict]:
        """The real tensors the op only reads, else new tensors of the recorded layouts (on
        `device` if given: then new ones only); the other values as recorded."""
        def made(value):
            if isinstance(value, Layout) and device is None and value in self.stand_ins:
                return self.stand_ins[value]
            if isinstance(value, Layout):
                return (value if device is None else replace(value, device=torch.device(device))).empty()
            return [made(v) for v in value] if isinstance(value, tuple) else value

        return [made(v) for v in self.args], {k: made(v) for k, v in self.kwargs}

    def replay(self) -> None:
        args, kwargs = self.arguments()
        self.op(*args, **kwargs)


def _frozen(value, read_only: bool, stand_ins: dict):
    """The value with tensors as layouts; real (not fake) tensors the op only reads into `stand_ins`."""
    if isinstance(value, torch.Tensor):
        layout = Layout.of(value)
        if read_only and not isinstance(value, FakeTensor) and value.device.type != "meta":
            stand_ins.setdefault(layout, value)
        return layout
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v, read_only, stand_ins) for v in value)
    return value


def _written(func: torch._ops.OpOverload) -> set:
    """Positions and names of the arguments the op writes."""
    written = set()
    for index, argument in enumerate(func._schema.arguments):
        if argument.alias_info is not None and argument.alias_info.is_write:
            written |= {index, argument.name}
    return written


class record_op_calls(TorchDispatchMode):
    """Records every v4:: op call made inside it (each distinct call once, in order), each with
    the values `where` held at the calls that made it (set it to say where a call came from).
    Run the step under torch's FakeTensorMode, inside this mode, and nothing executes."""

    def __init__(self):
        super().__init__()
        self.calls: dict[OpCall, set] = {}
        self.where = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == NAMESPACE:
            written, stand_ins = _written(func), {}
            call = OpCall(
                func, tuple(_frozen(v, i not in written, stand_ins) for i, v in enumerate(args)),
                tuple((k, _frozen(v, k not in written, stand_ins)) for k, v in kwargs.items()), stand_ins,
            )
            self.calls.setdefault(call, set()).add(self.where)
        return func(*args, **kwargs)


def compile_ahead(calls: Iterable[Callable[[], object]], workers: int | None = None) -> int:
    """Run each call with its Triton launches made compile-only, the compiles `workers` at a time
    (by default one per CPU this process may use), and return when every kernel is compiled: the
    number of compiles submitted (variants already in memory are not; those in Triton's disk
    cache load instead of compiling). Compiling ahead only saves time: a call that raises is
    skipped with a warning, and a kernel that fails to compile here compiles again at its launch,
    whose error then names the call."""
    workers = workers or len(os.sched_getaffinity(0))
    failed = []
    with ThreadPoolExecutor(workers, thread_name_prefix="triton-compile") as pool, AsyncCompileMode(pool, ignore_errors=True) as mode:
        with launches_compile_only():
            for call in calls:
                try:
                    call()
                except Exception as error:  # noqa: BLE001 - its kernels compile at their first launch instead
                    failed.append(f"{getattr(call, '__self__', call)}: {type(error).__name__}: {error}".splitlines()[0][:300])
        submitted = len(mode.future_kernels)  # read before the mode's exit waits for them and forgets them
    if failed:
        warnings.warn(f"compiling kernels ahead: {len(failed)} call(s) skipped, their kernels compile at first launch; first: {failed[0]}")
    return submitted


@contextlib.contextmanager
def launches_compile_only():
    """Every Triton launch a warm-up (compile, no launch) and every autotuned launch a warm-up of
    each config, as its first real call's benchmark would compile them. Triton has no switch for
    this, so the two entry points are wrapped for the duration: launches from other threads meanwhile
    would not run."""
    run, tuned_run = JITFunction.run, Autotuner.run

    def warmup(self, *args, grid, warmup, **kwargs):
        return run(self, *args, grid=grid, warmup=True, **kwargs)

    def every_config(self, *args, grid=None, warmup=None, **kwargs):
        for config in self.configs:
            self.fn.run(*args, grid=grid, warmup=True, **{**kwargs, **config.all_kwargs()})

    JITFunction.run, Autotuner.run = warmup, every_config
    try:
        yield
    finally:
        JITFunction.run, Autotuner.run = run, tuned_run
