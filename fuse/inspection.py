"""fuse.inspect: open the code Inductor generates for the decode step.

`inspect(target, out_dir)` compiles a fresh copy of the decode step the way a `DecodeRunner`
would (nested regions, regional or whole step, mode, Inductor options, dynamic batch), runs it once on padding
rows under `depyf.prepare_debug(out_dir)`, and writes an index of what the generated code
launches. No real sequence's cache is touched: the run uses only the decoder's scratch slot.

The dump, per compiled graph `__compiled_fn_N` (N is Dynamo's id; the nested and whole-step
compilations have one graph for the step, the regional one a graph per distinct layer kind,
shared by every layer of that kind):

- `__transformed_code_K_for_forward.py` (`..._for_step.py` for the whole step): the bytecode
  Dynamo substituted for the compiled frame, decompiled to Python. It gathers the graph's inputs
  (parameters, cache buffers, the step's tensors) and calls `__compiled_fn_N_<id>`. K counts
  frames, not graphs: the index says which file belongs to which graph.
- `full_code_for_forward_0.py` (`full_code_for_step_0.py`): the whole picture of the frame: for each of its cache entries
  the guards (`__guard_K_for_forward`, when that entry is reused) and its transformed code,
  then the original source.
- `__compiled_fn_N.<stage>.0.py`: the FX graph at successive stages, each a runnable
  `GraphModule` whose comments give the model source line of every node:
  `__compiled_fn_N.__compiled_fn_N_<id>.0.py` (`Captured_Graph` in older torch) is what Dynamo
  captured, torch-level calls; its node names are the "source nodes" of the index.
  `Forward_graph` is AOTAutograd's functional ATen graph (what Inductor receives),
  `AFTER_POST_GRAD` what Inductor lowers and fuses after its graph passes; the other stages
  (`BEFORE_PRE_GRAD`, `tensorify_python_scalars`, `pre_insert_deferred_runtime_asserts_*`)
  are steps in between.
- `__compiled_fn_N.kernel_K.py`: Inductor's output code. First the kernels' source (C++ inside
  `async_compile.cpp_pybinding(...)` on the CPU, Triton inside `async_compile.triton(...)` on
  CUDA, each Triton kernel under comments naming the source nodes and ATen ops it fused), then
  `call(args)`, the wrapper: read it top to bottom, it is this graph's launch sequence
  (buffer allocations, generated kernels, `extern_kernels.*` library calls such as mm, and the
  opaque custom ops `torch.ops.v4.*`). With nested compilation a layer kind that several layers
  share is a function of its own above the wrapper (`..._subgraph_K(args)`), which the wrapper
  calls once per such layer; a kind only one layer has is inlined into the wrapper. Triton kernels that Inductor loads as modules of their
  own (CUDA) may appear as further kernel_K files; the index points at the one with `call`.
  The C++ backend writes no origin comments: a C++ kernel's name lists the ops it fused.
- `index.json` and `index.md` (written here): per graph its files, the decoder layers that run
  it, and every kernel and call of its wrapper (see `Kernel`); then the custom-op calls of one
  decode step.

Counts: `Kernel.calls` is per run of its graph (what its wrapper does, a subgraph function's
launches counted once per call of it); with regional compilation a graph runs once per layer
listed under it, so `Inspection.custom_op_calls`, per decode step, is the sum over graphs of
calls times layers.
"""
from __future__ import annotations

import collections
import contextlib
import copy
import json
import os
import re
import types
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch
import torch._dynamo
from torch._dynamo.utils import counters

from fuse.runner import CompileOptions, DecodeRunner, batch_symbolic, batch_symbolic_block, compile_backend, nested_region_step

# Prefix of Triton kernel names (`triton_<category[:3]>_fused_...`) -> kernel kind.
_TRITON_KINDS = {
    "poi": "pointwise",
    "red": "reduction",
    "per": "persistent reduction",
    "tem": "template",
    "for": "foreach",
    "spl": "split scan",
}
_INDEX_FORMAT = 1  # bumped when index.json changes shape
_DUMP_PREFIXES = ("__compiled_fn_", "__transformed_code_", "full_code_for_")


