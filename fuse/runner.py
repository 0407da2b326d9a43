"""compile_decode: Inductor compiles the decode step (custom ops stay opaque) and, on CUDA, one
CUDA graph per batch-size bucket is captured around it, the way serving stacks replay decode.

What it takes care of:
- every compile, Triton JIT and autotune happens in warm-up, outside any capture;
- PyTorch's own cudagraph trees stay off: this runner owns capture, into one shared pool;
- padded rows read and write only the decoder's scratch slot (`pad_slot`), never a real one;
- after warm-up a recompile is an error naming the failed guard (or a warning, if lenient);
- a bucket whose capture fails falls back (compiled without a graph, else eager) and says why.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch
import torch._dynamo
from torch._dynamo.utils import counters
from torch._inductor.compile_fx import compile_fx

from fuse.passes import SkinnyProducts

log = logging.getLogger("fuse")


COMPILATIONS = ("auto", "nested", "regional", "whole")


def dynamo_reuses_nested_regions() -> bool:
    """Whether this torch's Dynamo traces a nested compile region once per distinct input
    signature and reuses the traced region for later calls (its `max_reuse_entries`). Without it
    (torch 2.11) Dynamo traces the region at every call: a 43-layer nested compile then traced 43
    blocks twice and started in 265 s cold and 96 s warm on the H200, against 120-160 s and
    15-22 s for the regional compile (docs/bench.md)."""
    return "max_reuse_entries" in inspect.signature(torch.compiler.nested_compile_region).parameters


def resolve_compilation(compilation: str) -> str:
    """"auto": "nested" where Dynamo reuses traced regions, else "regional"."""
    if compilation != "auto":
        return compilation
    return "nested" if dynamo_reuses_nested_regions() else "regional"


@dataclass(frozen=True)
class CompileOptions:
    """How `compile_decode` builds its runner."""

    buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    compile: bool = True  # False: the eager step (inside the bucket graphs, unless cuda_graphs=False)
    cuda_graphs: bool = True  # False: no capture (for A/B checks); ignored on the CPU
    # One compile with a symbolic batch size instead of one per bucket (2 shapes per layer kind:
    # the batch dimension is marked symbolic from the first compile on, and batch 1 gets its own
    # graph, as Dynamo specialises sizes 0 and 1): start-up stays flat as buckets are added, for
    # steps ~2-3% slower than per-bucket graphs (docs/compile_decode.md).
    dynamic_batch: bool = True
    # What one compile covers (one of COMPILATIONS; "auto", the default, is "nested" where
    # Dynamo reuses a traced region and "regional" where it would retrace every layer, see
    # dynamo_reuses_nested_regions; the options hold the resolved value):
    # "nested": the whole step is one graph in which every block is a nested compile region
    #   (torch.compiler.nested_compile_region): Inductor compiles each distinct layer kind (window /
    #   ratio 4 / ratio 128, hash / score routing) once and calls it from every layer of that kind,
    #   so compile time grows with the layer kinds, not the layer count, while the step's own glue
    #   (embedding, rotary tables, head) compiles too, and Dynamo compiles one graph per shape.
    # "regional": each block compiled on its own, one Dynamo graph per layer kind and shape; the
    #   head is one more compiled region unless compile_head=False.
    # "whole": the whole step as one flat graph (fuses across layers; compile time grows with depth).
    compilation: str = "auto"
    # Regional compiles only: the head (hc head, final norm, LM head) as one more compiled region
    # (two more compiles with a symbolic batch) instead of ~30 eager kernels after the blocks.
    # None: True for a regional compile (the other compilations compile the head with the step).
    compile_head: bool | None = None
    # Matrix products with at most this many output columns (the hyper-connection mixes, the
    # gate) and 4-deep batched ones (hc_post) compile as Inductor reductions fused with their
    # neighbours instead of library GEMM calls (fuse/passes.py). 0: all stay GEMMs. Not 128:
    # the indexer query's 128 x 128 Hadamard rotation as a reduction (rotary embedding fused
    # in) saves a kernel but took 23-32 us per call on the H200, against 7 us for the fp32 GEMM
    # plus 3 us for the rotary kernel before it.
    skinny_product_columns: int = 64
    # > 0: skinny products at least twice this deep are summed in pieces of K of at least this
    # depth, then over the pieces (fuse/passes.py), so that batch 1's few outputs still spread
    # over the SMs. Off by default: on the H200 no faster at batch 1, 2% slower at 16 and 64
    # (docs/bench.md).
    skinny_product_piece_depth: int = 0
    # Programmatic dependent launch for Inductor's kernels (Hopper and later): inside the captured
    # graph each kernel is launched while the one before it finishes and waits on the device for
    # its results, hiding the launch gap between the step's many short kernels.
    pdl: bool = False
    mode: str | None = None  # Inductor mode, e.g. "max-autotune-no-cudagraphs"
    inductor_options: Mapping[str, object] | None = None  # Inductor config patches, applied last
    cache_dir: str | None = None  # persistent Inductor/Triton caches: a second start is fast
    strict: bool = True  # a recompile after warm-up raises; False: it warns and is counted
    progress: bool = True  # one line per bucket with its warm-up/capture time

    def __post_init__(self):
        if not self.buckets or any(int(b) < 1 for b in self.buckets):
            raise ValueError(f"buckets must be positive batch sizes, got {self.buckets}")
        object.__setattr__(self, "buckets", tuple(sorted({int(b) for b in self.buckets})))
        if self.skinny_product_piece_depth < 0:
            raise ValueError(f"skinny_product_piece_depth must be >= 0 (0: no pieces), got {self.skinny_product_piece_depth}")
        if self.pdl and not self.compile:
            raise ValueError("pdl=True launches Inductor's kernels; with compile=False there are none")
        if self.compilation not in COMPILATIONS:
            raise ValueError(f"compilation must be one of {COMPILATIONS}, got {self.compilation!r}")
        object.__setattr__(self, "compilation", resolve_compilation(self.compilation))
        if self.compile_head is None:
            object.__setattr__(self, "compile_head", self.compile and self.compilation == "regional")
        if self.compile_head and not (self.compile and self.compilation == "regional"):
            raise ValueError(
                "compile_head=True compiles the head as a region of a regional compile; it needs compile=True and "
                "compilation='regional' (the other compilations compile the head with the step)"
            )
        if self.inductor_options:  # only then: reading Inductor's whole config copies it
            unknown = sorted(set(self.inductor_options) - set(torch._inductor.config.get_config_copy()))
            if unknown:
                raise ValueError(f"inductor_options names settings torch._inductor.config does not have: {unknown}")
        if self.mode and "reduce-overhead" in self.mode:
            raise ValueError("mode 'reduce-overhead' turns on PyTorch's cudagraph trees; compile_decode captures its own graphs")


def compile_backend(options: CompileOptions, device: torch.device) -> Callable:
    """The torch.compile backend of the step: Inductor with the options' mode and config
    patches, cudagraph trees off, and skinny products as reductions (fuse/passes.py)."""
    config: dict[str, object] = dict(torch._inductor.list_mode_options(options.mode)) if options.mode else {}
    # The runner captures its own graphs: cudagraph trees stay off whatever the mode says.
    config["triton.cudagraphs"] = False
    # Split reductions turn the mean of a narrow batch of wide rows (the hyper-connection norm
    # over hc*dim values) into two kernels; at decode batch sizes one program per row is as fast.
    config["split_reductions"] = False
    if device.type == "cpu":
        # Names the C++ kernels in profiler traces (fuse.count_launches); costs nothing unprofiled.
        config["cpp.enable_kernel_profile"] = True
    if options.pdl:
        config["triton.enable_pdl"] = True
    config.update(options.inductor_options or {})
    if "post_grad_custom_pre_pass" in config:
        raise ValueError(
            "inductor_options sets post_grad_custom_pre_pass, where compile_decode runs its own pass "
            "(set skinny_product_columns=0 and compile the model yourself to use another)"
        )
    config["post_grad_custom_pre_pass"] = SkinnyProducts(options.skinny_product_columns, options.skinny_product_piece_depth)

    def backend(graph: torch.fx.GraphModule, example_inputs):
        return compile_fx(graph, example_inputs, config_patches=dict(config))

    backend.config_patches = config  # for reading: what the step compiles with
    return backend


def check_pdl_support(device: torch.device) -> None:
    """Raise ValueError unless Inductor can launch this device's kernels with programmatic
    dependent launch: a CUDA GPU of compute capability 9.0 or later and a torch whose Inductor has
    the switch (`triton.enable_pdl`)."""
    if device.type != "cuda":
        raise ValueError(f"pdl=True needs a CUDA device (Hopper or later); the decoder is on {device}")
    major, minor = torch.cuda.get_device_capability(device)
    if major < 9:
        raise ValueError(f"pdl=True needs compute capability 9.0 or later; {device} has {major}.{minor}")
    if not hasattr(torch._inductor.config.triton, "enable_pdl"):
        raise ValueError(f"pdl=True needs Inductor's triton.enable_pdl, which torch {torch.__version__} lacks")


def pin_triton_toolchain() -> None:
    """Point Triton at the ptxas (and libdevice) Inductor uses, before anything compiles.

    Inductor sets them in this process only when it compiles a kernel here itself, which a warm
    start (every graph from the cache) never does. Triton's cache keys include the ptxas version,
    so the custom-op kernels and their autotune results that a cold start stored after Inductor
    had set them were all missed by the warm start, which compiled and tuned them again
    (17 s of a 50 s warm start on the H200, docs/bench.md). Set up front, both starts agree."""
    try:
        from torch._inductor.runtime import compile_tasks
    except ImportError:
        return
    for name in ("_set_triton_ptxas_path", "_set_triton_libdevice_path"):
        setter = getattr(compile_tasks, name, None)  # private helpers; absent in some versions
        if setter is not None:
            setter()


def mark_batch_dynamic(*tensors: torch.Tensor) -> None:
    """Dim 0 (the batch) symbolic in the graph Dynamo compiles next. Without the mark the first
    bucket compiles a static graph and only the second one a symbolic graph (automatic dynamic):
    one more graph per layer kind, which the largest bucket alone would use."""
    for t in tensors:
        torch._dynamo.maybe_mark_dynamic(t, 0)


def batch_symbolic_block(block: Callable) -> Callable:
    """A compiled block whose batch is marked symbolic on every call but batch 1's."""

    def run(streams: torch.Tensor, step, hadamard: torch.Tensor) -> torch.Tensor:
        if streams.shape[0] > 1:
            mark_batch_dynamic(streams, *(t for name, t in zip(step._fields, step) if name != "rope_compress_table"))
        return block(streams, step, hadamard)

    return run


