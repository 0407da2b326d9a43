"""Sparse MLA decode benchmark (H=64, D=512, bf16): SIMT vs head-batched vs split-K vs the Gluon
wgmma kernel (Hopper) vs the op's own choice (impl="auto").

Every variant is first checked against the reference on fresh inputs (an AssertionError stops the
run). Timing: one CUDA graph per variant holds one call per rotating input set (enough sets to
touch over 4x the L2), so the median replay time over the set count is device time per call
without host launch gaps, as in the captured decode step. Each sequence gathers from its own
cache slot of 128 window + 16384 compressed rows (at least 16 slots: the rows the sets touch
never fit in L2); its indices are the 128 ring rows plus random compressed rows, 10% set to -1
at random positions.

Effective bandwidth counts the bytes the op must move at least once: each sequence's distinct
valid KV rows (D x 2 bytes each) plus q and out (B x H x D x 2 bytes each); indices, sink and LSE
(under 1%) are not counted.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import replace

import torch

from kernels.bench.tables import markdown_table
from kernels.bench.timing import median_time_us
from kernels.cuda_graph import capture
from kernels.sparse_mla import plan
from kernels.sparse_mla import triton as smt
from kernels.sparse_mla.op import sparse_mla_decode_cuda
from kernels.sparse_mla.ref import sparse_mla_decode_reference
from kernels.triton_util import launches_dependents

HEADS, DIM, DTYPE = 64, 512, torch.bfloat16
WINDOW, COMPRESSED = 128, 16384
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128)
TOPKS = (640, 2048)
# The model's other layers at small batch: window-only (128 indices) and ratio-128 at 4K context
# (128 + 4096 / 128); the split sweep covers them too.
SHORT_TOPKS, SHORT_BATCHES = (128, 160), (1, 2, 4)
MAX_SETS = 256
TILE_SWEEP = (
    plan.TileConfig(64, 32, 4, 3, dv_split=2),
    plan.TileConfig(64, 32, 4, 1, dv_split=2),  # no software pipelining, but two programs fit per SM
    plan.TileConfig(64, 64, 4, 2, dv_split=2),  # the default at full occupancy
    # Two warpgroups per 64-head program: whole rows without the DV split's second gather, or
    # with it and no spills (kernels.bench.resource_usage); and a deep pipeline of small tiles.
    plan.TileConfig(64, 64, 8, 2),
    plan.TileConfig(64, 64, 8, 2, dv_split=2),
    plan.TileConfig(64, 32, 8, 3),
    plan.TileConfig(64, 16, 4, 6, dv_split=2),
    plan.TileConfig(64, 16, 4, 2, dv_split=2),
    plan.TileConfig(64, 32, 8, 2),  # one program per head block: Q K^T is duplicated across its two warpgroups
    plan.TileConfig(64, 16, 8, 2),
    plan.TileConfig(32, 32, 8, 2),
    plan.TileConfig(32, 64, 8, 2),
    plan.TileConfig(16, 32, 4, 2),
    plan.TileConfig(16, 64, 4, 3),
    # Pipelines deep enough that the gather runs two blocks ahead of its use (three KV buffers in
    # the sm_90 compile, kernels.bench.resource_usage); shallower ones keep one gather in flight.
    plan.TileConfig(64, 32, 8, 5),
    plan.TileConfig(64, 32, 4, 5, dv_split=2),
)


def tile_name(tiles: plan.TileConfig) -> str:
    name = f"{tiles.block_h}x{tiles.block_k} w{tiles.num_warps} s{tiles.num_stages}"
    return name + (" dv2" if tiles.dv_split == 2 else "")


class Case:
    """One (B, K) shape: a shared cache and `n_sets` rotating (q, indices) sets."""

    def __init__(self, batch: int, topk: int, l2_bytes: int, seed: int = 0, device: str = "cuda"):
        self.batch, self.topk = batch, topk
        gen = torch.Generator(device=device).manual_seed(seed)
        slots, rows = max(batch, 16), WINDOW + COMPRESSED
        self.kv_cache = torch.randn(slots, rows, DIM, device=device, generator=gen).to(DTYPE)
        self.sink = torch.randn(HEADS, device=device, generator=gen)
        self.scale = DIM**-0.5
        min_set_bytes = batch * (topk * DIM + 2 * HEADS * DIM) * 2
        n_sets = max(2, min(MAX_SETS, math.ceil(4 * l2_bytes / min_set_bytes)))
        self.sets = []
        self.moved_bytes = []  # effective bytes per set
        for j in range(n_sets):
            q = torch.randn(batch, HEADS, DIM, device=device, generator=gen).to(DTYPE)
            slot = (j * batch + torch.arange(batch, device=device)[:, None]) % slots
            ring = torch.arange(WINDOW, device=device).expand(batch, -1)
            picks = WINDOW + torch.randint(0, COMPRESSED, (batch, topk - WINDOW), device=device, generator=gen)
            indices = (slot * rows + torch.cat([ring, picks], 1)).to(torch.int32)
            indices[torch.rand(batch, topk, device=device, generator=gen) < 0.1] = -1
            self.sets.append((q, self.kv_cache, indices, self.sink, self.scale))
            unique_rows = sum(torch.unique(row[row >= 0]).numel() for row in indices)
            self.moved_bytes.append(unique_rows * DIM * 2 + 2 * q.numel() * 2)

    @property
    def bytes_per_call(self) -> float:
        return sum(self.moved_bytes) / len(self.moved_bytes)


def check_against_reference(name: str, fn, case: Case) -> torch.Tensor:
    """Run fn on set 0, compare with the reference (bf16 tolerances as tests/test_sparse_mla.py), return out."""
    args = case.sets[0]
    out, lse = fn(*args)
    ref_out, ref_lse = sparse_mla_decode_reference(*args)
    err = (out.float() - ref_out.float()).abs()
    bad = (err > 2e-2 + 2e-2 * ref_out.float().abs()).sum().item()
    lse_err = (lse - ref_lse).abs().max().item()
    if bad or err.mean().item() > 2e-3 or lse_err > 2e-3 or not torch.isfinite(out).all():
        raise AssertionError(
            f"sparse_mla {name} at B={case.batch}, K={case.topk}: {bad} outputs off (max err {err.max().item():.3g}, "
            f"mean {err.mean().item():.3g}), max LSE err {lse_err:.3g}"
        )
    return out


def time_per_call_us(fn, case: Case) -> tuple[float, torch.Tensor]:
    """Device time per call: one graph replays fn over every input set. Also returns the graph's
    output for set 0 so the caller can check that the captured run matches the eager one."""
    fn(*case.sets[0])  # one warm-up call, not one per set: the SIMT calls are slow
    graph, outs = capture(lambda: [fn(*args)[0] for args in case.sets], warmup=0)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    reps = 100 if start.elapsed_time(end) < 2.0 else 20  # keep the slow SIMT runs short
    us = median_time_us(graph.replay, [()], warmup=3, reps=reps) / len(case.sets)
    first = outs[0].clone()
    del graph, outs
    return us, first


VARIANTS = {
    "simt": smt.sparse_mla_decode_simt,
    "head_batched": smt.sparse_mla_decode_head_batched,
    "split_k": smt.sparse_mla_decode_split_k,
    "auto": sparse_mla_decode_cuda,  # what the op runs on CUDA
}
WGMMA = "wgmma"  # the Gluon kernel at its own split rule at every batch (Hopper only)
PDL = "split_k_pdl"  # split-K with the combine as a programmatic dependent (Hopper+), not in 'best other'


def wgmma_call(*args):
    from kernels.sparse_mla.gluon import sparse_mla_decode_wgmma

    return sparse_mla_decode_wgmma(*args)


def pickable(name: str) -> bool:
    """Whether auto could have picked this variant ('best other' compares against these)."""
    return name in VARIANTS or name == WGMMA


def default_plan_name(batch: int, topk: int, num_sms: int, capability) -> str:
    splits = plan.wgmma_splits(batch, HEADS, topk, num_sms, DIM, 2, capability)
    if splits is not None:
        return f"wgmma {HEADS}x{plan.WGMMA_BLOCK_N} s{plan.WGMMA_STAGES}, S={splits}"
    tiles, splits = plan.choose_plan(batch, HEADS, topk, num_sms)
    return f"{tile_name(tiles)}, S={splits}"


def split_k_pdl(*args):
    return smt.sparse_mla_decode_split_k(*args, pdl=True)


def plan_call(tiles: plan.TileConfig, splits: int, pdl: bool = False, overlap_launch: bool = False):
    """A call running this plan as the default path does: the head-batched kernel alone at one
    split, split-K with the combine at more (the combine, and with overlap_launch the split kernel
    too, launched with PDL if asked)."""
    if splits == 1:
        return lambda *a: smt.sparse_mla_decode_head_batched(*a, tiles=tiles)
    return lambda *a: smt.sparse_mla_decode_split_k(
        *a, num_splits=splits, tiles=tiles, pdl=pdl, overlap_launch=overlap_launch
    )


def checked_time_us(name: str, fn, case: Case) -> float:
    """Check fn against the reference, then time it; its graph replay must reproduce the eager
    output bit for bit."""
    eager = check_against_reference(name, fn, case)
    us, captured = time_per_call_us(fn, case)
    if not torch.equal(captured, eager):
        raise AssertionError(f"sparse_mla {name} at B={case.batch}, K={case.topk}: graph replay differs from eager")
    return us


def run_main_table(copy_gbs: float, l2_bytes: int, num_sms: int):
    rows, results = [], {}
    pdl_supported = launches_dependents(torch.device("cuda"))
    capability = plan.device_capability(torch.device("cuda"))
    for topk in TOPKS:
        for batch in BATCHES:
            case = Case(batch, topk, l2_bytes, seed=batch * 10 + topk)
            times = {name: checked_time_us(name, fn, case) for name, fn in VARIANTS.items()}
            if capability[0] == 9:
                times[WGMMA] = checked_time_us(WGMMA, wgmma_call, case)
            if pdl_supported:
                times[PDL] = checked_time_us(PDL, split_k_pdl, case)
            gbs = case.bytes_per_call / (times["auto"] * 1e-6) / 1e9
            best_other = min(t for name, t in times.items() if pickable(name) and name != "auto")
            results[(batch, topk)] = dict(times=times, gbs=gbs)
            rows.append([
                batch, topk,
                f"{times['simt']:.1f}", f"{times['head_batched']:.1f}", f"{times['split_k']:.1f}",
                f"{times[WGMMA]:.1f}" if WGMMA in times else "n/a",
                f"{times['auto']:.1f}", default_plan_name(batch, topk, num_sms, capability),
                f"{gbs:.0f}", f"{100 * gbs / copy_gbs:.0f}%",
                f"{times['simt'] / times['head_batched']:.1f}x",
                f"{times['head_batched'] / times['split_k']:.2f}x",
                f"{best_other / times['auto']:.2f}",
                f"{times[PDL]:.1f} ({times['split_k'] / times[PDL]:.2f}x)" if PDL in times else "n/a",
            ])
            print(f"sparse_mla B={batch} K={topk}: " + ", ".join(f"{k} {v:.1f} us" for k, v in times.items()), flush=True)
            del case
    header = [
        "B", "K", "SIMT us", "head-batched us", "split-K us", "wgmma us", "auto us",
        "auto's plan (tiles, splits)", "auto GB/s", "% of copy", "HB vs SIMT", "split-K vs HB",
        "best other / auto", "split-K PDL us (vs split-K)",
    ]
    return markdown_table(header, rows), results


def acceptance(results: dict) -> str:
    def verdict(ok: bool) -> str:
        return "PASS" if ok else "FAIL"

    lines = []
    t = results[(64, 640)]["times"]
    ratio = t["simt"] / t["head_batched"]
    lines.append(f"- head-batched vs SIMT at B=64, K=640: {ratio:.1f}x (target >= 6x): {verdict(ratio >= 6)}")
    t = results[(1, 640)]["times"]
    ratio = t["head_batched"] / t["auto"]
    ok = ratio >= 4 and t["auto"] < t["simt"] and t["auto"] <= 10
    lines.append(
        f"- auto at B=1, K=640: {t['auto']:.1f} us, {ratio:.1f}x faster than head-batched, "
        f"{t['simt'] / t['auto']:.1f}x faster than SIMT (targets >= 4x, > 1x, <= 10 us): {verdict(ok)}"
    )
    gbs = results[(128, 2048)]["gbs"]
    lines.append(f"- auto at B=128, K=2048: {gbs / 1e3:.2f} TB/s effective (target >= 3.0): {verdict(gbs >= 3000)}")
    worst = max(
        (
            (r["times"]["auto"] / min(v for k, v in r["times"].items() if pickable(k) and k != "auto"), shape)
            for shape, r in results.items()
        )
    )
    lines.append(
        f"- auto vs the fastest other variant, worst case B={worst[1][0]}, K={worst[1][1]}: "
        f"{worst[0]:.2f}x its time (target <= 1.10): {verdict(worst[0] <= 1.10)}"
    )
    return "\n".join(lines)


def run_split_sweep(l2_bytes: int, num_sms: int) -> str:
    """Default tiles at every split count: where the split model is off, this shows by how much."""
    counts = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)
    rows = []
    shapes = [(b, k) for k in TOPKS for b in BATCHES] + [(b, k) for k in SHORT_TOPKS for b in SHORT_BATCHES]
    for batch, topk in shapes:
        case = Case(batch, topk, l2_bytes, seed=1 + batch)
        tiles = plan.choose_tiles(batch, HEADS, topk, num_sms)
        chosen = plan.choose_num_splits(batch, HEADS, topk, num_sms)
        n_blocks = -(-topk // tiles.block_k)
        cells = []
        for splits in counts:
            if splits > n_blocks:
                cells.append("")
                continue
            us, _ = time_per_call_us(plan_call(tiles, splits), case)
            cells.append(f"**{us:.1f}**" if splits == chosen else f"{us:.1f}")
        rows.append([batch, topk, tile_name(tiles)] + cells)
        del case
    header = ["B", "K", "tile"] + [f"S={s}" for s in counts]
    return markdown_table(header, rows)


def run_tile_sweep(l2_bytes: int, num_sms: int) -> str:
    """Head-batched (one split) and split-K (default split count) at other tile shapes."""
    shapes = ((64, 640, 1), (128, 2048, 1), (1, 640, None), (16, 2048, None))
    rows = []
    for batch, topk, fixed_splits in shapes:
        case = Case(batch, topk, l2_bytes, seed=2 + batch)
        cells = []
        for tiles in TILE_SWEEP:
            if fixed_splits == 1:
                fn = plan_call(tiles, 1)
            else:
                splits = plan.choose_num_splits(batch, HEADS, topk, num_sms, tiles=tiles)
                fn = lambda *a, t=tiles, s=splits: smt.sparse_mla_decode_split_k(*a, num_splits=s, tiles=t)  # noqa: E731
            try:
                check_against_reference(f"tiles {tiles}", fn, case)
                us, _ = time_per_call_us(fn, case)
                cells.append(f"{us:.1f}")
            except AssertionError:
                raise
            except Exception as err:  # e.g. a tile that needs more shared memory than the SM has
                cells.append(type(err).__name__)
        rows.append([batch, topk, "head-batched" if fixed_splits == 1 else "split-K"] + cells)
        del case
    header = ["B", "K", "path"] + [tile_name(t) for t in TILE_SWEEP]
    return markdown_table(header, rows)


# The model's index lists (window 128; ratio-128 layers 160 at 4K context; ratio-4 layers 640)
# and the long list, at the batches where the candidates' ranking changes.
PLAN_SHAPES = ((1, 128), (8, 128), (16, 128), (32, 128), (1, 160), (8, 160), (16, 160), (32, 160),
               (1, 640), (2, 640), (4, 640), (8, 640), (64, 640), (128, 640),
               (1, 2048), (2, 2048), (16, 2048), (32, 2048), (64, 2048), (128, 2048))


def run_plan_sweep(l2_bytes: int, num_sms: int) -> str:
    """The default plan's candidates side by side: each candidate tile at the split count the cost
    model ranks best for it (the combine launched with PDL where the GPU has it), with the model's
    estimate next to the measured time. Bold: the default plan."""
    pdl = launches_dependents(torch.device("cuda"))
    rows = []
    for batch, topk in PLAN_SHAPES:
        case = Case(batch, topk, l2_bytes, seed=5 + batch)
        chosen = plan.choose_plan(batch, HEADS, topk, num_sms)
        for tiles in plan.candidate_tiles(HEADS, DIM, 2):
            splits = plan.choose_num_splits(batch, HEADS, topk, num_sms, tiles=tiles)
            fn = plan_call(tiles, splits, pdl)
            check_against_reference(f"plan candidate {tiles}", fn, case)
            us, _ = time_per_call_us(fn, case)
            estimate = plan.estimated_us(batch, HEADS, topk, DIM, 2, num_sms, tiles, splits)
            bold = "**" if (tiles, splits) == chosen else ""
            rows.append([batch, topk, f"{bold}{tile_name(tiles)}, S={splits}{bold}", f"{us:.1f}", f"{estimate:.1f}"])
        del case
    return markdown_table(["B", "K", "candidate (tiles, splits)", "measured us", "model us"], rows)


def run_overlap_check(l2_bytes: int, num_sms: int) -> str:
    """The default plan (the combine and the split kernel both launched with PDL) against the same
    plan whose split kernel waits for the kernel before it to finish before it launches: in the
    graph of back-to-back calls that kernel is the previous call's combine."""
    rows = []
    for batch, topk in PLAN_SHAPES:
        tiles, splits = plan.choose_plan(batch, HEADS, topk, num_sms)
        if splits == 1:
            continue
        case = Case(batch, topk, l2_bytes, seed=7 + batch)
        timed = []
        for overlap in (False, True):
            fn = plan_call(tiles, splits, pdl=True, overlap_launch=overlap)
            timed.append(checked_time_us(f"overlap_launch={overlap}", fn, case))
        rows.append([batch, topk, f"{tile_name(tiles)}, S={splits}", f"{timed[0]:.1f}", f"{timed[1]:.1f}", f"{timed[0] / timed[1]:.2f}x"])
        del case
    return markdown_table(["B", "K", "default plan", "us, split kernel after its predecessor", "us, overlapping (default)", "speed-up"], rows)


