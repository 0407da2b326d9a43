"""Reading Inductor's output code: the kernels a compiled graph's module defines and what its
wrapper (`call`) launches, with the ATen ops and captured-graph nodes each came from. Works on
the Python wrapper of either backend (C++ kernels on the CPU, Triton on CUDA)."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable

import torch

# Prefix of Triton kernel names (`triton_<category[:3]>_fused_...`) -> kernel kind.
_TRITON_KINDS = {
    "poi": "pointwise",
    "red": "reduction",
    "per": "persistent reduction",
    "tem": "template",
    "for": "foreach",
    "spl": "split scan",
}


@dataclass(frozen=True)
class Kernel:
    """One thing a graph's wrapper launches.

    kind: `pointwise`, `reduction`, `persistent reduction`, `template` (Triton, also `foreach`,
    `split scan`), `cpp` (an Inductor C++ kernel), `extern` (a library kernel the wrapper calls,
    `extern_kernels.mm`, or an ATen fallback `aten.*`) or `custom op` (an opaque op of another
    namespace, `v4.moe_experts`).
    ops: the ATen (and custom) ops it computes, for generated kernels the ops it fused. From
    Inductor's `Original ATen: [...]` comments where the output code has them (Triton kernels,
    extern calls, and C++ kernels compiled by fuse's backend, which has Inductor write them above
    C++ launches too); else read back from the kernel's name, which lists them
    (`cpp_fused_add_mean_mul_0`). Inside a nested compile region's function Inductor's comments
    name the call of the region and its inputs, not the nodes inside (`Unsorted Source Nodes`):
    a generated kernel there keeps the ops of its name, a library call or custom op its own op.
    source_nodes: the captured-graph nodes it came from (`Source Nodes: [...]` comments; empty
    where there are none).
    calls: launches per run of its graph.
    modules: the model modules it computes for (`layers.3.attn.compressor`), filled in by the code
    dump (fuse.inspection), which knows the model; a kernel of a function several layers share
    names them as a list or range (`layers.[0-1].attn`)."""

    name: str
    kind: str
    calls: int
    ops: tuple[str, ...] = ()
    source_nodes: tuple[str, ...] = ()
    graph: str = ""
    modules: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        return {
            "name": self.name, "kind": self.kind, "calls": self.calls, "modules": list(self.modules),
            "ops": list(self.ops), "source_nodes": list(self.source_nodes),
        }


@dataclass(frozen=True)
class Launch:
    """One launch of a kernel on one path of calls from the wrapper's `call`: the source nodes of
    the comment above it, the graph inputs it reads (positions in `call(args)`, which is the order
    of the captured graph's placeholders) and, where it runs in a nested compile region's function,
    the graph inputs that function's call passes (a function called once per layer gives one
    Launch per call)."""

    kernel: str
    source_nodes: tuple[str, ...]
    inputs: tuple[int, ...]
    region_inputs: tuple[int, ...] | None = None  # None: launched by `call` itself


_DEFINITION = re.compile(r"^(?P<name>\w+) = async_compile\.(?P<method>\w+)\(", re.M)
_TRIPLE_QUOTED = re.compile(r"[rR]?'''.*?'''|[rR]?\"\"\".*?\"\"\"", re.S)
_EXTERN_CALL = re.compile(r"(?<![\w.])extern_kernels\.(\w+)\(")
_OP_CALL = re.compile(r"(?<![\w.])(?:torch\.ops\.(?P<ns>\w+)|(?P<aten>aten))\.(?P<op>\w+)(?:\.\w+)?\(")
# In-place tensor methods the wrapper calls on buffers (a mutated graph input written back).
_METHOD_CALL = re.compile(r"(?<=\w)\.(copy_|zero_|fill_)\(")
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
    unsorted = False
    for line, times in zip(lines, runs):
        text = line.strip()
        if text.startswith("#"):
            if "Original ATen:" in text or "Source Nodes:" in text:
                pending, unsorted = _comment_origins(text), "Unsorted Source Nodes" in text
            continue
        if not text or _STREAM_LINE.match(text):
            continue
        if "async_compile." not in text:
            for match in launch.finditer(text) if launch else ():
                entry = defined[match.group(1)]
                entry["calls"] += times
                if pending and not entry["source_nodes"]:
                    entry["source_nodes"] = pending[0]
                    if not entry["ops"] or (pending[1] and not unsorted):
                        # a custom op never runs inside a generated kernel (ops_from_kernel_name)
                        entry["ops"] = tuple(op for op in pending[1] if op.split(".")[0] in ("aten", "prims")) or entry["ops"]
            for name, kind in _opaque_calls(text):
                entry = opaque.setdefault(name, {"kind": kind, "ops": (), "source_nodes": (), "calls": 0})
                entry["calls"] += times
                if pending:
                    entry["source_nodes"] = _union(entry["source_nodes"], pending[0])
                    # inside a nested region's function the comment's ops are those of the region's
                    # whole call: the call's own op stands for them (`extern_kernels.mm`: aten.mm)
                    own = (name.replace("extern_kernels.", "aten."),)
                    entry["ops"] = _union(entry["ops"], own if unsorted else pending[1])
        pending = None
    return [Kernel(name, **entry) for name, entry in (*defined.items(), *opaque.items())]


def wrapper_arity(source: str) -> int | None:
    """How many arguments the wrapper's `call(args)` unpacks (None: no such line)."""
    lines = _TRIPLE_QUOTED.sub("''", source).splitlines()
    found = _parameters(lines, _line_owners(lines)).get(_WRAPPER_ENTRY)
    return None if found is None else len(found)


