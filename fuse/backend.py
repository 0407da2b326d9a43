"""The torch.compile backend of the decode step: Inductor with cudagraph trees off, reductions
unsplit and skinny products as reductions (fuse/passes.py), plus the process settings a
compile needs first (compile caches, Triton's toolchain)."""
from __future__ import annotations

import os
from typing import Callable

import torch
from torch._inductor.compile_fx import compile_fx

from fuse.options import CompileOptions
from fuse.passes import SkinnyProducts


def compile_backend(options: CompileOptions, device: torch.device) -> Callable:
    """Inductor with the options' mode and config patches; `backend.config_patches` says what
    the step compiles with."""
    config: dict[str, object] = dict(torch._inductor.list_mode_options(options.mode)) if options.mode else {}
    # The runner captures its own graphs, whatever the mode says.
    config["triton.cudagraphs"] = False
    # At decode batch sizes one program per row of a wide norm is as fast as a split reduction's two kernels.
    config["split_reductions"] = False
    if device.type == "cpu":
        # Names the C++ kernels in profiler traces (launch accounting); costs nothing unprofiled.
        config["cpp.enable_kernel_profile"] = True
    config.update(options.inductor_options or {})
    config["post_grad_custom_pre_pass"] = SkinnyProducts(options.skinny_product_columns)

    def backend(graph: torch.fx.GraphModule, example_inputs):
        return compile_fx(graph, example_inputs, config_patches=dict(config))

    backend.config_patches = config
    return backend


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
