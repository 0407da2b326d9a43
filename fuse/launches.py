"""Count the kernels one call runs, by category, from the PyTorch profiler.

How kernels are counted:
- CUDA: every device kernel event (kernels replayed from a CUDA graph are traced one by one).
- CPU, eager: every ATen op the program dispatched, once (what the op runs inside itself is not
  counted again); views, allocations and other metadata-only ops count as nothing. Custom ops
  (`v4::*`) count as one opaque kernel each.
- CPU, compiled: every Inductor C++ kernel (`cpp_fused_*`, traced through Inductor's
  `cpp.enable_kernel_profile`) and every extern call the generated code makes (mm, custom ops).

Categories: gemm, custom (the opaque decode kernels), elementwise, copy, reduce, other. Names
are classified by the ops they come from (for fused kernels: the ops in their names): a fused
kernel that computes a matrix product (`mm`/`bmm` in its name, as compile_decode's skinny
products keep it) counts as gemm, with the norms and casts it fused, as a library GEMM with an
epilogue would; otherwise one that contains a reduction counts as reduce."""
from __future__ import annotations

import contextlib
import functools
import os
import sys
import json
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import torch
from torch.profiler import ProfilerActivity, profile

from kernels.registry import launched_kernels

CATEGORIES = ("gemm", "custom", "elementwise", "copy", "reduce", "other")
GLUE = ("elementwise", "copy", "reduce")

# ATen ops that only create views or allocate: no kernel.
_METADATA_OPS = {
    "view", "_unsafe_view", "as_strided", "reshape", "_reshape_alias", "expand", "expand_as", "unsqueeze",
    "squeeze", "t", "transpose", "permute", "select", "slice", "split", "split_with_sizes", "unflatten",
    "flatten", "narrow", "unbind", "chunk", "detach", "alias", "lift_fresh", "resolve_conj", "resolve_neg",
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "contiguous", "to", "type_as",
    "view_as", "view_as_real", "view_as_complex", "real", "imag", "numpy_T", "movedim", "_local_scalar_dense",
    "item", "is_nonzero", "result_type", "size", "stride", "dim", "lift", "set_", "record_stream",
}
_GEMM = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "_int_mm", "einsum", "dot", "mv", "addmv", "_scaled_mm"}
_REDUCE = {
    "sum", "mean", "amax", "amin", "max", "min", "argmax", "argmin", "topk", "sort", "argsort", "cumsum",
    "cumprod", "softmax", "_softmax", "log_softmax", "_log_softmax", "logsumexp", "norm", "var", "std",
    "any", "all", "prod", "cummax", "median", "unique", "_unique2", "bincount", "histc", "count_nonzero",
}
_COPY = {
    "copy", "copy_", "_to_copy", "clone", "cat", "stack", "index", "index_put", "index_put_", "_index_put_impl_",
    "index_select", "gather", "scatter", "scatter_", "scatter_add", "scatter_add_", "embedding", "fill", "fill_",
    "zero", "zero_", "zeros", "zeros_like", "ones", "full", "full_like", "repeat", "repeat_interleave", "roll",
    "flip", "constant_pad_nd", "pad", "masked_select", "nonzero", "arange", "masked_scatter", "index_copy",
}
# Words of Inductor kernel names (ops joined by "_") that only move data.
_COPY_TOKENS = {
    "copy", "clone", "cat", "stack", "index", "put", "select", "gather", "scatter", "embedding", "fill", "zero",
    "zeros", "repeat", "interleave", "constant", "pad", "nd", "roll", "flip", "slice", "full", "like", "new",
}
# Device kernel name fragments of library kernels (cuBLAS/cuTLASS and ATen's own).
_GEMM_KERNEL = re.compile(r"gemm|gemv|cutlass|xmma|nvjet|cublas|sm90_|splitKreduce", re.I)
_REDUCE_KERNEL = re.compile(r"reduce|softmax|topk|sort|scan|radix|bitonic|argmax|norm", re.I)
_COPY_KERNEL = re.compile(r"copy|CatArray|cat_|index|gather|scatter|fill|embedding|memset|memcpy", re.I)
# Collectives of a model split across ranks: torch.distributed's ops (`_c10d_functional::all_reduce`,
# `c10d::allreduce_`, gloo's) and NCCL's device kernels. Counted as "other" (neither a custom op
# nor glue), and their time summed apart (LaunchReport.collective_time_us).
_COLLECTIVE = re.compile(r"c10d|nccl|gloo", re.I)


