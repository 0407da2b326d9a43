"""How the CUDA path of sparse MLA decode is launched (kernels/sparse_mla/op.py): which
kernel (the Gluon wgmma kernel on Hopper at large batches, else the Triton head-batched one), its
tiles, the split count, and the split-K scratch a CUDA-graph caller preallocates. Every choice is
a pure function of the shapes and the SM count, so one capture per batch bucket stays valid: the
plan ranks a few candidate tiles and every split count with a cost model fitted to timings of them.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import triton

from kernels.triton_util import interpreting
from kernels.triton_util import num_sms as device_sm_count

# The combine holds every split's partial of a column chunk at once (4096 values per program):
# up to 64 splits its chunks stay at least 64 columns wide.
MAX_SPLITS = 64


@dataclass(frozen=True)
class TileConfig:
    """Launch shape of the head-batched kernel: heads and gathered rows per program, warps,
    pipeline depth, and into how many programs (1 or 2) the output columns are split."""

    block_h: int
    block_k: int
    num_warps: int
    num_stages: int
    dv_split: int = 1


def _block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def _tiles_for(block_h: int, head_dim: int, itemsize: int) -> TileConfig:
    """Tiles for a head block. The [block_h, head_dim] fp32 accumulator lives in registers:
    - up to 32 x 512 elements: one program, 8 warps (64 per thread) or 4 for smaller ones;
    - 64 x 512 (V4 at full occupancy): two programs each own 256 output columns (DV split) with a
      single warpgroup, so both products run as M=64 wgmma without duplicating Q K^T across
      warpgroups.
    fp32 inputs (a checking mode) use smaller tiles so Q and two KV stages fit in shared memory."""
    block_k = 32
    if itemsize > 2:
        block_h, block_k = min(block_h, 32), 16
    acc = block_h * _block_d(head_dim)
    if acc > 32 * 512:
        # 64 gathered rows per step, two stages: the fastest of the 64-head tiles.
        return TileConfig(block_h, 64, num_warps=4, num_stages=2, dv_split=2)
    return TileConfig(block_h, block_k, num_warps=8 if acc == 32 * 512 else 4, num_stages=2)


def head_batched_tiles(heads: int, head_dim: int = 512, itemsize: int = 2) -> TileConfig:
    """Tiles of the head-batched kernel at full occupancy: up to 64 heads per program, so each
    gathered row is read from HBM once per sequence and the M=64 products can use Hopper's wgmma."""
    return _tiles_for(min(64, max(16, triton.next_power_of_2(heads))), head_dim, itemsize)


def candidate_tiles(heads: int, head_dim: int, itemsize: int) -> list[TileConfig]:
    """The tiles the default plan chooses among: the full head block (for 64 heads: one
    warpgroup per half of the output columns), for 64 heads also whole rows on two warpgroups
    (no second gather of each row, no duplicated Q K^T; fastest when its programs alone fill the
    SMs), and 16-head blocks of 32 or 64 gathered rows (more,
    shorter programs at batch 1-8; 64 rows halve the split count, so the fp32 partials, where
    the index list is long)."""
    full = head_batched_tiles(heads, head_dim, itemsize)
    tiles = [full]
    if full.dv_split == 2:
        tiles.append(TileConfig(full.block_h, full.block_k, num_warps=8, num_stages=full.num_stages))
    if full.block_h > 16:
        small = _tiles_for(16, head_dim, itemsize)
        tiles.append(small)
        if itemsize <= 2:  # fp32 tiles stay small to fit shared memory (_tiles_for)
            tiles.append(replace(small, block_k=64))
    return tiles


# Rough costs on an H100/H200-class GPU, fitted to timings of the candidate tiles and used only to
# rank plans against each other. At decode sizes a program is latency-bound: after the first KV
# block each one waits for its indices and then the rows they name, which hides one warpgroup's
# products (0 below).
_ITER_US = 0.98  # each KV block after a program's first: index load, then the dependent gather
_ROW_US = 0.0334  # per gathered row of every block, the first included (whole 1 KB rows)
_PRODUCT_US = {4: 0.0, 8: 1.62}  # per 64 heads x 64 rows of Q K^T + P V, by warps per program
_PROGRAM_US = 4.03  # a program's fixed cost: launch share, the first block's wait
_PROGRAM_US_PER_KB = 0.0087  # its Q tile in and its output tile out
_COMBINE_US = 0.13  # the combine kernel, beyond what the programs' fixed cost covers
_PARTIAL_BYTES_PER_US = 1.33e6  # fp32 partials: written by the splits, read by the combine
_BYTES_PER_US = 4.0e6  # HBM bandwidth, 4 TB/s: a floor for the KV traffic
_SMEM_BYTES = 228 * 1024  # shared memory per SM (sm_90)


