"""The one builder of the compiled decode step, for every compilation (fuse/options.py): the
runner runs what it builds, and the code dump indexes the same graphs.

Each build compiles private copies of the model's code objects. Dynamo keeps its compiled
entries per code object, so two runners of one model (or of two models of one class) never
share, evict or count each other's graphs."""
from __future__ import annotations

import contextlib
import functools
import types
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import torch
import torch._dynamo

from fuse.backend import compile_backend
from fuse.options import CompileOptions


class DecodeModel(Protocol):
    """What fuse needs of a decode model; `model.Decoder` is one.

    - `step(tokens, positions, slots, layers=None, logits=None)`: one unchecked step, int64 [B]
      inputs on `device`, fp32 logits out; `layers` replaces the blocks' calls, `logits` the head's.
    - `layers`: the blocks, each called as `block(streams, step, hadamard)`, where `step` is a
      `model.layers.DecodeStep` whose `per_sequence()` tensors have the batch as dim 0.
    - `logits(streams)`: the head.
    - `check_inputs(tokens, positions, slots)`: raises ValueError naming bad input, returns the
      inputs on `device`; `recurrent_state()`: the buffers a repeated step reads back.
    - `pad_slot`: a cache slot padding rows may write; `max_batch`: the real slots.
    - optionally `parallel` (model.parallel.Parallel): a model split across the ranks of a
      torch.distributed group, whose step runs collectives; with more than one rank the ranks
      agree on the outcome of each compile and capture (`split_ranks`)."""

    layers: Sequence[torch.nn.Module]
    pad_slot: int
    max_batch: int

    @property
    def device(self) -> torch.device: ...

    def step(self, tokens, positions, slots, layers=None, logits=None) -> torch.Tensor: ...

    def logits(self, streams: torch.Tensor) -> torch.Tensor: ...

    def check_inputs(self, tokens, positions, slots) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...

    def recurrent_state(self) -> dict[str, torch.Tensor]: ...


def split_ranks(model: DecodeModel):
    """The model's rank layout where it is split across more than one rank, else None. Its
    `agree(phase, error)` is called by every rank after a phase that may fail on some rank only
    (and raises the first failing rank's error on every rank); `agreed_error(error)` finds such
    an outcome in an error's chain."""
    parallel = getattr(model, "parallel", None)
    return parallel if parallel is not None and parallel.world_size > 1 else None


def agreed_call(model: DecodeModel, phase: str, fn: Callable[[], object]):
    """fn(), where a model split across ranks has every rank raise the error of a rank whose
    fn() failed (that rank agrees with the others' next agreement, e.g. after their compile),
    so that no rank is left waiting in the step's collectives for it."""
    ranks = split_ranks(model)
    if ranks is None:
        return fn()
    try:
        return fn()
    except Exception as error:
        outcome = ranks.agreed_error(error)
        if outcome is None:
            ranks.agree(phase, error)  # raises on every rank
        raise outcome  # unwrapped from what the compiler wrapped it in


def _compiling_rank_0_first(ranks) -> tuple[Callable[[], None] | None, Callable[[], None] | None]:
    """(before, after) each graph's compile, for a model split across ranks (else no hooks).

    Rank 0 compiles each graph first; then the other ranks, together. The ranks' graphs are the
    same graph (what differs between ranks is in their buffers), so every rank after the first
    loads rank 0's output from Inductor's cache instead of compiling it again. Two agreements
    per graph: after rank 0's compile, and after every rank's. No rank runs a graph, and so its
    collectives, before every rank compiled it; a rank whose trace or compile fails agrees with
    its error in agreed_call at the next of them, and every rank raises it."""
    if ranks is None:
        return None, None

    def rank_0_compiled() -> None:
        ranks.agree("compiling the decode step (rank 0 first)")

    def every_rank_compiled() -> None:
        ranks.agree("compiling the decode step (every rank)")

    if ranks.rank == 0:
        return None, lambda: (rank_0_compiled(), every_rank_compiled())
    return rank_0_compiled, every_rank_compiled


def check_decode_model(obj) -> None:
    """Raise ValueError unless `obj` has what DecodeModel lists."""
    missing = [name for name in ("step", "layers", "logits", "check_inputs", "recurrent_state", "pad_slot", "max_batch", "device")
               if not hasattr(obj, name)]
    if missing:
        raise ValueError(f"expected a decode model such as model.Decoder, got {type(obj).__name__} (it lacks {', '.join(missing)})")


StepFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class CompiledStep:
    """`run(tokens, positions, slots) -> logits`, and which code objects its graphs belong to."""

    run: StepFn
    once_per_step: tuple[types.CodeType, ...]  # graphs of these run once per step (the step, or the head)
    per_layer: types.CodeType | None = None  # regional: every block's graphs are entries of this code
    compilation: str = "eager"  # what was compiled (see compilation_for)