@dataclass(frozen=True)
class Kernel:
    """One thing a graph's wrapper launches.

    kind: `pointwise`, `reduction`, `persistent reduction`, `template` (Triton, also `foreach`,
    `split scan`), `cpp` (an Inductor C++ kernel), `extern` (a library kernel the wrapper calls,
    `extern_kernels.mm`, or an ATen fallback `aten.*`) or `custom op` (an opaque op of another
    namespace, `v4.moe_experts`).
    ops: the ATen (and custom) ops it computes, for generated kernels the ops it fused. From
    Inductor's `Original ATen: [...]` comments where the output code has them (Triton kernels,
    extern calls); the C++ backend writes none, so for `cpp` kernels they are read back from the
    kernel's name, which lists them (`cpp_fused_add_mean_mul_0`).
    source_nodes: the captured-graph nodes it came from (`Source Nodes: [...]` comments; empty
    where there are none).
    calls: launches per run of its graph."""

    name: str
    kind: str
    calls: int
    ops: tuple[str, ...] = ()
    source_nodes: tuple[str, ...] = ()
    graph: str = ""

    def to_dict(self) -> dict:
        return {"name": self.name, "kind": self.kind, "calls": self.calls, "ops": list(self.ops), "source_nodes": list(self.source_nodes)}


@dataclass(frozen=True)
class CompiledGraph:
    """One Dynamo graph, its dump files and what its wrapper launches."""

    name: str  # `__compiled_fn_N`
    layers: tuple[int, ...] | None  # decoder layers that run it (regional); None: once per step (the step, or the compiled head)
    files: dict[str, Path | None]  # transformed_code, captured_graph, aot_forward_graph, post_grad_graph, output_code
    other_files: tuple[Path, ...]  # the remaining stages depyf dumped for this graph
    kernels: tuple[Kernel, ...]

    @property
    def runs_per_step(self) -> int:
        return 1 if self.layers is None else len(self.layers)

    def calls(self, kind: str) -> dict[str, int]:
        """Calls per run of this graph of each kernel of `kind` (e.g. "custom op")."""
        return {k.name: k.calls for k in self.kernels if k.kind == kind}


@dataclass(frozen=True)
class Inspection:
    """What `inspect` dumped and found. Calls of a `Kernel` are per run of its graph;
    `custom_op_calls` are per decode step (each graph's calls times the layers that run it)."""

    out_dir: Path  # the depyf dump
    index_json: Path
    index_md: Path
    graphs: tuple[CompiledGraph, ...]
    kernels: tuple[Kernel, ...]  # of every graph, in graph order (`Kernel.graph` says which)
    custom_op_calls: dict[str, int]  # custom op -> calls per decode step
    compilation: str  # CompileOptions.compilation
    batch: int


