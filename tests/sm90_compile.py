"""Compile every Triton and Gluon kernel the ops launch on a Hopper GPU, for sm_90, on a machine
without one, and never run them (tests/test_sm90_compile.py starts it in a new process):

    python tests/sm90_compile.py OUT.json

Triton compiles down to a cubin with its own ptxas for the target a stand-in driver names; every
JIT launch becomes a warm-up (compile, no launch) and an autotuned kernel compiles every config.
The ops' CUDA paths run on CPU tensors that hold no values, with the launch plans of a 132-SM
sm_90 GPU, at the shapes one V4-Flash decode step gives them (recorded on the meta device:
checkpoint formats and bf16, batches 1, 16 and 64), plus each sparse MLA variant. What a GPU
would reject at compile time fails here: an unsupported layout or type, a Triton API the
installed version lacks, a program over the shared memory an SM has. OUT.json: per kernel the
compiled variants with their shared memory; the calls that failed, with their errors."""
from __future__ import annotations

import importlib
import json
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
if os.environ.get("TRITON_INTERPRET") == "1":
    raise SystemExit("sm90_compile: run without TRITON_INTERPRET=1 (the interpreter compiles nothing)")

import torch  # noqa: E402
import triton  # noqa: E402
from torch._library.custom_ops import CustomOpDef  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402
from triton.runtime.autotuner import Autotuner  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

SMS = 132
SHARED_MEMORY = 227 * 1024  # sm_90's opt-in maximum per program
PACKAGES = ("blockscale", "hc_mix", "hc_sinkhorn", "indexer", "linear", "moe", "sparse_mla")
BATCHES = (1, 16, 64)
compiled: list[dict] = []


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


def compile_only(run):
    def warmup(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        compiled.append({"kernel": self.fn.__name__, "shared": kernel.metadata.shared,
                         "num_warps": kernel.metadata.num_warps, "num_stages": kernel.metadata.num_stages})
        return kernel

    return warmup


def every_config(self, *args, **kwargs):
    """An autotuned launch: every config compiled, as the GPU's first call would."""
    for config in self.configs:
        self.fn.run(*args, **{**kwargs, **config.all_kwargs()})


class DeviceProperties:
    multi_processor_count = SMS
    shared_memory_per_block_optin = SHARED_MEMORY
    major, minor = 9, 0


def stand_in_for_sm90() -> None:
    driver.set_active(Sm90Driver())
    JITFunction.run = compile_only(JITFunction.run)
    Autotuner.run = every_config
    torch.cuda.get_device_properties = lambda *a, **k: DeviceProperties()
    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
    torch.cuda.is_current_stream_capturing = lambda: False

    import kernels.hc_mix.op as hc_mix
    import kernels.linear.op as linear
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
    on_gpu = {"interpreting": lambda: False, "num_sms": lambda device: SMS,
              "shared_memory_per_block": lambda device: SHARED_MEMORY,
              "launches_dependents": lambda device: hasattr(triton.language.extra.cuda, "gdc_wait")}
    plain = {name: getattr(util, name) for name in on_gpu}
    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").startswith("kernels"):
            for name, function in plain.items():
                if getattr(module, name, None) is function:
                    setattr(module, name, on_gpu[name])


class RecordOps(TorchDispatchMode):
    """Every v4:: op call: its name, and per argument (shape, strides, dtype) or the value."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "v4":
            self.calls.append((func.name().split("::")[1], [describe(a) for a in args]))
        return func(*args, **(kwargs or {}))


def describe(value):
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), tuple(value.stride()), value.dtype)
    return ("value", value)


def make(description):
    """A CPU tensor of that layout, holding no chosen values (nothing runs); integers zero, as
    host code may index with them."""
    if description[0] == "value":
        return description[1]
    _, shape, stride, dtype = description
    tensor = torch.empty_strided(shape, stride, dtype=dtype)
    return tensor if dtype.is_floating_point else tensor.zero_()


def decode_step_calls(batches) -> list[tuple]:
    """The op calls of one eager decode step of V4-Flash (checkpoint formats, then bf16) and of
    the bench preset, on the meta device: every layer kind, a 4096-token cache."""
    from model import Decoder, ModelConfig

    flash = ModelConfig.preset("flash").replace(n_layers=4, compress_ratios=(0, 0, 4, 128))
    configs = [flash, flash.replace(dtype="bf16", expert_dtype=None), ModelConfig.preset("bench").replace(n_layers=4)]
    calls = {}
    for cfg in configs:
        for batch in batches:
            decoder = Decoder(cfg, max_batch=batch, max_seq_len=4096, device="meta", check_device_values=False)
            tokens = torch.zeros(batch, dtype=torch.long, device="meta")
            with RecordOps() as record:
                decoder(tokens, torch.zeros_like(tokens), torch.arange(batch, device="meta"))
            calls.update((repr(call), call) for call in record.calls)
    return list(calls.values())


def op_kernels() -> dict:
    """Op name -> the function its CUDA dispatch runs."""
    found = {}
    for package in PACKAGES:
        for value in vars(importlib.import_module(f"kernels.{package}.op")).values():
            if isinstance(value, CustomOpDef):
                found[value._qualname.split("::")[1]] = value._backend_fns["cuda"]
    return found


def extra_calls(batches) -> list[tuple[str, object]]:
    """Launches the decode step does not make in one process: the split + Sinkhorn kernel on its
    own (the model fuses it into the boundary op), the indexer's halves (index heads split two
    ways), and every sparse MLA variant, with and without a workspace, at the index counts of
    the window-only, ratio-128 and ratio-4 layers."""
    from kernels.hc_sinkhorn import hc_split_sinkhorn
    from kernels.indexer import indexer_scores, indexer_select
    from kernels.sparse_mla import sparse_mla_decode, sparse_mla_workspace
    from kernels.sparse_mla.gluon import sparse_mla_decode_wgmma

    ops = op_kernels()
    calls = []
    for batch in batches:
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
    out = pathlib.Path(sys.argv[1])
    batches = tuple(int(b) for b in sys.argv[2].split(",")) if len(sys.argv) > 2 else BATCHES
    stand_in_for_sm90()
    ops = op_kernels()
    calls = [(f"{name} {[d[1] for d in args][:3]}", lambda n=name, a=args: ops[n](*map(make, a)))
             for name, args in decode_step_calls(batches)]
    failures = []
    for label, call in calls + extra_calls(batches):
        try:
            call()
        except Exception as error:  # noqa: BLE001 - every failing call is reported
            failures.append({"call": label, "error": f"{type(error).__name__}: {str(error)[:2000]}"})
    kernels_compiled: dict[str, list] = {}
    for launch in compiled:
        variant = {k: launch[k] for k in ("shared", "num_warps", "num_stages")}
        if variant not in kernels_compiled.setdefault(launch["kernel"], []):
            kernels_compiled[launch["kernel"]].append(variant)
    out.write_text(json.dumps({"triton": triton.__version__, "launches": len(compiled), "kernels": kernels_compiled,
                               "failures": failures, "shared_memory_limit": SHARED_MEMORY}, indent=1))
    print(f"sm90_compile: {len(compiled)} launches compiled, {len(kernels_compiled)} kernels, {len(failures)} failed calls")
    return 0


if __name__ == "__main__":
    sys.exit(main())