def holds_block_scaled_weights(model: DecodeModel) -> bool:
    """Whether the model stores FP8 or packed FP4 weights (model/formats.py)."""
    return any(p.dtype in (torch.float8_e4m3fn, torch.uint8) for p in model.parameters())


def compilation_for(model: DecodeModel, options: CompileOptions) -> str:
    """options.compilation, except that "auto" takes the regional compile for a model with
    block-scaled weights: torch 2.13's Inductor cannot functionalise the nested region's cache
    writes beside them (auto_functionalized_v2 is left in the graph)."""
    if options.requested_compilation == "auto" and options.compilation == "nested" and holds_block_scaled_weights(model):
        return "regional"
    return options.compilation


def build_step(
    model: DecodeModel,
    options: CompileOptions,
    after_block: Callable[[int, types.CodeType], None] | None = None,
    on_graph: Callable[[torch.fx.GraphModule], None] | None = None,
    frames=None,
) -> CompiledStep:
    """The decode step as `options` compile it (`options.compile=False`: the eager step).
    `after_block(index, code)` (regional compilation only) is called after each block's compiled
    call, with the code object its graphs belong to: readers of Dynamo's cache learn from it which
    graph a layer ran. `on_graph(graph)`: the backend's (fuse/backend.py). `frames`
    (fuse.frames.Frames, regional compilation only): the blocks and the head run its frames,
    compiled ahead or loaded, instead of frames Dynamo traces at their first call."""
    if not options.compile:
        return CompiledStep(model.step, ())
    compilation = compilation_for(model, options)
    if frames is not None:
        if compilation != "regional" or after_block is not None or on_graph is not None:
            raise ValueError(f"frames compiled ahead serve the regional compilation without a code dump, not {compilation!r}")
        blocks, head = frames.blocks(), frames.head()
        run = lambda tokens, positions, slots: model.step(tokens, positions, slots, layers=blocks, logits=head)  # noqa: E731
        return CompiledStep(run, (), compilation=compilation)
    backend = compile_backend(options, model.device, on_graph, *_compiling_rank_0_first(split_ranks(model)))
    _mark_buffers_static(model)
    dynamic = None if options.dynamic_batch else False
    compile_ = lambda fn: torch.compile(fn, fullgraph=True, dynamic=dynamic, backend=backend)  # noqa: E731
    symbolic = options.dynamic_batch
    # batch_one_shared: the batch unbacked, bounded by the largest bucket, with the largest bucket
    # as Inductor's size hint (the size the default's symbolic graph is first traced at).
    shared, largest = options.batch_one_shared, max(options.buckets)
    unbacked_hint = largest if shared else None

    if compilation == "regional":
        forward = _shared_forward(model)
        if shared:
            forward = _batch_bounded(forward, largest)
        blocks = []
        for index, layer in enumerate(model.layers):
            block = compile_(types.MethodType(forward, layer))
            block = _batch_symbolic_block(block, unbacked_hint) if symbolic else block
            blocks.append(block if after_block is None else _reporting(block, lambda i=index: after_block(i, forward.__code__)))
        head_fn = _fresh_function(type(model).logits)
        if shared:
            head_fn = _batch_bounded(head_fn, largest)
        head = compile_(types.MethodType(head_fn, model))
        head = _batch_symbolic(head, unbacked_hint) if symbolic else head
        run = lambda tokens, positions, slots: model.step(tokens, positions, slots, layers=blocks, logits=head)  # noqa: E731
        return CompiledStep(run, (head_fn.__code__,), forward.__code__, compilation)

    if compilation == "nested":
        fn = _fresh_function(_nested_region_step(model, _shared_forward(model)))
        if shared:
            fn = _batch_bounded(fn, largest, batch_arg=0)
    else:  # "whole"
        step_fn = _fresh_function(type(model).step)
        fn = types.MethodType(_batch_bounded(step_fn, largest) if shared else step_fn, model)
    compiled = compile_(fn)
    compiled = _batch_symbolic(compiled, unbacked_hint) if symbolic else compiled
    return CompiledStep(compiled, (fn.__code__,), compilation=compilation)


def layer_kinds(model: DecodeModel) -> list[list[int]]:
    """The indices of the model's blocks grouped by kind, in order of first appearance: blocks of
    one type whose parameters and buffers have the same names, shapes and dtypes trace to the
    same graph and launch the same kernels."""
    kinds: dict[tuple, list[int]] = {}
    for index, block in enumerate(model.layers):
        tensors = [*block.named_parameters(), *block.named_buffers()]
        kinds.setdefault((type(block), tuple((name, tuple(t.shape), t.dtype) for name, t in tensors)), []).append(index)
    return list(kinds.values())