# -- the public entry point ---------------------------------------------------------------------
def inspect(target, out_dir: str | os.PathLike, *, batch: int = 1, options: CompileOptions | None = None) -> Inspection:
    """Compile a fresh copy of the decode step of `target` (a `model.Decoder`, compiled as
    `options` say, default `CompileOptions()`, or a `fuse.DecodeRunner`, compiled as its options
    say), run it once on `batch` padding rows under depyf, and index what Inductor generated.

    `out_dir` must be empty or absent, or hold an earlier dump (which is replaced). Nothing of
    the caller's is changed: real cache slots, compiled runners of the same model (their Dynamo
    caches are untouched: the copy of the step has code objects of its own), Dynamo's counters
    and memory of dynamic shapes, depyf's and Inductor's hooks and caches settings."""
    decoder, options = _resolve_target(target, options)
    if isinstance(batch, bool) or not isinstance(batch, int) or not 1 <= batch <= decoder.max_batch:
        raise ValueError(f"batch must be an int in [1, {decoder.max_batch}] (the decoder's max_batch), got {batch!r}")
    device = decoder.device
    compile_kwargs = {"backend": compile_backend(options, device)}
    out = _prepare_out_dir(Path(out_dir))

    graph_layers: dict[str, list[int]] = collections.defaultdict(list)
    with _preserved_dynamo_state(), _recompile_limit(len(decoder.layers) + 1), _depyf_dump(out):
        step, once_per_step_codes = _fresh_compiled_step(decoder, options, compile_kwargs, graph_layers)
        tokens = torch.zeros(batch, dtype=torch.int64, device=device)
        positions = torch.zeros(batch, dtype=torch.int64, device=device)
        slots = torch.full((batch,), decoder.pad_slot, dtype=torch.int64, device=device)
        with torch.no_grad():
            step(tokens, positions, slots)
        once_per_step = [name for code in once_per_step_codes for name in _graphs_of_frame(code)]
    layers_of = {name: tuple(layers) for name, layers in graph_layers.items()}
    layers_of.update((name, None) for name in once_per_step)

    graphs = tuple(_read_graph(out, name, layers_of.get(name, ())) for name in _graph_names(out, layers_of))
    kernels = tuple(k for g in graphs for k in g.kernels)
    per_step: collections.Counter[str] = collections.Counter()
    for g in graphs:
        for op, calls in g.calls("custom op").items():
            per_step[op] += calls * g.runs_per_step
    inspection = Inspection(
        out_dir=out,
        index_json=out / "index.json",
        index_md=out / "index.md",
        graphs=graphs,
        kernels=kernels,
        custom_op_calls=dict(sorted(per_step.items())),
        compilation=options.compilation,
        batch=batch,
    )
    index = index_dict(inspection, options, str(device))
    inspection.index_json.write_text(json.dumps(index, indent=2) + "\n")
    inspection.index_md.write_text(index_markdown(index))
    return inspection


def _resolve_target(target, options: CompileOptions | None):
    if isinstance(target, DecodeRunner):
        if options is not None:
            raise ValueError("options: a DecodeRunner is inspected with its own options; pass options only with a Decoder")
        return target.decoder, target.options
    if not all(hasattr(target, a) for a in ("step", "layers", "pad_slot", "max_batch", "device")):
        raise ValueError(f"target must be a model.Decoder or a fuse.DecodeRunner, got {type(target).__name__}")
    if options is not None and not isinstance(options, CompileOptions):
        raise ValueError(f"options must be a fuse.CompileOptions, got {type(options).__name__}")
    return target, options or CompileOptions()


