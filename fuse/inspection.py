"""The code Inductor generates for a runner's decode step, dumped with depyf and indexed.

`compile_decode(model, dump_dir=PATH)` compiles under `depyf.prepare_debug(PATH)`, so the dump
holds exactly the graphs the runner runs; `runner.inspection` (an `Inspection`) and PATH's
`index.json` / `index.md` say which graph runs for which bucket and layers, and what each one's
wrapper launches. `fuse.inspect(model, PATH, batch=B)` does the same for one bucket.

The dump holds, per compiled graph `__compiled_fn_N` (N is Dynamo's id; the nested and
whole-step compilations have one graph per shape for the step, the regional one a graph per
distinct layer kind and shape, shared by every layer of that kind, plus the head's), the kinds
of files DUMP_FILES (below) describes; each index.md lists them too.

Modules: the backend shows the dump each graph Dynamo captured (`CodeDump.record_graph`), whose
nodes carry the model module that called them; a kernel's modules are those of its source nodes
or of the parameters and buffers it reads (`_with_modules`), written once for all the layers
that run it (`layers.[0-1].attn`).

Counts: `Kernel.calls` is per run of its graph (a subgraph function's launches once per call of
it); a graph runs once per layer listed under it (regional) or once per step, so
`Inspection.custom_op_calls[bucket]`, per decode step, sums calls times runs over that bucket's
graphs.
"""
from __future__ import annotations

import collections
import contextlib
import json
import os
import re
import types
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterator

import torch

from fuse.output_code import Kernel, launches, parse_output_code, wrapper_arity

_INDEX_FORMAT = 3  # bumped when index.json changes shape

# What each kind of file in a dump is (module docstring); index.md lists it.
DUMP_FILES = (
    ("index.md, index.json", "this index: per graph its files and what its wrapper launches, and the custom-op calls per step"),
    ("__transformed_code_K_for_<frame>.py", "the bytecode Dynamo substituted for the compiled frame, decompiled to Python: it "
     "gathers the graph's inputs and calls `__compiled_fn_N_<id>`. K counts frames, not graphs: each graph below names its file"),
    ("full_code_for_<frame>_0.py", "the whole frame: per cache entry its guards and transformed code, then the original source"),
    ("__compiled_fn_N.__compiled_fn_N_<id>.0.py", "the FX graph Dynamo captured, a runnable `GraphModule` whose comments give "
     "the model source line of every node; its node names are the source nodes of the tables below (a nested region only "
     "one layer runs is inlined before Inductor compiles it: its nodes are those of its `subgraph_K` class, renamed where "
     "names collide)"),
    ("__compiled_fn_N.Forward_graph.0.py", "AOTAutograd's ATen graph"),
    ("__compiled_fn_N.AFTER_POST_GRAD.0.py", "what Inductor fuses, after its graph passes"),
    ("__compiled_fn_N.<other stage>.<i>.py", "`BEFORE_PRE_GRAD`, `tensorify_python_scalars`, "
     "`pre_insert_deferred_runtime_asserts_*`: steps in between (`<i>` counts repeats). A graph served from the compile "
     "cache has no AOTAutograd or post-grad stage: those ran when the cache was filled"),
    ("__compiled_fn_N.kernel_K.py", "Inductor's output code: the kernels' source (C++ on the CPU, Triton on CUDA), then "
     "`call(args)`, the wrapper: the graph's launch sequence (allocations, generated kernels, `extern_kernels.*` library "
     "calls, the opaque custom ops `torch.ops.v4.*`), each launch under a comment naming its source nodes and ATen ops. "
     "With nested compilation a layer kind several layers share is a function of its own above the wrapper "
     "(`..._subgraph_K(args)`), called once per such layer. Triton kernels Inductor loads as modules of their own are "
     "further kernel_K files; each graph below names the one with `call`"),
)
_DUMP_PREFIXES = ("__compiled_fn_", "__transformed_code_", "full_code_for_")


