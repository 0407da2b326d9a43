"""moe_experts: the Triton grouped GEMM against the plain-torch reference on fresh random inputs,
under every expert-load pattern (random, all tokens on one expert, experts without tokens, B=1,
more pairs per expert than a block holds); the block-scaled (FP4 / FP8) experts' grouped GEMV
likewise (its act_quant, the block-scaled linear's pre-pass, is tested bit for bit in
tests/test_blockscale.py).

CPU tests run the Triton kernels in the interpreter (TRITON_INTERPRET=1, fp32/fp16, small
widths). GPU tests run them compiled at V4-Flash widths in bf16, replayed in a CUDA graph with
new routing, under the sync debug mode, inside torch.compile, and through opcheck."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import kernels.moe.scaled as moe_scaled
import kernels.moe.triton as moe_triton
from kernels.blockscale.act_quant_pass import act_quant_triton, in_value_order
from kernels.blockscale.ref import act_quant, quantize_fp4_weight, quantize_fp8_weight
from kernels.cuda_graph import capture
from kernels.moe import moe_experts, moe_experts_reference
from kernels.moe.scaled import route_and_quantise

LIMIT = 10.0


def expert_weights(num_experts, dim, inter, dtype, device, seed):
    g = torch.Generator(device=device).manual_seed(seed)
    w1 = torch.randn(num_experts, inter, dim, generator=g, device=device) * dim**-0.5
    w3 = torch.randn(num_experts, inter, dim, generator=g, device=device) * dim**-0.5
    w2 = torch.randn(num_experts, dim, inter, generator=g, device=device) * inter**-0.5
    return w1.to(dtype), w2.to(dtype), w3.to(dtype)


def routing(pattern, batch, picks, num_experts, device, seed):
    """expert_ids [B, picks] (distinct per token) and fp32 routing weights for a load pattern."""
    g = torch.Generator(device=device).manual_seed(seed)
    if pattern == "random":
        ids = torch.rand(batch, num_experts, generator=g, device=device).argsort(1)[:, :picks]
    elif pattern == "some_experts_idle":  # only the first half of the experts get tokens
        pool = max(picks, num_experts // 2)
        ids = torch.rand(batch, pool, generator=g, device=device).argsort(1)[:, :picks]
    elif pattern == "one_hot_expert":  # every token picks expert E-1 (one block cannot hold them all)
        others = torch.rand(batch, num_experts - 1, generator=g, device=device).argsort(1)[:, : picks - 1]
        ids = torch.cat([torch.full_like(others[:, :1], num_experts - 1), others], 1)
    else:
        raise ValueError(pattern)
    weights = torch.rand(batch, picks, generator=g, device=device) + 0.1
    return ids, weights / weights.sum(1, keepdim=True) * 1.5


def assert_close_to_reference(out, ref, rel):
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert torch.isfinite(out).all()
    err = ((out - ref).abs().max() / ref.abs().max()).item()
    assert err <= rel, f"max error {err:.2e} of the output scale (limit {rel:.0e})"


# ---------------------------------------------------------------------------------------------
# CPU: interpreter
# ---------------------------------------------------------------------------------------------

SMALL = dict(dim=64, inter=48, num_experts=8)  # inter=48: partial N tiles and a masked K loop
CPU_TOL = {torch.float32: 1e-5, torch.float16: 1e-2}


@pytest.mark.interpreter
@pytest.mark.parametrize(
    "pattern,batch,dtype",
    [
        ("random", 5, torch.float32),
        ("random", 1, torch.float16),
        ("one_hot_expert", 40, torch.float32),  # 40 pairs on one expert: three 16-row blocks
        ("some_experts_idle", 9, torch.float16),
    ],
)
def test_matches_reference(pattern, batch, dtype):
    picks = 3
    w1, w2, w3 = expert_weights(SMALL["num_experts"], SMALL["dim"], SMALL["inter"], dtype, "cpu", seed=batch)
    ids, weights = routing(pattern, batch, picks, SMALL["num_experts"], "cpu", seed=batch + 1)
    if pattern == "one_hot_expert":
        assert int((ids == SMALL["num_experts"] - 1).sum()) == batch
    if pattern == "some_experts_idle":
        assert int(ids.max()) < SMALL["num_experts"] // 2
    x = torch.randn(batch, SMALL["dim"], generator=torch.Generator().manual_seed(batch + 2)).to(dtype)
    out = moe_experts(x, ids, weights, w1, w2, w3, LIMIT, impl="triton")
    ref = moe_experts_reference(x, ids, weights, w1, w2, w3, LIMIT)
    assert_close_to_reference(out, ref, CPU_TOL[dtype])


@pytest.mark.interpreter
def test_clamp_and_no_clamp():
    """A limit small enough to clamp most gate/up values, and limit 0 (no clamp)."""
    w1, w2, w3 = expert_weights(8, 64, 48, torch.float32, "cpu", seed=20)
    ids, weights = routing("random", 6, 2, 8, "cpu", seed=21)
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(22)) * 3
    for limit in (0.3, 0.0):
        out = moe_experts(x, ids, weights, w1, w2, w3, limit, impl="triton")
        ref = moe_experts_reference(x, ids, weights, w1, w2, w3, limit)
        assert_close_to_reference(out, ref, 1e-5)
    clamped = moe_experts(x, ids, weights, w1, w2, w3, 0.3, impl="triton")
    assert (clamped - out).abs().max() > 0.1 * out.abs().max(), "the clamp had no effect"


@pytest.mark.interpreter
def test_unselected_experts_are_never_used():
    """NaN in every expert nobody picked leaves the output finite and unchanged."""
    w1, w2, w3 = expert_weights(8, 64, 48, torch.float32, "cpu", seed=30)
    ids, weights = routing("some_experts_idle", 7, 3, 8, "cpu", seed=31)
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(32))
    ref = moe_experts_reference(x, ids, weights, w1, w2, w3, LIMIT)
    idle = torch.ones(8, dtype=torch.bool)
    idle[ids.unique()] = False
    assert idle.any()
    for w in (w1, w2, w3):
        w[idle] = float("nan")
    out = moe_experts(x, ids, weights, w1, w2, w3, LIMIT, impl="triton")
    assert_close_to_reference(out, ref, 1e-5)


@pytest.mark.interpreter
def test_six_picks_sixteen_experts_and_tile_choices():
    """The V4 routing shape (top-6 of 16) with the chosen tiles, other tiles and torch routing."""
    dim, inter, num_experts, batch = 64, 64, 16, 12
    w1, w2, w3 = expert_weights(num_experts, dim, inter, torch.float32, "cpu", seed=40)
    ids, weights = routing("random", batch, 6, num_experts, "cpu", seed=41)
    x = torch.randn(batch, dim, generator=torch.Generator().manual_seed(42))
    ref = moe_experts_reference(x, ids, weights, w1, w2, w3, LIMIT)
    variants = [
        dict(),
        dict(routing="torch"),
        dict(tiles=moe_triton.MoeTiles(block_m=32, up_block_n=32, up_block_k=32, down_block_n=16, down_block_k=64)),
    ]
    for kwargs in variants:
        out = moe_triton.moe_experts_triton(x, ids, weights, w1, w2, w3, LIMIT, **kwargs)
        assert_close_to_reference(out, ref, 1e-5)


@pytest.mark.interpreter
@pytest.mark.parametrize("pattern,batch,block_m,num_experts", [
    ("random", 1, 16, 16), ("one_hot_expert", 30, 16, 16), ("some_experts_idle", 50, 32, 16),
    ("random", 64, 64, 256),  # V4-Flash's experts at batch 64: most blocks unused
])
def test_routing_kernel_matches_torch_routing(pattern, batch, block_m, num_experts):
    """Both routing methods build the same blocks: each expert's pairs in token order, padded."""
    picks = 6
    ids, _ = routing(pattern, batch, picks, num_experts, "cpu", seed=50 + batch)
    by_kernel = moe_triton.route_pairs(ids, num_experts, block_m, "kernel")
    by_torch = moe_triton.route_pairs(ids, num_experts, block_m, "torch")
    assert torch.equal(by_kernel.block_expert, by_torch.block_expert)
    assert torch.equal(by_kernel.block_rows, by_torch.block_rows)
    flat = ids.reshape(-1)
    rows_seen = []
    for block in range(by_kernel.num_blocks):
        expert, count = int(by_kernel.block_expert[block]), int(by_kernel.block_rows[block])
        rows = slice(block * block_m, block * block_m + count)
        assert torch.equal(by_kernel.sorted_pair[rows], by_torch.sorted_pair[rows])
        if expert >= 0:
            assert (flat[by_kernel.sorted_pair[rows].long()] == expert).all()
            rows_seen += by_kernel.sorted_pair[rows].tolist()
        else:
            assert count == 0
    assert sorted(rows_seen) == list(range(flat.numel())), "every pair lands in exactly one row"


