"""Triton routed experts (semantics: kernels/moe/ref.py): a grouped GEMM over the (token, expert)
pairs of the batch, CUDA-graph safe (no host sync, no data-dependent shape).

Pipeline, all on the device:

1. Route: sort the P = B*k pairs (B*(k+1) with a shared expert: every token's last pair) by
   expert and lay them out in blocks of `block_m` rows, each expert's pairs padded to a whole
   number of blocks. Buffers have the static bound P + min(E, P)*(block_m - 1) rows. Per block: its expert (-1 for unused blocks) and its
   count of real rows. One single-program Triton kernel for decode-sized batches (a sort of the
   pair keys plus a histogram); torch ops (argsort, cumsum, searchsorted) for large ones.
2. Gate/up: per (block, N tile of the intermediate), g = x w1^T and u = x w3^T in one K loop,
   both rounded to the activation dtype, clamped, h = silu(g) * u * routing weight, rounded.
3. Down: per (block, N tile of the model width), y = h w2^T rounded to the activation dtype,
   stored per pair.
4. Combine: out[b] = sum over the k picks of y in fp32, in pick order (deterministic).

A program whose block has no expert returns before loading any weight, so a batch reads only
the experts it selected (at B=1, six). Tiles are chosen from the static shapes and the SM count
(`choose_tiles`): small token counts per expert make the products GEMV-like, so N is split
finely enough to give every SM several programs.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.dependent_launch import dependent_options, wait_for_predecessor
from kernels.moe.ref import check_shared_expert, with_shared_ids
from kernels.triton_util import SM90_SHARED_MEMORY_PER_BLOCK, dot_precision, num_sms, shared_memory_per_block

# Largest B*k routed by the single-program kernel (it holds every pair in registers).
MAX_PAIRS_ONE_PROGRAM = 4096
PROGRAMS_PER_SM = 4
# Shared memory per pipeline stage that still lets two programs share an SM at 4 stages.
STAGE_BYTES = 24 * 1024
# The gate/up product streams two weight strips per program, so it takes strips twice as wide as
# the rule above (two programs per SM, 40 KB stages: 160 KB at 4 stages) where they fit; GPUs with
# less shared memory per program keep the rule above.
UP_PROGRAMS_PER_SM = 2
UP_STAGE_BYTES = 40 * 1024


@dataclass(frozen=True)
class MoeTiles:
    """Launch shape: rows (pairs) per block, N and K tiles of the gate/up and down products."""

    block_m: int
    up_block_n: int
    up_block_k: int
    down_block_n: int
    down_block_k: int
    num_warps: int = 4
    num_stages: int = 4


@dataclass(frozen=True)
class PairBlocks:
    """Pairs grouped by expert in blocks of block_m rows (see the module docstring).

    sorted_pair [num_blocks*block_m] int32: flat pair index (token*k + pick) of each row; rows
    past a block's count are padding and are never read. block_expert [num_blocks] int32:
    expert of each block, -1 for unused blocks. block_rows [num_blocks] int32: real rows."""

    sorted_pair: torch.Tensor
    block_expert: torch.Tensor
    block_rows: torch.Tensor
    block_m: int

    @property
    def num_blocks(self) -> int:
        return self.block_expert.shape[0]


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Static bound on the blocks: each expert with pairs wastes at most block_m - 1 rows."""
    return (num_pairs + min(num_experts, num_pairs) * (block_m - 1)) // block_m


def _pow2_at_least(n: int, floor: int) -> int:
    return max(floor, triton.next_power_of_2(max(1, n)))


def _widest_tile(n: int, active_experts: int, num_sms: int, choices: tuple[int, ...], per_sm: int) -> int:
    """The widest N tile that still gives every SM per_sm programs, else the narrowest."""
    for block_n in choices:
        if active_experts * triton.cdiv(n, block_n) >= per_sm * num_sms:
            return block_n
    return choices[-1]


