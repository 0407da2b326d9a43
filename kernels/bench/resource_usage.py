"""Registers, spilled bytes and shared memory of the sparse-MLA kernels (the Triton
head-batched kernel per tile shape, the Gluon wgmma kernel per ring shape), from an offline
compile (no GPU needed):

    python -m kernels.bench.resource_usage [--arch 90]

A tile's cost is not only its shared memory: when a program's accumulator, Q tile, scores and
gather addresses need more than 255 registers per thread, the compiler spills to local memory
and the inner loop pays round trips through L1 for them. Triton compiles for the given
architecture on any machine; the cubin's resource usage comes from the cuobjdump that ships
with Triton's NVIDIA backend.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels.sparse_mla import plan
from kernels.sparse_mla import triton as smt

# The argument types of _head_batched_kernel at the model's dtypes (bf16 activations and cache).
_POINTERS = {
    "q_ptr": "*bf16", "kv_ptr": "*bf16", "idx_ptr": "*i32", "sink_ptr": "*fp32", "out_ptr": "*bf16",
    "lse_ptr": "*fp32", "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32",
}
_FLOATS = {"scale_log2": "fp32"}


@dataclass(frozen=True)
class Usage:
    registers: int
    spill_bytes: int  # per thread, the stack that holds spilled registers
    shared_bytes: int
    wgmma: int  # warpgroup MMA instructions in the PTX (Hopper tensor cores)
    mma_sync: int  # warp-level MMA instructions
    async_copies: int  # cp.async instructions: loads that go to shared memory without registers
    kv_buffers: int  # shared-memory buffers of the gathered KV tile: the pipeline keeps one fewer in flight


def _cuobjdump() -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def _compile(fn, constants: dict, source_type, arch: int, options: dict):
    """Compile fn for sm_`arch` as the runtime specialises a launch at the model's shapes: the
    named constants as constexprs, bf16/fp32 pointers, pointers 16-byte aligned and every other
    integer but the split length a multiple of 16 (without this the compiler cannot vectorise or
    pipeline the gathers)."""
    signature = {
        name: "constexpr" if name in constants else _POINTERS.get(name) or _FLOATS.get(name) or "i32"
        for name in fn.arg_names
    }
    aligned = {
        (i,): [["tt.divisibility", 16]]
        for i, name in enumerate(fn.arg_names)
        if signature[name] != "constexpr" and name not in _FLOATS and name != "blocks_per_split"
    }
    return triton.compile(
        source_type(fn=fn, signature=signature, constexprs=constants, attrs=aligned),
        target=GPUTarget("cuda", arch, 32),
        options=options,
    )


def _usage(compiled, kv_buffers: int) -> Usage:
    """Registers and spills from cuobjdump, shared memory from the metadata, instructions from the PTX."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        report = subprocess.run([_cuobjdump(), "-res-usage", path], capture_output=True, text=True, check=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", report)
    if found is None:
        raise RuntimeError(f"no resource usage in cuobjdump's report:\n{report}")
    ptx = compiled.asm["ptx"]
    return Usage(
        registers=int(found.group(1)), spill_bytes=int(found.group(2)), shared_bytes=compiled.metadata.shared,
        wgmma=ptx.count("wgmma.mma_async"), mma_sync=ptx.count("mma.sync"), async_copies=ptx.count("cp.async.cg"),
        kv_buffers=kv_buffers,
    )


def head_batched_usage(tiles: plan.TileConfig, head_dim: int = 512, split: bool = False, arch: int = 90) -> Usage:
    """Compile the head-batched kernel at these tiles for sm_`arch` and read its resource usage."""
    constants = dict(
        BLOCK_H=tiles.block_h, BLOCK_K=tiles.block_k, BLOCK_D=plan._block_d(head_dim), DV_SPLIT=tiles.dv_split,
        FLAT_ROWS=True, SPLIT=split, DOT_PRECISION="tf32",
        D=head_dim, stride_qd=1, stride_d=1,  # contiguous head dim, as the runtime specialises it
        stride_ik=1, stride_sink=1,  # the index and sink strides, 1 at the model's shapes
    )
    compiled = _compile(
        smt._head_batched_kernel, constants, ASTSource, arch,
        {"num_warps": tiles.num_warps, "num_stages": tiles.num_stages},
    )
    # The software pipeline's multi-buffered allocations of the [block_k, columns] KV tile.
    buffers = re.findall(rf"local_alloc : \(\) -> !ttg.memdesc<(\d+)x{tiles.block_k}x\d+x", compiled.asm["ttgir"])
    return _usage(compiled, max((int(n) for n in buffers), default=0))


def wgmma_usage(block_n: int = plan.WGMMA_BLOCK_N, stages: int = plan.WGMMA_STAGES, head_dim: int = 512,
                split: bool = False, arch: int = 90) -> Usage:
    """Compile the Gluon wgmma kernel (kernels/sparse_mla/gluon.py) for sm_`arch` at bf16 and
    read its resource usage; kv_buffers is its ring of gather buffers."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from kernels.sparse_mla import gluon as sg

    constants = dict(
        sg.kernel_constants(head_dim, block_n, stages, gl.bfloat16),
        FLAT_ROWS=True, SPLIT=split, stride_ik=1, stride_sink=1,
    )
    compiled = _compile(sg._sparse_mla_wgmma_kernel, constants, GluonASTSource, arch, {"num_warps": sg.NUM_WARPS})
    return _usage(compiled, stages)


def main(argv: list[str] | None = None) -> None:
    from kernels.bench.sparse_mla import TILE_SWEEP, tile_name

    parser = argparse.ArgumentParser(
        prog="python -m kernels.bench.resource_usage", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 for H100/H200")
    args = parser.parse_args(argv)
    planned = plan.candidate_tiles(64, 512, 2)
    print(f"sparse MLA head-batched kernel, H=64 blocks, D=512, bf16, sm_{args.arch}, triton {triton.__version__}\n")
    print("| tiles | registers | spilled bytes per thread | shared KiB | wgmma | mma.sync | cp.async | KV buffers |")
    print("|---|---|---|---|---|---|---|---|")
    for tiles in dict.fromkeys(tuple(planned) + TILE_SWEEP):
        usage = head_batched_usage(tiles, arch=args.arch)
        label = tile_name(tiles) + (" (a default-plan tile)" if tiles in planned else "")
        print(
            f"| {label} | {usage.registers} | {usage.spill_bytes} | {usage.shared_bytes / 1024:.1f} | "
            f"{usage.wgmma} | {usage.mma_sync} | {usage.async_copies} | {usage.kv_buffers} |"
        )
    print(f"\nsparse MLA Gluon wgmma kernel (kernels/sparse_mla/gluon.py), D=512, bf16, sm_{args.arch}\n")
    print("| rows x stages | split | registers | spilled bytes per thread | shared KiB | wgmma | cp.async |")
    print("|---|---|---|---|---|---|---|")
    for block_n, stages in ((plan.WGMMA_BLOCK_N, plan.WGMMA_STAGES), (32, 4), (32, 3), (16, 6)):
        for split in (False, True):
            usage = wgmma_usage(block_n, stages, split=split, arch=args.arch)
            print(
                f"| {block_n} x {stages} | {split} | {usage.registers} | {usage.spill_bytes} | "
                f"{usage.shared_bytes / 1024:.1f} | {usage.wgmma} | {usage.async_copies} |"
            )


if __name__ == "__main__":
    main()
