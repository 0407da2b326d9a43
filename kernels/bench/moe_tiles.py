"""GPU sweep of the FP4 experts' Gluon product tiles (kernels/moe/scaled_gluon.py): pipeline
stages of one or two 128-input blocks (`ScaledTiles.num_stages`, `blocks_per_stage`) against the
gate/up K split (`up_split`), on mma.sync and, on Hopper, with two blocks a stage also on the
warpgroup instruction (`product` "wgmma", with four and five programs an SM: `programs_per_sm`),
at batches 1, 4, 16 and 64 (256 experts, top-6),
beside the tiles `choose_mma_tiles` picks. Every variant is checked
against the reference first (one that fails to compile or to match is listed, not timed); times
as in kernels/bench/moe.py (one CUDA graph per routing set, sets rotated). What the defaults
should become is read off this table."""
from __future__ import annotations

import dataclasses
import itertools

from kernels.bench.moe import (
    DIM, INTER, LIMIT, check, distinct_experts, fp4_expert_bytes, make_scaled_experts, op_mma_tiles, scaled_routing_sets,
)
from kernels.bench.tables import markdown_table
from kernels.bench.timing import graph_time_us
from kernels.moe import moe_experts
from kernels.moe.scaled import ScaledTiles

BATCHES = (1, 4, 16, 64)
# (blocks a stage, stages): one block: ten stages take more registers than four programs an SM
# leave; two blocks: five take more shared memory than four programs an SM.
STAGES = ((1, 4), (1, 6), (1, 8), (2, 2), (2, 3), (2, 4))
SPLITS = (1, 2, 4)
WGMMA_PROGRAMS_PER_SM = (4, 5)  # the warpgroup product's registers leave room for a fifth program
SHOWN = 3  # best variants listed per batch


def run(copy_gbs: float) -> str:
    from kernels.moe.scaled_gluon import moe_experts_scaled_mma, runs_wgmma  # Gluon: imported where a GPU runs it

    (w1, w2, w3, scales), _, _ = make_scaled_experts(dense_too=False)
    rows, failed = [], []
    for batch in BATCHES:
        sets = scaled_routing_sets(batch)
        expected = moe_experts(*sets[0], w1, w2, w3, LIMIT, impl="reference", scales=scales)
        experts = sum(distinct_experts(ids) for _, ids, _ in sets) / len(sets)
        nbytes = experts * fp4_expert_bytes() + batch * DIM * (2 + 4)
        chosen = op_mma_tiles(sets[0][1], w1.shape[0])
        timed = []
        for name, tiles in candidate_tiles(chosen, runs_wgmma(w1.device)).items():
            path = lambda x, ids, weights, tiles=tiles: moe_experts_scaled_mma(  # noqa: E731
                x, ids, weights, w1, w2, w3, scales, LIMIT, tiles=tiles)
            try:
                check(path, sets[0], expected, f"tiles B={batch} {name}")
                timed.append((graph_time_us(path, sets), name))
            except Exception as error:  # noqa: BLE001 - listed below, the sweep goes on
                failed.append(f"B={batch} {name}: {type(error).__name__}: {str(error).splitlines()[0][:120]}")
        share = lambda us: f"{us:.1f} ({100 * nbytes / us / 1e3 / copy_gbs:.0f}%)"  # noqa: E731
        default = next((us for us, name in timed if name == describe(chosen)), float("nan"))
        timed.sort()
        rows.append([batch, f"{experts:.1f}", describe(chosen), share(default)]
                    + [f"{name}: {share(us)}" for us, name in timed[:SHOWN]])
        print(f"moe tiles B={batch}: default {default:.1f} us, best {timed[0] if timed else '-'}", flush=True)
    header = ["B", "experts read", "default tiles", "default graph us (% copy)"] + [
        f"best {i + 1}: graph us (% copy)" for i in range(SHOWN)]
    text = (
        "## FP4 experts' Gluon product: pipeline stages and gate/up K split swept\n\n"
        f"256 FP4 experts, top-6, D={DIM}, I={INTER}. Tiles: shared-memory stages of both products (each one or two "
        "128-input blocks), the gate/up K split. Bytes as in the routed-experts table; each variant matched the reference first.\n\n"
        + markdown_table(header, rows) + "\n"
    )
    if failed:
        text += "\nVariants that did not compile or match:\n\n" + "\n".join(f"- {line}" for line in failed) + "\n"
    return text


def candidate_tiles(chosen: ScaledTiles, wgmma: bool) -> dict[str, ScaledTiles]:
    """The chosen tiles first, then every STAGES x SPLITS variant of them the widths allow, by
    name; with `wgmma` each two-block variant also on the warpgroup instruction."""
    from kernels.moe.scaled_gluon import wide_stages_fit

    variants = {describe(chosen): chosen}
    for (blocks, stages), split in itertools.product(STAGES, SPLITS):
        if blocks == 1 or wide_stages_fit(DIM, INTER, split):
            tiles = dataclasses.replace(chosen, blocks_per_stage=blocks, num_stages=stages, up_split=split)
            variants.setdefault(describe(tiles), tiles)
            for programs in WGMMA_PROGRAMS_PER_SM if wgmma and blocks == 2 else ():
                on_wgmma = dataclasses.replace(tiles, product="wgmma", programs_per_sm=programs)
                variants.setdefault(describe(on_wgmma), on_wgmma)
    return variants


def describe(tiles: ScaledTiles) -> str:
    on = f", wgmma, {tiles.programs_per_sm} programs an SM" if tiles.product == "wgmma" else ""
    return f"{tiles.num_stages} stages of {tiles.blocks_per_stage} blocks, split {tiles.up_split}{on}"