def _deepest_k(rows: int, elem_bytes: int, k: int, stage_bytes: int) -> int:
    for block_k in (256, 128, 64, 32):
        if rows * block_k * elem_bytes <= stage_bytes and block_k <= max(32, triton.next_power_of_2(k)):
            return block_k
    return 16


@functools.lru_cache(maxsize=None)
def choose_tiles(
    num_pairs: int, num_experts: int, dim: int, inter: int, elem_bytes: int, num_sms: int,
    shared_memory: int = SM90_SHARED_MEMORY_PER_BLOCK,
) -> MoeTiles:
    """Tiles from static shapes: block_m fits the expected pairs per expert (16..64), the N tiles
    are as wide as the SM count allows, the K tiles as deep as the per-stage budget allows.
    shared_memory: bytes one program may use, which decides whether the wide gate/up tiles fit.
    Memoised (a pure function of its arguments), as every eager call asks it again."""
    active = max(1, min(num_pairs, num_experts))
    block_m = min(64, _pow2_at_least(triton.cdiv(num_pairs, active), 16))
    stages = MoeTiles.__dataclass_fields__["num_stages"].default
    wide_up = stages * UP_STAGE_BYTES + 32 * 1024 <= shared_memory  # 32 KB for the epilogue's scratch
    up_per_sm, up_stage = (UP_PROGRAMS_PER_SM, UP_STAGE_BYTES) if wide_up else (PROGRAMS_PER_SM, STAGE_BYTES)
    up_n = _widest_tile(inter, active, num_sms, (64, 32, 16), up_per_sm)
    down_n = _widest_tile(dim, active, num_sms, (128, 64, 32, 16), PROGRAMS_PER_SM)
    return MoeTiles(
        block_m=block_m,
        up_block_n=up_n,
        up_block_k=_deepest_k(block_m + 2 * up_n, elem_bytes, dim, up_stage),
        down_block_n=down_n,
        down_block_k=_deepest_k(block_m + down_n, elem_bytes, inter, STAGE_BYTES),
    )


# ---------------------------------------------------------------------------------------------
# Routing
# ---------------------------------------------------------------------------------------------


@triton.jit
def _pair_expert(ids_ptr, pair, pair_ok, shared_expert, PICKS: tl.constexpr, PAIRS_PER_TOKEN: tl.constexpr):
    """Expert of each pair (-1 where not pair_ok). Pairs run token by token; with a shared
    expert (PAIRS_PER_TOKEN = PICKS + 1) each token's last pair is the shared one."""
    if PAIRS_PER_TOKEN > PICKS:
        token = pair // PAIRS_PER_TOKEN
        pick = pair % PAIRS_PER_TOKEN
        routed = pick < PICKS
        expert = tl.load(ids_ptr + token * PICKS + pick, mask=pair_ok & routed, other=-1).to(tl.int32)
        return tl.where(pair_ok & ~routed, shared_expert, expert)
    return tl.load(ids_ptr + pair, mask=pair_ok, other=-1).to(tl.int32)