@pytest.mark.interpreter
def test_opcheck_cpu():
    w1, w2, w3 = expert_weights(4, 32, 16, torch.float32, "cpu", seed=60)
    ids, weights = routing("random", 3, 2, 4, "cpu", seed=61)
    x = torch.randn(3, 32)
    for shared in (-1, 3):
        torch.library.opcheck(torch.ops.v4.moe_experts.default, (x, ids, weights, w1, w2, w3, LIMIT, shared))


@pytest.mark.interpreter
@pytest.mark.parametrize("batch,dtype,routing_method", [(1, torch.float32, "kernel"), (9, torch.float16, "kernel"), (9, torch.float32, "torch")])
def test_shared_expert_is_every_tokens_last_pick(batch, dtype, routing_method):
    """shared_expert=s runs expert s for every token with weight 1, after its picks: the same as
    appending (s, 1) to each row, including where some tokens also routed to s."""
    num_experts, picks, shared = SMALL["num_experts"], 3, SMALL["num_experts"] - 1
    w1, w2, w3 = expert_weights(num_experts, SMALL["dim"], SMALL["inter"], dtype, "cpu", seed=110 + batch)
    ids, weights = routing("random", batch, picks, num_experts, "cpu", seed=111 + batch)
    ids[0, 0] = shared  # one token picks the shared expert as a routed one too
    x = torch.randn(batch, SMALL["dim"], generator=torch.Generator().manual_seed(112 + batch)).to(dtype)
    appended_ids = torch.cat([ids, torch.full((batch, 1), shared, dtype=ids.dtype)], 1)
    appended_weights = torch.cat([weights, torch.ones(batch, 1)], 1)
    expected = moe_experts_reference(x, appended_ids, appended_weights, w1, w2, w3, LIMIT)
    out = moe_triton.moe_experts_triton(x, ids, weights, w1, w2, w3, LIMIT, shared, routing=routing_method)
    assert_close_to_reference(out, expected, CPU_TOL[dtype])
    assert_close_to_reference(moe_experts_reference(x, ids, weights, w1, w2, w3, LIMIT, shared), expected, 1e-6)
    without = moe_experts(x, ids, weights, w1, w2, w3, LIMIT, impl="triton")
    assert (out - without).abs().max() > 0.1 * out.abs().max(), "the shared expert added nothing"


@pytest.mark.interpreter
def test_routing_with_a_shared_expert_matches_torch_routing():
    ids, _ = routing("random", 7, 6, 16, "cpu", seed=120)
    by_kernel = moe_triton.route_pairs(ids, 16, 16, "kernel", shared_expert=15)
    by_torch = moe_triton.route_pairs(ids, 16, 16, "torch", shared_expert=15)
    assert torch.equal(by_kernel.block_expert, by_torch.block_expert)
    assert torch.equal(by_kernel.block_rows, by_torch.block_rows)
    for block, count in enumerate(by_kernel.block_rows.tolist()):  # rows past the count are padding
        rows = slice(block * 16, block * 16 + count)
        assert torch.equal(by_kernel.sorted_pair[rows], by_torch.sorted_pair[rows])
    on_shared = [
        pair
        for block, (expert, count) in enumerate(zip(by_kernel.block_expert.tolist(), by_kernel.block_rows.tolist()))
        if expert == 15
        for pair in by_kernel.sorted_pair[block * 16 : block * 16 + count].tolist()
    ]
    routed_to_15 = [b * 7 + j for b in range(7) for j in range(6) if ids[b, j] == 15]
    assert sorted(on_shared) == sorted(routed_to_15 + [b * 7 + 6 for b in range(7)])  # each token's last pair


@pytest.mark.interpreter
@pytest.mark.parametrize("batch,shared,pow2", [(1, -1, True), (5, 15, False), (3, -1, False)])
def test_routing_and_quantisation_in_one_launch_equal_the_two_launches(batch, shared, pow2):
    """The block-scaled experts' first launch routes in its first program and quantises x in the
    others: both results bit for bit route_pairs' kernel and act_quant_triton's."""
    ids, _ = routing("random", batch, 6, 16, "cpu", seed=130 + batch)
    x = torch.randn(batch, 384) * torch.rand(batch, 1) * 8
    blocks, values, scales = route_and_quantise(x, ids, 16, 16, shared, pow2)
    by_kernel = moe_triton.route_pairs(ids, 16, 16, "kernel", shared_expert=shared)
    assert torch.equal(blocks.block_expert, by_kernel.block_expert)
    assert torch.equal(blocks.block_rows, by_kernel.block_rows)
    for block, count in enumerate(blocks.block_rows.tolist()):  # rows past the count are padding
        rows = slice(block * 16, block * 16 + count)
        assert torch.equal(blocks.sorted_pair[rows], by_kernel.sorted_pair[rows])
    expected_values, expected_scales = act_quant_triton(x, pow2)
    assert torch.equal(values.view(torch.uint8), expected_values.view(torch.uint8))
    assert torch.equal(scales, expected_scales)
    reference_values, reference_scales = act_quant(x, pow2=pow2)
    assert torch.equal(values.float(), reference_values.float()) and torch.equal(scales, reference_scales.float())


@pytest.mark.interpreter
@pytest.mark.parametrize("order", ["mma", "wgmma"])
@pytest.mark.parametrize("one_launch", [True, False])
def test_values_in_product_order_are_the_e4m3_values_placed(order, one_launch):
    """What the Gluon FP4 products read: the quantised values placed in the order of the product's
    registers ("mma": fp16, exactly the e4m3 values, each 8 inputs 4h + 2n + s at position
    4s + 2h + n; "wgmma": e4m3, each 32 inputs 8t + 2j + s at 16s + 4t + j); the scales as in e4m3
    order. Both ways of quantising x (in the routing launch, and after it where the routing takes
    the torch path)."""
    batch = 3 if one_launch else 1 + moe_triton.MAX_PAIRS_ONE_PROGRAM // 6
    ids, _ = routing("random", batch, 6, 16, "cpu", seed=140)
    x = torch.randn(batch, 384) * torch.rand(batch, 1) * 8
    assert moe_triton.routes_in_one_program(ids, -1) == one_launch
    _, values, scales = route_and_quantise(x, ids, 16, 16, -1, True, values_order=order)
    expected_values, expected_scales = act_quant_triton(x, True)
    assert values.dtype == (torch.float16 if order == "mma" else torch.float8_e4m3fn)
    assert torch.equal(scales, expected_scales)
    assert torch.equal(values.float(), in_value_order(expected_values.float(), order).float())
    assert not torch.equal(values.float(), expected_values.float())  # the order is not the identity