def _prepare_out_dir(out: Path) -> Path:
    """A new or empty folder. One holding only the files of an earlier dump (depyf's names and
    the index) is emptied first; anything else in it is refused, and nothing is deleted."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"out_dir {out} exists and is not a folder")
    out.mkdir(parents=True, exist_ok=True)
    entries = list(out.iterdir())
    foreign = sorted(p.name for p in entries if not (p.is_file() and _is_dump_file(p.name)))
    if foreign:
        raise ValueError(f"out_dir {out} is not empty ({', '.join(foreign[:5])}); pass a new or empty folder")
    for path in entries:
        path.unlink()
    return out.resolve()


def _is_dump_file(name: str) -> bool:
    return name.startswith(_DUMP_PREFIXES) or name in ("index.json", "index.md")


# -- compiling a fresh copy ---------------------------------------------------------------------
def _fresh_function(fn: types.FunctionType) -> types.FunctionType:
    """`fn` with a private copy of its code object. Dynamo keeps its compiled entries per code
    object, so compiling the copy neither reuses nor adds to the entries of runners already
    compiled from the same model (torch._dynamo.reset() would drop theirs)."""
    fresh = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    fresh.__kwdefaults__ = fn.__kwdefaults__
    fresh.__qualname__ = fn.__qualname__
    return fresh


def _fresh_compiled_step(decoder, options: CompileOptions, kwargs: dict, graph_layers: dict[str, list[int]]):
    """(step(tokens, positions, slots), the code objects of the graphs that run once per step:
    the step's, or the compiled head's). Nested: the step with its blocks as nested compile
    regions, as the runner builds it. Regional: every block compiled from one shared code copy, as
    the runner shares Block.forward, and after each block call the graph it ran is recorded in
    `graph_layers`; the head compiled as the runner compiles it (compile_head)."""
    # dynamic_batch: batch 1 runs a graph of its own (Dynamo specialises sizes 0 and 1); any
    # other batch, the batch-symbolic graph the runner's buckets share.
    dynamic = None if options.dynamic_batch else False
    compile_ = lambda fn: torch.compile(fn, fullgraph=True, dynamic=dynamic, **kwargs)
    if options.compilation != "regional":
        if options.compilation == "nested":
            fresh = _fresh_function(nested_region_step(decoder))
            compiled = compile_(fresh)
        else:
            fresh = _fresh_function(type(decoder).step)
            compiled = compile_(types.MethodType(fresh, decoder))
        return (batch_symbolic(compiled) if options.dynamic_batch else compiled), [fresh.__code__]

    copies: dict[types.FunctionType, types.FunctionType] = {}
    blocks = []
    for index, layer in enumerate(decoder.layers):
        forward = getattr(layer.forward, "__func__", None)
        if forward is None or layer.forward.__self__ is not layer:
            raise ValueError(f"layer {index} has no forward method to compile")
        fresh = copies.setdefault(forward, _fresh_function(forward))
        compiled = compile_(types.MethodType(fresh, layer))
        blocks.append(_recording_block(index, batch_symbolic_block(compiled) if options.dynamic_batch else compiled, fresh.__code__, graph_layers))
    head, head_codes = None, []
    if options.compile_head:
        fresh = _fresh_function(type(decoder).logits)
        head = compile_(types.MethodType(fresh, decoder))
        head = batch_symbolic(head) if options.dynamic_batch else head
        head_codes.append(fresh.__code__)
    return (lambda tokens, positions, slots: decoder.step(tokens, positions, slots, layers=blocks, logits=head)), head_codes


def _recording_block(index: int, compiled: Callable, code: types.CodeType, graph_layers) -> Callable:
    def block(streams, step, hadamard):
        out = compiled(streams, step, hadamard)
        # Dynamo moves the cache entry that ran (or was just compiled) to the front of the
        # code object's list, so the first entry names the graph this layer ran.
        names = _graphs_of_frame(code, first_only=True)
        if not names:
            raise RuntimeError(f"fuse.inspect: cannot tell which compiled graph layer {index} ran")
        graph_layers[names[0]].append(index)
        return out

    return block


def _graphs_of_frame(code: types.CodeType, first_only: bool = False) -> list[str]:
    """`__compiled_fn_N` called by the transformed code of each cache entry of `code`."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    entries = _debug_get_cache_entry_list(code)
    names = []
    for entry in entries[:1] if first_only else entries:
        names += [m.group(1) for n in entry.code.co_names if (m := re.match(r"(__compiled_fn_\d+)", n))]
    return names


# -- global state: what the dump needs, restored afterwards -------------------------------------
@contextlib.contextmanager
def _depyf_dump(out: Path) -> Iterator[None]:
    import depyf
    from torch._inductor.codecache import PyCodeCache

    # depyf puts back the loader it replaced as a bound method, not the classmethod it was.
    descriptor = PyCodeCache.__dict__["load_by_key_path"]
    real = PyCodeCache.load_by_key_path
    try:
        with warnings.catch_warnings():
            # prepare_debug's reminder to run the code several times: this one run is what we want.
            warnings.filterwarnings("ignore", message=".*You are trying to debug `torch.compile`")
            with _caches_off(), depyf.prepare_debug(str(out)), _load_by_key_path_keywords(out, PyCodeCache, real):
                yield
    finally:
        PyCodeCache.load_by_key_path = descriptor


@contextlib.contextmanager
def _load_by_key_path_keywords(out: Path, code_cache, real: Callable) -> Iterator[None]:
    """Compatibility shim for depyf 0.20 on recent torch: depyf replaces
    PyCodeCache.load_by_key_path with a function of (key, path, linemap, attrs) that copies the
    module into the dump and loads the copy. torch 2.13 also passes a keyword-only argument,
    `set_sys_modules`, from PyCodeCache.load (Triton kernel modules, autotuning candidates),
    which that function rejects with a TypeError, so CUDA compiles fail under prepare_debug.
    Calls with keywords are copied the same way here and the keywords reach the real loader;
    calls without them (all of them where torch passes none) go through depyf's function."""
    from depyf.explain.utils import get_current_compiled_fn_name, write_code_to_file_template

    dumping = code_cache.__dict__["load_by_key_path"]  # what prepare_debug installed

    def load_by_key_path(key, path, linemap=None, attrs=None, **keywords):
        if not keywords:
            return dumping(key, path, linemap, attrs)
        template = os.path.join(str(out), get_current_compiled_fn_name() + ".kernel_%s.py")
        copied = write_code_to_file_template(Path(path).read_text(), template)
        return real(key, copied, linemap, attrs, **keywords)

    code_cache.load_by_key_path = load_by_key_path
    try:
        yield
    finally:
        code_cache.load_by_key_path = dumping


