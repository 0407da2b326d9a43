"""GPU benchmark of the router's product: fp32 rows times its bf16 weight (V4-Flash: 256 experts x
4096), exact in fp32 as the official gate computes it; then the whole gate (product, scores, top-k,
renormalisation) as `v4::moe_gate`'s one launch against the ops it replaces. `linear` (the `v4::grouped_linear` op: the
fp32 GEMV at one row, the library's product at more) against what runs without the op: cuBLAS's fp32 product of the weight upcast every call. The
ways are timed in turn (interleaved graph replays, median of rounds) on rotating inputs; kernels
per call from the profiler. Each way is checked against an fp64 product first."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.bench.linear import BATCHES, kernels_per_call
from kernels.bench.tables import markdown_table
from kernels.bench.timing import interleaved_graph_times_us, rotation_count
from kernels.gate import moe_gate, moe_gate_reference
from kernels.linear import linear

EXPERTS, DIM = 256, 4096
TOLERANCE = 1e-5  # relative to the output scale: fp32 sums in another order (bf16 rows: ~1e-3)
SETS = 8  # rotating inputs: the weight is 2 MB, L2-resident in every way alike


def run(copy_gbs: float) -> str:
    del copy_gbs  # the product is L2- and latency-bound; no bandwidth column
    ways = {"op": linear, "cuBLAS of the upcast": lambda x, w: F.linear(x, w.float())}
    rows_out = []
    for batch in BATCHES:
        sets = [(torch.randn(batch, DIM, device="cuda"), (torch.randn(EXPERTS, DIM, device="cuda") * DIM**-0.5).bfloat16())
                for _ in range(SETS)]
        x, w = sets[0]
        expected = F.linear(x.double(), w.double())
        for name, fn in ways.items():
            err = ((fn(x, w).double() - expected).abs().max() / expected.abs().max()).item()
            if err > TOLERANCE:
                raise AssertionError(f"router B={batch} {name}: relative error {err:.2e} > {TOLERANCE}")
        times = interleaved_graph_times_us(ways, sets)
        ours, theirs = times["op"], times["cuBLAS of the upcast"]
        rows_out.append([batch, f"{ours:.1f}", f"{theirs:.1f}", f"{theirs / ours:.2f}x",
                         kernels_per_call(ways["op"], sets[0]), kernels_per_call(ways["cuBLAS of the upcast"], sets[0])])
    header = ["B", "op us", "cuBLAS of the upcast us", "speed-up", "kernels (op)", "kernels (cuBLAS)"]
    return (
        f"## The router's product (fp32 rows x bf16 weight, {EXPERTS} x {DIM})\n\n"
        "One CUDA graph per input set, the two ways replayed in turn (median of rounds). 'op': `linear` "
        "(one row: the fp32 GEMV; more: "
        "the library's product); 'cuBLAS of the upcast': `F.linear(x, w.float())`, the weight upcast "
        f"every call. Both matched an fp64 product within {TOLERANCE:g} of the output scale first.\n\n"
        + markdown_table(header, rows_out) + "\n\n" + gate_table()
    )


GATE_BATCHES = (1, 4, 16, 64)
TOPK, ROUTE_SCALE = 6, 2.5


def gate_composed(x, w, bias):
    """The gate as separate ops: the linear op's fp32 product, then scores, top-k and renormalisation."""
    scores = F.softplus(linear(x.float(), w)).sqrt()
    ids = (scores + bias).topk(TOPK, dim=-1).indices
    picked = scores.gather(1, ids)
    return picked / picked.sum(-1, keepdim=True) * ROUTE_SCALE, ids


def gate_table() -> str:
    """`moe_gate` (one launch) against the composition it replaces, eager and compiled, on weights
    rotated past the L2 (a decode step reads each layer's gate weight from memory)."""
    compiled = torch.compile(gate_composed, fullgraph=True)
    ways = {
        "moe_gate": lambda x, w, bias: moe_gate(x, w, bias, None, TOPK, ROUTE_SCALE),
        "composed": gate_composed,
        "composed, compiled": compiled,
    }
    rows_out = []
    for batch in GATE_BATCHES:
        sets = [(torch.randn(batch, DIM, device="cuda").bfloat16(), (torch.randn(EXPERTS, DIM, device="cuda") * DIM**-0.5).bfloat16(),
                 torch.randn(EXPERTS, device="cuda") * 0.1) for _ in range(rotation_count(EXPERTS * DIM * 2))]
        expected_weights, expected_ids = moe_gate_reference(*sets[0][:2], sets[0][2], None, TOPK, ROUTE_SCALE)
        for name, fn in ways.items():
            weights, ids = fn(*sets[0])
            err = ((weights - expected_weights).abs().max() / expected_weights.abs().max()).item()
            if not torch.equal(ids, expected_ids) or err > TOLERANCE:
                raise AssertionError(f"gate B={batch} {name}: ids differ or relative error {err:.2e} > {TOLERANCE}")
        times = interleaved_graph_times_us(ways, sets)
        row = [batch]
        for name, fn in ways.items():
            row += [f"{times[name]:.1f}", kernels_per_call(fn, sets[0])]
        rows_out.append(row + [f"{times['composed, compiled'] / times['moe_gate']:.2f}x"])
    header = ["B"] + [f"{name} {col}" for name in ways for col in ("us", "kernels")] + ["moe_gate speed-up over compiled"]
    return (
        f"## The MoE gate in one launch (`v4::moe_gate`, {EXPERTS} experts x {DIM}, top-{TOPK})\n\n"
        "One CUDA graph per input set, the ways replayed in turn (median of rounds), each layer's weight rotated past "
        "the L2 as a decode step reads them. 'moe_gate': the op (kernels/gate: the fp32 product, scores, top-k and "
        "renormalisation in one kernel); 'composed': the linear op's fp32 product, then softplus, sqrt, top-k, "
        "gather and renormalisation as torch ops; 'composed, compiled': that under torch.compile (what Inductor "
        f"makes of the glue). Every way matched the reference's ids and weights (within {TOLERANCE:g}) first.\n\n"
        + markdown_table(header, rows_out) + "\n"
    )