@dataclass(frozen=True)
class CompiledGraph:
    """One Dynamo graph, its dump files and what its wrapper launches."""

    name: str  # `__compiled_fn_N`
    layers: tuple[int, ...] | None  # decoder layers that run it (regional); None: once per step (the step, or the head)
    buckets: tuple[int, ...]  # buckets whose step runs it
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
    """What a dump holds. Calls of a `Kernel` are per run of its graph; `custom_op_calls` are per
    decode step of each bucket (each graph's calls times the layers that run it)."""

    out_dir: Path
    index_json: Path
    index_md: Path
    graphs: tuple[CompiledGraph, ...]
    kernels: tuple[Kernel, ...]  # of every graph, in graph order (`Kernel.graph` says which)
    custom_op_calls: dict[int, dict[str, int]]  # bucket -> custom op -> calls per decode step
    compilation: str
    buckets: tuple[int, ...]
    around_step: tuple[Kernel, ...] = ()  # what a runner's call launches besides the step

    def graphs_of(self, bucket: int) -> tuple[CompiledGraph, ...]:
        return tuple(g for g in self.graphs if bucket in g.buckets)

    def entry(self, name: str, origin: str, bucket: int) -> Kernel | None:
        """The index entry of a kernel the profiler saw in a step of `bucket` (fuse.launches):
        a generated kernel by its name (the CPU profiler prefixes `graph_<n>_`), a library or
        custom-op kernel by the op that launched it (`origin`: `aten::mm`, `v4::moe_experts`)."""
        candidates = [k for g in self.graphs_of(bucket) for k in g.kernels] + list(self.around_step)
        base = re.sub(r"^graph_\d+_", "", name)
        found = next((k for k in candidates if k.name == base), None)
        if found is None and origin:
            namespace, _, op = origin.partition("::")
            qualified = f"{namespace}.{op.split('.')[0]}"
            wanted = {qualified, f"extern_kernels.{op.split('.')[0]}"}
            found = next((k for k in candidates if k.name in wanted), None)
            found = found or next((k for k in candidates if qualified in k.ops), None)
        return found


class CodeDump:
    """Dumps what is compiled inside it (`with dump:`) into `out_dir` and records which graph each
    bucket's first call (`dump.first_call(size)`) and each regional layer (`dump.after_block`)
    ran; `dump.inspection(...)` then reads and indexes the dump.

    `out_dir` must be new or empty, or hold an earlier dump, which is replaced. With `model`
    (the decoder compiled), `record_graph` (the backend's `on_graph`) learns which of its modules
    each node of a captured graph belongs to, and the index names each kernel's modules."""

    def __init__(self, out_dir: str | os.PathLike, model: torch.nn.Module | None = None):
        self.out = _prepare_out_dir(Path(out_dir))
        self._model = model
        self._names: ModelNames | None = None
        self._graph_modules: dict[str, GraphModules] = {}
        self._stack: contextlib.ExitStack | None = None
        self._once_per_step_codes: tuple[types.CodeType, ...] = ()
        self._bucket: int | None = None  # the bucket whose first call is running
        self._layers: dict[str, set[int]] = collections.defaultdict(set)
        self._buckets: dict[str, set[int]] = collections.defaultdict(set)
        self._once_per_step: set[str] = set()

    def __enter__(self) -> "CodeDump":
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(_depyf_dump(self.out))
        return self

    def __exit__(self, *exc) -> bool | None:
        return self._stack.__exit__(*exc)

    def watch(self, once_per_step_codes: tuple[types.CodeType, ...]) -> None:
        """The code objects whose graphs run once per step (CompiledStep.once_per_step)."""
        self._once_per_step_codes = once_per_step_codes

    @contextlib.contextmanager
    def first_call(self, bucket: int) -> Iterator[None]:
        self._bucket = bucket
        try:
            yield
        finally:
            self._bucket = None
        for code in self._once_per_step_codes:
            for name in _graphs_of_frame(code, first_only=True):
                self._buckets[name].add(bucket)
                self._once_per_step.add(name)

    def record_graph(self, graph: torch.fx.GraphModule) -> None:
        """Called by the backend with each graph Dynamo captured, before Inductor compiles it:
        records the model module of each node and input (read only; the graph is not changed)."""
        if not isinstance(self._model, torch.nn.Module):
            return
        from depyf.explain.utils import get_current_compiled_fn_name

        if self._names is None:
            self._names = ModelNames.of(self._model)
        self._graph_modules[get_current_compiled_fn_name()] = graph_modules(graph, self._names)

    def after_block(self, index: int, code: types.CodeType) -> None:
        """After layer `index` ran a graph compiled from `code` (regional compilation)."""
        if self._bucket is None:
            return
        # Dynamo moves the entry that ran (or was just compiled) to the front of the code's list.
        names = _graphs_of_frame(code, first_only=True)
        if not names:
            raise RuntimeError(f"fuse: cannot tell which compiled graph layer {index} ran")
        self._layers[names[0]].add(index)
        self._buckets[names[0]].add(self._bucket)

    def inspection(
        self, compilation: str, buckets: tuple[int, ...], settings: dict[str, object], around_step: tuple[Kernel, ...] = ()
    ) -> Inspection:
        """Read the dump, write index.json and index.md, and return what they say. `settings`
        (device, options) are written into the index as they are; `around_step` lists what the
        runner launches besides the step."""
        recorded = set(self._buckets)
        graphs = []
        for name in _graph_names(self.out, recorded):
            layers = None if name in self._once_per_step else tuple(sorted(self._layers.get(name, ())))
            graph = _read_graph(self.out, name, layers, tuple(sorted(self._buckets.get(name, ()))))
            if self._names is not None and name in self._graph_modules and graph.files["output_code"]:
                graph = _with_modules(graph, self._graph_modules[name], self._names)
            graphs.append(graph)
        per_step: dict[int, collections.Counter[str]] = {b: collections.Counter() for b in buckets}
        for g in graphs:
            for bucket in g.buckets:
                for op, calls in g.calls("custom op").items():
                    per_step[bucket][op] += calls * g.runs_per_step
        inspection = Inspection(
            out_dir=self.out,
            index_json=self.out / "index.json",
            index_md=self.out / "index.md",
            graphs=tuple(graphs),
            kernels=tuple(k for g in graphs for k in g.kernels),
            custom_op_calls={b: dict(sorted(c.items())) for b, c in per_step.items()},
            compilation=compilation,
            buckets=buckets,
            around_step=tuple(replace(k, graph="runner") for k in around_step),
        )
        index = index_dict(inspection, settings)
        inspection.index_json.write_text(json.dumps(index, indent=2) + "\n")
        inspection.index_md.write_text(index_markdown(index))
        return inspection


