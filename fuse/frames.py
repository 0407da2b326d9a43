"""Dynamo's output of the regional step, compiled ahead so that an artifact can hold it: a start
from the artifact loads each frame's bytecode, guards and compiled graph instead of tracing.

torch.compile traces every frame with Dynamo at its first call, in every start. Here each layer
kind's block and the head are compiled with torch's `aot_compile` instead: the unbound function
(the block's `forward`, the model's `logits`) with the module as its first argument, so that the
module's parameters and buffers are graph inputs and one frame serves every layer of its kind. A
frame is compiled at its first call, for batch 1 and for the symbolic batch apart (as Dynamo would
compile them), or for every batch with `batch_one_shared`.

The guards a frame keeps are those torch can save: the arguments' shapes, strides and dtypes
(parameters and buffers included), the symbolic batch's range, the module attributes the code
branches on, torch's global state. Guards on globals (which code runs) are dropped: the
artifact's manifest pins the source of fuse, kernels and model instead. A loaded frame never
recompiles: a call its guards refuse raises, naming the frame and the failed guard."""
from __future__ import annotations

import contextlib
import io
import os
import re
import tempfile
import time
import types
from typing import Callable, Mapping

import torch

from fuse.backend import compile_backend
from fuse.options import CompileOptions, dynamo_saves_frames
from fuse.stats import compile_counts
from fuse.step import compilation_for, layer_kinds, mark_batch_dynamic

FrameFn = Callable[..., torch.Tensor]


def frames_apply(model, options: CompileOptions) -> bool:
    """Whether a start of `model` with `options` compiles (or loads) its frames ahead: one with an
    artifact to hold them, the regional compilation, no code dump (it reads Dynamo's traces), on
    a torch that saves frames."""
    return (options.compile and options.artifact is not None and options.dump_dir is None and dynamo_saves_frames()
            and compilation_for(model, options) == "regional")


class Frames:
    """The step's compiled frames by name ("block<kind>/batch1", "block<kind>/batch",
    "head/batch1", "head/batch"): loaded from `saved` (name -> bytes) where there, else compiled
    with `backend` at their first call. `blocks()` and `head()` call them the way
    `model.step(layers=, logits=)` calls blocks and the head."""

    def __init__(self, model, backend: Callable, *, symbolic: bool, largest: int, batch_one_shared: bool,
                 saved: Mapping[str, bytes] | None = None):
        self.model = model
        self.backend_seconds = 0.0
        self.backend = _serializable(backend, self._add_backend_seconds)
        self.symbolic = symbolic
        self.largest = largest
        self.batch_one_shared = batch_one_shared
        self.kind_of = {index: kind for kind, indices in enumerate(layer_kinds(model)) for index in indices}
        self.block_forward = _unbound(type(model.layers[0]).forward, largest if batch_one_shared else None)
        self.head_fn = _unbound(type(model).logits, largest if batch_one_shared else None)
        self.functions: dict[str, FrameFn] = {}
        self.compiled: list[str] = []  # frames compiled in this process, in order
        # Their compile time as torch.compile's timers split it (theirs do not see aot_compile's backend).
        self.seconds = {"dynamo": 0.0, "backend compile or cache load": 0.0}
        # Inductor compiles torch's counters missed: aot_compile bypasses Inductor's cache without counting it.
        self.uncounted_inductor_compiles = 0
        self.load(saved or {})

    @classmethod
    def for_options(cls, model, options: CompileOptions, saved: Mapping[str, bytes] | None = None) -> "Frames":
        """The frames of `model` compiled as `options` say (the backend, batch shapes and bound)."""
        return cls(model, compile_backend(options, model.device), symbolic=options.dynamic_batch, largest=max(options.buckets),
                   batch_one_shared=options.batch_one_shared, saved=saved)

    def load(self, saved: Mapping[str, bytes]) -> None:
        """Add frames saved by `saved()` here or in another process (an artifact, a compile worker)."""
        for name, data in saved.items():
            self.functions[name] = self._load(name, data)

    def _load(self, name: str, data: bytes) -> FrameFn:
        fn = self.head_fn if name.startswith("head") else self.block_forward
        try:
            return torch.compiler.load_compiled_function(io.BytesIO(data), f_globals=fn.__globals__)
        except Exception as error:  # noqa: BLE001 - torch raises several kinds for a frame of other versions
            raise ValueError(f"fuse: the compiled frame {name} could not be loaded ({type(error).__name__}: "
                             f"{str(error).splitlines()[0][:300] if str(error) else ''})") from error

    def blocks(self) -> list[Callable]:
        def block(index: int) -> Callable:
            layer, kind = self.model.layers[index], self.kind_of[index]

            def run(streams: torch.Tensor, step, hadamard: torch.Tensor) -> torch.Tensor:
                return self._call(f"block{kind}", self.block_forward, (layer, streams, step, hadamard),
                                  (streams, *step.per_sequence()))

            return run

        return [block(index) for index in range(len(self.model.layers))]

    def head(self) -> Callable:
        return lambda streams: self._call("head", self.head_fn, (self.model, streams), (streams,))

    def _call(self, prefix: str, fn: types.FunctionType, args: tuple, per_sequence: tuple[torch.Tensor, ...]) -> torch.Tensor:
        batch = per_sequence[0].shape[0]
        dynamic = self.symbolic and (self.batch_one_shared or batch > 1)
        name = f"{prefix}/{'batch' if dynamic else f'batch{batch}'}"
        frame = self.functions.get(name)
        if frame is None:
            example = args
            if dynamic:  # marked on copies: a frame's guards refuse a call whose tensors carry marks it was not compiled with
                copies = {id(t): t.clone() for t in per_sequence}  # (not views: a view's base would be guarded on too)
                example = tuple(_replaced(a, copies) for a in args)
                mark_batch_dynamic(*copies.values(), unbacked_hint=self.largest if self.batch_one_shared else None)
            frame = self.functions[name] = self._compile(fn, example)
            self.compiled.append(name)
        try:
            return frame(*args)
        except RuntimeError as error:
            if "GuardManager check failed" not in str(error):
                raise
            failed = re.search(r"verbose_code_parts=\[(.*?)\],?\n", str(error), re.S)  # the failed guards, as torch words them
            raise RuntimeError(f"fuse: the compiled frame {name} does not accept this call (a frame never recompiles): "
                               f"{failed.group(1) if failed else error}") from error

    def _compile(self, fn: types.FunctionType, args: tuple) -> FrameFn:
        start, backend_before, counted = time.perf_counter(), self.backend_seconds, compile_counts()["inductor"]
        with torch._dynamo.config.patch(enable_aot_compile=True), _unread_dtype_attributes(args[0]):
            compiled = torch.compile(fn, fullgraph=True, dynamic=None if self.symbolic else False, backend=self.backend,
                                     options={"guard_filter_fn": _saveable_guards})
            frame = compiled.aot_compile((args, {}))
        backend = self.backend_seconds - backend_before
        self.uncounted_inductor_compiles += compile_counts()["inductor"] == counted
        self.seconds["backend compile or cache load"] += backend
        self.seconds["dynamo"] += time.perf_counter() - start - backend
        return frame

    def _add_backend_seconds(self, seconds: float) -> None:
        self.backend_seconds += seconds

    def saved(self) -> dict[str, bytes]:
        """Every frame of this process (compiled or loaded) as bytes, for the artifact."""
        out = {}
        with tempfile.TemporaryDirectory(prefix="fuse-frames-") as folder:
            for name, frame in self.functions.items():
                path = os.path.join(folder, "frame")
                frame.save_compiled_function(path)
                with open(path, "rb") as f:
                    out[name] = f.read()
        return out