def _caches_off() -> contextlib.ExitStack:
    """A compile served from Inductor's FX graph cache or AOTAutograd's cache skips the stages
    whose graphs depyf dumps, and a runner of the same model has likely filled those caches with
    these very graphs: both are off while we compile."""
    stack = contextlib.ExitStack()
    for config, keys in (
        (torch._inductor.config, ("fx_graph_cache", "fx_graph_remote_cache")),
        (torch._functorch.config, ("enable_autograd_cache", "enable_remote_autograd_cache")),
    ):
        stack.enter_context(config.patch({k: False for k in keys if hasattr(config, k)}))
    return stack


def _recompile_limit(limit: int):
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    return config.patch({name: max(getattr(config, name), limit)})


@contextlib.contextmanager
def _preserved_dynamo_state() -> Iterator[None]:
    """Dynamo's counters (runners account compiles with them) and its automatic-dynamic memory
    of frame shapes (keyed by function name and line, so shared between a code copy and its
    original) are put back as they were."""
    saved_counters = {k: collections.Counter(v) for k, v in counters.items()}
    try:
        from torch._dynamo import pgo
    except ImportError:
        pgo = None
    saved_shapes = copy.deepcopy(getattr(pgo, "_CODE_STATE", None))
    try:
        yield
    finally:
        counters.clear()
        counters.update(saved_counters)
        if pgo is not None and hasattr(pgo, "_CODE_STATE"):
            pgo._CODE_STATE = saved_shapes


# -- reading the dump ---------------------------------------------------------------------------
def _graph_names(out: Path, mapped: dict) -> list[str]:
    found = {m.group(1) for p in out.iterdir() if (m := re.match(r"(__compiled_fn_\d+)\.", p.name))}
    return sorted(found | set(mapped), key=lambda n: int(n.rsplit("_", 1)[1]))


def _read_graph(out: Path, name: str, layers: tuple[int, ...] | None) -> CompiledGraph:
    own = sorted(p for p in out.iterdir() if p.name.startswith(name + "."))
    refers = re.compile(rf"\b{name}[_(]")  # `__compiled_fn_3_<id>(` or `__compiled_fn_3(`, never `__compiled_fn_31`
    files: dict[str, Path | None] = {
        "transformed_code": next((p for p in sorted(out.glob("__transformed_code_*.py")) if refers.search(p.read_text())), None),
        "captured_graph": next(
            (p for p in own if p.name.startswith((f"{name}.Captured_Graph.", f"{name}.{name}_", f"{name}.{name}."))), None
        ),
        "aot_forward_graph": next((p for p in own if ".Forward_graph." in p.name), None),
        "post_grad_graph": next((p for p in own if ".AFTER_POST_GRAD." in p.name), None),
        "output_code": next((p for p in own if ".kernel_" in p.name and _is_wrapper(p.read_text())), None),
    }
    kernels = parse_output_code(files["output_code"].read_text()) if files["output_code"] else []
    other = tuple(p for p in own if p not in files.values())
    return CompiledGraph(name, layers, files, other, tuple(replace(k, graph=name) for k in kernels))


def _is_wrapper(source: str) -> bool:
    return re.search(r"^\s*def call\(", source, re.M) is not None