STAGE_ROUNDS = 5  # interleaved rounds of the stage check: its differences are a few percent


def run_stage_check(l2_bytes: int, num_sms: int) -> str:
    """The default plan against the same tiles and split count with the other pipeline depth (one
    stage where the plan pipelines, two where it does not), interleaved rounds, median."""
    rows = []
    for batch, topk in PLAN_SHAPES:
        tiles, splits = plan.choose_plan(batch, HEADS, topk, num_sms)
        if splits == 1:
            continue
        other = replace(tiles, num_stages=2 if tiles.num_stages == 1 else 1)
        case = Case(batch, topk, l2_bytes, seed=11 + batch)
        calls = {"auto": sparse_mla_decode_cuda, "other": plan_call(other, splits, pdl=True, overlap_launch=True)}
        for name, fn in calls.items():
            check_against_reference(name, fn, case)
        times = {name: [] for name in calls}
        for round_ in range(STAGE_ROUNDS):
            for name, fn in calls.items() if round_ % 2 == 0 else reversed(calls.items()):
                times[name].append(time_per_call_us(fn, case)[0])
        default_us, other_us = (statistics.median(times[name]) for name in calls)
        rows.append([
            batch, topk, f"{tile_name(tiles)}, S={splits}", plan.blocks_per_split(topk, tiles.block_k, splits), f"{default_us:.2f}",
            f"{tile_name(other)}: {other_us:.2f}", f"{other_us / default_us:.2f}x",
        ])
        del case
    return markdown_table(
        ["B", "K", "default plan", "blocks per split", "auto us", "other depth us", "other / auto"], rows
    )