# The custom ops that are matrix products (the projections, dense or block-scaled, alone or
# several beside each other): gemm, as cuBLAS's are, with the activation quantisation they fuse.
MATRIX_PRODUCT_OPS = frozenset({"v4::grouped_linear", "v4::blockscale_linear", "v4::linears_beside"})


def _custom_kernel_names() -> set[str]:
    """Names of the Triton and Gluon kernels behind the opaque custom ops (kernels/), but those of
    the matrix products, which count as gemm."""
    return {name for name, op in launched_kernels().items() if op not in MATRIX_PRODUCT_OPS}


@functools.cache
def _gemm_kernel_names() -> frozenset[str]:
    """Names of kernels/' own matrix-product kernels (MATRIX_PRODUCT_OPS)."""
    return frozenset(name for name, op in launched_kernels().items() if op in MATRIX_PRODUCT_OPS)


def classify_op(name: str) -> str:
    """Category of a profiler op (`aten::mul`, `v4::moe_experts`) or kernel name."""
    if _COLLECTIVE.search(name):
        return "other"
    if "::" in name:
        namespace, op = name.split("::", 1)
        op = op.split(".")[0]
        if f"{namespace}::{op}" in MATRIX_PRODUCT_OPS:
            return "gemm"  # a matrix product, whoever runs it
        if namespace not in ("aten", "prims"):
            return "custom"
        if op in _GEMM:
            return "gemm"
        if op in _REDUCE:
            return "reduce"
        if op in _COPY:
            return "copy"
        return "elementwise"
    return classify_kernel(name)


def classify_kernel(name: str, custom: Iterable[str] = ()) -> str:
    """Category of a generated or library kernel name. Inductor names fused kernels after their
    ops (`triton_red_fused_add_sum_3`, `cpp_fused_mul_sin_0`): any reduction makes it reduce,
    only data-movement ops make it copy."""
    base = name.rsplit("_cpp_fused_", 1)[-1] if "cpp_fused_" in name else name
    if _COLLECTIVE.search(name):
        return "other"  # "ncclDevKernel_AllReduce...": no reduction of the step's own
    if name in _gemm_kernel_names():
        return "gemm"
    if name in custom or any(name.startswith(c) for c in custom if c):
        return "custom"
    inductor = re.match(r"(?:graph_\d+_)?(?:cpp_fused|triton_(poi|red|per|tem)(?:_fused)?)_?(.*?)(?:_\d+)?$", name)
    if inductor:
        kind, ops = inductor.group(1), [t for t in inductor.group(2).split("_") if t]
        if kind == "tem" or any(t in _GEMM for t in ops):
            return "gemm"
        if kind in ("red", "per") or any(t in _REDUCE for t in ops):
            return "reduce"
        if ops and all(t in _COPY_TOKENS for t in ops):
            return "copy"
        return "elementwise"
    if _GEMM_KERNEL.search(base):
        return "gemm"
    if _REDUCE_KERNEL.search(base):
        return "reduce"
    if _COPY_KERNEL.search(base):
        return "copy"
    if re.search(r"elementwise|vectorized|unrolled|pointwise", base, re.I):
        return "elementwise"
    return "other"