@pytest.mark.parametrize("order", ["mma", "wgmma"])
def test_value_orders_place_every_input_once(order):
    """in_value_order's placements are permutations within each 8 ("mma") or 32 ("wgmma")
    inputs, with the positions the module's docstring gives."""
    values = torch.arange(1, 65, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 64 distinct e4m3 values, ascending
    placed = in_value_order(values, order).float()
    width = 8 if order == "mma" else 32
    assert sorted(placed.tolist()) == values.tolist()
    assert torch.equal(placed.view(-1, width).sort(1).values, values.view(-1, width))
    # (input, its position), worked out by hand from the docstring's formulas
    where = {"mma": [(1, 4), (2, 1), (4, 2), (7, 7), (9, 12)], "wgmma": [(1, 16), (2, 1), (8, 4), (31, 31), (33, 48)]}
    for i, at in where[order]:
        assert placed[at] == values[i], (i, at)


def test_e2m1_codes_as_e4m3_bytes_and_their_slots_meet_the_wgmma_values():
    """The "wgmma" product's decoding (kernels/moe/scaled_gluon.py, _E2M1_TO_E4M3 and
    _e4m3_weight_group), written out in torch: a code's sign to bit 7 and its other three bits to
    bits 4..2 is the e4m3 byte of 2^-6 times its value (all 16 codes); nibble s of byte 4t + j of
    a scale group at k-slot 16s + 4t + j meets, slot by slot, the activation in_value_order
    "wgmma" stores there, so the slots' dot product is the inputs' own."""
    e2m1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
    codes = torch.arange(16, dtype=torch.uint8)
    as_e4m3 = (((codes & 8) << 4) | ((codes & 7) << 2)).view(torch.float8_e4m3fn).float()
    assert torch.equal(as_e4m3, e2m1 * 2.0**-6) and torch.equal(as_e4m3.signbit(), e2m1.signbit())
    g = torch.Generator().manual_seed(7)
    nibbles = torch.randint(0, 16, (5, 32), generator=g, dtype=torch.uint8)  # 5 rows, one scale group
    packed = nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)  # low nibble first
    t, j, s = torch.arange(4)[:, None, None], torch.arange(4)[None, :, None], torch.arange(2)[None, None, :]
    slot_code = ((packed[:, 4 * t + j] >> (4 * s)) & 15).permute(0, 3, 1, 2).reshape(5, 32)  # slot 16s + 4t + j
    values = torch.randn(32).to(torch.float8_e4m3fn).float()
    slot_value = in_value_order(values, "wgmma").float()
    assert torch.equal(e2m1[slot_code.long()] @ slot_value, e2m1[nibbles.long()] @ values)


def test_bad_input_raises():
    w1, w2, w3 = expert_weights(4, 32, 16, torch.float32, "cpu", seed=70)
    ids, weights = routing("random", 3, 2, 4, "cpu", seed=71)
    x = torch.randn(3, 32)
    with pytest.raises(ValueError, match="impl"):
        moe_experts(x, ids, weights, w1, w2, w3, LIMIT, impl="fast")
    with pytest.raises(ValueError, match="expert weights"):
        moe_experts(x, ids, weights, w1, w2[:, :16], w3, LIMIT)
    with pytest.raises(ValueError, match="expert_ids"):
        moe_experts(x, ids[:2], weights[:2], w1, w2, w3, LIMIT)
    with pytest.raises(ValueError, match="dtype"):
        moe_triton.moe_experts_triton(x.half(), ids, weights, w1, w2, w3, LIMIT)
    with pytest.raises(ValueError, match="method"):
        moe_triton.route_pairs(ids, 4, 16, "sorted")
    for shared in (4, -2):
        with pytest.raises(ValueError, match=rf"shared_expert must be -1 or an expert in \[0, 4\), got {shared}"):
            moe_experts(x, ids, weights, w1, w2, w3, LIMIT, shared_expert=shared)
        with pytest.raises(ValueError, match="shared_expert must be"):
            moe_triton.moe_experts_triton(x, ids, weights, w1, w2, w3, LIMIT, shared)


# ---------------------------------------------------------------------------------------------
# Block-scaled experts (FP4 / FP8): CPU, interpreter
# ---------------------------------------------------------------------------------------------

SCALED = dict(dim=256, inter=128, num_experts=16)  # two activation blocks in, one out of w1/w3
E8M0 = torch.float8_e8m0fnu
QUANTIZE = {"fp4": quantize_fp4_weight, "fp8": quantize_fp8_weight}


def scaled_experts(fmt, scale_dtype, num_experts, dim, inter, device, seed):
    """w1, w2, w3 in `fmt` as the checkpoints store them, and their scales (w1, w2, w3)."""
    dense = expert_weights(num_experts, dim, inter, torch.float32, device, seed)
    # One expert at a time: the reference quantiser's fp32 temporaries of all experts at flash
    # widths would take several GiB next to the other test processes on the GPU.
    (w1, s1), (w2, s2), (w3, s3) = (
        [torch.stack(parts) for parts in zip(*(QUANTIZE[fmt](e, scale_dtype) for e in w))] for w in dense
    )
    return w1, w2, w3, (s1, s2, s3)


# Tolerances of the block-scaled experts, as a share of the output scale, per token. Products of
# e4m3 activations and e2m1 / e4m3 weights are exact in fp32, and act_quant is computed bit for
# bit (the shared pre-pass and helpers: tests/test_blockscale.py), so a token agrees with the reference up to the order of
# the fp32 sums (fp32 x) or one rounding of each pick's output to x's dtype that order decided
# (fp16 x: 2^-11 of a pick's output): SUM_TOL. Rarely the sum order moves an intermediate (a
# gate/up value, or h before act_quant) across a rounding midpoint, and h's act_quant then
# picks the other neighbouring e4m3 value: one element of one token's h off by one e4m3 step
# (at most 1/8 of it). One element's share of a token's output at these widths is about
# 1/sqrt(picks * inter) ~ 5%, so a step moves the output by < 1%: FLIP_TOL allows a few. Such a
# flip touches one token; most tokens must stay within SUM_TOL.
SUM_TOL = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
FLIP_TOL = 3e-2


def assert_scaled_close(out, ref, dtype):
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert torch.isfinite(out).all()
    per_token = ((out - ref).abs().amax(1) / ref.abs().max()).tolist()
    assert max(per_token) <= FLIP_TOL, f"per-token max errors {per_token} (limit {FLIP_TOL:.0e})"
    exact = sum(err <= SUM_TOL[dtype] for err in per_token)
    assert 2 * exact >= len(per_token), f"per-token max errors {per_token}: most should be within {SUM_TOL[dtype]:.0e}"


def routed_ids(pattern, batch, picks, num_experts, seed, device="cpu"):
    """Routing over experts 0..E-2: expert E-1 is the shared one, which the model never routes to
    (the reference's dense path merges a token's two pairs on one expert before act_quant)."""
    return routing(pattern, batch, picks, num_experts - 1, device, seed)


@pytest.mark.interpreter
@pytest.mark.parametrize(
    "fmt,scale_dtype,batch,dtype,shared",
    [
        ("fp4", E8M0, 5, torch.float32, 15),
        ("fp4", E8M0, 1, torch.float16, -1),
        ("fp4", torch.float32, 5, torch.float16, 15),
        ("fp4", torch.float32, 1, torch.float32, 15),
        ("fp8", E8M0, 5, torch.float16, 15),
        ("fp8", torch.float32, 5, torch.float32, -1),
    ],
)
def test_scaled_matches_reference(fmt, scale_dtype, batch, dtype, shared):
    picks, num_experts = 3, SCALED["num_experts"]
    w1, w2, w3, scales = scaled_experts(fmt, scale_dtype, num_experts, SCALED["dim"], SCALED["inter"], "cpu", seed=200 + batch)
    ids, weights = routed_ids("random", batch, picks, num_experts, seed=201 + batch)
    x = torch.randn(batch, SCALED["dim"], generator=torch.Generator().manual_seed(202 + batch)).to(dtype)
    out = moe_experts(x, ids, weights, w1, w2, w3, LIMIT, impl="triton", shared_expert=shared, scales=scales)
    ref = moe_experts_reference(x, ids, weights, w1, w2, w3, LIMIT, shared, scales)
    assert_scaled_close(out, ref, dtype)
    if shared >= 0:
        without = moe_experts(x, ids, weights, w1, w2, w3, LIMIT, impl="triton", scales=scales)
        assert (out - without).abs().max() > 0.1 * out.abs().max(), "the shared expert added nothing"