def _replaced(value, tensors: dict[int, torch.Tensor]):
    """`value` with the tensors `tensors` maps by id replaced, inside a NamedTuple (the block's DecodeStep) too."""
    if isinstance(value, torch.Tensor):
        return tensors.get(id(value), value)
    if isinstance(value, tuple) and hasattr(value, "_replace"):
        return value._replace(**{k: tensors.get(id(v), v) for k, v in value._asdict().items() if isinstance(v, torch.Tensor)})
    return value


def _unbound(fn: types.FunctionType, largest: int | None) -> types.FunctionType:
    """`fn(module, x, ...)`; with `largest`, telling the compiler 1 <= batch <= largest (dim 0 of x)."""
    if largest is None:
        return fn

    def bounded(module, x, *args):
        torch._check(x.shape[0] >= 1)
        torch._check(x.shape[0] <= largest)
        return fn(module, x, *args)

    return bounded


def _saveable_guards(entries) -> list[bool]:
    """Keep what torch can save and what tells calls apart; drop guards on globals (see the module docstring)."""
    from torch._dynamo.guards import CheckFunctionManager

    unsupported = CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES
    return [not entry.is_global and entry.guard_type not in unsupported for entry in entries]


def _serializable(backend: Callable, timed: Callable[[float], None]) -> Callable:
    """`backend` with its compiled graph wrapped the way aot_compile saves it: torch wraps only its
    own backends' results in some versions, and a compiled graph that can serialize itself in
    others; `timed(seconds)` after each call."""
    from torch._dynamo.aot_compile_types import BundledAOTAutogradSerializableCallable, SerializableCallable

    def compile_(graph: torch.fx.GraphModule, example_inputs):
        start = time.perf_counter()
        compiled = backend(graph, example_inputs)
        timed(time.perf_counter() - start)
        if not isinstance(compiled, SerializableCallable) and getattr(compiled, "serialize", None) is not None:
            compiled = BundledAOTAutogradSerializableCallable(compiled)
        return compiled

    return compile_


@contextlib.contextmanager
def _unread_dtype_attributes(module: torch.nn.Module):
    """Hide the module's own torch.dtype and torch.device attributes while its frame compiles (the
    blocks' forward and the head read none). torch saves a guarded module with each attribute no
    guard reads replaced by a placeholder, matched by identity, so an attribute holding
    torch.float32 would replace the dtype of every fp32 tensor guard too, and the frame would fail
    to load."""
    hidden = {k: v for k, v in vars(module).items() if isinstance(v, (torch.dtype, torch.device))}
    for name in hidden:
        del module.__dict__[name]
    try:
        yield
    finally:
        module.__dict__.update(hidden)