# -- the dump folder and depyf ---------------------------------------------------------------
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
            with depyf.prepare_debug(str(out)), _load_by_key_path_keywords(out, PyCodeCache, real):
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


def _graphs_of_frame(code: types.CodeType, first_only: bool = False) -> list[str]:
    """`__compiled_fn_N` called by the transformed code of each cache entry of `code`."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    entries = _debug_get_cache_entry_list(code)
    names = []
    for entry in entries[:1] if first_only else entries:
        names += [m.group(1) for n in entry.code.co_names if (m := re.match(r"(__compiled_fn_\d+)", n))]
    return names


# -- reading the dump ---------------------------------------------------------------------------
def _graph_names(out: Path, mapped: dict) -> list[str]:
    found = {m.group(1) for p in out.iterdir() if (m := re.match(r"(__compiled_fn_\d+)\.", p.name))}
    return sorted(found | set(mapped), key=lambda n: int(n.rsplit("_", 1)[1]))


def _read_graph(out: Path, name: str, layers: tuple[int, ...] | None, buckets: tuple[int, ...]) -> CompiledGraph:
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
    return CompiledGraph(name, layers, buckets, files, other, tuple(replace(k, graph=name) for k in kernels))


def _is_wrapper(source: str) -> bool:
    return re.search(r"^\s*def call\(", source, re.M) is not None


# -- model modules ------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelNames:
    """The compiled model's module names (`layers.3.attn`, "" the model itself) by object id, the
    module owning each parameter and buffer by tensor id, and the names of its decoder layers."""

    modules: dict[int, str]
    owners: dict[int, str]
    layers: tuple[str, ...]

    @classmethod
    def of(cls, model: torch.nn.Module) -> "ModelNames":
        modules: dict[int, str] = {}
        for name, module in model.named_modules(remove_duplicate=False):
            modules.setdefault(id(module), name)
        owners: dict[int, str] = {}
        for name, tensor in (*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)):
            owners.setdefault(id(tensor), name.rpartition(".")[0])
        layers = tuple(modules[id(layer)] for layer in getattr(model, "layers", ()) if id(layer) in modules)
        return cls(modules, owners, layers)


@dataclass(frozen=True)
class GraphModules:
    """Where a captured graph's nodes come from: node name -> module (the innermost module call
    Dynamo recorded for it, else the owner of a parameter or buffer it reads directly), and per
    graph input, in placeholder order (that of the output code's `call(args)`), the module owning
    it (None for the step's own inputs)."""

    nodes: dict[str, str]
    inputs: tuple[str | None, ...]


def graph_modules(graph: torch.fx.GraphModule, names: ModelNames) -> GraphModules:
    nodes: dict[str, str] = {}
    inputs: list[str | None] = []
    for node in graph.graph.nodes:
        if node.op == "placeholder":
            try:
                example = node.meta["grapharg"].example
            except (KeyError, AttributeError, RuntimeError):
                example = None
            owner = names.owners.get(id(example)) if isinstance(example, torch.Tensor) else None
            inputs.append(owner)
            if owner is not None:
                nodes[node.name] = owner
            continue
        # nn_module_stack: outermost first, keyed by id(module) (`<id>@<n>` for its n-th call)
        stack = [names.modules.get(int(k.split("@")[0])) for k in node.meta.get("nn_module_stack") or {} if k.split("@")[0].isdigit()]
        stack = [m for m in stack if m is not None]
        read = [nodes[i.name] for i in node.all_input_nodes if i.op == "placeholder" and i.name in nodes]
        module = stack[-1] if stack else read[0] if read else None
        if module is not None:
            nodes[node.name] = module
    return GraphModules(nodes, tuple(inputs))


def _with_modules(graph: CompiledGraph, recorded: GraphModules, names: ModelNames) -> CompiledGraph:
    """`graph` with each kernel's modules: for a generated kernel launched by the wrapper itself,
    those of its source nodes, else of the parameters and buffers it reads (for a library call or
    custom op the other way round); inside a nested region's function (whose comments name the
    region's call, not the nodes inside), those of what it reads, else the layer whose call runs
    it. A regional graph runs for every layer of its kind: its modules are those of the layer it
    was captured from, named for all of them."""
    source = graph.files["output_code"].read_text()
    # the wrapper's arguments are the captured graph's inputs in order; where the counts differ,
    # what a launch reads says nothing
    inputs = recorded.inputs if wrapper_arity(source) == len(recorded.inputs) else ()
    owners = lambda positions: [inputs[p] for p in positions if p < len(inputs) and inputs[p] is not None]  # noqa: E731
    opaque = {k.name for k in graph.kernels if k.kind in ("extern", "custom op")}
    own = names.layers[graph.layers[0]] if graph.layers and graph.layers[0] < len(names.layers) else ""
    found: dict[str, list[str]] = {}
    for launch in launches(source):
        if launch.region_inputs is None:
            nodes = [recorded.nodes[n] for n in launch.source_nodes if n in recorded.nodes]
            if launch.kernel in opaque:
                # the weights a library call or custom op reads, else its own node: the last
                # (topologically sorted) of its source nodes, those before fed it
                modules = owners(launch.inputs) or nodes[-1:]
            else:
                modules = nodes or owners(launch.inputs)
        else:
            modules = owners(launch.inputs) or _layers_of(owners(launch.region_inputs), names.layers)
        if len(set(modules)) > 1:
            modules = [m for m in modules if m]  # the model itself says nothing beside a module
        # Nodes of the compiled function's own body have no module call recorded: they belong to
        # the layer a regional graph was captured from, else to the model.
        found.setdefault(launch.kernel, []).extend(modules or [own])
    kernels = tuple(replace(k, modules=module_list(found.get(k.name, ()), names.layers, graph.layers)) for k in graph.kernels)
    return replace(graph, kernels=kernels)


def _layers_of(modules: list[str], layers: tuple[str, ...]) -> list[str]:
    """The decoder layers `modules` lie in (a region's call passes its layer's parameters)."""
    return list(dict.fromkeys(layer for m in modules for layer in layers if m == layer or m.startswith(layer + ".")))


def module_list(modules, layers: tuple[str, ...], run_by: tuple[int, ...] | None = None) -> tuple[str, ...]:
    """Distinct module paths in order of first appearance, each decoder layer's path written once
    for all the layers it appears in: `layers.3.attn`, `layers.[0-1].attn`, `layers.[3,5].ffn`;
    "" (the model itself) as `(model)`. `run_by`: the layers a regional graph runs for, which
    stand for the one layer named in its modules."""
    index = {name: i for i, name in enumerate(layers)}
    groups: dict[tuple[str, str], list[int]] = {}
    for module in modules:
        layer = next((l for l in layers if module == l or module.startswith(l + ".")), None)
        if layer is None:
            groups.setdefault((module, ""), [])
            continue
        parent, rest = layer.rpartition(".")[0], module[len(layer):]
        indices = groups.setdefault((parent, rest), [])
        for i in run_by if run_by is not None else (index[layer],):
            if i not in indices:
                indices.append(i)
    out = []
    for (head, rest), indices in groups.items():
        if not indices:
            out.append(head or "(model)")
        else:
            out.append(f"{head + '.' if head else ''}{_index_set(sorted(indices))}{rest}")
    return tuple(out)


def _index_set(indices: list[int]) -> str:
    """[3] -> `3`; [0, 1] -> `[0-1]`; [3, 5] -> `[3,5]`; [0, 1, 2, 4] -> `[0-2,4]`."""
    if len(indices) == 1:
        return str(indices[0])
    runs: list[list[int]] = []
    for i in indices:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return "[" + ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs) + "]"


# -- the index ----------------------------------------------------------------------------------
def index_dict(inspection: Inspection, settings: dict[str, object]) -> dict:
    import depyf

    rel = lambda p: None if p is None else p.name  # noqa: E731
    return {
        "fuse_inspect": _INDEX_FORMAT,
        "torch": torch.__version__,
        "depyf": depyf.__version__,
        **settings,
        "compilation": inspection.compilation,
        "buckets": list(inspection.buckets),
        "full_code": sorted(p.name for p in inspection.out_dir.glob("full_code_for_*.py")),
        "custom_op_calls_per_step": {str(b): calls for b, calls in inspection.custom_op_calls.items()},
        "around_step": [k.to_dict() for k in inspection.around_step],
        "graphs": [
            {
                "name": g.name,
                "layers": None if g.layers is None else list(g.layers),
                "buckets": list(g.buckets),
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
_FROM_CACHE = ("aot_forward_graph", "post_grad_graph")  # stages a compile-cache hit skips


def index_markdown(index: dict) -> str:
    """index.md: the same content as index.json, as tables."""
    settings = ", ".join(f"{k}={v}" for k, v in index.items() if k not in _INDEX_KEYS)
    lines = [
        "# Inductor code of the decode step",
        "",
        f"torch {index['torch']}, depyf {index['depyf']}, {index['compilation']} compilation, buckets "
        f"{index['buckets']}; {settings}.",
        "",
        "Each graph lists what its output code's wrapper (`call`) launches, with calls per run of the graph; "
        "a graph runs once per layer listed, or once per step. ops: the ATen ops a kernel computes (for fused "
        "kernels, the ops it fused); module: the model modules it computes for (`layers.[0-1].attn`: a function "
        "both layers run); source nodes: nodes of the captured graph (inside a function several layers share, "
        "those of its call). "
        f"Whole frame with guards: {', '.join(f'`{n}`' for n in index['full_code']) or 'none'}.",
        "",
        "## The files in this folder",
        "",
        "| file | what it is |",
        "|---|---|",
        *(f"| `{name}` | {what} |" for name, what in DUMP_FILES),
        "",
        "## Custom-op calls per decode step",
        "",
        "| bucket | op | calls per step |",
        "|---|---|---|",
        *(f"| {bucket} | `{op}` | {calls} |" for bucket, ops in index["custom_op_calls_per_step"].items() for op, calls in ops.items()),
    ]
    if index["around_step"]:
        lines += ["", "## Around the step", "", "What the runner launches per call besides the step's graphs.", "",
                  "| kernel | kind | calls | module | ops |", "|---|---|---|---|---|"]
        lines += [f"| `{k['name']}` | {k['kind']} | {k['calls']} | {', '.join(k['modules'])} | {', '.join(k['ops'])} |"
                  for k in index["around_step"]]
    once_per_step = "the head" if index["compilation"] == "regional" else "the step"
    for g in index["graphs"]:
        runs = once_per_step if g["layers"] is None else "layers " + ", ".join(map(str, g["layers"]))
        buckets = ", ".join(map(str, g["buckets"])) or "none recorded"
        lines += ["", f"## `{g['name']}`: {runs} ({g['runs_per_step']} run(s) per step), buckets {buckets}", ""]
        for role, name in g["files"].items():
            missing = "served from the compile cache" if role in _FROM_CACHE and g["files"]["output_code"] else "not dumped"
            lines.append(f"- {_FILE_ROLES[role]}: " + (f"[`{name}`]({name})" if name else missing))
        lines += ["", "| kernel | kind | calls | module | ops | source nodes |", "|---|---|---|---|---|---|"]
        lines += [
            f"| `{k['name']}` | {k['kind']} | {k['calls']} | {', '.join(k['modules'])} | {', '.join(k['ops'])} | "
            f"{', '.join(k['source_nodes'])} |"
            for k in g["kernels"]
        ]
    return "\n".join(lines) + "\n"


_INDEX_KEYS = {"fuse_inspect", "torch", "depyf", "compilation", "buckets", "full_code", "custom_op_calls_per_step", "around_step", "graphs"}