def test_scaled_gate_up_splits_only_where_tiles_leave_sms_idle():
    """V4-Flash widths on 132 SMs: batch 1 (7 pairs: 112 gate/up tiles) splits K so that every SM
    gets two programs, each split at least 4 blocks; batch 16 (96 experts: 1536 tiles) does not."""
    from kernels.moe.scaled import choose_scaled_tiles
    from kernels.triton_util import MIN_BLOCKS_PER_SPLIT

    one = choose_scaled_tiles(7, 256, 4096, 2048, 132)
    assert one.up_split > 1 and 7 * 16 * one.up_split >= 2 * 132 and 32 // one.up_split >= MIN_BLOCKS_PER_SPLIT
    assert choose_scaled_tiles(96, 256, 4096, 2048, 132).up_split == 1
    assert choose_scaled_tiles(7, 256, 256, 2048, 132).up_split == 1  # two blocks of K: nothing to split


def test_mma_product_splits_gate_up_k_in_one_wave():
    """The Gluon product's gate/up K split (one_block_mma_tiles; choose_mma_tiles keeps it): the most equal parts (dividing K's blocks, at least
    MIN_BLOCKS_PER_SPLIT blocks each) whose programs (4 a 128-column tile: w1 and w3, two halves
    each) fit one wave of `ScaledTiles.programs_per_sm` an SM, with the shallow pipeline; programs
    beyond one wave take the deep pipeline and K in two halves where each has enough blocks."""
    from kernels.moe.scaled_gluon import (
        DEEP_PIPELINE_STAGES, GATE_UP_PARTS, PIPELINE_STAGES, one_block_mma_tiles,
    )
    from kernels.triton_util import MIN_BLOCKS_PER_SPLIT

    assert GATE_UP_PARTS == 4 and one_block_mma_tiles(6, 256, 4096, 2048, 132).programs_per_sm == 4
    assert one_block_mma_tiles(6, 256, 4096, 2048, 132).up_split == 1  # 384 programs: one wave of 528
    assert one_block_mma_tiles(1, 256, 4096, 2048, 132).up_split == 8  # 64 programs a split
    assert one_block_mma_tiles(2, 256, 4096, 2048, 132).up_split == 4  # 128: 4 ways fill 512 of 528
    for pairs in (1, 2, 6, 8):
        assert one_block_mma_tiles(pairs, 256, 4096, 2048, 132).num_stages == PIPELINE_STAGES
    for pairs in (9, 96, 384):  # 576 programs and more: several waves
        tiles = one_block_mma_tiles(pairs, 256, 4096, 2048, 132)
        assert (tiles.up_split, tiles.num_stages) == (2, DEEP_PIPELINE_STAGES)
    assert one_block_mma_tiles(96, 256, 512, 2048, 132).up_split == 1  # 4 blocks: halves too short
    for dim in (4096, 2816, 1792, 256):
        for pairs in (1, 2, 3, 6):
            split = one_block_mma_tiles(pairs, 256, dim, 2048, 132).up_split
            blocks = dim // 128
            assert blocks % split == 0 and (split == 1 or blocks // split >= MIN_BLOCKS_PER_SPLIT)
            assert split == 1 or pairs * 16 * 4 * split <= 4 * 132


def test_mma_product_takes_two_blocks_a_stage_where_they_divide_every_k_range():
    """choose_mma_tiles: one_block_mma_tiles' split, with WIDE_STAGES stages of two blocks where
    two blocks divide each gate/up split's blocks and the intermediate's; else one_block_mma_tiles'
    tiles as they are."""
    from kernels.moe.scaled_gluon import WIDE_STAGES, choose_mma_tiles, one_block_mma_tiles

    for dim, inter in ((4096, 2048), (2816, 2048), (1792, 2048), (4096, 384), (512, 512)):
        for pairs in (1, 2, 6, 96, 384):
            one = one_block_mma_tiles(pairs, 256, dim, inter, 132)
            chosen = choose_mma_tiles(pairs, 256, dim, inter, 132)
            fits = (dim // 128) % (2 * one.up_split) == 0 and (inter // 128) % 2 == 0
            wide = dataclasses.replace(one, blocks_per_stage=2, num_stages=WIDE_STAGES)
            assert chosen == (wide if fits else one), (dim, inter, pairs)
    assert choose_mma_tiles(6, 256, 4096, 2048, 132).blocks_per_stage == 2  # V4-Flash, batch 1
    assert choose_mma_tiles(1, 256, 1792, 2048, 132).blocks_per_stage == 1  # 14 blocks in 2 splits of 7


@pytest.mark.interpreter
@pytest.mark.parametrize("fmt,split", [("fp4", 2), ("fp4", 3), ("fp8", 3)])
def test_scaled_gate_up_split_k(fmt, split):
    """K of the gate/up product split 2 or 3 ways (4 blocks: 2 + 2, and 2 + 1 + 1): the last split
    of each tile sums the partials and runs the epilogue, for every 16-row chunk of its segment
    (20 tokens on one expert: two chunks, one arrival), and the arrival counters are back at zero.
    (The interpreter runs programs one after another, so the arrival order never varies here; the
    GPU tests check that the result does not depend on it.)"""
    from kernels.moe.scaled import choose_scaled_tiles, moe_experts_scaled_triton
    from kernels.arrival import split_counters

    picks, num_experts, dim, inter = 3, 8, 512, 256
    w1, w2, w3, scales = scaled_experts(fmt, E8M0, num_experts, dim, inter, "cpu", seed=230 + split)
    for batch, pattern in ((1, "random"), (5, "random"), (20, "one_hot_expert")):
        ids, weights = routed_ids(pattern, batch, picks, num_experts, seed=231 + batch)
        x = torch.randn(batch, dim, generator=torch.Generator().manual_seed(232 + batch)).to(torch.float32)
        tiles = dataclasses.replace(choose_scaled_tiles(batch * picks, num_experts, dim, inter, 8), up_split=split)
        out = moe_experts_scaled_triton(x, ids, weights, w1, w2, w3, scales, LIMIT, tiles=tiles)
        assert_scaled_close(out, moe_experts_reference(x, ids, weights, w1, w2, w3, LIMIT, -1, scales), torch.float32)
    assert not split_counters(torch.device("cpu"), 64).any()


@pytest.mark.interpreter
@pytest.mark.parametrize("product", ["dot_scaled", "codes"])
def test_scaled_fp4_both_products(product):
    """FP4 with ue8m0 scales through `tl.dot_scaled` (the default) and through the codes decoded
    in the kernel (the other formats' path, kept for them and for comparison)."""
    from kernels.moe.scaled import choose_scaled_tiles, moe_experts_scaled_triton

    picks, num_experts, batch = 3, SCALED["num_experts"], 6
    w1, w2, w3, scales = scaled_experts("fp4", E8M0, num_experts, SCALED["dim"], SCALED["inter"], "cpu", seed=220)
    ids, weights = routed_ids("random", batch, picks, num_experts, seed=221)
    x = torch.randn(batch, SCALED["dim"], generator=torch.Generator().manual_seed(222)).to(torch.float16)
    tiles = dataclasses.replace(choose_scaled_tiles(batch * picks, num_experts, SCALED["dim"], SCALED["inter"], 8), product=product)
    out = moe_experts_scaled_triton(x, ids, weights, w1, w2, w3, scales, LIMIT, tiles=tiles)
    assert_scaled_close(out, moe_experts_reference(x, ids, weights, w1, w2, w3, LIMIT, -1, scales), torch.float16)


@pytest.mark.interpreter
@pytest.mark.parametrize(
    "batch,pattern,shared,dtype",
    [
        (20, "one_hot_expert", -1, torch.float32),  # 20 pairs on one expert: two 16-row chunks
        (40, "random", 15, torch.float16),  # the shared expert's 40 pairs: three chunks
        (70, "random", 15, torch.float32),  # 70 pairs: two segments of the shared expert
    ],
)
def test_scaled_experts_picked_by_many_tokens(batch, pattern, shared, dtype):
    """An expert several tokens picked: its pairs in one program's segment (up to 64), 16 rows at
    a time, beyond that in several segments; the same sums as the reference."""
    picks, num_experts = 3, SCALED["num_experts"]
    w1, w2, w3, scales = scaled_experts("fp4", E8M0, num_experts, SCALED["dim"], SCALED["inter"], "cpu", seed=210 + batch)
    ids, weights = routed_ids(pattern, batch, picks, num_experts, seed=211 + batch)
    x = torch.randn(batch, SCALED["dim"], generator=torch.Generator().manual_seed(212 + batch)).to(dtype)
    out = moe_experts(x, ids, weights, w1, w2, w3, LIMIT, impl="triton", shared_expert=shared, scales=scales)
    ref = moe_experts_reference(x, ids, weights, w1, w2, w3, LIMIT, shared, scales)
    assert_scaled_close(out, ref, dtype)


@pytest.mark.interpreter
@pytest.mark.parametrize("fmt", ["fp4", "fp8"])
def test_scaled_unselected_experts_are_never_read(fmt):
    """NaN scales on every expert nobody picked (nor the shared one) leave the output unchanged."""
    num_experts = SCALED["num_experts"]
    w1, w2, w3, scales = scaled_experts(fmt, torch.float32, num_experts, SCALED["dim"], SCALED["inter"], "cpu", seed=220)
    ids, weights = routing("some_experts_idle", 4, 3, num_experts, "cpu", seed=221)
    x = torch.randn(4, SCALED["dim"], generator=torch.Generator().manual_seed(222))
    ref = moe_experts_reference(x, ids, weights, w1, w2, w3, LIMIT, scales=scales)
    idle = torch.ones(num_experts, dtype=torch.bool)
    idle[ids.unique()] = False
    assert idle.any()
    for s in scales:
        s[idle] = float("nan")
    out = moe_experts(x, ids, weights, w1, w2, w3, LIMIT, impl="triton", scales=scales)
    assert_scaled_close(out, ref, torch.float32)


@pytest.mark.interpreter
def test_scaled_clamp_and_no_clamp():
    w1, w2, w3, scales = scaled_experts("fp4", E8M0, 8, SCALED["dim"], SCALED["inter"], "cpu", seed=230)
    ids, weights = routing("random", 3, 2, 8, "cpu", seed=231)
    x = torch.randn(3, SCALED["dim"], generator=torch.Generator().manual_seed(232)) * 3
    outs = {}
    for limit in (0.3, 0.0):
        outs[limit] = moe_experts(x, ids, weights, w1, w2, w3, limit, impl="triton", scales=scales, pow2=False)
        assert_scaled_close(outs[limit], moe_experts_reference(x, ids, weights, w1, w2, w3, limit, scales=scales, pow2=False), torch.float32)
    assert (outs[0.3] - outs[0.0]).abs().max() > 0.1 * outs[0.0].abs().max(), "the clamp had no effect"


def test_scaled_bad_input_raises():
    w1, w2, w3, scales = scaled_experts("fp4", E8M0, 4, 128, 128, "cpu", seed=240)
    ids, weights = routing("random", 2, 2, 4, "cpu", seed=241)
    x = torch.randn(2, 128)
    with pytest.raises(ValueError, match="w1 and w3 must share a format"):
        moe_scaled.moe_experts_scaled_triton(x, ids, weights, w1, w2, w3, (scales[0], scales[1], scales[2].float()), LIMIT)
    with pytest.raises(ValueError, match="expert_ids must be integer"):
        moe_scaled.moe_experts_scaled_triton(x, ids.float(), weights, w1, w2, w3, scales, LIMIT)
    with pytest.raises(ValueError, match="x must be one of"):
        moe_scaled.moe_experts_scaled_triton(x.double(), ids, weights, w1, w2, w3, scales, LIMIT)
    with pytest.raises(ValueError, match="w2 must be contiguous"):
        moe_scaled.moe_experts_scaled_triton(x, ids, weights, w1, w2.transpose(1, 2).contiguous().transpose(1, 2), w3, scales, LIMIT)
    with pytest.raises(ValueError, match="shared_expert must be"):
        moe_scaled.moe_experts_scaled_triton(x, ids, weights, w1, w2, w3, scales, LIMIT, shared_expert=4)
    with pytest.raises(ValueError, match="w2's scale"):
        moe_experts(x, ids, weights, w1, w2, w3, LIMIT, impl="triton", scales=(scales[0], scales[1][:, None], scales[2]))


# opcheck's schema test cannot take fp8 arguments (it multiplies them).
SCALED_OPCHECKS = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")


def test_scaled_opcheck_cpu():
    ids, weights = routing("random", 3, 2, 3, "cpu", seed=251)
    x = torch.randn(3, 128)
    for fmt, shared in (("fp4", -1), ("fp8", 3)):
        w1, w2, w3, scales = scaled_experts(fmt, E8M0, 4, 128, 128, "cpu", seed=250)
        args = (x, ids, weights, w1, w2, w3, *scales, LIMIT, shared, True)
        torch.library.opcheck(torch.ops.v4.moe_experts_scaled.default, args, test_utils=SCALED_OPCHECKS)


# ---------------------------------------------------------------------------------------------
# GPU: compiled, V4-Flash widths, bf16
# ---------------------------------------------------------------------------------------------

FLASH = dict(dim=4096, inter=2048, num_experts=16, picks=6)
GPU_TOL = 2e-2  # bf16 rounding of gate/up, h and each expert output, summed in another order



@pytest.fixture(scope="module")
def flash_weights():
    return expert_weights(FLASH["num_experts"], FLASH["dim"], FLASH["inter"], torch.bfloat16, "cuda", seed=80)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "pattern,batch,shared",
    [
        ("random", 1, -1), ("random", 16, -1), ("random", 64, -1), ("one_hot_expert", 64, -1), ("some_experts_idle", 32, -1),
        ("random", 1000, -1), ("random", 1, 15), ("random", 64, 15), ("one_hot_expert", 64, 15), ("random", 1000, 15),
    ],
)
def test_flash_widths_bf16(flash_weights, pattern, batch, shared):
    w1, w2, w3 = flash_weights
    ids, weights = routing(pattern, batch, FLASH["picks"], FLASH["num_experts"], "cuda", seed=81 + batch)
    x = torch.randn(batch, FLASH["dim"], device="cuda").to(torch.bfloat16)
    out = moe_experts(x, ids, weights, w1, w2, w3, LIMIT, shared_expert=shared)
    ref = moe_experts_reference(x, ids, weights, w1, w2, w3, LIMIT, shared)
    assert_close_to_reference(out, ref, GPU_TOL)


@pytest.mark.gpu
def test_cuda_graph_replay_with_new_routing(flash_weights):
    w1, w2, w3 = flash_weights
    batch = 24
    x = torch.randn(batch, FLASH["dim"], device="cuda").to(torch.bfloat16)
    ids, weights = routing("random", batch, FLASH["picks"], FLASH["num_experts"], "cuda", seed=90)
    graph, out = capture(lambda: moe_experts(x, ids, weights, w1, w2, w3, LIMIT))
    for seed, pattern in ((91, "one_hot_expert"), (92, "some_experts_idle"), (93, "random")):
        new_ids, new_weights = routing(pattern, batch, FLASH["picks"], FLASH["num_experts"], "cuda", seed=seed)
        ids.copy_(new_ids)
        weights.copy_(new_weights)
        x.copy_(torch.randn(batch, FLASH["dim"], device="cuda"))
        graph.replay()
        assert_close_to_reference(out.clone(), moe_experts_reference(x, ids, weights, w1, w2, w3, LIMIT), GPU_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 64])