@triton.jit
def _route_pairs_kernel(
    ids_ptr, shift_ptr, sorted_pair_ptr, block_expert_ptr, block_rows_ptr,
    num_pairs, num_experts, num_blocks, shared_expert,
    BLOCK_M: tl.constexpr, PAIRS: tl.constexpr, EXPERTS: tl.constexpr, BLOCKS_PER_STEP: tl.constexpr,
    PICKS: tl.constexpr, PAIRS_PER_TOKEN: tl.constexpr,
    DEPENDENT: tl.constexpr = False,
):
    """The whole routing in one program (route_pairs' "kernel" method); also called as the first
    program of kernels/moe/scaled.py's routing-and-quantisation launch."""
    wait_for_predecessor(DEPENDENT)
    pair = tl.arange(0, PAIRS)
    expert = _pair_expert(ids_ptr, pair, pair < num_pairs, shared_expert, PICKS, PAIRS_PER_TOKEN)
    valid = (pair < num_pairs) & (expert >= 0) & (expert < num_experts)
    counts = tl.histogram(tl.where(valid, expert, 0), EXPERTS, mask=valid)
    padded = tl.cdiv(counts, BLOCK_M) * BLOCK_M
    padded_end = tl.cumsum(padded, axis=0)
    padded_start = padded_end - padded
    first = tl.cumsum(counts, axis=0) - counts  # rank of each expert's first pair in sorted order

    # Stable sort by expert: key = expert * PAIRS + pair (invalid pairs sort last).
    experts = tl.arange(0, EXPERTS)
    tl.store(shift_ptr + experts, padded_start - first)
    tl.debug_barrier()  # the table is read back below through other threads' addresses
    key = tl.sort(tl.where(valid, expert * PAIRS + pair, EXPERTS * PAIRS))
    rank = tl.arange(0, PAIRS)
    sorted_ok = key < EXPERTS * PAIRS
    sorted_expert = tl.where(sorted_ok, key // PAIRS, 0)
    row = rank + tl.load(shift_ptr + sorted_expert, mask=sorted_ok, other=0)
    tl.store(sorted_pair_ptr + row, key % PAIRS, mask=sorted_ok)

    # Block table: every block unused, then each expert's own blocks from its padded start (a
    # loop over an expert's blocks, at decode one or two, rather than over all blocks).
    for first_block in range(0, num_blocks, BLOCKS_PER_STEP):
        block = first_block + tl.arange(0, BLOCKS_PER_STEP)
        tl.store(block_expert_ptr + block, tl.full([BLOCKS_PER_STEP], -1, tl.int32), mask=block < num_blocks)
        tl.store(block_rows_ptr + block, tl.zeros([BLOCKS_PER_STEP], tl.int32), mask=block < num_blocks)
    tl.debug_barrier()  # the experts' stores below land after these
    expert_blocks = padded // BLOCK_M
    for j in range(0, tl.max(expert_blocks, axis=0)):
        has = j < expert_blocks
        block = padded_start // BLOCK_M + j
        tl.store(block_expert_ptr + block, experts, mask=has)
        tl.store(block_rows_ptr + block, tl.minimum(counts - j * BLOCK_M, BLOCK_M), mask=has)


def _route_pairs_torch(flat_ids: torch.Tensor, num_experts: int, block_m: int, num_blocks: int) -> PairBlocks:
    """Same layout as _route_pairs_kernel with torch ops (no host sync), for large batches."""
    device = flat_ids.device
    ids = flat_ids.long()
    valid = (ids >= 0) & (ids < num_experts)
    bucket = torch.where(valid, ids, num_experts)  # an extra bucket for invalid ids gets no block
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=device)
    counts.scatter_add_(0, bucket, torch.ones_like(bucket))
    counts = counts[:num_experts]
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    padded_start = padded_end - padded
    first = counts.cumsum(0) - counts
    order = torch.argsort(bucket, stable=True)
    sorted_bucket = bucket[order]
    sorted_ok = sorted_bucket < num_experts
    shift = torch.cat([padded_start - first, padded_start.new_zeros(1)])
    rank = torch.arange(ids.numel(), device=device)
    dump = num_blocks * block_m  # invalid pairs land in one extra row, cut off below
    row = torch.where(sorted_ok, rank + shift[sorted_bucket], dump)
    sorted_pair = torch.empty(dump + 1, dtype=torch.int32, device=device)
    sorted_pair.scatter_(0, row, order.to(torch.int32))

    row0 = torch.arange(num_blocks, device=device) * block_m
    owner = torch.searchsorted(padded_end, row0, right=True)
    used = owner < num_experts
    owner = owner.clamp(max=num_experts - 1)
    rows_left = (counts[owner] - (row0 - padded_start[owner])).clamp(max=block_m)
    return PairBlocks(
        sorted_pair=sorted_pair[:dump],
        block_expert=torch.where(used, owner, -1).to(torch.int32),
        block_rows=torch.where(used, rows_left, 0).to(torch.int32),
        block_m=block_m,
    )