# -- parsing Inductor's output code -------------------------------------------------------------
_DEFINITION = re.compile(r"^(?P<name>\w+) = async_compile\.(?P<method>\w+)\(", re.M)
_TRIPLE_QUOTED = re.compile(r"[rR]?'''.*?'''|[rR]?\"\"\".*?\"\"\"", re.S)
_EXTERN_CALL = re.compile(r"(?<![\w.])extern_kernels\.(\w+)\(")
_OP_CALL = re.compile(r"(?<![\w.])(?:torch\.ops\.(?P<ns>\w+)|(?P<aten>aten))\.(?P<op>\w+)(?:\.\w+)?\(")
_SOURCE_NODES = re.compile(r"Source Nodes: \[([^\]]*)\]")
_ORIGINAL_ATEN = re.compile(r"Original ATen: \[([^\]]*)\]")
_STREAM_LINE = re.compile(r"stream\w* = get_raw_stream\(")
_NOT_KERNELS = {"inductor"}  # torch.ops.inductor.*: allocation helpers


def parse_output_code(source: str) -> list[Kernel]:
    """Kernels an Inductor output-code module defines and the calls its wrapper makes: generated
    kernels in definition order, then extern calls and custom ops in order of first call. Works on
    the Python wrapper of either backend (C++ kernels on the CPU, Triton on CUDA)."""
    known = known_ops()
    defined: dict[str, dict] = {}
    for match in _DEFINITION.finditer(source):
        name, method = match["name"], match["method"]
        comments = _comment_block_above(source, match.start())
        body = _TRIPLE_QUOTED.search(source, match.end())
        body_text = body.group(0) if body else ""
        if method == "triton":
            kind, ops, nodes = triton_kernel_info(name, comments, body_text, known)
        elif method.startswith("cpp"):
            kind, ops, nodes = "cpp", ops_from_kernel_name(name, known), ()
        else:  # other backends (cuda templates, halide, ...): their async_compile method names the kind
            kind, ops, nodes = method, ops_from_kernel_name(name, known), ()
        defined[name] = {"kind": kind, "ops": ops, "source_nodes": nodes, "calls": 0}

    opaque: dict[str, dict] = {}
    launch = re.compile(r"(?<![\w.])(" + "|".join(map(re.escape, defined)) + r")(?:\.run)?\(") if defined else None
    lines = _TRIPLE_QUOTED.sub("''", source).splitlines()
    runs = _runs_per_call(lines)
    # Inductor writes a launch's origin comment directly above it (on CUDA with the stream line
    # between); any other line in between means the comment was not about a launch.
    pending: tuple[tuple[str, ...], tuple[str, ...]] | None = None
    for line, times in zip(lines, runs):
        text = line.strip()
        if text.startswith("#"):
            if "Original ATen:" in text or "Source Nodes:" in text:
                pending = _comment_origins(text)
            continue
        if not text or _STREAM_LINE.match(text):
            continue
        if "async_compile." not in text:
            for match in launch.finditer(text) if launch else ():
                entry = defined[match.group(1)]
                entry["calls"] += times
                if pending and not entry["ops"] and not entry["source_nodes"]:
                    entry["source_nodes"], entry["ops"] = pending
            for name, kind in _opaque_calls(text):
                entry = opaque.setdefault(name, {"kind": kind, "ops": (), "source_nodes": (), "calls": 0})
                entry["calls"] += times
                if pending:
                    entry["source_nodes"] = _union(entry["source_nodes"], pending[0])
                    entry["ops"] = _union(entry["ops"], pending[1])
        pending = None
    return [Kernel(name, **entry) for name, entry in (*defined.items(), *opaque.items())]


_DEF = re.compile(r"^(?P<indent>\s*)def (?P<name>\w+)\(")
_WRAPPER_ENTRY = "call"