def test_no_host_sync_and_opcheck_cuda(flash_weights, batch):
    """Neither the Triton path nor the plain-torch reference syncs with the host."""
    w1, w2, w3 = flash_weights
    ids, weights = routing("random", batch, FLASH["picks"], FLASH["num_experts"], "cuda", seed=100)
    x = torch.randn(batch, FLASH["dim"], device="cuda").to(torch.bfloat16)
    moe_experts(x, ids, weights, w1, w2, w3, LIMIT)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        moe_experts(x, ids, weights, w1, w2, w3, LIMIT)
        moe_experts(x, ids, weights, w1, w2, w3, LIMIT, impl="reference")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.library.opcheck(torch.ops.v4.moe_experts.default, (x, ids, weights, w1, w2, w3, LIMIT, FLASH["num_experts"] - 1))


@pytest.mark.parametrize("shared_memory_kib", [227, 163, 99])
def test_gate_up_tiles_fit_the_shared_memory_they_are_planned_for(shared_memory_kib):
    """Wide gate/up tiles (two programs per SM) only where their pipeline fits one program's
    shared memory; the down tiles do not depend on it."""
    smem = shared_memory_kib * 1024
    for batch in (1, 16, 64):
        tiles = moe_triton.choose_tiles(batch * 6, 16, 4096, 2048, 2, 132, smem)
        narrow = moe_triton.choose_tiles(batch * 6, 16, 4096, 2048, 2, 132, 99 * 1024)
        stage = (tiles.block_m + 2 * tiles.up_block_n) * tiles.up_block_k * 2
        assert tiles.num_stages * stage <= smem, (shared_memory_kib, batch, tiles)
        assert (tiles.down_block_n, tiles.down_block_k) == (narrow.down_block_n, narrow.down_block_k)
        assert (tiles.up_block_n > narrow.up_block_n) == (shared_memory_kib == 227), (shared_memory_kib, batch, tiles)