def batch_symbolic(compiled: Callable) -> Callable:
    """A compiled function of batch-major tensors (the whole step's tokens, positions and slots;
    the head's streams) whose batch is marked symbolic on every call but batch 1's."""

    def run(*inputs: torch.Tensor) -> torch.Tensor:
        if inputs[0].shape[0] > 1:
            mark_batch_dynamic(*inputs)
        return compiled(*inputs)

    return run


def nested_region_step(decoder) -> Callable:
    """decoder.step(tokens, positions, slots) with every block's call a nested compile region.
    One region function (the blocks' shared forward) serves all blocks, so Dynamo traces each
    distinct layer kind once and reuses the traced region for every other layer of that kind, and
    Inductor compiles each region once. Outside torch.compile it is the step."""
    forwards = {type(layer).forward for layer in decoder.layers}
    if len(forwards) != 1:
        raise ValueError(f"nested compilation needs the decoder's blocks to share one forward, got {len(forwards)}")
    (forward,) = forwards
    region = torch.compiler.nested_compile_region(forward)
    blocks = [functools.partial(region, layer) for layer in decoder.layers]

    def step(tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        return decoder.step(tokens, positions, slots, layers=blocks)

    return step


@dataclass
class RunnerStats:
    compiles: int = 0  # graphs Dynamo compiled (all warm-up, unless a recompile happened)
    graph_breaks: int = 0
    recompiles: int = 0  # compiles after warm-up (lenient mode only; strict mode raises)
    captured: list[int] = field(default_factory=list)  # buckets replayed from a CUDA graph
    fallbacks: dict[int, str] = field(default_factory=dict)  # bucket -> why it runs without a graph
    warmup_seconds: dict[int, float] = field(default_factory=dict)
    # Where the start went, summed over buckets (seconds): "first calls" (compile or compile-cache
    # load, Triton loading and autotuning, one run), and within them Dynamo's tracing and the
    # backend (AOTAutograd + Inductor, cache hits included) as torch's timers report them (not
    # clipped: in rare full-suite runs on the CPU they summed to more than the first calls' wall
    # time); "warm-up runs"; "captures".
    start_seconds: dict[str, float] = field(default_factory=dict)


def _decode_mode():
    """Every step, warm-up or request, runs in one autograd mode whatever the caller's is: grad
    mode is part of Dynamo's guards, so a request under torch.no_grad() or inference_mode would
    otherwise recompile the step that warm-up compiled."""
    stack = contextlib.ExitStack()
    stack.enter_context(torch.inference_mode(False))
    stack.enter_context(torch.no_grad())
    return stack


def _dynamo_totals() -> tuple[int, int]:
    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


# Parts of a start, from torch's own compile timers (torch._dynamo.utils.compilation_time_metrics):
# a frame's compile (`_compile.compile_inner`) is Dynamo's tracing and guards plus the backend
# (`OutputGraph.call_user_compiler`: AOTAutograd and Inductor, compile-cache hits included).
_COMPILE_TIMERS = ("dynamo", "backend compile or cache load")


def _compile_timer_totals() -> dict[str, float]:
    from torch._dynamo.utils import compilation_time_metrics

    total = lambda key: sum(compilation_time_metrics.get(key, ()))
    backend = total("OutputGraph.call_user_compiler")
    return {"dynamo": total("_compile.compile_inner") - backend, "backend compile or cache load": backend}


@dataclass
class _Bucket:
    size: int
    tokens: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    run: Callable[[], torch.Tensor]  # fills nothing: runs the step on the static inputs


class DecodeRunner:
    """`runner(tokens, positions, slots) -> logits [B, vocab]`, the decoder's signature."""

    def __init__(self, decoder, options: CompileOptions):
        self.decoder = decoder
        self.options = options
        self.device = decoder.device
        self.stats = RunnerStats()
        buckets = [b for b in options.buckets if b <= decoder.max_batch]
        if not buckets:
            raise ValueError(f"no bucket fits max_batch={decoder.max_batch}: {options.buckets}")
        self.buckets = tuple(buckets)
        self.use_graphs = self._wants_graphs()
        self._step = self._make_step()
        self._buckets: dict[int, _Bucket] = {}
        self._warm_up()

    # -- building -------------------------------------------------------------------------------
    def _make_step(self) -> Callable:
        if self.options.pdl:
            check_pdl_support(self.device)
        if not self.options.compile:
            return self.decoder.step
        if self.device.type == "cuda":
            pin_triton_toolchain()
        if self.options.cache_dir:
            # Inductor and Triton read their cache locations from the environment.
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(self.options.cache_dir, "inductor")
            os.environ["TRITON_CACHE_DIR"] = os.path.join(self.options.cache_dir, "triton")
        kwargs = {"backend": compile_backend(self.options, self.device)}
        dynamic = None if self.options.dynamic_batch else False
        compilation = self.options.compilation
        if compilation == "regional":
            blocks = [torch.compile(layer, fullgraph=True, dynamic=dynamic, **kwargs) for layer in self.decoder.layers]
            head = None
            if self.options.compile_head:
                head = torch.compile(self.decoder.logits, fullgraph=True, dynamic=dynamic, **kwargs)
            if self.options.dynamic_batch:
                blocks = [batch_symbolic_block(block) for block in blocks]
                if head is not None:
                    head = batch_symbolic(head)
            decoder = self.decoder
            return lambda tokens, positions, slots: decoder.step(tokens, positions, slots, layers=blocks, logits=head)
        step = nested_region_step(self.decoder) if compilation == "nested" else self.decoder.step
        step = torch.compile(step, fullgraph=True, dynamic=dynamic, **kwargs)
        return batch_symbolic(step) if self.options.dynamic_batch else step

    def _static_inputs(self, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Inputs of a bucket, filled with padding rows: token 0 at position 0 in the scratch slot."""
        device = self.device
        tokens = torch.zeros(size, dtype=torch.int64, device=device)
        positions = torch.zeros(size, dtype=torch.int64, device=device)
        slots = torch.full((size,), self.decoder.pad_slot, dtype=torch.int64, device=device)
        return tokens, positions, slots

    def _warm_up(self) -> None:
        compiles0, breaks0 = _dynamo_totals()
        timers0 = _compile_timer_totals()
        pool = torch.cuda.graph_pool_handle() if self.use_graphs and self.device.type == "cuda" else None
        # Dynamo keeps one cache entry per (layer kind, bucket) on the shared code object.
        limit = 8 * (len(self.buckets) + 1)
        patch = torch._dynamo.config.patch(recompile_limit=limit) if hasattr(torch._dynamo.config, "recompile_limit") else torch._dynamo.config.patch(cache_size_limit=limit)
        with patch, _decode_mode():
            # Largest first: the shared pool then serves the smaller graphs from the same memory.
            for size in sorted(self.buckets, reverse=True):
                start = time.perf_counter()
                self._buckets[size] = self._build_bucket(size, pool)
                self.stats.warmup_seconds[size] = time.perf_counter() - start
                if self.options.progress:
                    how = "graph" if size in self.stats.captured else self.stats.fallbacks.get(size, "no graph")
                    log.warning("fuse: bucket %3d ready in %6.1f s (%s)", size, self.stats.warmup_seconds[size], how)
        compiles1, breaks1 = _dynamo_totals()
        for name, total in _compile_timer_totals().items():
            self.stats.start_seconds[name] = total - timers0[name]
        self.stats.compiles = compiles1 - compiles0
        self.stats.graph_breaks = breaks1 - breaks0

    def _build_bucket(self, size: int, pool) -> _Bucket:
        inputs = self._static_inputs(size)
        step = self._step
        if not self.use_graphs:
            with self._phase("first calls"):
                step(*inputs)  # compile (or check the eager path) now, not on the first request
            return _Bucket(size, *inputs, run=lambda: step(*inputs))
        try:
            run = self._capture(step, inputs, pool)
            self.stats.captured.append(size)
            return _Bucket(size, *inputs, run=run)
        except Exception as error:  # this bucket runs without a graph; the others are unaffected
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            reason = f"capture failed: {type(error).__name__}: {error}".splitlines()[0][:300]
            log.warning("fuse: bucket %d falls back to running without a CUDA graph (%s)", size, reason)
            try:
                step(*inputs)
                how = "compiled" if self.options.compile else "eager"
                self.stats.fallbacks[size] = reason + f"; runs {how} without a graph"
                return _Bucket(size, *inputs, run=lambda: step(*inputs))
            except Exception as second:
                eager = self.decoder.step
                self.stats.fallbacks[size] = reason + f"; compiled run failed too ({type(second).__name__}); runs eager"
                return _Bucket(size, *inputs, run=lambda: eager(*inputs))

    @contextlib.contextmanager
    def _phase(self, name: str):
        """Adds the block's wall time, its GPU work finished, to stats.start_seconds[name]."""
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            self.stats.start_seconds[name] = self.stats.start_seconds.get(name, 0.0) + time.perf_counter() - start

    def _capture(self, step: Callable, inputs: tuple, pool) -> Callable[[], torch.Tensor]:
        """Warm up off the capture stream (compile, Triton JIT, autotune), then capture one graph."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            with self._phase("first calls"):
                step(*inputs)
            with self._phase("warm-up runs"):
                step(*inputs)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with self._phase("captures"), torch.cuda.graph(graph, pool=pool):
            output = step(*inputs)

        def replay() -> torch.Tensor:
            graph.replay()
            return output

        return replay

    def _wants_graphs(self) -> bool:
        return self.options.cuda_graphs and self.device.type == "cuda"

    # -- running --------------------------------------------------------------------------------
    def bucket_for(self, batch: int) -> int:
        return next(b for b in self.buckets if b >= batch)

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        return self.run_checked(*self.decoder.check_inputs(tokens, positions, slots))

    def run_checked(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """The step on inputs already checked by `decoder.check_inputs` (on the model's device)."""
        largest = self.buckets[-1]
        chunks = [
            self._run(tokens[i : i + largest], positions[i : i + largest], slots[i : i + largest])
            for i in range(0, tokens.shape[0], largest)
        ]
        return chunks[0] if len(chunks) == 1 else torch.cat(chunks)

    def _run(self, tokens, positions, slots) -> torch.Tensor:
        n = tokens.shape[0]
        bucket = self._buckets[self.bucket_for(n)]
        with _decode_mode():
            for static, value, pad in (
                (bucket.tokens, tokens, 0),
                (bucket.positions, positions, 0),
                (bucket.slots, slots, self.decoder.pad_slot),
            ):
                static[:n].copy_(value)
                static[n:].fill_(pad)  # rows a larger batch left behind must not touch its slots
            with self._recompile_guard():
                output = bucket.run()
            return output[:n].clone()  # the caller owns it; the static output is overwritten next call

    @contextlib.contextmanager
    def _recompile_guard(self):
        if not self.options.compile or self.use_graphs and not self.stats.fallbacks:
            yield  # graph replays and eager runs never consult Dynamo
            return
        before, _ = _dynamo_totals()
        if self.options.strict:
            try:
                with torch._dynamo.config.patch(error_on_recompile=True):
                    yield
            except torch._dynamo.exc.RecompileError as error:
                raise RuntimeError(
                    f"the compiled decode step would recompile after warm-up, which compile_decode forbids "
                    f"(pass CompileOptions(strict=False) to allow it with a warning):\n{error}"
                ) from error
            return
        yield
        after, _ = _dynamo_totals()
        if after > before:
            self.stats.recompiles += after - before
            warnings.warn(f"fuse: the decode step recompiled after warm-up ({self.stats.recompiles} so far)")

    def describe(self) -> str:
        s = self.stats
        lines = [
            f"buckets {list(self.buckets)} on {self.device}: compiled={self.options.compile} "
            f"graphs={self.use_graphs} dynamic_batch={self.options.dynamic_batch}"
            + (f" compilation={self.options.compilation}" if self.options.compile else ""),
            f"compiles {s.compiles}, graph breaks {s.graph_breaks}, recompiles after warm-up {s.recompiles}",
        ]
        if s.start_seconds:
            t = s.start_seconds
            compile_part = ", ".join(f"{name} {t[name]:.1f} s" for name in _COMPILE_TIMERS if name in t)
            phases = [
                f"{name} {t[name]:.1f} s" + (f" (torch's compile timers: {compile_part})" if name == "first calls" else "")
                for name in ("first calls", "warm-up runs", "captures")
                if name in t
            ]
            lines.append("start: " + ", ".join(phases))
        lines += [f"bucket {b}: {reason}" for b, reason in sorted(s.fallbacks.items())]
        return "\n".join(lines)


def compile_decode(decoder, buckets=None, **options) -> DecodeRunner:
    """Compile `decoder`'s step and, on CUDA, capture one graph per batch bucket.
    Keyword options are the fields of CompileOptions."""
    if buckets is not None:
        options["buckets"] = tuple(buckets)
    return DecodeRunner(decoder, CompileOptions(**options))

