"""The custom ops' calls of one decode step, recorded for the GPU tests that call each op on its own."""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fuse.bench import synthesize_context
from model import Decoder, ModelConfig


def record_step_op_calls() -> dict[str, tuple]:
    """One call (op, args, kwargs) of each v4 op, as a decode step of the bench widths makes it
    (three layers: window, window, ratio 4 with the indexer; bf16 on CUDA, where the boundary and
    projection kernels take the tensors; bf16 weights, then FP8 linears and FP4 experts), at a position with compressed entries to select from;
    v4::hc_split_sinkhorn, which that step leaves to the boundary kernel, and v4::moe_gate, which
    the model's gate does not call, each called on its own."""
    calls: dict[str, tuple] = {}

    class Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func._schema.name.startswith("v4::"):
                calls.setdefault(func._schema.name, (func, args, kwargs))
            return func(*args, **kwargs)

    inputs = [t.cuda() for t in (torch.tensor([3, 5, 7, 11]), torch.full((4,), 200), torch.arange(4))]
    bench = ModelConfig.preset("bench", layers=3)
    # bf16 weights, then the checkpoint's formats (FP8 linears, FP4 experts) for the block-scaled ops
    for cfg in (bench, bench.replace(dtype="fp8", expert_dtype="fp4")):
        decoder = Decoder(cfg, max_batch=4, max_seq_len=256, dtype=torch.bfloat16, device="cuda")
        decoder.init_random(0)
        synthesize_context(decoder, seed=1)
        with torch.no_grad(), Recorder():
            decoder.step(*inputs)
        del decoder
    hc = bench.hc_mult
    mixes = torch.randn(4, (2 + hc) * hc, device="cuda")
    scale, base = torch.rand(3, device="cuda"), torch.randn((2 + hc) * hc, device="cuda")
    calls.setdefault("v4::hc_split_sinkhorn", (torch.ops.v4.hc_split_sinkhorn.default, (mixes, scale, base, hc, 20, 1e-6), {}))
    x, gate_weight = torch.randn(4, bench.dim, device="cuda").bfloat16(), torch.randn(256, bench.dim, device="cuda").bfloat16()
    calls.setdefault("v4::moe_gate", (torch.ops.v4.moe_gate.default, (x, gate_weight, torch.randn(256, device="cuda"), None, 6, 2.5), {}))
    return calls
