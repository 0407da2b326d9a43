"""GPU benchmark of the routed experts at V4-Flash widths (D=4096, I=2048, bf16, 16 experts, top-6):
the Triton grouped GEMM against the plain-torch reference and against a dense path that runs all
16 experts (three cuBLAS products over the stacked weights), and the same call with a shared
expert as every token's seventh pair (as the model runs it).

Bandwidth counts the expert weights a batch must read: 3 * I * D * 2 bytes per distinct selected
expert. Every variant (including each tile shape of the sweep) is checked against the reference
before it is timed.

A second table times the block-scaled experts as V4-Flash stores them (`scaled_table`): 256 FP4
experts with ue8m0 scales, top-6, and the shared expert in FP8 run after them as the model runs it
when the formats differ (three block-scaled products), beside the same experts dequantised to
bf16 through the dense Triton kernel."""
from __future__ import annotations

import dataclasses

import torch
from triton.runtime.errors import OutOfResources

from kernels.bench.tables import markdown_table
from kernels.bench.timing import graph_time_us, interleaved_graph_times_us, kernel_times_us, median_time_us
from kernels.blockscale.op import blockscale_linear
from kernels.blockscale.ref import FP4_BLOCK, dequantize_fp4_weight, quantize_fp4_weight, quantize_fp8_weight
from kernels.moe import SharedExpertWeights, moe_experts, swiglu
from kernels.moe.ref import shared_expert_product
from kernels.moe.scaled import ScaledTiles, choose_scaled_tiles, moe_experts_scaled_triton
from kernels.moe.shared import shared_expert_triton
from kernels.moe.triton import MoeTiles, choose_tiles, moe_experts_triton
from kernels.side_stream import run_beside
from kernels.triton_util import num_sms, shared_memory_per_block

DIM, INTER, EXPERTS, PICKS, LIMIT = 4096, 2048, 16, 6, 10.0
SHARED = EXPERTS - 1  # the expert the "+ shared" column runs for every token, as the model does
# Warps of the decoded-codes column: with 8 its kernels compile for sm_90 without spills (110 registers).
CODES_WARPS = 8
BATCHES = (1, 16, 32, 64)
WEIGHT_SETS = 2  # 2 x 768 MB: consecutive calls never find their weights in L2
TOLERANCE = 2e-2  # max error relative to the output scale (bf16 rounding points, fp32 sum order)
COPY_TARGET, DENSE_TARGET = 0.60, 0.5


def dense_all_experts(x, expert_ids, expert_weights, w1, w2, w3, swiglu_limit):
    """Every expert on every token, a zero routing weight where not picked: reads all experts."""
    num_experts, inter, dim = w1.shape
    route = torch.zeros(x.shape[0], num_experts, device=x.device).scatter_add_(1, expert_ids.long(), expert_weights.float())
    gate = (x @ w1.reshape(num_experts * inter, dim).t()).view(-1, num_experts, inter)
    up = (x @ w3.reshape(num_experts * inter, dim).t()).view(-1, num_experts, inter)
    h = (swiglu(gate, up, swiglu_limit) * route[..., None]).to(x.dtype)
    return torch.bmm(h.transpose(0, 1), w2.transpose(1, 2)).float().sum(0)


def make_weights() -> list[tuple[torch.Tensor, ...]]:
    sets = []
    for _ in range(WEIGHT_SETS):
        w1 = (torch.randn(EXPERTS, INTER, DIM, device="cuda") * DIM**-0.5).to(torch.bfloat16)
        w3 = (torch.randn(EXPERTS, INTER, DIM, device="cuda") * DIM**-0.5).to(torch.bfloat16)
        w2 = (torch.randn(EXPERTS, DIM, INTER, device="cuda") * INTER**-0.5).to(torch.bfloat16)
        sets.append((w1, w2, w3))
    return sets


def make_inputs(batch: int, weight_sets) -> list[tuple]:
    """One input set per weight set: random distinct top-6 per token, positive routing weights."""
    sets = []
    for w1, w2, w3 in weight_sets:
        x = torch.randn(batch, DIM, device="cuda").to(torch.bfloat16)
        ids = torch.rand(batch, EXPERTS, device="cuda").argsort(1)[:, :PICKS]
        weights = torch.rand(batch, PICKS, device="cuda") + 0.1
        weights = weights / weights.sum(1, keepdim=True) * 1.5
        sets.append((x, ids, weights, w1, w2, w3, LIMIT))
    return sets