# Block-scaled experts at V4-Flash widths: 32 routed experts and the shared one stacked last.
SCALED_FLASH = dict(dim=4096, inter=2048, num_experts=33, picks=6)


@pytest.fixture(scope="module", params=[("fp4", E8M0), ("fp8", E8M0), ("fp4", torch.float32)], ids=["fp4", "fp8", "fp4-fp32-scales"])
def flash_scaled(request):
    fmt, scale_dtype = request.param
    c = SCALED_FLASH
    return scaled_experts(fmt, scale_dtype, c["num_experts"], c["dim"], c["inter"], "cuda", seed=300)


def scaled_flash_inputs(batch, seed, pattern="random"):
    c = SCALED_FLASH
    ids, weights = routed_ids(pattern, batch, c["picks"], c["num_experts"], seed, "cuda")
    x = torch.randn(batch, c["dim"], device="cuda", generator=torch.Generator("cuda").manual_seed(seed)).to(torch.bfloat16)
    return x, ids, weights


@pytest.mark.gpu
@pytest.mark.parametrize("batch,pattern", [(1, "random"), (16, "random"), (64, "random"), (64, "one_hot_expert")])
def test_scaled_flash_widths_bf16(flash_scaled, batch, pattern):
    """The default implementation at V4-Flash widths; the same result twice (batch 1 splits K,
    whose partial sums must not depend on which split arrives last)."""
    w1, w2, w3, scales = flash_scaled
    shared = SCALED_FLASH["num_experts"] - 1
    x, ids, weights = scaled_flash_inputs(batch, 310 + batch, pattern)
    for shared_expert in (-1, shared):
        out = moe_experts(x, ids, weights, w1, w2, w3, LIMIT, shared_expert=shared_expert, scales=scales)
        ref = moe_experts_reference(x, ids, weights, w1, w2, w3, LIMIT, shared_expert, scales)
        assert_scaled_close(out, ref, torch.bfloat16)
        assert torch.equal(moe_experts(x, ids, weights, w1, w2, w3, LIMIT, shared_expert=shared_expert, scales=scales), out)


@pytest.mark.gpu
def test_scaled_inside_torch_compile(flash_scaled):
    """The custom op traced by Dynamo (its fake implementation) and run by Inductor's wrapper."""
    w1, w2, w3, scales = flash_scaled
    shared = SCALED_FLASH["num_experts"] - 1
    x, ids, weights = scaled_flash_inputs(16, 320)

    @torch.compile(fullgraph=True)
    def step(x, ids, weights):
        return moe_experts(x * 2, ids, weights, w1, w2, w3, LIMIT, shared_expert=shared, scales=scales) + 1

    ref = moe_experts_reference(x * 2, ids, weights, w1, w2, w3, LIMIT, shared, scales) + 1
    assert_scaled_close(step(x, ids, weights) - 1, ref - 1, torch.bfloat16)


@pytest.mark.gpu
def test_scaled_cuda_graph_replay_with_new_routing(flash_scaled):
    w1, w2, w3, scales = flash_scaled
    shared = SCALED_FLASH["num_experts"] - 1
    batch = 24
    x, ids, weights = scaled_flash_inputs(batch, 330)
    graph, out = capture(lambda: moe_experts(x, ids, weights, w1, w2, w3, LIMIT, shared_expert=shared, scales=scales))
    for seed, pattern in ((331, "one_hot_expert"), (332, "some_experts_idle"), (333, "random")):
        new_x, new_ids, new_weights = scaled_flash_inputs(batch, seed, pattern)
        x.copy_(new_x)
        ids.copy_(new_ids)
        weights.copy_(new_weights)
        graph.replay()
        ref = moe_experts_reference(x, ids, weights, w1, w2, w3, LIMIT, shared, scales)
        assert_scaled_close(out.clone(), ref, torch.bfloat16)


