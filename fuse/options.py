"""CompileOptions: how `compile_decode` builds its runner, checked when constructed."""
from __future__ import annotations

import inspect
import os
from dataclasses import dataclass, field
from typing import Mapping

import torch

COMPILATIONS = ("auto", "nested", "regional", "whole")
# What a start does with an artifact that does not match it (fuse/artifact.py): raise naming the
# mismatch, rebuild it, or (like "refuse", and there must be one) load only.
ARTIFACT_MODES = ("refuse", "rebuild", "load")


def dynamo_reuses_nested_regions() -> bool:
    """Whether Dynamo traces a nested compile region once per input signature and reuses it
    (`max_reuse_entries`, torch 2.13). Without it every layer is traced again, which makes the
    nested compile's start several times slower than the regional one at full depth."""
    return "max_reuse_entries" in inspect.signature(torch.compiler.nested_compile_region).parameters


def dynamo_saves_frames() -> bool:
    """Whether Dynamo compiles a frame ahead and loads it back in another process
    (`aot_compile`, `torch.compiler.load_compiled_function`): an artifact can then hold the
    regional compile's frames (fuse/frames.py), and a start from it traces nothing."""
    import torch._dynamo

    return hasattr(torch.compiler, "load_compiled_function") and hasattr(torch._dynamo.config, "enable_aot_compile")


def resolve_compilation(compilation: str, artifact: bool = False) -> str:
    """"auto": "regional" for a start with an artifact where Dynamo saves frames, else "nested"
    where Dynamo reuses traced regions, else "regional"."""
    if compilation != "auto":
        return compilation
    if artifact and dynamo_saves_frames():
        return "regional"
    return "nested" if dynamo_reuses_nested_regions() else "regional"


@dataclass(frozen=True)
class CompileOptions:
    """How `compile_decode` builds its runner; docs/options.md explains each field."""

    buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    compile: bool = True  # False: the eager step (still captured per bucket unless cuda_graphs=False)
    cuda_graphs: bool = True  # False: no capture; ignored off CUDA
    # One graph with a symbolic batch for every bucket but batch 1, instead of one per bucket.
    dynamic_batch: bool = True
    # Batch 1 runs that graph too (the batch unbacked: no size-1 specialisation), so that each
    # layer kind compiles once instead of twice. Needs dynamic_batch.
    batch_one_shared: bool = False
    # What one compile covers, one of COMPILATIONS; the options hold the resolved value.
    compilation: str = "auto"
    # Matrix products with at most this many output columns become Inductor reductions fused
    # with their neighbours (fuse/passes.py); 0 keeps every product a library GEMM.
    skinny_product_columns: int = 64
    mode: str | None = None  # an Inductor mode, e.g. "max-autotune-no-cudagraphs"
    inductor_options: Mapping[str, object] | None = None  # Inductor config patches, applied last
    cache_dir: str | None = None  # persistent Inductor/Triton caches, so that a second start is fast
    dump_dir: str | None = None  # write the generated code (depyf) and an index of its kernels here
    # A file holding what a start compiled (fuse/artifact.py): loaded when there, else written after the start.
    artifact: str | None = None
    artifact_mode: str = "refuse"  # one of ARTIFACT_MODES: what a mismatched or missing artifact does
    strict: bool = True  # a recompile after warm-up raises; False: it warns and is counted
    # The custom ops' Triton kernels of every bucket compiled before the first calls, this many at
    # a time (fuse/precompile.py; None: one per CPU; 0: each compiles at its first launch). CUDA only.
    kernel_compile_workers: int | None = None
    # The step's graphs compiled first in this many worker processes, one layer kind and batch shape each
    # where there are enough (fuse/compile_workers.py; None: as many as fit, on CUDA; 0: none).
    compile_workers: int | None = 0
    # The custom ops' kernels launched as programmatic dependents where the GPU has them (Hopper and
    # later: kernels/dependent_launch.py); False: plain launches (what they save, `fuse bench --variants fuse,fuse-no-pdl`).
    dependent_launches: bool = True
    progress: bool = True  # one log line per bucket with its warm-up time (and per compile worker as it ends)
    requested_compilation: str = field(default="auto", init=False, repr=False, compare=False)  # before resolving

    def __post_init__(self):
        if not self.buckets or any(isinstance(b, bool) or int(b) < 1 for b in self.buckets):
            raise ValueError(f"buckets must be positive batch sizes, got {self.buckets}")
        object.__setattr__(self, "buckets", tuple(sorted({int(b) for b in self.buckets})))
        if self.compilation not in COMPILATIONS:
            raise ValueError(f"compilation must be one of {COMPILATIONS}, got {self.compilation!r}")
        object.__setattr__(self, "requested_compilation", self.compilation)
        object.__setattr__(self, "compilation", resolve_compilation(self.compilation, artifact=self.artifact is not None))
        if self.batch_one_shared and not self.dynamic_batch:
            raise ValueError("batch_one_shared=True needs dynamic_batch=True (batch 1 shares the symbolic batch's graph)")
        for name, meaning in (("kernel_compile_workers", "(0: none ahead) or None (one per CPU)"),
                              ("compile_workers", "(0: none) or None (as many as fit, on CUDA)")):
            workers = getattr(self, name)
            if workers is not None and (not isinstance(workers, int) or isinstance(workers, bool) or workers < 0):
                raise ValueError(f"{name} must be >= 0 {meaning}, got {workers!r}")
        if self.skinny_product_columns < 0:
            raise ValueError(f"skinny_product_columns must be >= 0 (0: none), got {self.skinny_product_columns}")
        if self.inductor_options:  # only then: reading Inductor's whole config copies it
            unknown = sorted(set(self.inductor_options) - set(torch._inductor.config.get_config_copy()))
            if unknown:
                raise ValueError(f"inductor_options names settings torch._inductor.config does not have: {unknown}")
            if "post_grad_custom_pre_pass" in self.inductor_options:
                raise ValueError(
                    "inductor_options sets post_grad_custom_pre_pass, where compile_decode runs its own pass "
                    "(set skinny_product_columns=0 and compile the model yourself to use another)"
                )
        if self.mode and "reduce-overhead" in self.mode:
            raise ValueError("mode 'reduce-overhead' turns on PyTorch's cudagraph trees; compile_decode captures its own graphs")
        if self.dump_dir is not None and not self.compile:
            raise ValueError("dump_dir writes the generated code; with compile=False there is none")
        if self.artifact_mode not in ARTIFACT_MODES:
            raise ValueError(f"artifact_mode must be one of {ARTIFACT_MODES}, got {self.artifact_mode!r}")
        if self.artifact is not None:
            if not self.compile:
                raise ValueError("artifact holds what a start compiles; with compile=False there is nothing")
            path = self.artifact if isinstance(self.artifact, (str, os.PathLike)) else None
            if path is None or not os.fspath(path) or not isinstance(os.fspath(path), str):
                raise ValueError(f"artifact must be a file path, got {self.artifact!r}")
            object.__setattr__(self, "artifact", os.fspath(path))