def launches(source: str) -> list[Launch]:
    """Every launch parse_output_code counts, once per path of calls that reaches it, with the
    graph inputs it reads: the names of the wrapper's arguments on its line, followed through the
    calls of nested regions' functions (`f_args = [buf0, arg8_1, ...]`; `f(f_args)`) back to
    `call(args)`. Buffers are not followed."""
    lines = _TRIPLE_QUOTED.sub("''", source).splitlines()
    owner = _line_owners(lines)
    defined = [match["name"] for match in _DEFINITION.finditer(source)]
    launch = re.compile(r"(?<![\w.])(" + "|".join(map(re.escape, defined)) + r")(?:\.run)?\(") if defined else None
    params = _parameters(lines, owner)
    sites = _call_sites(lines, owner, set(params) - {_WRAPPER_ENTRY})

    def resolve(name: str, function: str, path: tuple) -> int | None:
        if name not in params.get(function, {}):
            return None
        if function == _WRAPPER_ENTRY:
            return params[function][name]
        caller, elements = path[-1]
        position = params[function][name]
        return resolve(elements[position], caller, path[:-1]) if position < len(elements) else None

    found: list[Launch] = []
    pending: tuple[str, ...] = ()
    for i, line in enumerate(lines):
        text = line.strip()
        if text.startswith("#"):
            if "Source Nodes:" in text or "Original ATen:" in text:
                pending = _comment_origins(text)[0]
            continue
        if not text or _STREAM_LINE.match(text):
            continue
        function = owner[i]
        names = [] if "async_compile." in text or function not in params else (
            [m.group(1) for m in launch.finditer(text)] if launch else []
        ) + [name for name, _ in _opaque_calls(text)]
        for path in _call_paths(function, sites) if names else ():
            read = [resolve(t, function, path) for t in dict.fromkeys(re.findall(r"\b\w+\b", text))]
            region = None
            if path:
                caller, elements = path[-1]
                region = tuple(p for p in (resolve(e, caller, path[:-1]) for e in elements) if p is not None)
            inputs = tuple(p for p in read if p is not None)
            found += [Launch(name, pending, inputs, region) for name in names]
        pending = ()
    return found


def _parameters(lines: list[str], owner: list[str | None]) -> dict[str, dict[str, int]]:
    """Function -> its arguments by position, from the line that unpacks them (`arg0_1, arg1_1 = args`)."""
    params: dict[str, dict[str, int]] = {}
    for line, function in zip(lines, owner):
        if function and function not in params and (match := re.match(r"^\s*(\w+(?:\s*,\s*\w+)*),?\s*=\s*args\s*$", line)):
            params[function] = {name.strip(): i for i, name in enumerate(match.group(1).split(","))}
    return params


def _call_sites(lines: list[str], owner: list[str | None], functions: set[str]) -> dict[str, list[tuple[str, list[str]]]]:
    """Function -> (caller, argument expressions) of each call of it: `f_args = [a, b]` (then
    `f(f_args)`) or `f([a, b])`."""
    sites: dict[str, list[tuple[str, list[str]]]] = {name: [] for name in functions}
    if not functions:
        return sites
    names = "|".join(map(re.escape, sorted(functions)))
    listed = re.compile(rf"^\s*({names})_args = \[(.*)\]\s*$")
    direct = re.compile(rf"(?<![\w.])({names})\(\[(.*)\]\)")
    for line, caller in zip(lines, owner):
        match = listed.match(line) or direct.search(line)
        if match and caller:
            sites[match.group(1)].append((caller, [e.strip() for e in _split_arguments(match.group(2))]))
    return sites


def _call_paths(function: str | None, sites: dict, seen: frozenset = frozenset()) -> list[tuple]:
    """The chains of call sites from `call` to `function` (one empty chain for `call` itself)."""
    if function == _WRAPPER_ENTRY:
        return [()]
    if function is None or function in seen:
        return []
    return [path + (site,) for site in sites.get(function, ()) for path in _call_paths(site[0], sites, seen | {function})]


def _split_arguments(text: str) -> list[str]:
    """`a, f(b, c), d` -> [`a`, `f(b, c)`, `d`]."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += char in "([{"
        depth -= char in ")]}"
        if char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p for p in parts if p.strip()]


_DEF = re.compile(r"^(?P<indent>\s*)def (?P<name>\w+)\(")
_WRAPPER_ENTRY = "call"


def _line_owners(lines: list[str]) -> list[str | None]:
    """The innermost function each line of a module belongs to (None at module level)."""
    owner: list[str | None] = []
    stack: list[tuple[int, str]] = []
    for line in lines:
        if line.strip():
            indent = len(line) - len(line.lstrip())
            while stack and indent <= stack[-1][0]:
                stack.pop()
        owner.append(stack[-1][1] if stack else None)
        if (match := _DEF.match(line)) is not None:
            stack.append((len(match["indent"]), match["name"]))
    return owner


def _runs_per_call(lines: list[str]) -> list[int]:
    """For each line of a wrapper module, how often it runs per call of the wrapper: 1 in
    `call`, n in a function that code running once calls n times (the nested compile regions'
    subgraph functions), 0 elsewhere (module level, `get_args`, the benchmark harness)."""
    owner = _line_owners(lines)
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
    for match in _METHOD_CALL.finditer(text):
        yield f"aten.{match.group(1)}", "extern"


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