@pytest.mark.gpu
def test_scaled_no_host_sync_and_opcheck_cuda(flash_scaled):
    w1, w2, w3, scales = flash_scaled
    shared = SCALED_FLASH["num_experts"] - 1
    x, ids, weights = scaled_flash_inputs(8, 340)
    moe_experts(x, ids, weights, w1, w2, w3, LIMIT, shared_expert=shared, scales=scales)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        moe_experts(x, ids, weights, w1, w2, w3, LIMIT, shared_expert=shared, scales=scales)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    args = (x, ids, weights, w1, w2, w3, *scales, LIMIT, shared, True)
    torch.library.opcheck(torch.ops.v4.moe_experts_scaled.default, args, test_utils=SCALED_OPCHECKS)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "batch,pattern,split",
    [(1, "random", None), (16, "random", None), (64, "random", None), (64, "one_hot_expert", None),
     (12, "one_hot_expert", 3)],  # 12 pairs on one expert in chunks of 8, with K split 3 ways
)
def test_scaled_mma_product_matches_reference(flash_scaled, batch, pattern, split):
    """The Gluon product (codes decoded into the tensor-core fragments) against the reference, the
    routed experts alone and with the shared one, every chunk and split path; the same result
    twice (the split sums in a fixed order)."""
    from kernels.moe.scaled import choose_scaled_tiles
    from kernels.moe.scaled_gluon import moe_experts_scaled_mma

    w1, w2, w3, scales = flash_scaled
    if w1.dtype != torch.uint8:
        pytest.skip("the mma product takes FP4 experts")
    c = SCALED_FLASH
    x, ids, weights = scaled_flash_inputs(batch, 350 + batch, pattern)
    tiles = None
    if split is not None:
        tiles = dataclasses.replace(choose_scaled_tiles(batch * c["picks"], c["num_experts"], c["dim"], c["inter"], 132),
                                    product="mma", up_split=split)
    for shared_expert in (-1, c["num_experts"] - 1):
        out = moe_experts_scaled_mma(x, ids, weights, w1, w2, w3, scales, LIMIT, shared_expert, tiles=tiles)
        ref = moe_experts_reference(x, ids, weights, w1, w2, w3, LIMIT, shared_expert, scales)
        assert_scaled_close(out, ref, torch.bfloat16)
        assert torch.equal(moe_experts_scaled_mma(x, ids, weights, w1, w2, w3, scales, LIMIT, shared_expert, tiles=tiles), out)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "batch,pattern,split,stages",
    [(1, "random", None, None), (16, "random", None, None), (64, "random", None, None),
     (12, "one_hot_expert", 4, 2), (9, "random", 1, 4)],  # 12 pairs on one expert: chunks of 8, K split 4 ways
)
def test_scaled_wgmma_product_matches_reference(flash_scaled, batch, pattern, split, stages):
    """The product on Hopper's warpgroup instruction (codes decoded to e4m3, the activations in
    "wgmma" order read from shared memory) against the reference, at the op's tiles and at other
    splits and pipeline depths, the routed experts alone and with the shared one; the same result
    twice."""
    from kernels.moe.scaled_gluon import choose_mma_tiles, moe_experts_scaled_mma, runs_wgmma

    w1, w2, w3, scales = flash_scaled
    if w1.dtype != torch.uint8 or not runs_wgmma(w1.device):
        pytest.skip("the wgmma product takes FP4 experts on a compute capability 9.x GPU")
    c = SCALED_FLASH
    x, ids, weights = scaled_flash_inputs(batch, 450 + batch, pattern)
    for shared_expert in (-1, c["num_experts"] - 1):
        pairs = batch * (c["picks"] + (shared_expert >= 0))
        tiles = dataclasses.replace(choose_mma_tiles(pairs, c["num_experts"], c["dim"], c["inter"], 132), product="wgmma")
        if split is not None:
            tiles = dataclasses.replace(tiles, up_split=split, num_stages=stages)
        assert tiles.blocks_per_stage == 2
        out = moe_experts_scaled_mma(x, ids, weights, w1, w2, w3, scales, LIMIT, shared_expert, tiles=tiles)
        ref = moe_experts_reference(x, ids, weights, w1, w2, w3, LIMIT, shared_expert, scales)
        assert_scaled_close(out, ref, torch.bfloat16)
        assert torch.equal(moe_experts_scaled_mma(x, ids, weights, w1, w2, w3, scales, LIMIT, shared_expert, tiles=tiles), out)


@pytest.mark.gpu
@pytest.mark.parametrize("scale_dtype, dim, inter, up_split, stages",
                         [(torch.float32, 384, 384, 2, 4), (E8M0, 512, 512, 3, 8), (torch.float32, 384, 384, 1, 2),
                          (torch.float32, 512, 640, 1, 2)])
def test_scaled_mma_product_odd_step_counts(scale_dtype, dim, inter, up_split, stages):
    """K splits of fewer 128-input steps than the pipeline's stages (copies past the last step
    fill their slots with zeros), odd counts of steps where the scales allow them (fp32 scales:
    3 steps split 2 + 1; one-byte scales take rows of 512 inputs: 4 steps split 2 + 2 + none),
    and the shallowest pipeline (one step copied ahead) over more steps than its stages: the
    refilling steps in rounds of the stages with one left over (gate/up: 4 steps, 3 refilling),
    and in whole rounds (down: 5 steps, 4 refilling)."""
    from kernels.moe.scaled import choose_scaled_tiles
    from kernels.moe.scaled_gluon import moe_experts_scaled_mma

    num_experts = 6
    w1, w2, w3, scales = scaled_experts("fp4", scale_dtype, num_experts, dim, inter, "cuda", seed=370)
    for batch in (1, 9):
        x = torch.randn(batch, dim, device="cuda").to(torch.bfloat16)
        ids, weights = routed_ids("random", batch, 2, num_experts, seed=371 + batch, device="cuda")
        tiles = dataclasses.replace(choose_scaled_tiles(batch * 3, num_experts, dim, inter, 132), product="mma",
                                    up_split=up_split, num_stages=stages)
        out = moe_experts_scaled_mma(x, ids, weights, w1, w2, w3, scales, LIMIT, num_experts - 1, tiles=tiles)
        assert_scaled_close(out, moe_experts_reference(x, ids, weights, w1, w2, w3, LIMIT, num_experts - 1, scales),
                            torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 16, 64])
def test_scaled_mma_two_blocks_a_stage_give_one_blocks_result(flash_scaled, batch):
    """`ScaledTiles.blocks_per_stage` 2 (each row's codes copied 128 bytes at a time, two blocks
    multiplied a stage) sums the same block products in the same order: bit for bit one block a
    stage, and the reference within tolerance, over pipelines shallower and deeper than the op's
    (choose_mma_tiles takes two blocks a stage at these widths)."""
    from kernels.moe.scaled_gluon import moe_experts_scaled_mma, one_block_mma_tiles

    w1, w2, w3, scales = flash_scaled
    if w1.dtype != torch.uint8:
        pytest.skip("the mma product takes FP4 experts")
    c = SCALED_FLASH
    x, ids, weights = scaled_flash_inputs(batch, 390 + batch, "random")
    for shared_expert in (-1, c["num_experts"] - 1):
        pairs = batch * (c["picks"] + (shared_expert >= 0))
        tiles = one_block_mma_tiles(pairs, c["num_experts"], c["dim"], c["inter"], torch.cuda.get_device_properties(0).multi_processor_count)
        one = moe_experts_scaled_mma(x, ids, weights, w1, w2, w3, scales, LIMIT, shared_expert, tiles=tiles)
        for stages in (2, 3, 4):
            two = moe_experts_scaled_mma(x, ids, weights, w1, w2, w3, scales, LIMIT, shared_expert,
                                         tiles=dataclasses.replace(tiles, blocks_per_stage=2, num_stages=stages))
            assert torch.equal(two, one)
        assert_scaled_close(two, moe_experts_reference(x, ids, weights, w1, w2, w3, LIMIT, shared_expert, scales), torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 16, 64])
def test_scaled_mma_down_kernel_as_a_dependent_launch(flash_scaled, batch):
    """The down kernel launched as a programmatic dependent of the gate/up (`ScaledTiles.
    dependent_launch`: its first weight copies before it waits for the gate/up's activations)
    gives the result of the down kernel launched after the gate/up ends, bit for bit, called
    and replayed from a captured graph with new inputs."""
    from kernels.moe.scaled_gluon import choose_mma_tiles, moe_experts_scaled_mma
    from kernels.triton_util import launches_dependents

    w1, w2, w3, scales = flash_scaled
    if w1.dtype != torch.uint8:
        pytest.skip("the mma product takes FP4 experts")
    if not launches_dependents(torch.device("cuda")):
        pytest.skip("programmatic dependent launch needs a Hopper GPU")
    c = SCALED_FLASH
    shared_expert = c["num_experts"] - 1
    pairs = batch * (c["picks"] + 1)
    tiles = choose_mma_tiles(pairs, c["num_experts"], c["dim"], c["inter"], torch.cuda.get_device_properties(0).multi_processor_count)
    assert tiles.dependent_launch

    def call(x, ids, weights, dependent):
        return moe_experts_scaled_mma(x, ids, weights, w1, w2, w3, scales, LIMIT, shared_expert,
                                      tiles=dataclasses.replace(tiles, dependent_launch=dependent))

    x, ids, weights = scaled_flash_inputs(batch, 395 + batch, "random")
    after = call(x, ids, weights, False)
    assert torch.equal(call(x, ids, weights, True), after)
    assert_scaled_close(after, moe_experts_reference(x, ids, weights, w1, w2, w3, LIMIT, shared_expert, scales), torch.bfloat16)
    graph, out = capture(lambda: call(x, ids, weights, True))
    for seed in (396, 397):
        new = scaled_flash_inputs(batch, seed + batch, "random")
        for dst, src in zip((x, ids, weights), new):
            dst.copy_(src)
        graph.replay()
        assert torch.equal(out, call(*new, False))