def _mark_buffers_static(model) -> None:
    """Every buffer of `model` a static input of the graphs that take it as an argument (the rope
    tables and the Hadamard matrix the step hands the blocks). Dynamo marks a module's buffers so
    the first time it traces one of the module's methods (the head), so a graph traced before
    that and one traced after would differ, and a compile worker, which traces in another order,
    would miss the runner's cache."""
    for buffer in model.buffers():
        torch._dynamo.mark_static_address(buffer, guard=False)


def _shared_forward(model: DecodeModel) -> types.FunctionType:
    """A private copy of the one forward all blocks share (one compile per layer kind needs one)."""
    forwards = {type(layer).forward for layer in model.layers}
    if len(forwards) != 1:
        raise ValueError(f"the decoder's blocks must share one forward to be compiled per layer kind, got {len(forwards)}")
    return _fresh_function(forwards.pop())


def _nested_region_step(model: DecodeModel, forward: types.FunctionType) -> StepFn:
    """model.step with every block called through one nested compile region: Dynamo traces each
    distinct layer kind once and Inductor compiles it once, called from every layer of the kind."""
    region = torch.compiler.nested_compile_region(forward)
    blocks = [functools.partial(region, layer) for layer in model.layers]

    def step(tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        return model.step(tokens, positions, slots, layers=blocks)

    return step


def _fresh_function(fn: types.FunctionType, name: str | None = None) -> types.FunctionType:
    """`fn` with a private copy of its code object (see the module docstring), renamed `name` if
    given: the code dump names each compiled frame after its code object."""
    name = name or fn.__name__
    fresh = types.FunctionType(fn.__code__.replace(co_name=name), fn.__globals__, name, fn.__defaults__, fn.__closure__)
    fresh.__kwdefaults__ = fn.__kwdefaults__
    fresh.__qualname__ = fn.__qualname__ if name == fn.__name__ else name
    return fresh


def mark_batch_dynamic(*tensors: torch.Tensor, unbacked_hint: int | None = None) -> None:
    """Dim 0 (the batch) symbolic in the graph Dynamo compiles next. Without the mark the first
    bucket compiles a static graph and only the second a symbolic one: one more graph per kind.
    With `unbacked_hint` the batch is unbacked, a size the compiler never learns, so that it
    cannot specialise size 1 either: one symbol for every tensor, and `unbacked_hint` the size
    Inductor tunes its kernels for (it would otherwise assume a batch of thousands)."""
    for t in tensors:
        if unbacked_hint is not None:
            torch._dynamo.decorators.mark_unbacked(t, 0, hint_override=unbacked_hint, shape_id="batch")
        else:
            torch._dynamo.maybe_mark_dynamic(t, 0)


def _batch_bounded(fn: types.FunctionType, largest: int, batch_arg: int = 1) -> types.FunctionType:
    """`fn` telling the compiler 1 <= batch <= `largest`, the batch being dim 0 of argument
    `batch_arg` (after `self` by default). An unbacked batch has no upper bound otherwise, and
    Inductor, unable to prove 32-bit indices safe, would index every kernel in 64 bits."""

    def bounded(*args):
        batch = args[batch_arg].shape[0]
        torch._check(batch >= 1)
        torch._check(batch <= largest)
        return fn(*args)

    return _fresh_function(bounded, name=fn.__name__)  # the dump shows the frame under the wrapped function's name


def _batch_symbolic(compiled: Callable, unbacked_hint: int | None) -> Callable:
    """A compiled function of batch-major tensors whose batch is symbolic on every call but batch
    1's (Dynamo specialises size 1, so batch 1 gets a graph of its own), or with an
    `unbacked_hint` (batch_one_shared) on every call, batch 1's too."""

    def run(*inputs: torch.Tensor) -> torch.Tensor:
        if unbacked_hint is not None or inputs[0].shape[0] > 1:
            mark_batch_dynamic(*inputs, unbacked_hint=unbacked_hint)
        return compiled(*inputs)

    return run


def _batch_symbolic_block(block: Callable, unbacked_hint: int | None) -> Callable:
    def run(streams: torch.Tensor, step, hadamard: torch.Tensor) -> torch.Tensor:
        if unbacked_hint is not None or streams.shape[0] > 1:
            mark_batch_dynamic(streams, *step.per_sequence(), unbacked_hint=unbacked_hint)
        return block(streams, step, hadamard)

    return run


def _reporting(block: Callable, after: Callable[[], None]) -> Callable:
    def run(*args) -> torch.Tensor:
        out = block(*args)
        after()
        return out

    return run


def decode_mode() -> contextlib.ExitStack:
    """Every step, warm-up or request, runs in one autograd mode whatever the caller's: grad mode
    is part of Dynamo's guards, so a request under torch.no_grad() or inference_mode would
    otherwise recompile what warm-up compiled."""
    stack = contextlib.ExitStack()
    stack.enter_context(torch.inference_mode(False))
    stack.enter_context(torch.no_grad())
    return stack