def route_pairs(
    expert_ids: torch.Tensor, num_experts: int, block_m: int, method: str = "auto", shared_expert: int = -1
) -> PairBlocks:
    """Group the pairs of expert_ids [B,k] by expert (see PairBlocks); with shared_expert >= 0
    each token has a last pair on that expert (pair b*(k+1)+k). method: "kernel" (one Triton
    program), "torch", or "auto" (the kernel up to MAX_PAIRS_ONE_PROGRAM pairs)."""
    batch, picks = expert_ids.shape
    num_pairs = batch * (picks + (shared_expert >= 0))
    if method == "auto":
        method = "kernel" if routes_in_one_program(expert_ids, shared_expert) else "torch"
    if method == "torch":
        if shared_expert >= 0:
            expert_ids = with_shared_ids(expert_ids, shared_expert)
        return _route_pairs_torch(expert_ids.reshape(-1), num_experts, block_m, max_blocks(num_pairs, num_experts, block_m))
    if method != "kernel":
        raise ValueError(f"route_pairs: unknown method {method!r}")
    if not routes_in_one_program(expert_ids, shared_expert):
        raise ValueError(f"route_pairs: the kernel takes at most {MAX_PAIRS_ONE_PROGRAM} pairs, got {num_pairs}")
    blocks, args, meta = routing_launch(expert_ids, num_experts, block_m, shared_expert)
    _route_pairs_kernel[(1,)](*args, **meta, num_warps=4, **dependent_options(expert_ids.device))
    return blocks


def routes_in_one_program(expert_ids: torch.Tensor, shared_expert: int) -> bool:
    """Whether route_pairs' "auto" takes the one-program kernel: at most MAX_PAIRS_ONE_PROGRAM pairs."""
    batch, picks = expert_ids.shape
    return batch * (picks + (shared_expert >= 0)) <= MAX_PAIRS_ONE_PROGRAM


def routing_launch(expert_ids: torch.Tensor, num_experts: int, block_m: int, shared_expert: int) -> tuple[PairBlocks, tuple, dict]:
    """The routing's buffers (as PairBlocks, filled by the launch), and the arguments and
    constants of _route_pairs_kernel for them: at most MAX_PAIRS_ONE_PROGRAM pairs."""
    batch, picks = expert_ids.shape
    pairs_per_token = picks + (shared_expert >= 0)
    num_pairs = batch * pairs_per_token
    num_blocks = max_blocks(num_pairs, num_experts, block_m)
    device = expert_ids.device
    experts_pow2 = _pow2_at_least(num_experts, 32)  # at least one histogram bin per lane
    shift = torch.empty(experts_pow2, dtype=torch.int32, device=device)
    blocks = PairBlocks(
        sorted_pair=torch.empty(num_blocks * block_m, dtype=torch.int32, device=device),
        block_expert=torch.empty(num_blocks, dtype=torch.int32, device=device),
        block_rows=torch.empty(num_blocks, dtype=torch.int32, device=device),
        block_m=block_m,
    )
    args = (expert_ids.contiguous(), shift, blocks.sorted_pair, blocks.block_expert, blocks.block_rows,
            num_pairs, num_experts, num_blocks, shared_expert)
    meta = dict(BLOCK_M=block_m, PAIRS=_pow2_at_least(num_pairs, 16), EXPERTS=experts_pow2,
                BLOCKS_PER_STEP=_pow2_at_least(min(num_blocks, 1024), 16), PICKS=picks, PAIRS_PER_TOKEN=pairs_per_token)
    return blocks, args, meta


# ---------------------------------------------------------------------------------------------
# Expert products
# ---------------------------------------------------------------------------------------------