def check(fn, input_set, expected: torch.Tensor, label: str) -> None:
    out = fn(*input_set)
    err = ((out.float() - expected).abs().max() / expected.abs().max()).item()
    if not (err <= TOLERANCE):  # also catches NaN
        raise AssertionError(f"moe {label}: max error {err:.2e} of the output scale (limit {TOLERANCE:.0e})")


def distinct_experts(ids: torch.Tensor, shared: int = -1) -> int:
    picked = ids.reshape(-1)
    if shared >= 0:
        picked = torch.cat([picked, picked.new_tensor([shared])])
    return picked.unique().numel()


def bytes_read(input_sets, shared: int = -1) -> float:
    """Mean bytes of expert weights the sets must read (distinct selected experts, and the shared one)."""
    per_expert = 3 * INTER * DIM * 2
    return sum(per_expert * distinct_experts(ids, shared) for _, ids, *_ in input_sets) / len(input_sets)


def tile_variants(chosen: MoeTiles) -> list[tuple[str, MoeTiles]]:
    """The chosen tiles and single-knob neighbours, for tuning on the target GPU."""
    swap = dataclasses.replace
    variants = [("chosen", chosen)]
    for scale, name in ((2, "x2"), (0.5, "/2")):
        for field in ("up_block_n", "down_block_n", "up_block_k", "down_block_k"):
            value = int(getattr(chosen, field) * scale)
            if 16 <= value <= 512:
                variants.append((f"{field} {name}", swap(chosen, **{field: value})))
    variants += [("stages 3", swap(chosen, num_stages=3)), ("stages 5", swap(chosen, num_stages=5))]
    if chosen.block_m < 64:
        variants.append(("block_m x2", swap(chosen, block_m=2 * chosen.block_m)))
    return variants