@dataclass
class LaunchReport:
    """Kernels per call by category (averaged over the profiled calls) and their time: device time
    on CUDA, on the CPU the CPU time of each counted op or kernel (what it runs inside included)."""

    label: str
    device: str
    calls: int
    counts: dict[str, float]
    time_us: dict[str, float] = field(default_factory=dict)
    layers: int | None = None
    kernels: dict[str, float] = field(default_factory=dict)  # per-name counts, for reading
    # per-name time per call in us: device time on CUDA, the op's CPU time on the CPU
    kernel_time_us: dict[str, float] = field(default_factory=dict)
    # per-name op that launched it (`aten::mm`, `v4::moe_experts`), "" for generated kernels;
    # on CUDA known only for kernels launched outside a CUDA graph
    origins: dict[str, str] = field(default_factory=dict)
    # time per call between the counted kernels, from the first one's start to the last one's end
    # (idle_between): on CUDA the device waiting for launches, on the CPU the host between ops
    idle_us: float | None = None
    # idle_us split by the kernel that ended each wait (idle_before): per name, time per call
    idle_before_us: dict[str, float] = field(default_factory=dict)
    # kernel time per call that ran beside other kernels (a side stream): the categories' times
    # sum it twice, so their total exceeds the span the kernels cover by this much (overlapped)
    overlap_us: float | None = None

    @property
    def total(self) -> float:
        return sum(self.counts.values())

    @property
    def glue(self) -> float:
        return sum(self.counts.get(c, 0) for c in GLUE)

    def glue_time_share(self) -> float | None:
        total = sum(self.time_us.values())
        return sum(self.time_us.get(c, 0.0) for c in GLUE) / total if total else None

    def category_time_us(self, category: str) -> float:
        """Time per call of a category's kernels; "glue" and "total" sum theirs."""
        if category in ("glue", "total"):
            return sum(self.time_us.get(c, 0.0) for c in (GLUE if category == "glue" else CATEGORIES))
        return self.time_us.get(category, 0.0)

    def rows(self) -> list[tuple[str, float, float | None, float | None]]:
        """(category, kernels per call, per layer, share of device (CUDA) or CPU time)."""
        total_time = self.category_time_us("total")
        out = []
        for c in CATEGORIES + ("glue", "total"):
            count = self.glue if c == "glue" else self.total if c == "total" else self.counts.get(c, 0.0)
            t = self.category_time_us(c)
            out.append((c, count, count / self.layers if self.layers else None, t / total_time if total_time else None))
        return out

    def collective_time_us(self) -> float:
        """Time per call in collectives (a model split across ranks): device time of NCCL's
        kernels on CUDA; on the CPU the CPU time of the collective ops, waits included."""
        return sum(us for name, us in self.kernel_time_us.items() if _COLLECTIVE.search(name))

    def collectives(self) -> float:
        """Collective ops (CPU) or kernels (CUDA) per call."""
        return sum(n for name, n in self.kernels.items() if _COLLECTIVE.search(name))

    def rank_summary(self) -> dict:
        """What a split run gathers of each rank's profiled call: its kernels (all, glue), its
        collectives and the time in them (fuse report's and fuse bench's per-rank tables)."""
        return {"total": self.total, "glue": self.glue, "collectives": self.collectives(),
                "collective_us": self.collective_time_us()}

    def to_dict(self) -> dict:
        return {
            "label": self.label, "device": self.device, "calls": self.calls, "layers": self.layers,
            "counts": self.counts, "glue": self.glue, "total": self.total, "time_us": self.time_us,
            "glue_time_share": self.glue_time_share(), "kernels": self.kernels,
            "kernel_time_us": self.kernel_time_us, "origins": self.origins,
            "collectives": self.collectives(), "collective_time_us": self.collective_time_us(),
            "idle_us": self.idle_us, "idle_before_us": self.idle_before_us, "overlap_us": self.overlap_us,
        }

    def top_kernels_markdown(self, count: int = 15) -> str:
        """The `count` kernels that take the most time per call: name, category, launches per
        call, time per call and share of the total, as a markdown table."""
        unit = "device" if self.device == "cuda" else "CPU"
        return self._ranked_markdown(self.kernel_time_us, f"{unit} us per call", "share", count)

    def waits_markdown(self, count: int = 10) -> str:
        """The `count` kernels the most idle time comes before (the call waiting for their
        launch: on CUDA the device, on the CPU the host between ops): name, category, launches
        per call, idle time before them per call and its share of all idle time."""
        return self._ranked_markdown(self.idle_before_us, "idle us before it per call", "share of idle", count)

    def _ranked_markdown(self, us_by_name: dict[str, float], column: str, share_column: str, count: int) -> str:
        """The `count` names with the most us in `us_by_name`, as rows of name, category,
        launches per call, their us and its share of the sum."""
        total = sum(us_by_name.values())
        custom = _custom_kernel_names() if self.device == "cuda" else ()
        lines = [f"| kernel | category | per call | {column} | {share_column} |", "|---|---|---|---|---|"]
        for name, us in sorted(us_by_name.items(), key=lambda kv: -kv[1])[:count]:
            category = classify_kernel(name, custom) if self.device == "cuda" else classify_op(name)
            short = name if len(name) <= 90 else name[:87] + "..."
            share = f"{100 * us / total:.1f}%" if total else ""
            lines.append(f"| `{short}` | {category} | {self.kernels.get(name, 0):g} | {us:.1f} | {share} |")
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def to_markdown(self) -> str:
        unit = "device" if self.device == "cuda" else "CPU"
        header = f"| category | kernels per call | per layer | share of {unit} time |\n|---|---|---|---|"
        lines = [header] + [
            f"| {c} | {n:g} | {'' if pl is None else f'{pl:.1f}'} | {'' if share is None else f'{100 * share:.1f}%'} |"
            for c, n, pl, share in self.rows()
        ]
        return f"**{self.label}** ({self.device})\n\n" + "\n".join(lines)

    def __str__(self) -> str:
        lines = [f"{self.label} ({self.device}, kernels per call)", f"{'category':<12}{'count':>10}{'per layer':>12}{'time':>9}"]
        for c, n, pl, share in self.rows():
            lines.append(f"{c:<12}{n:>10g}{'' if pl is None else f'{pl:.1f}':>12}{'' if share is None else f'{100 * share:.1f}%':>9}")
        return "\n".join(lines)