@triton.jit
def _block_rows(sorted_pair_ptr, block_expert_ptr, block_rows_ptr, block, BLOCK_M: tl.constexpr):
    """The block's expert (-1: unused), its row offsets, the real-row mask and their pair indices."""
    expert = tl.load(block_expert_ptr + block)
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = tl.arange(0, BLOCK_M) < tl.load(block_rows_ptr + block)
    pair = tl.load(sorted_pair_ptr + rows, mask=row_ok, other=0)
    return expert, rows, row_ok, pair


@triton.jit
def _routed_swiglu(
    acc_gate, acc_up, act_ptr, route_w_ptr, token, pair, row_ok, swiglu_limit,
    PICKS: tl.constexpr, PAIRS_PER_TOKEN: tl.constexpr, HAS_LIMIT: tl.constexpr,
):
    """A gate/up tile's weighted SwiGLU in fp32, as the reference: the products rounded to the
    activation dtype (act_ptr's), clamped, silu(gate) * up times the pair's routing weight
    (weights are [B, PICKS]; the shared expert's pair, pick PICKS, weighs 1)."""
    act_dtype = act_ptr.dtype.element_ty
    pick = pair % PAIRS_PER_TOKEN
    route_w = tl.load(route_w_ptr + token * PICKS + pick, mask=row_ok & (pick < PICKS), other=1.0)
    return clamped_swiglu(acc_gate.to(act_dtype).to(tl.float32), acc_up.to(act_dtype).to(tl.float32), swiglu_limit, HAS_LIMIT) * route_w[:, None]


@triton.jit
def clamped_swiglu(gate, up, swiglu_limit, HAS_LIMIT: tl.constexpr):
    """silu(gate) * up in fp32 with gate clamped from above and up both ways (HAS_LIMIT)."""
    if HAS_LIMIT:
        up = tl.minimum(tl.maximum(up, -swiglu_limit), swiglu_limit)
        gate = tl.minimum(gate, swiglu_limit)
    return gate * tl.sigmoid(gate) * up