def run(copy_gbs: float) -> str:
    weight_sets = make_weights()
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count

    def triton_path(*args):
        return moe_experts(*args, impl="triton")

    def reference_path(*args):
        return moe_experts(*args, impl="reference")

    def with_shared(*args):  # the model's call: every token's seventh pair on the shared expert
        return moe_experts(*args, impl="triton", shared_expert=SHARED)

    rows, sweep, verdicts = [], {}, []
    for batch in BATCHES:
        sets = make_inputs(batch, weight_sets)
        expected = reference_path(*sets[0])
        check(triton_path, sets[0], expected, f"B={batch} triton")
        check(dense_all_experts, sets[0], expected, f"B={batch} dense")
        check(with_shared, sets[0], moe_experts(*sets[0], impl="reference", shared_expert=SHARED), f"B={batch} + shared")
        eager = median_time_us(triton_path, sets)
        replay = graph_time_us(triton_path, sets)
        reference = graph_time_us(reference_path, sets)
        dense = graph_time_us(dense_all_experts, sets)
        shared = graph_time_us(with_shared, sets)
        gbs = bytes_read(sets) / (replay * 1e-6) / 1e9
        shared_gbs = bytes_read(sets, SHARED) / (shared * 1e-6) / 1e9
        experts_read = sum(distinct_experts(ids) for _, ids, *_ in sets) / len(sets)
        rows.append([
            batch, f"{experts_read:.1f}", f"{eager:.1f}", f"{replay:.1f}", f"{gbs:.0f}", f"{100 * gbs / copy_gbs:.0f}%",
            f"{reference:.1f}", f"{reference / replay:.2f}x", f"{dense:.1f}", f"{replay / dense:.2f}",
            f"{shared:.1f}", f"{100 * shared_gbs / copy_gbs:.0f}%",
        ])
        print(f"moe B={batch}: triton {replay:.1f} us ({gbs:.0f} GB/s), reference {reference:.1f}, dense {dense:.1f}", flush=True)
        if replay > reference:
            verdicts.append(f"B={batch}: slower than the plain-torch path (MISSES)")
        if batch == 64:
            met = "meets" if gbs >= COPY_TARGET * copy_gbs else "MISSES"
            verdicts.append(f"B=64: {100 * gbs / copy_gbs:.0f}% of copy bandwidth (target {COPY_TARGET:.0%}: {met})")
        if batch == 1:
            met = "meets" if replay <= DENSE_TARGET * dense else "MISSES"
            verdicts.append(f"B=1: {replay / dense:.2f} of the dense time (target <= {DENSE_TARGET}: {met})")

        chosen = choose_tiles(batch * PICKS, EXPERTS, DIM, INTER, 2, num_sms, shared_memory_per_block(torch.device("cuda")))
        for name, tiles in tile_variants(chosen):
            def tiled(*args, tiles=tiles):
                return moe_experts_triton(*args, tiles=tiles)

            try:
                check(tiled, sets[0], expected, f"B={batch} tiles {tiles}")
                sweep.setdefault(name, {})[batch] = (graph_time_us(tiled, sets), tiles)
            except OutOfResources:
                sweep.setdefault(name, {})[batch] = None
        del sets
        torch.cuda.empty_cache()

    table = markdown_table(
        ["B", "experts read", "Triton us", "Triton graph us", "GB/s (graph)", "% copy", "reference graph us",
         "speedup vs reference", f"dense ({EXPERTS} experts) graph us", "Triton / dense",
         "Triton + shared expert graph us", "+ shared % copy"],
        rows,
    )
    sweep_rows = []
    for name, per_batch in sweep.items():
        cells = []
        for batch in BATCHES:
            entry = per_batch.get(batch)
            cells.append("n/a" if entry is None else f"{entry[0]:.1f}")
        sweep_rows.append([name] + cells)
    best = []
    for batch in BATCHES:
        timed = [(v[batch][0], name, v[batch][1]) for name, v in sweep.items() if v.get(batch)]
        us, name, tiles = min(timed, key=lambda t: t[0])
        best.append(f"- B={batch}: best `{name}` {us:.1f} us: {tiles}")
    sweep_table = markdown_table(["tiles"] + [f"B={b} graph us" for b in BATCHES], sweep_rows)
    del weight_sets
    torch.cuda.empty_cache()
    return (
        f"## Routed experts (D={DIM}, I={INTER}, {EXPERTS} experts, top-{PICKS}, bf16)\n\n"
        "Every path matched the plain-torch reference (max error <= 2% of the output scale) before timing. "
        "Median CUDA-event times over rotating weight sets; 'graph' replays one CUDA graph per set. GB/s and "
        "% copy count the weights of the distinct selected experts. '+ shared': the same call with every "
        "token's seventh pair on one expert (`shared_expert`), as the model runs its shared expert.\n\n"
        f"{table}\n\n" + "\n".join(f"- {v}" for v in verdicts) + "\n\n"
        "### Tile sweep (each checked against the reference)\n\n"
        f"{sweep_table}\n\n" + "\n".join(best) + "\n\n" + scaled_table(copy_gbs)
    )


# ---------------------------------------------------------------------------------------------
# Block-scaled experts as V4-Flash stores them
# ---------------------------------------------------------------------------------------------

SCALED_EXPERTS = 256
SCALED_BATCHES = (1, 16, 64)
SCALED_ROUTINGS = 4  # routing sets rotated through, so that consecutive calls read other experts
SCALED_TARGET = 0.70  # of copy bandwidth, at every batch
SCALE_BYTES = 1  # ue8m0