PARTS = ("main", "split", "tiles", "plan", "overlap", "stages")  # the main table with its acceptance, then the sweeps


def run(copy_gbs: float, parts: tuple[str, ...] = PARTS) -> str:
    """The section's markdown; `parts` picks tables."""
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        raise ValueError(f"unknown parts {unknown}; choose from {list(PARTS)}")
    props = torch.cuda.get_device_properties(0)
    l2_bytes = getattr(props, "L2_cache_size", 50 << 20)
    num_sms = props.multi_processor_count
    out = ["## Sparse MLA decode"]
    if "main" in parts:
        table, results = run_main_table(copy_gbs, l2_bytes, num_sms)
        out += [
            f"H={HEADS}, D={DIM}, bf16; cache slots of {WINDOW}+{COMPRESSED} rows; 10% of indices -1. Times are device "
            "time per call (CUDA graph over rotating inputs > 4x L2). Effective GB/s = (distinct valid KV rows + q + out) "
            "bytes / time. Variants: SIMT = one program per (sequence, head); head-batched = blocks of 64 heads (two "
            "programs per block, one per half of the output columns), no split; split-K = default tiles and split "
            "count, always with the combine; auto = the op's CUDA path (head-batched alone when the plan has one "
            "split; on Hopper the split kernel and the combine launched with PDL; on Hopper from 16 64-head blocks up the Gluon wgmma kernel); wgmma = the Gluon kernel (64 heads x 64 rows, two cp.async stages) at its split rule at every batch. Tiles: heads x rows per "
            "program, warps, pipeline stages, dv2 = output columns split in two programs. 'best other / auto' "
            "< 0.91 means auto is over 10% slower than some variant it could have picked. Split-K PDL = "
            "split-K with its combine launched as a programmatic dependent of the split kernel (opt-in, Hopper "
            "and later), against plain split-K at the same tiles and split count.",
            table,
            "### Acceptance",
            acceptance(results),
        ]
    if "split" in parts:
        out += [
            "### Split count sweep (default tiles; bold = the default's choice; S=1 runs without the combine)",
            run_split_sweep(l2_bytes, num_sms),
        ]
    if "tiles" in parts:
        out += [
            "### Tile sweep (head-batched with one split, split-K with each tile's default split count)",
            run_tile_sweep(l2_bytes, num_sms),
        ]
    if "plan" in parts:
        out += [
            "### The default plan's candidates (each at its best split count by the cost model; bold = the default)",
            run_plan_sweep(l2_bytes, num_sms),
        ]
    if "overlap" in parts:
        out += [
            "### The split kernel launched as a programmatic dependent of the kernel before it (`overlap_launch`, the default on Hopper)",
            run_overlap_check(l2_bytes, num_sms),
        ]
    if "stages" in parts:
        out += [
            "### Pipeline depth of the default plan's splits (the other depth at the same tiles and split count)",
            run_stage_check(l2_bytes, num_sms),
        ]
    return "\n\n".join(out)
