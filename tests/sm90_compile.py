"""Compile every Triton and Gluon kernel the ops launch on a Hopper GPU, for sm_90, on a machine
without one, and never run them (tests/test_sm90_compile.py starts it in a new process):

    python tests/sm90_compile.py OUT.json [--batches 1,16,64] [--ahead WORKERS]

Triton compiles down to a cubin with its own ptxas for the target a stand-in driver names; every
JIT launch becomes a warm-up (compile, no launch) and an autotuned kernel compiles every config.
The ops' CUDA paths run on CPU tensors that hold no values, with the launch plans of a 132-SM
sm_90 GPU, at the shapes one V4-Flash decode step gives them (recorded on the meta device:
checkpoint formats and bf16, batches 1, 16 and 64), plus each sparse MLA variant. What a GPU
would reject at compile time fails here: an unsupported layout or type, a Triton API the
installed version lacks, a program over the shared memory an SM has. OUT.json: per kernel the
compiled variants with their shared memory, registers and local memory (ptxas's spills and
stack: what a variant costs an SM, read without one) and their innermost tensor-core loops'
instruction counts (mma_loops); the calls that failed, with their errors.
With --ahead, kernels/precompile.py's compile_ahead compiles every kernel first, WORKERS at a time; the
launches then compile nothing where its kernels are the ones they look up (compiled_in_launches)."""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
if os.environ.get("TRITON_INTERPRET") == "1":
    raise SystemExit("sm90_compile: run without TRITON_INTERPRET=1 (the interpreter compiles nothing)")

import torch  # noqa: E402
import triton  # noqa: E402
from torch._library.custom_ops import CustomOpDef  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from kernels.precompile import OpCall, compile_ahead, launches_compile_only, record_op_calls  # noqa: E402

SMS = 132
CUOBJDUMP = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
SHARED_MEMORY = 227 * 1024  # sm_90's opt-in maximum per program
PACKAGES = ("blockscale", "hc_mix", "hc_sinkhorn", "indexer", "linear", "moe", "sparse_mla")
BATCHES = (1, 16, 64)
compiled: list[dict] = []
count = {"compiles": 0}


class Sm90Driver:
    """What Triton asks a driver for before it compiles: the target, a device and a stream."""

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")


_USAGE: dict[int, dict] = {}


def resource_usage(kernel) -> dict:
    """Registers a thread and bytes of local memory (spilled registers and stack) of a compiled
    kernel, as ptxas reports them in its cubin, and its tensor-core loops (mma_loops), from the
    cubin's SASS (cuobjdump, shipped with Triton)."""
    key = id(kernel.asm["cubin"])
    if key not in _USAGE:
        with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
            cubin.write(kernel.asm["cubin"])
            cubin.flush()
            report = subprocess.run([str(CUOBJDUMP), "-res-usage", cubin.name], capture_output=True, text=True).stdout
            sass = subprocess.run([str(CUOBJDUMP), "-sass", cubin.name], capture_output=True, text=True).stdout
        regs, stack = re.search(r"REG:(\d+)", report), re.search(r"STACK:(\d+)", report)
        local = re.search(r"LOCAL:(\d+)", report)
        _USAGE[key] = {"registers": int(regs.group(1)) if regs else None,
                       "local_bytes": int(stack.group(1)) + (int(local.group(1)) if local else 0) if stack else None,
                       "mma_loops": mma_loops(sass)}
    return _USAGE[key]


# Tensor-core instructions in sm_90 SASS: mma.sync (HMMA, IMMA: shape MNK run together, as
# 16816) and wgmma (HGMMA, IGMMA, QGMMA: a warp's 16 rows of M x N x K, as 64x8x32).
_TENSOR_CORE = re.compile(r"^(?:@!?U?P\w+\s+)?(?:HMMA|IMMA|HGMMA|IGMMA|QGMMA)\.(?:\d+x\d+x(\d+)|16\d(\d+))\b")
_SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);")


