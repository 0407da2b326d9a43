"""Triton MoE gate (semantics: kernels/gate/ref.py): one launch from the hidden rows to the
routing weights and expert ids.

Unfused, a decode step's gate is a GEMV of the 256 x 4096 weight, then the scores, the top-k
rounds and the renormalisation in one or two generated kernels, each a launch with a ramp and a
tail for a few microseconds of work. Here program (p, q) loads BLOCK_E experts' whole rows of
the weight at once (one round trip to memory; upcast to fp32 as read), multiplies ROW_BLOCK rows
of x by them on CUDA cores, in fp32, and writes those logits to a scratch; the last program of a
row block to arrive (kernels/arrival.py) reads its rows' logits back and, a few rows at a time,
forms the scores, picks the top k by k rounds of argmax (ties to the lower index; a hash layer
reads its ids instead) and writes the renormalised weights and the ids.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.arrival import arrives_last, split_counters
from kernels.dependent_launch import dependent_options, wait_for_predecessor

BLOCK_E = 2  # experts a program: 128 programs over V4-Flash's 256, 16 KB of weight each
BLOCK_M = 2  # rows of x a program multiplies at a time
ROW_BLOCK = 8  # rows of x a program takes (grid axis 1): a counter each, whose last program ranks them
PICK_ROWS = 4  # rows that last program ranks at a time
WARPS = 8
MAX_DIM = 8192  # a program holds its experts' whole rows of the weight in registers


@triton.jit
def _sqrt_softplus(x):
    """sqrt(softplus(x)) as torch's softplus (beta 1, threshold 20): log1p(exp(x)) to a few ulp,
    log(1 + e) corrected by how 1 + e rounded (Goldberg), x itself above 20 (e capped there, so
    that no branch left unused overflows or divides by zero)."""
    e = tl.exp(tl.minimum(x, 20.0))
    u = 1.0 + e
    rounded = u - 1.0  # exact; 0 where e is below half an ulp of 1
    log1p = tl.where(rounded == 0.0, e, tl.log(u) * (e / tl.where(rounded == 0.0, 1.0, rounded)))
    return tl.sqrt(tl.where(x > 20.0, x, log1p))


@triton.jit
def _moe_gate_kernel(
    x_ptr, w_ptr, bias_ptr, hashed_ptr, logits_ptr, counter_ptr, weights_ptr, ids_ptr,
    rows, experts, dim, route_scale, stride_xm, stride_wn, stride_hm,
    TOPK: tl.constexpr, HASHED: tl.constexpr, EXPERTS_P2: tl.constexpr, TOPK_P2: tl.constexpr, DIM_P2: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr, ROW_BLOCK: tl.constexpr, PICK_ROWS: tl.constexpr,
    WEIGHT_COPIED: tl.constexpr, DEPENDENT: tl.constexpr = False,
):
    e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    e_ok = e < experts
    first_row = tl.program_id(1) * ROW_BLOCK
    last_row = tl.minimum(first_row + ROW_BLOCK, rows)
    ks = tl.arange(0, DIM_P2)
    k_ok = ks < dim
    # The program's rows of the weight, whole: one round trip to memory (L2 for the later row
    # blocks), then its block of x's rows from L2. The weight is a parameter, loaded while the
    # kernel before drains, unless it is a copy that kernel made (WEIGHT_COPIED).
    if WEIGHT_COPIED:
        wait_for_predecessor(DEPENDENT)
    w = tl.load(w_ptr + e.to(tl.int64)[:, None] * stride_wn + ks[None, :], mask=e_ok[:, None] & k_ok[None, :], other=0.0)
    w = w.to(tl.float32)
    if not WEIGHT_COPIED:
        wait_for_predecessor(DEPENDENT)
    for m0 in range(first_row, last_row, BLOCK_M):
        m = m0 + tl.arange(0, BLOCK_M)
        m_ok = m < last_row
        x = tl.load(x_ptr + m[:, None] * stride_xm + ks[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        logits = tl.sum(x.to(tl.float32)[:, None, :] * w[None, :, :], axis=2)
        tl.store(logits_ptr + m[:, None] * experts + e[None, :], logits, mask=m_ok[:, None] & e_ok[None, :])
    counter = counter_ptr + tl.program_id(1)
    if arrives_last(counter, tl.num_programs(0)):  # the last of the row block's programs ranks its rows
        columns = tl.arange(0, EXPERTS_P2)
        slots = tl.arange(0, TOPK_P2)
        for m0 in range(first_row, last_row, PICK_ROWS):
            m = m0 + tl.arange(0, PICK_ROWS)
            m_ok = m < last_row
            picked = tl.zeros([PICK_ROWS, TOPK_P2], tl.float32)
            chosen = tl.zeros([PICK_ROWS, TOPK_P2], tl.int64)
            if HASHED:
                chosen = tl.load(hashed_ptr + m[:, None] * stride_hm + slots[None, :],
                                 mask=m_ok[:, None] & (slots < TOPK)[None, :], other=0).to(tl.int64)
                # .cg: other programs wrote the scratch; read it from L2
                logit = tl.load(logits_ptr + m[:, None] * experts + chosen, mask=m_ok[:, None] & (slots < TOPK)[None, :],
                                other=0.0, cache_modifier=".cg")
                picked = tl.where((slots < TOPK)[None, :], _sqrt_softplus(logit), 0.0)
            else:
                ok = m_ok[:, None] & (columns < experts)[None, :]
                scores = _sqrt_softplus(tl.load(logits_ptr + m[:, None] * experts + columns[None, :], mask=ok, other=0.0,
                                                cache_modifier=".cg"))
                bias = tl.load(bias_ptr + columns, mask=columns < experts, other=0.0)
                keys = tl.where(ok, scores + bias[None, :], float("-inf"))
                for r in tl.static_range(TOPK):
                    best = tl.argmax(keys, axis=1, tie_break_left=True)
                    hit = columns[None, :] == best[:, None]
                    value = tl.sum(tl.where(hit, scores, 0.0), axis=1)  # exact: one nonzero term
                    picked = tl.where(slots[None, :] == r, value[:, None], picked)
                    chosen = tl.where(slots[None, :] == r, best.to(tl.int64)[:, None], chosen)
                    keys = tl.where(hit, float("-inf"), keys)
            total = tl.where(m_ok, tl.sum(picked, axis=1), 1.0)  # rows past the batch: nothing to divide
            out = m_ok[:, None] & (slots < TOPK)[None, :]
            tl.store(weights_ptr + m[:, None] * TOPK + slots[None, :], picked / total[:, None] * route_scale, mask=out)
            tl.store(ids_ptr + m[:, None] * TOPK + slots[None, :], chosen, mask=out)
        tl.atomic_xchg(counter, 0)


def moe_gate_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, hashed_ids: torch.Tensor | None,
                    topk: int, route_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """moe_gate_reference's result in one launch (inputs checked by the caller; at most MAX_DIM
    features)."""
    rows, dim = x.shape
    if dim > MAX_DIM:
        raise ValueError(f"moe_gate (triton): at most {MAX_DIM} features, got {dim}")
    experts = weight.shape[0]
    weight_copied = weight.stride(-1) != 1
    if weight_copied:
        weight = weight.contiguous()
    x = x.contiguous()
    logits = torch.empty((rows, experts), dtype=torch.float32, device=x.device)
    weights = torch.empty((rows, topk), dtype=torch.float32, device=x.device)
    ids = torch.empty((rows, topk), dtype=torch.int64, device=x.device)
    hashed = hashed_ids.contiguous() if hashed_ids is not None else ids  # unread without a hash layer
    row_blocks = triton.cdiv(rows, ROW_BLOCK)
    _moe_gate_kernel[(triton.cdiv(experts, BLOCK_E), row_blocks)](
        x, weight, bias if bias is not None else logits, hashed, logits, split_counters(x.device, row_blocks), weights, ids,
        rows, experts, dim, float(route_scale), x.stride(0), weight.stride(0), hashed.stride(0),
        TOPK=topk, HASHED=hashed_ids is not None, EXPERTS_P2=triton.next_power_of_2(experts),
        TOPK_P2=triton.next_power_of_2(topk), DIM_P2=triton.next_power_of_2(dim), BLOCK_E=BLOCK_E, BLOCK_M=BLOCK_M,
        ROW_BLOCK=ROW_BLOCK, PICK_ROWS=PICK_ROWS, WEIGHT_COPIED=weight_copied, num_warps=WARPS,
        **dependent_options(x.device),
    )
    return weights, ids