def _runs_per_call(lines: list[str]) -> list[int]:
    """For each line of a wrapper module, how often it runs per call of the wrapper: 1 in
    `call`, n in a function that code running once calls n times (the nested compile regions'
    subgraph functions), 0 elsewhere (module level, `get_args`, the benchmark harness)."""
    owner: list[str | None] = []  # innermost function each line belongs to
    stack: list[tuple[int, str]] = []
    for line in lines:
        if line.strip():
            indent = len(line) - len(line.lstrip())
            while stack and indent <= stack[-1][0]:
                stack.pop()
        owner.append(stack[-1][1] if stack else None)
        if (match := _DEF.match(line)) is not None:
            stack.append((len(match["indent"]), match["name"]))
    functions = {name for name in owner if name}
    callers: dict[str, list[int]] = {name: [] for name in functions}
    if functions - {_WRAPPER_ENTRY}:
        called = re.compile(r"(?<![\w.])(" + "|".join(map(re.escape, sorted(functions - {_WRAPPER_ENTRY}))) + r")\(")
        for i, line in enumerate(lines):
            if not _DEF.match(line):
                for match in called.finditer(line):
                    callers[match.group(1)].append(i)
    memo: dict[str | None, int] = {None: 0, _WRAPPER_ENTRY: 1}

    def runs(name: str | None, seen: frozenset = frozenset()) -> int:
        if name not in memo:
            memo[name] = 0 if name in seen else sum(runs(owner[i], seen | {name}) for i in callers[name])
        return memo[name]

    return [runs(name) for name in owner]


def triton_kernel_info(
    name: str, comments: str, body: str, known: dict[str, str] | None = None
) -> tuple[str, tuple[str, ...], tuple[str, ...]]:
    """(kind, ops, source nodes) of a Triton kernel from its name (`triton_<poi|red|per|tem>_...`,
    else the `@triton_heuristics.<kind>` decorator in its source) and the comments Inductor
    writes above its definition (`# Topologically Sorted Source Nodes: [...], Original ATen:
    [...]`, `# Source Nodes: [...]` in older torch; the ops fall back to the kernel's name)."""
    prefix = re.match(r"triton_([a-z]+)_", name)
    decorator = re.search(r"@triton_heuristics\.(\w+)", body)
    if prefix and prefix.group(1) in _TRITON_KINDS:
        kind = _TRITON_KINDS[prefix.group(1)]
    elif decorator:
        kind = decorator.group(1).replace("_", " ")
    else:
        kind = "triton"
    nodes, ops = _comment_origins(comments)
    return kind, ops or ops_from_kernel_name(name, known_ops() if known is None else known), nodes


def _comment_block_above(source: str, position: int) -> str:
    """The run of comment lines directly above the line that starts at `position`."""
    block, end = [], position
    while end > 0:
        start = source.rfind("\n", 0, end - 1) + 1
        line = source[start:end].strip()
        if not line.startswith("#"):
            break
        block.append(line)
        end = start
    return "\n".join(reversed(block))