def mma_loops(sass: str) -> list[dict]:
    """The innermost loops of a kernel's SASS that issue tensor-core instructions: per loop its
    instructions, of them the tensor-core ones ("mma"), and their work in 16 x 16 steps a warp
    ("k16": a warp's 16 rows times 16 inputs each; mma.sync's m16n8k16 one, wgmma's 64x8x32 two).
    A loop is the span from a backward branch's target to the branch. Where a product's work on
    the SMs is decoding weights in registers, instructions per k16 step is what a change to its
    loop moves."""
    code = [(int(a, 16), text.strip()) for a, text in _SASS_LINE.findall(sass)]
    at = {address: i for i, (address, _) in enumerate(code)}
    spans = []
    for i, (address, text) in enumerate(code):
        branch = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", text)
        first = at.get(int(branch.group(1), 16)) if branch else None
        if first is not None and first < i:
            body = [t for _, t in code[first:i + 1]]
            shapes = [m for m in map(_TENSOR_CORE.match, body) if m]
            if shapes:
                k16 = sum(int(m.group(1) or m.group(2)) / 16 for m in shapes)
                spans.append((first, i, {"instructions": len(body), "mma": len(shapes), "k16": k16}))
    return [loop for first, last, loop in spans
            if not any((f, l) != (first, last) and first <= f and l <= last for f, l, _ in spans)]


def recording_compiles():
    """Each kernel a launch returns (compiled or from memory), with its shared memory, warps and
    stages, appended to `compiled`; and the number of compiles (count["compiles"])."""
    run, do_compile = JITFunction.run, JITFunction._do_compile

    def recorded(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=warmup, **kwargs)
        compiled.append({"kernel": self.fn.__name__, "shared": kernel.metadata.shared,
                         "num_warps": kernel.metadata.num_warps, "num_stages": kernel.metadata.num_stages,
                         **resource_usage(kernel)})
        return kernel

    def counted(self, *args, **kwargs):
        count["compiles"] += 1
        return do_compile(self, *args, **kwargs)

    JITFunction.run, JITFunction._do_compile = recorded, counted


class DeviceProperties:
    multi_processor_count = SMS
    shared_memory_per_block_optin = SHARED_MEMORY
    major, minor = 9, 0


def stand_in_for_sm90() -> None:
    driver.set_active(Sm90Driver())
    torch.cuda.get_device_properties = lambda *a, **k: DeviceProperties()
    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
    torch.cuda.is_current_stream_capturing = lambda: False

    import kernels.dependent_launch  # noqa: F401  (its launches_dependents patched below)
    import kernels.hc_mix.op as hc_mix
    import kernels.linear.op as linear
    import kernels.moe.scaled_gluon as scaled_gluon
    import kernels.sparse_mla.gluon as gluon
    import kernels.sparse_mla.plan as plan
    import kernels.triton_util as util
    import model.hyper

    # The CUDA paths' device tests, without the device: the shapes and strides decide.
    def boundary_kernel(streams, fn):
        return (streams.shape[1] == hc_mix.KERNEL_HC and hc_mix.tiles(streams.shape[2])
                and streams.stride(-1) == 1 and fn.stride(-1) == 1)

    def linear_kernel(x, weight):
        return weight.dtype in linear.HALF_DTYPES and weight.shape[-1] >= weight.shape[-2]

    hc_mix.takes_kernel = model.hyper.boundary_takes_kernel = boundary_kernel
    linear.takes_kernel = linear_kernel
    plan.device_capability = lambda device: (9, 0)
    plan.device_sm_count = lambda device: SMS
    gluon.check_wgmma_inputs = lambda q, kv_cache: None
    scaled_gluon.runs_wgmma = lambda device: True
    on_gpu = {"interpreting": lambda: False, "num_sms": lambda device: SMS,
              "shared_memory_per_block": lambda device: SHARED_MEMORY,
              "launches_dependents": lambda device: hasattr(triton.language.extra.cuda, "gdc_wait")}
    plain = {name: getattr(util, name) for name in on_gpu}
    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").startswith("kernels"):
            for name, function in plain.items():
                if getattr(module, name, None) is function:
                    setattr(module, name, on_gpu[name])


def decode_step_calls(batches) -> list[OpCall]:
    """The op calls of one eager decode step of V4-Flash (checkpoint formats, then bf16) and of
    the bench preset, on the meta device: every layer kind, a 4096-token cache."""
    from model import Decoder, ModelConfig

    flash = ModelConfig.preset("flash").replace(n_layers=4, compress_ratios=(0, 0, 4, 128))
    configs = [flash, flash.replace(dtype="bf16", expert_dtype=None), ModelConfig.preset("bench").replace(n_layers=4)]
    with record_op_calls() as record:
        for cfg in configs:
            for batch in batches:
                decoder = Decoder(cfg, max_batch=batch, max_seq_len=4096, device="meta", check_device_values=False)
                tokens = torch.zeros(batch, dtype=torch.long, device="meta")
                decoder(tokens, torch.zeros_like(tokens), torch.arange(batch, device="meta"))
    return list(record.calls)


