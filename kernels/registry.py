"""Which custom op launches each device kernel of the op packages: profiles name kernels, the
launch accounting (fuse.launches) counts them by the op they belong to."""
from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import pkgutil

# The custom op each package's kernels belong to. Where a package registers two ops that launch
# the same kernels (hc_mix's hc_pre_norm and hc_post_pre_norm, sparse_mla's op with and without a
# workspace, moe's dense and block-scaled experts, which share the routing and combine kernels,
# the indexer's top-k and its two halves), a profile cannot tell them apart: they count under
# the op named here.
OPS = {
    "blockscale": "v4::blockscale_linear",
    "gate": "v4::moe_gate",
    "hc_mix": "v4::hc_post_pre_norm",
    "hc_sinkhorn": "v4::hc_split_sinkhorn",
    "indexer": "v4::indexer_topk",
    "linear": "v4::grouped_linear",
    "moe": "v4::moe_experts",
    "sparse_mla": "v4::sparse_mla_decode",
}


def launched_kernels() -> dict[str, str]:
    """Kernel name -> the qualified custom op that launches it ("v4::sparse_mla_decode", ...), for
    every Triton or Gluon function defined in an op package (JIT functions, autotuned and
    heuristic wrappers by the name of the function they wrap; device helpers too, which never show
    up in a profile on their own). Empty where Triton is not installed: no kernel of ours runs."""
    return dict(_launched_kernels())


@functools.cache
def _launched_kernels() -> dict[str, str]:
    if importlib.util.find_spec("triton") is None:
        return {}
    from triton.runtime import KernelInterface

    found: dict[str, str] = {}
    for package, op in OPS.items():
        for info in pkgutil.iter_modules(importlib.import_module(f"kernels.{package}").__path__):
            module = importlib.import_module(f"kernels.{package}.{info.name}")
            for obj in vars(module).values():
                if not isinstance(obj, KernelInterface):
                    continue
                fn = _python_function(obj)
                if fn.__module__ != module.__name__:
                    continue  # imported here, counted where it is defined
                if found.setdefault(fn.__name__, op) != op:
                    raise ValueError(
                        f"kernel {fn.__name__} is defined for both {found[fn.__name__]} and {op}: a profile cannot tell them apart"
                    )
    return found


def _python_function(kernel):
    """The Python function under a JIT function or an autotuning/heuristics wrapper of one."""
    fn = kernel
    while not inspect.isfunction(fn):
        fn = fn.fn
    return fn