def diff_markdown(eager: LaunchReport, compiled: LaunchReport) -> str:
    """Eager against compiled, per category: kernels per call (and per layer) and the ratio."""
    lines = [
        f"| category | {eager.label} | {compiled.label} | ratio | {eager.label} per layer | {compiled.label} per layer |",
        "|---|---|---|---|---|---|",
    ]
    for (c, a, apl, _), (_, b, bpl, _) in zip(eager.rows(), compiled.rows()):
        ratio = f"{a / b:.1f}x" if b else ("-" if not a else "inf")
        fmt = lambda v: "" if v is None else f"{v:.1f}"
        lines.append(f"| {c} | {a:g} | {b:g} | {ratio} | {fmt(apl)} | {fmt(bpl)} |")
    return "\n".join(lines)


def time_markdown(eager: LaunchReport, compiled: LaunchReport) -> str:
    """Eager against compiled, per category: time per call (device time on CUDA, CPU time on the
    CPU) and its share of the call's time; glue and total sum their categories."""
    unit = "device" if compiled.device == "cuda" else "CPU"
    lines = [
        f"| category | {eager.label} {unit} us | {eager.label} share | {compiled.label} {unit} us | {compiled.label} share |",
        "|---|---|---|---|---|",
    ]
    for (c, *_, eager_share), (*_, compiled_share) in zip(eager.rows(), compiled.rows()):
        cells = [f"{eager.category_time_us(c):.1f}", _percent(eager_share),
                 f"{compiled.category_time_us(c):.1f}", _percent(compiled_share)]
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    if eager.idle_us is not None and compiled.idle_us is not None:
        between = ("device idle between kernels (waiting for launches)" if compiled.device == "cuda"
                   else "host time between ops and kernels")
        lines += ["", f"Besides the kernels, per call: {between}: {eager.label} {eager.idle_us:.1f} us, "
                      f"{compiled.label} {compiled.idle_us:.1f} us."]
        if compiled.device == "cuda" and max(eager.overlap_us or 0.0, compiled.overlap_us or 0.0) > 0:
            lines[-1] += (f" Kernel time that ran beside other kernels (side streams; counted in each category): "
                          f"{eager.label} {eager.overlap_us or 0.0:.1f} us, {compiled.label} {compiled.overlap_us or 0.0:.1f} us.")
    return "\n".join(lines)


def _percent(share: float | None) -> str:
    return "-" if share is None else f"{100 * share:.1f}%"


def _cpu_kernel_events(events) -> list:
    """The outermost profiler events that are kernels by the CPU rules of the module docstring:
    an ATen op counts once however it is implemented inside (its nested ATen calls are its own
    business); view and allocation ops count as nothing but are looked through, since one may
    wrap a real copy (`contiguous` -> `clone` -> `copy_`); custom ops and Inductor C++ kernels
    count once each; profiler ranges of the compiled-code machinery are looked through."""

    def counts_itself(e) -> bool:
        name = e.name
        if "cpp_fused" in name or "cpp_kernel" in name:
            return True
        if "::" not in name:
            return False
        namespace, op = name.split("::", 1)
        return namespace not in ("aten", "prims") or op.split(".")[0] not in _METADATA_OPS

    def outermost(e):
        if counts_itself(e):
            yield e
            return
        for child in e.cpu_children:
            yield from outermost(child)

    found = []
    for root in (e for e in events if e.cpu_parent is None):
        found += outermost(root)
    return found