def op_kernels() -> dict:
    """Op name -> the function its CUDA dispatch runs."""
    found = {}
    for package in PACKAGES:
        for value in vars(importlib.import_module(f"kernels.{package}.op")).values():
            if isinstance(value, CustomOpDef):
                found[value._qualname.split("::")[1]] = value._backend_fns["cuda"]
    return found


def extra_calls(batches) -> list[tuple[str, object]]:
    """Launches the decode step does not make in one process: the MoE gate in one kernel, the split + Sinkhorn kernel on its
    own (the model fuses it into the boundary op), the indexer's halves (index heads split two
    ways), the Gluon products of the FP4 experts and the FP8 linear, the FP8 one-row GEMV, and every sparse MLA
    variant, with and without a workspace, at the index counts of the window-only, ratio-128 and ratio-4 layers."""
    from kernels.gate.triton import moe_gate_triton
    from kernels.hc_sinkhorn import hc_split_sinkhorn
    from kernels.indexer import indexer_scores, indexer_select
    from kernels.sparse_mla import sparse_mla_decode, sparse_mla_workspace
    from kernels.sparse_mla.gluon import sparse_mla_decode_wgmma

    from kernels.blockscale.gemv import blockscale_gemv
    from kernels.blockscale.gluon import blockscale_linear_mma
    from kernels.moe.scaled_gluon import choose_mma_tiles, moe_experts_scaled_mma, one_block_mma_tiles

    ops = op_kernels()
    calls = []
    experts = [torch.empty(8, 2048, 4096 // 2, dtype=torch.uint8), torch.empty(8, 4096, 2048 // 2, dtype=torch.uint8)]
    scales = [torch.empty(8, 2048, 4096 // 32, dtype=torch.float8_e8m0fnu), torch.empty(8, 4096, 2048 // 32, dtype=torch.float8_e8m0fnu)]
    for batch in batches:
        routed = (torch.empty(batch, 4096, dtype=torch.bfloat16), torch.zeros(batch, 6, dtype=torch.long), torch.empty(batch, 6))
        calls.append((f"moe_experts_scaled_mma B={batch}", lambda r=routed: moe_experts_scaled_mma(
            *r, experts[0], experts[1], experts[0], (scales[0], scales[1], scales[0]), 10.0)))
        one_block = one_block_mma_tiles(batch * 6, 8, 4096, 2048, SMS)
        calls.append((f"moe_experts_scaled_mma one block a stage B={batch}", lambda r=routed, t=one_block: moe_experts_scaled_mma(
            *r, experts[0], experts[1], experts[0], (scales[0], scales[1], scales[0]), 10.0, tiles=t)))
        for programs in (4, 5):  # the warpgroup product's registers bounded for four and five programs an SM
            wgmma = dataclasses.replace(choose_mma_tiles(batch * 6, 8, 4096, 2048, SMS), product="wgmma",
                                        programs_per_sm=programs)
            calls.append((f"moe_experts_scaled_mma wgmma {programs} programs B={batch}", lambda r=routed, t=wgmma: (
                moe_experts_scaled_mma(*r, experts[0], experts[1], experts[0], (scales[0], scales[1], scales[0]), 10.0, tiles=t))))
        for n, k in ((1536, 4096), (4096, 8192), (32768, 1024), (4160, 4096)):  # 4160: tiles of 64
            fp8 = (torch.empty(batch, k, dtype=torch.bfloat16), torch.empty(n, k, dtype=torch.float8_e4m3fn),
                   torch.empty(-(-n // 128), k // 128, dtype=torch.float8_e8m0fnu))
            calls.append((f"blockscale_linear_mma B={batch} {n}x{k}", lambda f=fp8: blockscale_linear_mma(*f)))
            if batch == 1:
                calls.append((f"blockscale_gemv {n}x{k}", lambda f=fp8: blockscale_gemv(*f)))
        gate = (torch.empty(batch, 4096, dtype=torch.bfloat16), torch.empty(256, 4096, dtype=torch.bfloat16))
        calls.append((f"moe_gate B={batch}", lambda g=gate: moe_gate_triton(*g, torch.empty(256), None, 6, 2.5)))
        calls.append((f"moe_gate hashed B={batch}", lambda g=gate, b=batch: moe_gate_triton(
            *g, None, torch.zeros(b, 6, dtype=torch.int32), 6, 2.5)))
        mixes = torch.empty(batch, 24)
        calls.append((f"hc_split_sinkhorn B={batch}",
                      lambda m=mixes: hc_split_sinkhorn(m, torch.empty(3), torch.empty(24), 4, 20, 1e-6, impl="triton")))
        index = (torch.empty(batch, 32, 128, dtype=torch.bfloat16), torch.empty(batch, 32, dtype=torch.bfloat16),
                 torch.empty(batch + 1, 1024, 128, dtype=torch.bfloat16), torch.zeros(batch, dtype=torch.long),
                 torch.zeros(batch, dtype=torch.long))
        calls.append((f"indexer_scores B={batch}", lambda i=index: indexer_scores(*i, impl="triton")))
        calls.append((f"indexer_select B={batch}",
                      lambda i=index: indexer_select(torch.empty(len(i[4]), 1024), i[4], 512, impl="triton")))
        for topk in (128, 160, 640):
            q = torch.empty(batch, 64, 512, dtype=torch.bfloat16)
            kv = torch.empty(batch + 1, 4096 + 128, 512, dtype=torch.bfloat16)
            inputs = (q, kv, torch.zeros(batch, topk, dtype=torch.int32), torch.empty(64), 0.04)
            for impl in ("simt", "head_batched", "split_k", "triton"):
                calls.append((f"sparse_mla {impl} B={batch} topk={topk}",
                              lambda i=inputs, impl=impl: sparse_mla_decode(*i, return_lse=True, impl=impl)))
            calls.append((f"sparse_mla wgmma B={batch} topk={topk}", lambda i=inputs: sparse_mla_decode_wgmma(*i)))
            workspace = sparse_mla_workspace(batch, 64, 512, topk, "cpu")
            calls.append((f"sparse_mla with workspace B={batch} topk={topk}",
                          lambda i=inputs, w=workspace: ops["sparse_mla_decode_with_workspace"](*i, w)))
    return calls


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=pathlib.Path)
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)))
    parser.add_argument("--ahead", type=int, default=0, metavar="WORKERS",
                        help="first compile every kernel through kernels.precompile.compile_ahead, WORKERS at a time")
    args = parser.parse_args()
    batches = tuple(int(b) for b in args.batches.split(","))
    stand_in_for_sm90()
    ops = op_kernels()

    def on_cpu(call: OpCall):
        inputs, kw = call.arguments(device="cpu")
        return ops[call.name](*inputs, **kw)

    calls = [(f"{call.name} {[getattr(a, 'shape', a) for a in call.args][:3]}", lambda c=call: on_cpu(c))
             for call in decode_step_calls(batches)] + extra_calls(batches)
    ahead = {}
    if args.ahead:
        start = time.perf_counter()
        ahead["submitted"] = compile_ahead([call for _, call in calls], args.ahead)
        ahead["seconds"] = round(time.perf_counter() - start, 2)
    recording_compiles()
    failures = []
    with launches_compile_only():
        for label, call in calls:
            try:
                call()
            except Exception as error:  # noqa: BLE001 - every failing call is reported
                failures.append({"call": label, "error": f"{type(error).__name__}: {str(error)[:2000]}"})
    kernels_compiled: dict[str, list] = {}
    for launch in compiled:
        variant = {k: launch[k] for k in ("shared", "num_warps", "num_stages", "registers", "local_bytes", "mma_loops")}
        if variant not in kernels_compiled.setdefault(launch["kernel"], []):
            kernels_compiled[launch["kernel"]].append(variant)
    args.out.write_text(json.dumps({
        "triton": triton.__version__, "launches": len(compiled), "kernels": kernels_compiled, "failures": failures,
        "shared_memory_limit": SHARED_MEMORY, "ahead": ahead, "compiled_in_launches": count["compiles"],
    }, indent=1))
    spilling = {name: max(v["local_bytes"] or 0 for v in variants) for name, variants in kernels_compiled.items()
                if any(v["local_bytes"] for v in variants)}
    print(f"sm90_compile: {len(compiled)} launches, {count['compiles']} compiled there, {len(kernels_compiled)} kernels, "
          f"{len(failures)} failed calls" + (f"; ahead: {ahead}" if ahead else "")
          + (f"; local memory (spills, stack), most bytes a thread: {spilling}" if spilling else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