def fp4_expert_bytes() -> int:
    """One expert's packed FP4 weights and their scales (w1, w2, w3)."""
    return 3 * (INTER * DIM // 2 + INTER * DIM // FP4_BLOCK * SCALE_BYTES)


def make_scaled_experts(dense_too: bool = True) -> tuple[tuple, tuple | None, tuple]:
    """256 FP4 experts (packed w1, w2, w3 and their ue8m0 scales, quantised from random weights a
    few experts at a time), the same experts dequantised to bf16 (None without `dense_too`: 13 GB
    a caller may not need), and the FP8 shared expert ([w1; w3] and its 128 x 128 block scales,
    w2 and its)."""
    shapes = {"w1": (INTER, DIM), "w2": (DIM, INTER), "w3": (INTER, DIM)}
    packed = {n: torch.empty(SCALED_EXPERTS, o, i // 2, dtype=torch.uint8, device="cuda") for n, (o, i) in shapes.items()}
    scales = {n: torch.empty(SCALED_EXPERTS, o, i // FP4_BLOCK, dtype=torch.float8_e8m0fnu, device="cuda") for n, (o, i) in shapes.items()}
    dense = None
    if dense_too:
        dense = {n: torch.empty(SCALED_EXPERTS, o, i, dtype=torch.bfloat16, device="cuda") for n, (o, i) in shapes.items()}
    chunk = 16
    for first in range(0, SCALED_EXPERTS, chunk):
        rows = slice(first, first + chunk)
        for name, (out, inp) in shapes.items():
            w = torch.randn(chunk, out, inp, device="cuda") * inp**-0.5
            packed[name][rows], scales[name][rows] = quantize_fp4_weight(w)
            if dense_too:
                dense[name][rows] = dequantize_fp4_weight(packed[name][rows], scales[name][rows]).to(torch.bfloat16)
    # The shared expert as the model stores it: w1 and w3 stacked along the outputs (one product), w2.
    gate_up = quantize_fp8_weight(torch.randn(2 * INTER, DIM, device="cuda") * DIM**-0.5)
    down = quantize_fp8_weight(torch.randn(DIM, INTER, device="cuda") * INTER**-0.5)
    fp4 = (packed["w1"], packed["w2"], packed["w3"], (scales["w1"], scales["w2"], scales["w3"]))
    return fp4, (dense["w1"], dense["w2"], dense["w3"]) if dense_too else None, (*gate_up, *down)


def op_mma_tiles(ids: torch.Tensor, num_experts: int) -> ScaledTiles:
    """The tiles the op's Gluon product chooses for this routing (V4-Flash widths)."""
    from kernels.moe.scaled_gluon import choose_mma_tiles  # Gluon: imported where a GPU runs it

    return choose_mma_tiles(ids.numel(), num_experts, DIM, INTER, num_sms(ids.device))


def scaled_routing_sets(batch: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    sets = []
    for _ in range(SCALED_ROUTINGS):
        x = torch.randn(batch, DIM, device="cuda").to(torch.bfloat16)
        ids = torch.rand(batch, SCALED_EXPERTS, device="cuda").argsort(1)[:, :PICKS]
        weights = torch.rand(batch, PICKS, device="cuda") + 0.1
        sets.append((x, ids, weights / weights.sum(1, keepdim=True) * 1.5))
    return sets


def scaled_table(copy_gbs: float) -> str:
    """FP4 experts through the op (its CUDA product) against the other products of the same
    semantics and the same experts dequantised to bf16 through the dense kernel; GB/s counts the
    bytes each must move: the distinct picked experts' weights (and scales), x, and the fp32 output."""
    from kernels.moe.scaled_gluon import (  # Gluon: imported where a GPU runs it
        DEEP_PIPELINE_STAGES, PIPELINE_STAGES, moe_experts_scaled_mma, one_block_mma_tiles,
    )

    fp4, dense, shared = make_scaled_experts()
    w1, w2, w3, scales = fp4
    d1, d2, d3 = dense

    def fp4_path(x, ids, weights, impl="auto"):
        return moe_experts(x, ids, weights, w1, w2, w3, LIMIT, impl=impl, scales=scales)

    shared_weights = SharedExpertWeights(*shared)

    def model_path(x, ids, weights):  # the FP8 shared expert beside the routed FP4 experts, as model/moe.py
        return moe_experts(x, ids, weights, w1, w2, w3, LIMIT, scales=scales, shared_weights=shared_weights)

    def shared_after(x, ids, weights):  # the routed experts, then the shared expert on the same stream
        return fp4_path(x, ids, weights) + shared_expert_product(x, shared_weights, LIMIT, True, blockscale_linear).float()

    def beside(priority: int = 0, gate_up_gemv: bool = False):
        """The shared expert beside the routed experts, composed here (its output added after the
        routed op's combine): on a side stream of `priority`, its gate/up at one row through the
        FP8 GEMV where `gate_up_gemv` (the op takes the Triton plan for its 16 MiB)."""
        def path(x, ids, weights):
            out, routed = run_beside(lambda: shared_expert_triton(x, shared_weights, LIMIT, True, gate_up_gemv),
                                     lambda: fp4_path(x, ids, weights), x.device, priority)
            return routed + out.float()

        return path

    def forked_before_routing(x, ids, weights):  # the op with its side stream forked before the routing kernel
        return moe_experts_scaled_mma(x, ids, weights, w1, w2, w3, scales, LIMIT, shared_weights=shared_weights,
                                      shared_after_routing=False)

    # The op's side stream forked before its routing, and the shared expert beside the routed experts
    # as the bench composes it, each against the model.
    shared_variants = {
        "forked before routing": forked_before_routing,
        "beside, high-priority side stream": beside(priority=-1),
        "beside, gate/up GEMV": beside(gate_up_gemv=True),
    }

    def dense_path(x, ids, weights, impl="auto"):
        return moe_experts(x, ids, weights, d1, d2, d3, LIMIT, impl=impl)

    def tiles(ids, **changes):
        return dataclasses.replace(choose_scaled_tiles(ids.numel(), w1.shape[0], DIM, INTER, num_sms(ids.device)), **changes)

    def mma_tiles(ids, **changes) -> ScaledTiles:  # the op's Gluon tiles with `changes`
        return dataclasses.replace(op_mma_tiles(ids, w1.shape[0]), **changes)

    def mma_split(ids, factor: int) -> ScaledTiles:  # the op's tiles, its gate/up K split `factor` times the ways
        chosen = op_mma_tiles(ids, w1.shape[0])
        return dataclasses.replace(chosen, up_split=factor * chosen.up_split)

    def one_block(ids) -> ScaledTiles:  # the op's split with one block a stage and its pipeline depth
        return one_block_mma_tiles(ids.numel(), w1.shape[0], DIM, INTER, num_sms(ids.device))

    # The products the op does not run by default, each on the op's semantics (kernels/moe/scaled*.py),
    # and the op's own product with its gate/up K split into more ways or one block a pipeline stage.
    candidates = {
        "Triton dot_scaled": lambda x, ids, weights: moe_experts_scaled_triton(
            x, ids, weights, w1, w2, w3, scales, LIMIT, tiles=tiles(ids, product="dot_scaled")),
        "Triton codes decoded": lambda x, ids, weights: moe_experts_scaled_triton(
            x, ids, weights, w1, w2, w3, scales, LIMIT, tiles=tiles(ids, product="codes", num_warps=CODES_WARPS)),
        "Gluon split x2": lambda x, ids, weights: moe_experts_scaled_mma(
            x, ids, weights, w1, w2, w3, scales, LIMIT, tiles=mma_split(ids, 2)),
        "Gluon one block a stage": lambda x, ids, weights: moe_experts_scaled_mma(
            x, ids, weights, w1, w2, w3, scales, LIMIT, tiles=one_block(ids)),
        "Gluon no dependent launch": lambda x, ids, weights: moe_experts_scaled_mma(
            x, ids, weights, w1, w2, w3, scales, LIMIT, tiles=mma_tiles(ids, dependent_launch=False)),
        "Gluon wgmma": lambda x, ids, weights: moe_experts_scaled_mma(
            x, ids, weights, w1, w2, w3, scales, LIMIT, tiles=mma_tiles(ids, product="wgmma")),
        "Gluon wgmma, 5 programs an SM": lambda x, ids, weights: moe_experts_scaled_mma(
            x, ids, weights, w1, w2, w3, scales, LIMIT, tiles=mma_tiles(ids, product="wgmma", programs_per_sm=5)),
    }

    shared_bytes = sum(t.numel() * t.element_size() for t in shared)
    rows, shared_rows, kernel_rows, verdicts = [], [], [], []
    for batch in SCALED_BATCHES:
        sets = scaled_routing_sets(batch)
        expected = fp4_path(*sets[0], impl="reference")
        check(fp4_path, sets[0], expected, f"scaled B={batch} FP4")
        check(dense_path, sets[0], dense_path(*sets[0], impl="reference"), f"scaled B={batch} bf16 dequantised")
        experts = sum(distinct_experts(ids) for _, ids, _ in sets) / len(sets)
        io_bytes = batch * DIM * (2 + 4)  # x in bf16, the fp32 output
        fp4_bytes = experts * fp4_expert_bytes() + io_bytes
        bf16_bytes = experts * 3 * INTER * DIM * 2 + io_bytes
        with_shared = moe_experts(*sets[0], w1, w2, w3, LIMIT, impl="reference", scales=scales, shared_weights=shared_weights)
        check(model_path, sets[0], with_shared, f"scaled B={batch} + FP8 shared")
        check(shared_after, sets[0], with_shared, f"scaled B={batch} + FP8 shared after")
        for name, path in shared_variants.items():
            check(path, sets[0], with_shared, f"scaled B={batch} {name}")
        # The routed experts alone and every way with the shared expert, timed in turn: a few us apart.
        ways = {"routed": fp4_path, "model": model_path, "after": shared_after, **shared_variants}
        shared_us = interleaved_graph_times_us(ways, sets)
        fp4_us, model_us, after_us = shared_us["routed"], shared_us["model"], shared_us["after"]
        dense_us = graph_time_us(dense_path, sets)
        fp4_gbs = fp4_bytes / (fp4_us * 1e-6) / 1e9
        model_gbs = (fp4_bytes + shared_bytes) / (model_us * 1e-6) / 1e9
        dense_gbs = bf16_bytes / (dense_us * 1e-6) / 1e9
        shared_row = [batch, f"{fp4_us:.1f}", f"{model_us:.1f}", f"{100 * model_gbs / copy_gbs:.0f}%", f"{after_us:.1f}",
                      f"{after_us / model_us:.2f}x"]
        for name in shared_variants:
            shared_row += [f"{shared_us[name]:.1f}", f"{model_us / shared_us[name]:.2f}x"]
        shared_rows.append(shared_row)
        row = [
            batch, f"{experts:.1f}", f"{fp4_bytes / 1e6:.0f}", f"{fp4_us:.1f}", f"{fp4_gbs:.0f}", f"{100 * fp4_gbs / copy_gbs:.0f}%",
            f"{bf16_bytes / 1e6:.0f}", f"{dense_us:.1f}", f"{dense_gbs:.0f}", f"{100 * dense_gbs / copy_gbs:.0f}%",
            f"{fp4_us / dense_us:.2f}",
        ]
        for name, path in candidates.items():
            try:  # a product that fails to compile or to match is reported, not timed
                check(path, sets[0], expected, f"scaled B={batch} {name}")
                beside = interleaved_graph_times_us({"op": fp4_path, "candidate": path}, sets)  # the ratio side by side
                us = beside["candidate"]
                row += [f"{us:.1f}", f"{100 * fp4_bytes / (us * 1e-6) / 1e9 / copy_gbs:.0f}%", f"{beside['op'] / us:.2f}x"]
            except Exception as error:  # noqa: BLE001
                row += [f"fails: {type(error).__name__}: {str(error)[:100]}", "-", "-"]
        rows.append(row)
        kernels = kernel_times_us(fp4_path, sets)
        kernel_rows.append([batch, f"{sum(kernels.values()):.1f}"] + [f"`{name[:40]}` {us:.1f}" for name, us in kernels.items()])
        print(f"moe scaled B={batch}: FP4 {fp4_us:.1f} us ({fp4_gbs:.0f} GB/s), bf16 {dense_us:.1f} us", flush=True)
        met = "meets" if fp4_gbs >= SCALED_TARGET * copy_gbs else "MISSES"
        verdicts.append(f"B={batch}: FP4 at {100 * fp4_gbs / copy_gbs:.0f}% of copy bandwidth (target {SCALED_TARGET:.0%}: {met})")
        del sets
    headers = ["B", "experts read", "FP4 MB", "FP4 graph us", "FP4 GB/s", "FP4 % copy",
               "bf16 MB", "bf16 dequantised graph us", "bf16 GB/s", "bf16 % copy", "FP4 / bf16 time"]
    for name in candidates:
        headers += [f"{name} graph us", f"{name} % copy", f"{name} speedup"]
    table = markdown_table(headers, rows)
    widest = max(len(row) for row in kernel_rows)  # batches launch different kernels (a K split's, a combine's)
    kernel_table = markdown_table(["B", "kernels us"] + [f"kernel {i + 1}" for i in range(widest - 2)],
                                  [row + ["-"] * (widest - len(row)) for row in kernel_rows])
    shared_headers = ["B", "routed alone graph us", "+ FP8 shared (model) graph us", "+ shared % copy",
                      "+ FP8 shared after graph us", "beside speedup"]
    for name in shared_variants:
        shared_headers += [f"{name} graph us", f"{name} vs model"]
    return (
        f"## Block-scaled routed experts (D={DIM}, I={INTER}, {SCALED_EXPERTS} FP4 experts, ue8m0 scales, top-{PICKS}, bf16 x)\n\n"
        "Every path matched its reference (max error <= 2% of the output scale) before timing. One CUDA graph per "
        f"routing set, {SCALED_ROUTINGS} sets rotated. MB and GB/s count what each must move: the distinct picked experts' "
        "weights (FP4: packed codes and scales), x and the fp32 output. 'FP4': the op `v4::moe_experts_scaled` as the "
        "model calls it (on sm_89+ the Gluon product of kernels/moe/scaled_gluon.py, the codes decoded straight into the "
        "tensor-core instruction's registers). 'bf16 dequantised': the same experts dequantised to bf16 through the dense Triton kernel. "
        "The other products of the same semantics, each with its 'speedup' (the op's time over its own, the two timed in "
        "turn, median of 5 rounds): 'Triton dot_scaled' "
        "(kernels/moe/scaled.py, `tl.dot_scaled` on the packed codes), 'Triton codes decoded' (the codes decoded in the "
        f"Triton kernel, then an fp16 dot, {CODES_WARPS} warps); 'Gluon split x2': the op's Gluon product with "
        "the gate/up product's K split into twice the ways the op chooses (`ScaledTiles.up_split`); 'Gluon one block a "
        "stage': the op's Gluon product with one 128-input block a pipeline stage (`ScaledTiles.blocks_per_stage`: each "
        f"weight row's codes read 64 bytes at a time, not 128) and {PIPELINE_STAGES} or {DEEP_PIPELINE_STAGES} stages "
        "as the op chose before two blocks a stage; 'Gluon no dependent launch': the op's Gluon product with its down "
        "kernel launched after the gate/up kernel ends, not as its programmatic dependent (`ScaledTiles.dependent_launch`: "
        "the down kernel's launch and first weight copies overlapping the gate/up kernel's last programs); 'Gluon "
        "wgmma': the op's tiles on Hopper's warpgroup instruction (`ScaledTiles.product` \"wgmma\": the codes decoded to "
        "e4m3, the activations read from shared memory; fails elsewhere than on sm_90), and the same with each "
        "thread's registers bounded to five programs an SM instead of four (`ScaledTiles.programs_per_sm`: 102 "
        "registers instead of 128, the decoded e4m3 codes taking half the registers of fp16 ones).\n\n"
        f"{table}\n\n" + "\n".join(f"- {v}" for v in verdicts) + "\n\n"
        "### The FP8 shared expert with the routed experts\n\n"
        "'+ FP8 shared (model)': `v4::moe_experts_scaled_shared`, the routed experts with the shared expert in FP8 "
        "(two `blockscale_linear` products, w1 and w3 as one, and one SwiGLU kernel) on a side stream beside them and "
        "its output added in their combine, as model/moe.py runs it when the formats differ ('% copy' counts its bytes "
        "too; its side stream forks after the routing kernel); '+ FP8 shared after': the routed experts, then the shared "
        "expert on the same stream; 'beside speedup': after over the model. Then, each against the model: 'forked before "
        "routing': the op with its side stream forked before the routing kernel (`shared_after_routing=False`: the "
        "routing's few programs then wait for SMs behind the shared expert's first product); the shared expert beside "
        "the routed op composed here (its output added after the op's combine, one more kernel): 'high-priority side "
        "stream' (CUDA stream priority -1), 'gate/up GEMV' (at one row the 16 MiB gate/up product through the FP8 "
        "GEMV instead of the Triton plan the linear op takes). Every path matched the reference first; the routed "
        "experts alone and these ways were timed in turn, median of 5 rounds.\n\n"
        f"{markdown_table(shared_headers, shared_rows)}\n\n"
        "### Where the FP4 op's time goes\n\n"
        "Each kernel the op launches and its device time per call (us, the profiler over 20 calls launched one after "
        "another, not in a graph); 'kernels us': their sum. The op's graph time above adds the gaps between them.\n\n"
        f"{kernel_table}\n"
    )