@triton.jit
def _gate_up_kernel(
    x_ptr, w1_ptr, w3_ptr, route_w_ptr, h_ptr,
    sorted_pair_ptr, block_expert_ptr, block_rows_ptr,
    dim, inter, swiglu_limit,
    stride_xm, stride_xk,
    stride_w1e, stride_w1n, stride_w1k,
    stride_w3e, stride_w3n, stride_w3k,
    stride_hm, stride_hn,
    PICKS: tl.constexpr, PAIRS_PER_TOKEN: tl.constexpr, HAS_LIMIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    DEPENDENT: tl.constexpr = False,
):
    wait_for_predecessor(DEPENDENT)
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(inter, BLOCK_N)
    block = pid // tiles_n
    tile_n = pid % tiles_n
    expert, rows, row_ok, pair = _block_rows(sorted_pair_ptr, block_expert_ptr, block_rows_ptr, block, BLOCK_M)
    if expert < 0:
        return

    token = pair // PAIRS_PER_TOKEN
    offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < inter
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + token[:, None].to(tl.int64) * stride_xm + offs_k[None, :] * stride_xk
    expert = expert.to(tl.int64)
    w1_ptrs = w1_ptr + expert * stride_w1e + offs_n[None, :].to(tl.int64) * stride_w1n + offs_k[:, None] * stride_w1k
    w3_ptrs = w3_ptr + expert * stride_w3e + offs_n[None, :].to(tl.int64) * stride_w3n + offs_k[:, None] * stride_w3k

    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, dim, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
            w1 = tl.load(w1_ptrs, mask=n_ok[None, :], other=0.0)
            w3 = tl.load(w3_ptrs, mask=n_ok[None, :], other=0.0)
        else:
            k_ok = (k + offs_k) < dim
            x = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w1 = tl.load(w1_ptrs, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
            w3 = tl.load(w3_ptrs, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        acc_gate = tl.dot(x, w1, acc_gate, input_precision=DOT_PRECISION)
        acc_up = tl.dot(x, w3, acc_up, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        w1_ptrs += BLOCK_K * stride_w1k
        w3_ptrs += BLOCK_K * stride_w3k

    h = _routed_swiglu(acc_gate, acc_up, h_ptr, route_w_ptr, token, pair, row_ok, swiglu_limit, PICKS, PAIRS_PER_TOKEN, HAS_LIMIT)
    h_ptrs = h_ptr + rows[:, None].to(tl.int64) * stride_hm + offs_n[None, :] * stride_hn
    tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _down_kernel(
    h_ptr, w2_ptr, y_ptr,
    sorted_pair_ptr, block_expert_ptr, block_rows_ptr,
    dim, inter,
    stride_hm, stride_hk,
    stride_we, stride_wn, stride_wk,
    stride_ym, stride_yn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    DEPENDENT: tl.constexpr = False,
):
    wait_for_predecessor(DEPENDENT)
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(dim, BLOCK_N)
    block = pid // tiles_n
    tile_n = pid % tiles_n
    expert, rows, row_ok, pair = _block_rows(sorted_pair_ptr, block_expert_ptr, block_rows_ptr, block, BLOCK_M)
    if expert < 0:
        return

    offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < dim
    offs_k = tl.arange(0, BLOCK_K)
    h_ptrs = h_ptr + rows[:, None].to(tl.int64) * stride_hm + offs_k[None, :] * stride_hk
    w_ptrs = w2_ptr + expert.to(tl.int64) * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None] * stride_wk

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, inter, BLOCK_K):
        if EVEN_K:
            h = tl.load(h_ptrs, mask=row_ok[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=n_ok[None, :], other=0.0)
        else:
            k_ok = (k + offs_k) < inter
            h = tl.load(h_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        acc = tl.dot(h, w, acc, input_precision=DOT_PRECISION)
        h_ptrs += BLOCK_K * stride_hk
        w_ptrs += BLOCK_K * stride_wk

    y_ptrs = y_ptr + pair[:, None].to(tl.int64) * stride_ym + offs_n[None, :] * stride_yn
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _moe_combine_kernel(
    y_ptr, ids_ptr, out_ptr, addend_ptr,
    dim, num_experts,
    stride_ym, stride_ob, stride_ab,
    PICKS: tl.constexpr, PAIRS_PER_TOKEN: tl.constexpr, BLOCK_N: tl.constexpr, HAS_ADDEND: tl.constexpr,
    DEPENDENT: tl.constexpr = False,
):
    wait_for_predecessor(DEPENDENT)
    token = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < dim
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for pick in tl.static_range(PAIRS_PER_TOKEN):
        pair = token * PAIRS_PER_TOKEN + pick
        y = tl.load(y_ptr + pair.to(tl.int64) * stride_ym + offs_n, mask=n_ok, other=0.0)
        if pick < PICKS:
            expert = tl.load(ids_ptr + token * PICKS + pick)
            routed = (expert >= 0) & (expert < num_experts)  # pairs with an invalid id were never computed
            acc += tl.where(routed, y.to(tl.float32), 0.0)
        else:  # the shared expert's pair
            acc += y.to(tl.float32)
    if HAS_ADDEND:  # a shared expert of its own format, after the picks
        acc += tl.load(addend_ptr + token.to(tl.int64) * stride_ab + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + token.to(tl.int64) * stride_ob + offs_n, acc, mask=n_ok)


# ---------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------


def moe_experts_triton(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    expert_weights: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    swiglu_limit: float,
    shared_expert: int = -1,
    tiles: MoeTiles | None = None,
    routing: str = "auto",
) -> torch.Tensor:
    """Weighted sum of each token's experts, [B,D] fp32 (arguments as moe_experts_reference).
    Expert ids outside [0, E) contribute nothing. `tiles` overrides choose_tiles and `routing`
    the route_pairs method (both for tuning and tests)."""
    if not (x.dtype == w1.dtype == w2.dtype == w3.dtype):
        raise ValueError(f"moe_experts: x {x.dtype} and weights {w1.dtype}, {w2.dtype}, {w3.dtype} must share a dtype")
    if expert_ids.dtype.is_floating_point:
        raise ValueError(f"moe_experts: expert_ids must be integer, got {expert_ids.dtype}")
    check_shared_expert(shared_expert, w1.shape[0])  # its pairs would otherwise add unwritten rows
    batch, dim = x.shape
    picks = expert_ids.shape[1]
    pairs_per_token = picks + (shared_expert >= 0)
    num_experts, inter, _ = w1.shape
    out = torch.empty((batch, dim), dtype=torch.float32, device=x.device)
    if batch == 0 or pairs_per_token == 0:
        return out.zero_()
    num_pairs = batch * pairs_per_token
    if tiles is None:
        tiles = choose_tiles(
            num_pairs, num_experts, dim, inter, x.element_size(), num_sms(x.device), shared_memory_per_block(x.device)
        )

    ids = expert_ids.contiguous()
    route_w = expert_weights.reshape(-1).to(torch.float32).contiguous()
    blocks = route_pairs(ids, num_experts, tiles.block_m, routing, shared_expert)
    h = torch.empty((blocks.num_blocks * tiles.block_m, inter), dtype=x.dtype, device=x.device)
    y = torch.empty((num_pairs, dim), dtype=x.dtype, device=x.device)
    precision = dot_precision(x.dtype)
    launch = dict(num_warps=tiles.num_warps, num_stages=tiles.num_stages, **dependent_options(x.device))

    _gate_up_kernel[(blocks.num_blocks * triton.cdiv(inter, tiles.up_block_n),)](
        x, w1, w3, route_w, h,
        blocks.sorted_pair, blocks.block_expert, blocks.block_rows,
        dim, inter, float(swiglu_limit),
        x.stride(0), x.stride(1),
        w1.stride(0), w1.stride(1), w1.stride(2),
        w3.stride(0), w3.stride(1), w3.stride(2),
        h.stride(0), h.stride(1),
        PICKS=picks, PAIRS_PER_TOKEN=pairs_per_token, HAS_LIMIT=swiglu_limit > 0,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.up_block_n, BLOCK_K=tiles.up_block_k,
        EVEN_K=dim % tiles.up_block_k == 0, DOT_PRECISION=precision,
        **launch,
    )
    _down_kernel[(blocks.num_blocks * triton.cdiv(dim, tiles.down_block_n),)](
        h, w2, y,
        blocks.sorted_pair, blocks.block_expert, blocks.block_rows,
        dim, inter,
        h.stride(0), h.stride(1),
        w2.stride(0), w2.stride(1), w2.stride(2),
        y.stride(0), y.stride(1),
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.down_block_n, BLOCK_K=tiles.down_block_k,
        EVEN_K=inter % tiles.down_block_k == 0, DOT_PRECISION=precision,
        **launch,
    )
    return combine_pairs(y, ids, out, num_experts, pairs_per_token)


def combine_pairs(
    y: torch.Tensor, expert_ids: torch.Tensor, out: torch.Tensor, num_experts: int, pairs_per_token: int,
    addend: torch.Tensor | None = None,
) -> torch.Tensor:
    """out[b] = the fp32 sum of y's rows b*pairs_per_token ... in pick order (the shared expert's
    pair last), pairs with an expert id outside [0, E) left out, then addend[b] where given.
    y [P, D]; expert_ids [B, k] contiguous; addend [B, D] rows contiguous; out [B, D] fp32,
    written and returned."""
    batch, dim = out.shape
    combine_n = min(1024, triton.next_power_of_2(dim))
    _moe_combine_kernel[(batch, triton.cdiv(dim, combine_n))](
        y, expert_ids, out, out if addend is None else addend,
        dim, num_experts,
        y.stride(0), out.stride(0), 0 if addend is None else addend.stride(0),
        PICKS=expert_ids.shape[1], PAIRS_PER_TOKEN=pairs_per_token, BLOCK_N=combine_n, HAS_ADDEND=addend is not None,
        num_warps=4, **dependent_options(out.device),
    )
    return out
