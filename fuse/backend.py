"""The torch.compile backend of the decode step: Inductor with cudagraph trees off, reductions
unsplit and skinny products as reductions (fuse/passes.py), plus the process settings a
compile needs first (compile caches, Triton's toolchain).

Inductor writes, above each Triton kernel launch and extern call of its output code, the
captured-graph nodes and ATen ops it came from (`# Topologically Sorted Source Nodes: [...],
Original ATen: [...]`), and nothing above a C++ kernel's launch; the backend has it write the
same line there, so that the code dump can say where every kernel came from on the CPU too. The
line is a comment of the Python wrapper: the kernels and what runs are the same. It is written
for every compile, dump or not, so a dumping runner and a plain one share the compile cache;
the post-grad pass's cache key carries it (`_OriginComments`), so that output code cached
before it was written is not reused."""
from __future__ import annotations

import contextlib
import functools
import os
import threading
from typing import Callable

import torch
from torch._inductor.compile_fx import compile_fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from fuse.options import CompileOptions
from fuse.passes import SkinnyProducts


def compile_backend(
    options: CompileOptions, device: torch.device, on_graph: Callable[[torch.fx.GraphModule], None] | None = None,
    before_compile: Callable[[], None] | None = None, after_compile: Callable[[], None] | None = None,
) -> Callable:
    """Inductor with the options' mode and config patches; `backend.config_patches` says what
    the step compiles with. `on_graph(graph)` sees each graph Dynamo captured before Inductor
    compiles it (the code dump reads the model modules of its nodes there); it must not change
    the graph, and the compile and its cache keys are the same with it or without.
    `before_compile()` and `after_compile()` run around each graph's compile, before it first
    runs (a split model's ranks wait there for rank 0's compile, fuse/step.py)."""
    config: dict[str, object] = dict(torch._inductor.list_mode_options(options.mode)) if options.mode else {}
    # The runner captures its own graphs, whatever the mode says.
    config["triton.cudagraphs"] = False
    # At decode batch sizes one program per row of a wide norm is as fast as a split reduction's two kernels.
    config["split_reductions"] = False
    if device.type == "cpu":
        # Names the C++ kernels in profiler traces (launch accounting); costs nothing unprofiled.
        config["cpp.enable_kernel_profile"] = True
    else:
        # Each generated kernel a programmatic dependent launch (Inductor writes it for Hopper and
        # later only): it starts while the kernel before it drains (`fuse bench --variants fuse,fuse-no-pdl`).
        config["triton.enable_pdl"] = True
    config.update(options.inductor_options or {})
    config["post_grad_custom_pre_pass"] = _OriginComments(SkinnyProducts(options.skinny_product_columns))

    def backend(graph: torch.fx.GraphModule, example_inputs):
        if on_graph is not None:
            on_graph(graph)
        if before_compile is not None:
            before_compile()
        with cpp_origin_comments():
            compiled = compile_fx(graph, example_inputs, config_patches=dict(config))
        if after_compile is not None:
            after_compile()
        return compiled

    backend.config_patches = config
    return backend


class _OriginComments(CustomGraphPass):
    """The post-grad pass, its cache key extended by the origin comments of C++ launches (see
    the module docstring): output code generated without them is not served from the cache."""

    def __init__(self, graph_pass: CustomGraphPass):
        self.graph_pass = graph_pass

    def uuid(self) -> str:
        return f"{self.graph_pass.uuid()}; C++ launches with origin comments v1"

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.graph_pass(graph)


_writing_origins = threading.local()


@contextlib.contextmanager
def cpp_origin_comments():
    """While Inductor generates code inside, each C++ kernel launch gets the origin comment
    Inductor writes above Triton launches (the module docstring says why)."""
    _install_cpp_origin_comments()
    depth = getattr(_writing_origins, "depth", 0)
    _writing_origins.depth = depth + 1
    try:
        yield
    finally:
        _writing_origins.depth = depth


@functools.cache
def _install_cpp_origin_comments() -> None:
    """Wraps CppScheduling.codegen_comment, which Inductor calls right before it writes a C++
    kernel's launch (and which writes nothing there but a provenance handle, when those are on).
    The wrapper writes the line only inside cpp_origin_comments(); a torch without the method or
    the helper is left as it is, and its dumps have no source nodes for C++ kernels."""
    try:
        from torch._inductor.codegen.cpp import CppScheduling
        from torch._inductor.utils import get_kernel_metadata
        from torch._inductor.virtualized import V
    except ImportError:
        return
    original = CppScheduling.__dict__.get("codegen_comment")
    if original is None:
        return

    def codegen_comment(self, node_schedule, kernel_name=None):
        original(self, node_schedule, kernel_name)
        if not getattr(_writing_origins, "depth", 0):
            return
        try:
            origins, _ = get_kernel_metadata(node_schedule, V.graph.wrapper_code)
        except Exception:  # a comment is never worth a failed compile
            return
        if origins:
            V.graph.wrapper_code.writeline(origins)

    CppScheduling.codegen_comment = codegen_comment


def use_cache_dir(cache_dir: str) -> None:
    """Inductor and Triton read their cache locations from the environment."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache_dir, "inductor")
    os.environ["TRITON_CACHE_DIR"] = os.path.join(cache_dir, "triton")


def pin_triton_toolchain() -> None:
    """Point Triton at the ptxas and libdevice Inductor uses, before anything compiles.

    Inductor sets them only when it compiles a kernel in this process, which a warm start (every
    graph from the cache) never does; Triton's cache keys include the ptxas version, so without
    this the custom ops' kernels and autotune results a cold start stored miss on a warm start."""
    try:
        from torch._inductor.runtime import compile_tasks
    except ImportError:
        return
    for name in ("_set_triton_ptxas_path", "_set_triton_libdevice_path"):
        setter = getattr(compile_tasks, name, None)  # private helpers; absent in some versions
        if setter is not None:
            setter()


def warm_compile_pool(device: torch.device) -> None:
    """Start Inductor's pool of Triton compile processes now, for a start that is about to compile
    on `device`. Until the pool is ready Inductor compiles each Triton kernel in this process, one
    at a time; torch's own "inductor" backend starts it at its first call, this one (compile_fx
    called directly) would only at the first kernel. No pool on the CPU (its C++ kernels compile
    in threads), with one compile thread, or where TORCH_WARM_POOL=0."""
    if device.type != "cuda":
        return
    from torch._inductor import async_compile

    warm = getattr(async_compile, "maybe_warm_pool", None)  # absent in some versions
    if warm is not None:
        warm()