def count_launches(
    fn: Callable, *inputs, calls: int = 1, warmup: int = 1, label: str = "call", layers: int | None = None,
    trace_path: str | os.PathLike | None = None,
) -> LaunchReport:
    """Run fn(*inputs) `warmup` times, then profile `calls` calls and count their kernels by
    category (see the module docstring for the method on each device). `trace_path`: also write
    the profiled calls' timeline there (Chrome trace JSON; open it in Perfetto or chrome://tracing)."""
    for _ in range(warmup):
        fn(*inputs)
    on_cuda = torch.cuda.is_available() and any(isinstance(t, torch.Tensor) and t.is_cuda for t in _flatten(inputs))
    if on_cuda:
        torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    import torch._inductor.config as inductor_config

    with inductor_config.patch({"cpp.enable_kernel_profile": True}):
        prof = profile(activities=activities)
        with _quiet_stderr():  # the profiler's C++ side logs each start and stop there
            prof.start()
        try:
            for _ in range(calls):
                fn(*inputs)
            if on_cuda:
                torch.cuda.synchronize()
        finally:
            with _quiet_stderr():
                prof.stop()
    if trace_path is not None:
        prof.export_chrome_trace(os.fspath(trace_path))
    names: Counter[str] = Counter()
    name_us: Counter[str] = Counter()
    time_us: Counter[str] = Counter()
    origins: dict[str, str] = {}
    spans: list[tuple[float, float]] = []
    span_names: list[str] = []
    if on_cuda:
        origins = _device_kernel_origins(prof.events())
        custom = _custom_kernel_names()
        for e in prof.events():
            # Host<->device transfers are not kernels; device-side memcpy/memset count as copies.
            if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith(("Memcpy HtoD", "Memcpy DtoH")):
                us = getattr(e, "device_time", None) or e.cuda_time
                names[e.name] += 1
                name_us[e.name] += us
                time_us[classify_kernel(e.name, custom)] += us
                spans.append((e.time_range.start, e.time_range.end))
                span_names.append(e.name)
        counts = Counter()
        for name, n in names.items():
            counts[classify_kernel(name, custom)] += n
    else:
        for e in _cpu_kernel_events(prof.events()):
            names[e.name] += 1
            name_us[e.name] += e.cpu_time_total
            time_us[classify_op(e.name)] += e.cpu_time_total
            origins[e.name] = e.name if "::" in e.name else ""
            spans.append((e.time_range.start, e.time_range.end))
            span_names.append(e.name)
        counts = Counter()
        for name, n in names.items():
            counts[classify_op(name)] += n
    return LaunchReport(
        label=label,
        device="cuda" if on_cuda else "cpu",
        calls=calls,
        counts={c: counts.get(c, 0) / calls for c in CATEGORIES},
        time_us={c: time_us.get(c, 0.0) / calls for c in CATEGORIES},
        layers=layers,
        kernels={k: v / calls for k, v in sorted(names.items(), key=lambda kv: -kv[1])},
        kernel_time_us={k: v / calls for k, v in sorted(name_us.items(), key=lambda kv: -kv[1])},
        origins={k: origins[k] for k in names if k in origins},
        idle_us=idle_between(spans) / calls,
        idle_before_us={name: us / calls for name, us in idle_before(spans, span_names).items()},
        overlap_us=overlapped(spans) / calls,
    )


def idle_between(spans: Iterable[tuple[float, float]]) -> float:
    """The time from the first span's start to the last one's end that no span covers
    (overlapping spans, as kernels on two streams, count once)."""
    spans = list(spans)
    return sum(idle_before(spans, [""] * len(spans)).values())


def idle_before(spans: Sequence[tuple[float, float]], names: Sequence[str]) -> dict[str, float]:
    """idle_between split by what ended each gap: per name, the idle time just before its spans
    start (a span that starts while another runs waited for nothing). The values sum to
    idle_between(spans)."""
    waits: Counter[str] = Counter()
    reach = None
    for (start, end), name in sorted(zip(spans, names)):
        if reach is not None and start > reach:
            waits[name] += start - reach
        reach = end if reach is None else max(reach, end)
    return dict(waits)


def overlapped(spans: Iterable[tuple[float, float]]) -> float:
    """The spans' summed lengths less the length of their union: time a span ran beside another."""
    spans = list(spans)
    if not spans:
        return 0.0
    union = max(end for _, end in spans) - min(start for start, _ in spans) - idle_between(spans)
    return sum(end - start for start, end in spans) - union


@contextlib.contextmanager
def _quiet_stderr():
    """File descriptor 2 to /dev/null inside the block (C++ writes there directly)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def _device_kernel_origins(events) -> dict[str, str]:
    """Device kernel name -> the outermost op above its launch (`aten::mm`, `v4::moe_experts`),
    "" where no op launched it (Inductor's generated kernels). Kernels replayed from a CUDA graph
    are launched by the graph, not an op: only those of the custom ops are known, by name."""
    origins = dict(launched_kernels())
    for e in events:
        if e.device_type != torch.autograd.DeviceType.CPU or not e.kernels:
            continue
        # The profiler hangs a device kernel on the op that launched it; the outermost op wins.
        op, parent = (e.name if "::" in e.name else ""), e.cpu_parent
        while parent is not None:
            if "::" in parent.name:
                op = parent.name
            parent = parent.cpu_parent
        for kernel in e.kernels:
            origins.setdefault(kernel.name, op)
    return origins


def _flatten(items) -> list:
    out = []
    for item in items:
        if isinstance(item, (list, tuple)):
            out += _flatten(item)
        else:
            out.append(item)
    return out