def _comment_origins(comments: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    nodes = _SOURCE_NODES.search(comments)
    ops = _ORIGINAL_ATEN.search(comments)
    split = lambda m: tuple(x.strip() for x in m.group(1).split(",") if x.strip()) if m else ()
    return split(nodes), split(ops)


def _opaque_calls(text: str) -> Iterable[tuple[str, str]]:
    for match in _EXTERN_CALL.finditer(text):
        yield f"extern_kernels.{match.group(1)}", "extern"
    for match in _OP_CALL.finditer(text):
        namespace = match["ns"] or match["aten"]
        if namespace in _NOT_KERNELS:
            continue
        yield f"{namespace}.{match['op']}", "extern" if namespace in ("aten", "prims") else "custom op"


def _union(a: tuple[str, ...], b: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(dict.fromkeys((*a, *b)))


def known_ops() -> dict[str, str]:
    """Op name -> qualified name (`add` -> `aten.add`, `moe_experts` -> `v4.moe_experts`) of
    every registered operator and higher-order op; ATen wins where namespaces share a name."""
    known: dict[str, str] = {}
    for qualified in getattr(torch._C, "_dispatch_get_all_op_names", lambda: [])():
        namespace, _, rest = qualified.partition("::")
        name = rest.split(".", 1)[0]
        if name and (name not in known or namespace == "aten"):
            known[name] = f"{namespace}.{name}"
    for name in getattr(torch._ops, "_higher_order_ops", {}):
        known.setdefault(name, name)
    return known


def ops_from_kernel_name(name: str, known: dict[str, str]) -> tuple[str, ...]:
    """The ops an Inductor kernel name lists: `<prefix>_fused_<op>_<op>..._<n>` joins the sorted
    op names with "_", and op names contain "_" too (`__rshift__`, `_to_copy`, `floor_divide`),
    so they are split by taking, at each point, the longest known op name; an unknown word stands
    for itself."""
    start = name.find("fused_")
    if start < 0:
        return ()
    text = re.sub(r"_\d+$", "", name[start + len("fused_") :])
    ops, i = [], 0
    while i < len(text):
        ends = [j for j in range(len(text), i, -1) if j == len(text) or text[j] == "_"]
        end = next((j for j in ends if text[i:j] in known), None)
        if end is None:
            end = ends[-1]  # the shortest word
            ops.append(text[i:end])
        else:
            ops.append(known[text[i:end]])
        i = end + 1
    # A custom op never runs inside a generated kernel; Inductor names a kernel after the nodes
    # it was built from, and a kernel that reads a custom op's outputs can carry its name.
    return tuple(op for op in ops if op and op.split(".")[0] in ("aten", "prims") or "." not in op and op)


# -- the index ----------------------------------------------------------------------------------
def index_dict(inspection: Inspection, options: CompileOptions, device: str) -> dict:
    import depyf

    rel = lambda p: None if p is None else p.name
    return {
        "fuse_inspect": _INDEX_FORMAT,
        "torch": torch.__version__,
        "depyf": depyf.__version__,
        "device": device,
        "batch": inspection.batch,
        "compilation": inspection.compilation,
        "dynamic_batch": options.dynamic_batch,
        "mode": options.mode,
        "full_code": sorted(p.name for p in inspection.out_dir.glob("full_code_for_*.py")),
        "custom_op_calls_per_step": inspection.custom_op_calls,
        "graphs": [
            {
                "name": g.name,
                "layers": None if g.layers is None else list(g.layers),
                "runs_per_step": g.runs_per_step,
                "files": {role: rel(path) for role, path in g.files.items()},
                "other_files": [p.name for p in g.other_files],
                "kernels": [k.to_dict() for k in g.kernels],
            }
            for g in inspection.graphs
        ],
    }


_FILE_ROLES = {
    "transformed_code": "Dynamo's transformed bytecode, decompiled",
    "captured_graph": "captured FX graph",
    "aot_forward_graph": "AOTAutograd forward graph (ATen)",
    "post_grad_graph": "graph after Inductor's passes",
    "output_code": "Inductor output code (kernels, then the wrapper `call`)",
}


def index_markdown(index: dict) -> str:
    """index.md: the same content as index.json, as tables."""
    lines = [
        "# Inductor code of the decode step",
        "",
        f"torch {index['torch']}, depyf {index['depyf']}, {index['device']}, batch {index['batch']}, "
        f"{index['compilation']} compilation, dynamic_batch={index['dynamic_batch']}, mode={index['mode']}.",
        "",
        "Each graph lists what its output code's wrapper (`call`) launches, with calls per run of the graph; "
        "a graph runs once per layer listed. ops: the ATen ops a kernel computes (for fused kernels, the ops it "
        "fused); source nodes: nodes of the captured graph (the C++ backend does not name them). "
        f"Whole frame with guards: {', '.join(f'`{n}`' for n in index['full_code']) or 'none'}.",
        "",
        "## Custom-op calls per decode step",
        "",
        "| op | calls per step |",
        "|---|---|",
        *(f"| `{op}` | {calls} |" for op, calls in index["custom_op_calls_per_step"].items()),
    ]
    once_per_step = "the head" if index["compilation"] == "regional" else "the step"
    for g in index["graphs"]:
        runs = once_per_step if g["layers"] is None else "layers " + ", ".join(map(str, g["layers"]))
        lines += ["", f"## `{g['name']}`: {runs} ({g['runs_per_step']} run(s) per step)", ""]
        lines += [f"- {_FILE_ROLES[role]}: " + (f"[`{name}`]({name})" if name else "not dumped") for role, name in g["files"].items()]
        lines += ["", "| kernel | kind | calls | ops | source nodes |", "|---|---|---|---|---|"]
        lines += [
            f"| `{k['name']}` | {k['kind']} | {k['calls']} | {', '.join(k['ops'])} | {', '.join(k['source_nodes'])} |"
            for k in g["kernels"]
        ]
    return "\n".join(lines) + "\n"