def test_scaled_mma_product_refuses_blocks_a_stage_that_do_not_divide_its_splits():
    """Two blocks a stage need an even count of 128-input blocks in every K split of the gate/up
    product and in the intermediate width; other counts of blocks are refused before anything
    is quantised or launched."""
    from kernels.moe.scaled import ScaledTiles
    from kernels.moe.scaled_gluon import moe_experts_scaled_mma

    w1, w2, w3, scales = scaled_experts("fp4", torch.float32, 4, 512, 384, "cpu", seed=365)
    ids, weights = routed_ids("random", 2, 2, 4, seed=366)
    x = torch.randn(2, 512)
    for tiles, named in ((ScaledTiles(down_block_n=64, blocks_per_stage=2), "inter 384"),
                         (ScaledTiles(down_block_n=64, blocks_per_stage=2, up_split=4), "in 4 splits"),
                         (ScaledTiles(down_block_n=64, blocks_per_stage=3), "got 3")):
        with pytest.raises(ValueError, match=f"blocks_per_stage.*{named}"):
            moe_experts_scaled_mma(x, ids, weights, w1, w2, w3, scales, LIMIT, tiles=tiles)


def test_scaled_wgmma_product_refuses_other_gpus_and_one_block_a_stage(monkeypatch):
    """The warpgroup instruction is Hopper's, and its product copies two blocks a stage: elsewhere,
    or with one block a stage, it is refused by name before anything is quantised or launched."""
    import kernels.moe.scaled_gluon as scaled_gluon
    from kernels.moe.scaled import ScaledTiles

    w1, w2, w3, scales = scaled_experts("fp4", E8M0, 4, 512, 512, "cpu", seed=367)
    ids, weights = routed_ids("random", 2, 2, 4, seed=368)
    x = torch.randn(2, 512)
    wide = ScaledTiles(down_block_n=64, blocks_per_stage=2, product="wgmma")
    with pytest.raises(ValueError, match="wgmma product runs on sm_90 only, not on cpu"):
        scaled_gluon.moe_experts_scaled_mma(x, ids, weights, w1, w2, w3, scales, LIMIT, tiles=wide)
    monkeypatch.setattr(scaled_gluon, "runs_wgmma", lambda device: True)
    with pytest.raises(ValueError, match="copies 2 blocks a stage, got 1"):
        scaled_gluon.moe_experts_scaled_mma(x, ids, weights, w1, w2, w3, scales, LIMIT,
                                            tiles=dataclasses.replace(wide, blocks_per_stage=1))


def test_scaled_mma_product_refuses_other_formats():
    """FP8 experts, a width that is not whole 128-blocks, or rows laid out otherwise than the copies
    take are refused by name before any launch."""
    from kernels.moe.scaled_gluon import _copyable, choose_mma_tiles, moe_experts_scaled_mma, takes
    from kernels.triton_util import converts_e4m3

    w1, w2, w3, scales = scaled_experts("fp8", E8M0, 4, 256, 128, "cpu", seed=360)
    ids, weights = routed_ids("random", 2, 2, 4, seed=361)
    with pytest.raises(ValueError, match="mma product takes FP4 experts"):
        moe_experts_scaled_mma(torch.randn(2, 256), ids, weights, w1, w2, w3, scales, LIMIT)
    w1, w2, w3, scales = scaled_experts("fp4", E8M0, 4, 256, 96, "cpu", seed=362)
    with pytest.raises(ValueError, match="multiples of 128"):
        moe_experts_scaled_mma(torch.randn(2, 256), ids, weights, w1, w2, w3, scales, LIMIT)
    # Rows the copies into shared memory cannot take: w3 a view with longer rows than w1's, scales
    # not contiguous along their groups, one-byte scales in rows of 12 bytes (384 inputs).
    w1, w2, w3, scales = scaled_experts("fp4", E8M0, 4, 512, 512, "cpu", seed=363)
    x = torch.randn(2, 512)
    assert takes(x, w1, w2, w3, scales) or not converts_e4m3(x.device)
    wide_w3 = torch.cat([w3, w3], dim=2)[..., : w3.shape[2]]
    with pytest.raises(ValueError, match="alike in row strides"):
        moe_experts_scaled_mma(x, ids, weights, w1, w2, wide_w3, scales, LIMIT)
    strided = (scales[0], scales[1].transpose(1, 2).contiguous().transpose(1, 2), scales[2])
    with pytest.raises(ValueError, match="contiguous along the inputs"):
        moe_experts_scaled_mma(x, ids, weights, w1, w2, w3, strided, LIMIT)
    for scale_dtype, refused in ((E8M0, True), (torch.float32, False)):
        w1, w2, w3, scales = scaled_experts("fp4", scale_dtype, 4, 384, 512, "cpu", seed=364)
        assert _copyable(w1, w2, w3, scales) is not refused
    with pytest.raises(ValueError, match="one-byte scales 16"):
        w1, w2, w3, scales = scaled_experts("fp4", E8M0, 4, 384, 512, "cpu", seed=364)
        moe_experts_scaled_mma(torch.randn(2, 384), ids, weights, w1, w2, w3, scales, LIMIT)
    w1, w2, w3, scales = scaled_experts("fp4", E8M0, 4, 512, 512, "cpu", seed=365)
    shallow = dataclasses.replace(choose_mma_tiles(4, 4, 512, 512, 132), num_stages=1)
    with pytest.raises(ValueError, match="num_stages must be at least 2"):
        moe_experts_scaled_mma(torch.randn(2, 512), ids, weights, w1, w2, w3, scales, LIMIT, tiles=shallow)
    for programs in (1, 9):
        crowded = dataclasses.replace(choose_mma_tiles(4, 4, 512, 512, 132), programs_per_sm=programs)
        with pytest.raises(ValueError, match=rf"programs_per_sm must be in \[2, 8\], got {programs}"):
            moe_experts_scaled_mma(torch.randn(2, 512), ids, weights, w1, w2, w3, scales, LIMIT, tiles=crowded)


@pytest.mark.parametrize("wgmma", [False, True])
def test_tile_sweep_times_the_chosen_tiles_and_every_variant(wgmma):
    """kernels.bench moe_tiles: the tiles choose_mma_tiles picks first, then every stages x split
    variant once (the chosen one not twice), all deep enough for the Gluon pipeline; on Hopper
    each two-block variant also on the warpgroup instruction."""
    from kernels.bench.moe_tiles import SPLITS, STAGES, WGMMA_PROGRAMS_PER_SM, candidate_tiles
    from kernels.moe.scaled_gluon import choose_mma_tiles

    for pairs in (6, 96):
        chosen = choose_mma_tiles(pairs, 256, 4096, 2048, 132)
        variants = candidate_tiles(chosen, wgmma)
        assert next(iter(variants.values())) == chosen
        combos = {(t.blocks_per_stage, t.num_stages, t.up_split, t.product == "wgmma", t.programs_per_sm)
                  for t in variants.values()}
        every = {(b, s, k, False, 4) for b, s in STAGES for k in SPLITS}  # every split divides V4-Flash's 32 blocks in pairs
        if wgmma:
            every |= {(b, s, k, True, p) for b, s in STAGES for k in SPLITS for p in WGMMA_PROGRAMS_PER_SM if b == 2}
        assert combos == {(chosen.blocks_per_stage, chosen.num_stages, chosen.up_split, False, 4)} | every
        assert len(variants) == len(combos) and all(t.num_stages >= 2 for t in variants.values())