def _programs_per_sm(tiles: TileConfig, head_dim: int, itemsize: int) -> int:
    """How many programs of these tiles share an SM, by shared memory: the Q tile plus the
    pipelined KV tiles (whole rows: a DV-split program loads both halves for Q K^T)."""
    width = _block_d(head_dim) * itemsize
    smem = tiles.block_h * width + tiles.num_stages * tiles.block_k * width
    return max(1, _SMEM_BYTES // smem)


def blocks_per_split(topk: int, block_k: int, splits: int) -> int:
    """Whole KV blocks each split covers (at least one; with more splits than blocks the trailing
    splits are empty)."""
    return triton.cdiv(triton.cdiv(max(topk, 1), block_k), splits)


def estimated_us(batch, heads, topk, head_dim, itemsize, num_sms, tiles: TileConfig, splits: int) -> float:
    """Waves of programs x per-program latency, bounded below by HBM traffic; splitting adds the
    fp32 partials and the combine."""
    split_blocks = blocks_per_split(topk, tiles.block_k, splits)
    head_blocks = triton.cdiv(heads, tiles.block_h)
    programs = batch * head_blocks * tiles.dv_split * splits
    waves = triton.cdiv(programs, num_sms * _programs_per_sm(tiles, head_dim, itemsize))
    # A DV-split program does all of Q K^T but half of P V.
    products = tiles.block_k * tiles.block_h / 64**2 * (0.5 + 0.5 / tiles.dv_split)
    rows_us = tiles.block_k * _ROW_US
    block_us = _ITER_US + rows_us + products * _PRODUCT_US.get(tiles.num_warps, _PRODUCT_US[8])
    out_bytes = tiles.block_h * head_dim // tiles.dv_split * (4 if splits > 1 else itemsize)
    program_us = _PROGRAM_US + rows_us + (tiles.block_h * head_dim * itemsize + out_bytes) / 1024 * _PROGRAM_US_PER_KB
    compute = waves * (program_us + (split_blocks - 1) * block_us)
    time = max(compute, batch * topk * head_dim * itemsize / _BYTES_PER_US)
    if splits > 1:
        partial_bytes = batch * head_blocks * splits * tiles.block_h * (head_dim + 1) * 4
        time += _COMBINE_US + partial_bytes / _PARTIAL_BYTES_PER_US
    return time


def _split_candidates(batch: int, heads: int, topk: int, num_sms: int, tiles: TileConfig) -> list[int]:
    """Split counts worth ranking for these tiles: only 1 when batch x head blocks already fills
    the SMs (partials would only add traffic) or the index list is one block; otherwise every
    distinct count of whole KV blocks per split up to MAX_SPLITS (none leaves a split empty)."""
    n_blocks = triton.cdiv(max(topk, 1), tiles.block_k)
    if batch * triton.cdiv(heads, tiles.block_h) * tiles.dv_split >= num_sms or n_blocks == 1:
        return [1]
    return sorted({triton.cdiv(n_blocks, triton.cdiv(n_blocks, s)) for s in range(1, min(n_blocks, MAX_SPLITS) + 1)})


# Candidate tiles that run a split of a single KV block faster without software pipelining
# (num_stages=1): with one block there is nothing to overlap. 16x64 tiles and splits of two or
# more blocks keep two stages (`--sparse-mla-parts stages` of the benchmark checks it).
_SINGLE_BLOCK_UNPIPELINED = (TileConfig(16, 32, 4, 2), TileConfig(64, 64, 4, 2, dv_split=2))


def _staged(tiles: TileConfig, topk: int, splits: int) -> TileConfig:
    """The plan's tiles with one pipeline stage where each split is one block of such tiles."""
    if splits > 1 and blocks_per_split(topk, tiles.block_k, splits) == 1 and tiles in _SINGLE_BLOCK_UNPIPELINED:
        return replace(tiles, num_stages=1)
    return tiles


@functools.lru_cache(maxsize=None)
def choose_plan(
    batch: int, heads: int, topk: int, num_sms: int, head_dim: int = 512, itemsize: int = 2
) -> tuple[TileConfig, int]:
    """Tiles and split count of the default path: a pure function of the shapes and the SM count
    (CUDA-graph safe), the pair with the lowest estimated time (splits of one block of some tiles
    then without pipelining, _SINGLE_BLOCK_UNPIPELINED). Memoised: ranking every candidate
    costs Python time that eager calls would otherwise pay per layer."""
    shape = (batch, heads, topk, num_sms, head_dim, itemsize)
    plans = [(tiles, _best_splits(*shape, tiles)) for tiles in candidate_tiles(heads, head_dim, itemsize)]
    # min keeps the first of equal estimates: the candidates' order breaks ties, as _best_splits
    # breaks them towards fewer splits.
    tiles, splits = min(plans, key=lambda plan: estimated_us(batch, heads, topk, head_dim, itemsize, num_sms, *plan))
    return _staged(tiles, topk, splits), splits


def choose_tiles(batch: int, heads: int, topk: int, num_sms: int, head_dim: int = 512, itemsize: int = 2) -> TileConfig:
    """The default plan's tiles (choose_plan)."""
    return choose_plan(batch, heads, topk, num_sms, head_dim, itemsize)[0]


def choose_num_splits(
    batch: int,
    heads: int,
    topk: int,
    num_sms: int,
    head_dim: int = 512,
    itemsize: int = 2,
    tiles: TileConfig | None = None,
) -> int:
    """The default plan's split count, or with `tiles` given the best split count for those tiles."""
    if tiles is None:
        return choose_plan(batch, heads, topk, num_sms, head_dim, itemsize)[1]
    return _best_splits(batch, heads, topk, num_sms, head_dim, itemsize, tiles)


@functools.lru_cache(maxsize=None)
def _best_splits(batch, heads, topk, num_sms, head_dim, itemsize, tiles: TileConfig) -> int:
    costs = [
        (estimated_us(batch, heads, topk, head_dim, itemsize, num_sms, tiles, splits), splits)
        for splits in _split_candidates(batch, heads, topk, num_sms, tiles)
    ]
    return min(costs)[1]


# The Gluon kernel (kernels/sparse_mla/gluon.py), at its tile: 64 heads x 64 gathered rows per
# step, two shared-memory stages. It beats the Triton plans once the 64-head blocks alone nearly
# fill the GPU and the index lists are long; on short lists (the window-only and ratio-128
# layers' 128-160 indices) its fixed cost per program spreads over too few blocks.
WGMMA_BLOCK_N = 64
WGMMA_STAGES = 2
WGMMA_MIN_HEAD_BLOCKS = 16
WGMMA_MIN_TOPK = 512
WGMMA_HEAD_DIMS = (128, 256, 512)


def wgmma_splits(
    batch: int, heads: int, topk: int, num_sms: int, head_dim: int, itemsize: int, capability: tuple[int, int] | None,
    min_head_blocks: int = WGMMA_MIN_HEAD_BLOCKS, min_topk: int = WGMMA_MIN_TOPK,
) -> int | None:
    """The split count when the default path runs the Gluon wgmma kernel, None when it runs a
    Triton plan: a compute capability 9.x GPU (warpgroup MMA), 16-bit activations, whole 64-head
    blocks, at least `min_head_blocks` of them over the batch and `min_topk` indices. Splits fill
    the SMs once (one program each: its shared memory takes the SM) and never outnumber the index
    blocks. A pure function of the shapes, so CUDA-graph safe."""
    if capability is None or capability[0] != 9 or itemsize != 2:
        return None
    if heads % 64 or head_dim not in WGMMA_HEAD_DIMS:
        return None
    head_blocks = batch * (heads // 64)
    if head_blocks == 0 or head_blocks < min_head_blocks or topk < min_topk:
        return None
    return max(1, min(num_sms // head_blocks, -(-topk // WGMMA_BLOCK_N), MAX_SPLITS))


def device_capability(device: torch.device) -> tuple[int, int] | None:
    """The GPU's compute capability, None where kernels do not run on one (CPU, interpreter)."""
    if device.type != "cuda" or interpreting():
        return None
    return torch.cuda.get_device_capability(device)


def workspace_numel(batch: int, heads: int, head_dim: int, num_splits: int) -> int:
    """fp32 elements of split-K scratch: partial outputs [B, S, H, D] then partial LSEs [B, S, H]."""
    return batch * num_splits * heads * (head_dim + 1)


def sparse_mla_workspace(
    batch: int, heads: int, head_dim: int, topk: int, device, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """Scratch for the default path at these shapes (activation dtype `dtype`), to allocate before
    a CUDA-graph capture and pass as `workspace`. May be empty when one split suffices."""
    device = torch.device(device)
    itemsize = dtype.itemsize
    num_sms = device_sm_count(device)
    splits = choose_num_splits(batch, heads, topk, num_sms, head_dim, itemsize)
    # Room for the wgmma kernel's splits too: the default path takes it at these shapes unless q
    # or the cache has a strided last dimension.
    wgmma = wgmma_splits(batch, heads, topk, num_sms, head_dim, itemsize, device_capability(device))
    splits = max(splits, wgmma or 1)
    numel = workspace_numel(batch, heads, head_dim, splits) if splits > 1 else 0
    return torch.empty(numel, dtype=torch.float32, device=device)
