"""indexer_topk and its two halves (indexer_scores, indexer_select: the index heads split across
processes): the Triton path against the plain-torch reference on fresh random inputs.

CPU tests run the Triton kernels in the interpreter (TRITON_INTERPRET=1, fp32/fp16, small
shapes). GPU tests run them compiled at V4 shapes in bf16, replayed in a CUDA graph, and
through opcheck. Picks are compared as sets (the CUDA kernel returns them in entry order)."""
from __future__ import annotations

import pytest
import torch

import kernels.indexer.triton as indexer_triton
from kernels.indexer import exact_fp32_products, indexer_scores, indexer_select, indexer_topk, indexer_topk_reference
from kernels.cuda_graph import capture


@pytest.fixture(autouse=True)
def fp32_matmul_without_tf32():
    """The reference's fp32 einsum must not run in TF32 (other code may have enabled it)."""
    with exact_fp32_products():
        yield


def test_exact_fp32_products_puts_the_setting_back_exactly():
    """Put back as it was, also as a fresh process has it (nothing set): a later compile's cache
    key includes the setting, and a changed key compiles again what the cache holds."""
    matmul = torch.backends.cuda.matmul
    name, untouched = ("fp32_precision", "none") if hasattr(matmul, "fp32_precision") else ("allow_tf32", False)
    outer = getattr(matmul, name)  # as this module's fixture set it
    try:
        for before in (untouched, outer):
            setattr(matmul, name, before)
            with exact_fp32_products():
                assert matmul.allow_tf32 is False
            assert getattr(matmul, name) == before
        with pytest.raises(RuntimeError, match="inside"), exact_fp32_products():
            raise RuntimeError("inside")
        assert getattr(matmul, name) == outer
    finally:
        setattr(matmul, name, outer)


def fp64_scores(q, weights, cache, slots, visible):
    """score[b, t] in fp64 for every row of the slot (independent of both implementations)."""
    keys = cache[slots.long()].double()
    dots = torch.einsum("bhd,btd->bht", q.double(), keys).relu()
    return (dots * weights.double()[..., None]).sum(1)


def assert_same_picks(picks, expected, scores, visible, topk, tol=0.0):
    """picks and expected ([B, topk], any order) hold the same entries and -1 padding. With
    tol > 0, entries whose score is within tol of the topk-th visible score may differ (a swap
    across a near-tie); every pick must still score at least that threshold - tol."""
    assert picks.dtype == torch.int32 and picks.shape == expected.shape == (scores.shape[0], topk)
    rows = scores.shape[1]
    for b in range(scores.shape[0]):
        vis = min(max(int(visible[b]), 0), rows)
        count = min(vis, topk)
        row = picks[b].tolist()
        got = row[:count]
        assert row[count:] == [-1] * (topk - count), f"row {b}: -1 padding wrong: {row}"
        assert len(set(got)) == count and all(0 <= e < vis for e in got), f"row {b}: bad picks {sorted(got)}"
        want = {e for e in expected[b].tolist() if e >= 0}
        differ = set(got) ^ want
        if vis <= topk or tol == 0:
            assert not differ, f"row {b} (visible {vis}): entries {sorted(differ)} differ"
            continue
        kth = scores[b, :vis].topk(topk).values[-1]
        near = (scores[b, sorted(differ)] - kth).abs() <= tol if differ else torch.ones(0, dtype=torch.bool)
        assert bool(near.all()), f"row {b}: entries {sorted(differ)} differ away from the threshold"
        assert bool((scores[b, got] >= kth - tol).all()), f"row {b}: a pick scores below the threshold"


def random_inputs(batch, heads, dim, num_slots, rows, dtype, device, seed, weight_scale=1.0):
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(batch, heads, dim, generator=g, device=device).to(dtype)
    weights = (torch.randn(batch, heads, generator=g, device=device) * weight_scale).to(dtype)
    cache = torch.randn(num_slots, rows, dim, generator=g, device=device).to(dtype)
    slots = torch.randint(0, num_slots, (batch,), generator=g, device=device)
    return q, weights, cache, slots


# ---------------------------------------------------------------------------------------------
# CPU: interpreter
# ---------------------------------------------------------------------------------------------


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_matches_reference_ragged(dtype):
    """Ragged visible counts (none, negative, fewer than topk, exactly topk, many more, past the
    capacity) over several slots, two sequences sharing one."""
    rows, topk = 600, 48
    visible = torch.tensor([0, -2, 1, 47, 48, 49, 257, 600, 10**6])
    q, weights, cache, slots = random_inputs(len(visible), 16, 32, 4, rows, dtype, "cpu", seed=1)
    slots[3] = slots[6]
    picks = indexer_topk(q, weights, cache, slots, visible, topk, impl="triton")
    expected = indexer_topk_reference(q, weights, cache, slots, visible, topk)
    assert_same_picks(picks, expected, fp64_scores(q, weights, cache, slots, visible), visible, topk)


@pytest.mark.interpreter
def test_odd_head_sizes_and_topk_past_capacity():
    """Head count and width that are not powers of two (masked lanes), int32 slots/visible,
    and topk larger than the capacity (the reference pads with -1)."""
    rows, topk = 40, 64
    visible = torch.tensor([40, 13, 0], dtype=torch.int32)
    q, weights, cache, slots = random_inputs(3, 12, 20, 2, rows, torch.float32, "cpu", seed=2)
    slots = slots.to(torch.int32)
    picks = indexer_topk(q, weights, cache, slots, visible, topk, impl="triton")
    expected = indexer_topk_reference(q, weights, cache, slots, visible, topk)
    assert_same_picks(picks, expected, fp64_scores(q, weights, cache, slots, visible), visible, topk)


@pytest.mark.interpreter
def test_entries_past_visible_are_never_used():
    """NaN in every row at or past visible[b] changes nothing: those rows are neither scored nor
    selected, and the capacity does not matter."""
    rows, topk = 500, 32
    visible = torch.tensor([300, 77, 12])
    q, weights, cache, slots = random_inputs(3, 16, 32, 3, rows, torch.float32, "cpu", seed=3)
    slots = torch.tensor([2, 0, 1])
    clean = indexer_topk(q, weights, cache, slots, visible, topk, impl="triton")
    poisoned = cache.clone()
    for b in range(3):
        poisoned[slots[b], visible[b]:] = float("nan")
    bigger = torch.cat([poisoned, torch.full_like(poisoned, float("nan"))], dim=1)
    for variant in (poisoned, bigger):
        picks = indexer_topk(q, weights, variant, slots, visible, topk, impl="triton")
        assert torch.equal(picks.sort(1).values, clean.sort(1).values)
    expected = indexer_topk_reference(q, weights, cache, slots, visible, topk)
    assert_same_picks(clean, expected, fp64_scores(q, weights, cache, slots, visible), visible, topk)


def topk_of_keys(keys, visible, topk):
    """Plain-torch top-k of int32 keys over keys[b, :visible[b]] (as sets, -1 padded)."""
    scores = keys.long().masked_fill(torch.arange(keys.shape[1])[None, :] >= visible[:, None], -(2**40))
    picked = scores.topk(topk, dim=1).indices
    return torch.where(torch.arange(topk)[None, :] < visible[:, None].clamp(max=topk), picked, -1).to(torch.int32)


@pytest.mark.interpreter
def test_select_stage_every_digit_pass():
    """The radix select alone on crafted keys: full 32-bit range with negatives, keys that agree
    on the top 24 bits (all four digit passes run), and a visible count above one select block."""
    g = torch.Generator().manual_seed(4)
    rows, topk = 2600, 100
    spread = (torch.randperm(rows, generator=g) - rows // 2) * 1_600_000  # distinct, +-2e9
    wide = spread + torch.randint(0, 1_600_000, (rows,), generator=g)
    narrow = 0x12345600 + torch.randperm(rows, generator=g)  # distinct below bit 12 only
    negative_narrow = -0x7654300 - torch.randperm(rows, generator=g)
    keys = torch.stack([wide, narrow, negative_narrow]).to(torch.int32)
    visible = torch.tensor([rows, 250, 2100])
    picks = indexer_triton.select_topk_keys(keys, visible, topk)
    expected = topk_of_keys(keys, visible, topk)
    for b in range(3):
        assert sorted(picks[b].tolist()) == sorted(expected[b].tolist()), f"row {b}"
        assert picks[b].tolist() == sorted(picks[b].tolist()), "picks come in entry order"


@pytest.mark.interpreter
def test_select_stage_ties_take_lowest_entries():
    """Ties at the threshold: every key above it is picked, then the lowest-numbered ties."""
    keys = torch.tensor([[5, 9, 7, 7, 1, 7, 9, 7, 0, 7]], dtype=torch.int32)
    picks = indexer_triton.select_topk_keys(keys, torch.tensor([10]), 4)
    assert picks.tolist() == [[1, 2, 3, 6]]


@pytest.mark.interpreter
def test_opcheck_cpu():
    q, weights, cache, slots = random_inputs(3, 16, 32, 2, 64, torch.float32, "cpu", seed=5)
    visible = torch.tensor([64, 5, 30])
    torch.library.opcheck(torch.ops.v4.indexer_topk.default, (q, weights, cache, slots, visible, 16))


def split_heads_picks(q, weights, cache, slots, visible, topk, parts, impl):
    """indexer_topk as split processes run it: each part of the heads scores, the scores are
    summed, the sum selects."""
    scores = sum(indexer_scores(qp, wp, cache, slots, visible, impl=impl)
                 for qp, wp in zip(q.chunk(parts, 1), weights.chunk(parts, 1)))
    return scores, indexer_select(scores, visible, topk, impl=impl)


@pytest.mark.interpreter
def test_scores_of_split_heads_summed_then_selected():
    """Each part's Triton scores equal the reference's on the visible entries and are 0 past
    them; the picks of their sum are the whole heads' top-k."""
    rows, topk = 300, 24
    visible = torch.tensor([0, -1, 5, 24, 25, 180, 300, 10**6])
    q, weights, cache, slots = random_inputs(len(visible), 16, 32, 3, rows, torch.float32, "cpu", seed=13)
    for qp, wp in zip(q.chunk(2, 1), weights.chunk(2, 1)):
        got = indexer_scores(qp, wp, cache, slots, visible, impl="triton")
        want = indexer_scores(qp, wp, cache, slots, visible, impl="reference")
        past = torch.arange(rows)[None, :] >= visible[:, None]
        assert got.dtype == torch.float32 and bool((got[past] == 0).all()) and bool((want[past] == 0).all())
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    _, picks = split_heads_picks(q, weights, cache, slots, visible, topk, parts=4, impl="triton")
    scores = fp64_scores(q, weights, cache, slots, visible)
    expected = indexer_topk_reference(q, weights, cache, slots, visible, topk)
    assert_same_picks(picks, expected, scores, visible, topk, score_tolerance(scores))


@pytest.mark.interpreter
def test_select_from_scores_negative_and_ragged():
    """The select kernel reading fp32 scores (negatives, values a few ulps apart, a visible
    count above one select block) picks the reference's set, in entry order."""
    g = torch.Generator().manual_seed(14)
    rows, topk = 2300, 64
    spread = torch.randn(rows, generator=g) * 1e3
    close = 1.0 + torch.randperm(rows, generator=g) * 2.0**-20  # distinct, a few ulps apart
    scores = torch.stack([spread, close, -close, spread.abs() * -1])
    visible = torch.tensor([rows, 2100, 63, 700])
    picks = indexer_select(scores, visible, topk, impl="triton")
    expected = indexer_select(scores, visible, topk, impl="reference")
    for b in range(len(visible)):
        assert sorted(picks[b].tolist()) == sorted(expected[b].tolist()), f"row {b}"
        real = [e for e in picks[b].tolist() if e >= 0]
        assert real == sorted(real), "picks come in entry order"


@pytest.mark.interpreter
def test_opcheck_scores_and_select_cpu():
    q, weights, cache, slots = random_inputs(3, 16, 32, 2, 64, torch.float32, "cpu", seed=15)
    visible = torch.tensor([64, 5, 30])
    torch.library.opcheck(torch.ops.v4.indexer_scores.default, (q, weights, cache, slots, visible))
    scores = torch.randn(3, 64)
    torch.library.opcheck(torch.ops.v4.indexer_select.default, (scores, visible, 16))


def test_bad_input_to_the_halves_is_named():
    q, weights, cache, slots = random_inputs(2, 4, 8, 2, 16, torch.float32, "cpu", seed=16)
    visible = torch.tensor([3, 4])
    with pytest.raises(ValueError, match="^indexer_scores expects q"):
        indexer_scores(q, weights, cache[..., :4], slots, visible)
    with pytest.raises(ValueError, match="^indexer_select expects scores \\[B,R\\] fp32, got torch.float16"):
        indexer_select(torch.zeros(2, 16, dtype=torch.float16), visible, 4)
    with pytest.raises(ValueError, match="^indexer_select: visible must be"):
        indexer_select(torch.zeros(2, 16), visible[:1], 4)
    with pytest.raises(ValueError, match="^indexer_select: topk must be >= 1"):
        indexer_select(torch.zeros(2, 16), visible, 0)


def test_bad_input_raises():
    q, weights, cache, slots = random_inputs(2, 4, 8, 2, 16, torch.float32, "cpu", seed=6)
    visible = torch.tensor([3, 4])
    with pytest.raises(ValueError, match="impl"):
        indexer_topk(q, weights, cache, slots, visible, 4, impl="fast")
    with pytest.raises(ValueError, match="topk"):
        indexer_topk(q, weights, cache, slots, visible, 0)
    with pytest.raises(ValueError, match="index_cache"):
        indexer_topk(q, weights, cache[..., :4], slots, visible, 4)
    with pytest.raises(ValueError, match="dtype|float16"):
        indexer_triton.indexer_topk_triton(q, weights, cache.half(), slots, visible, 4)


# ---------------------------------------------------------------------------------------------
# GPU: compiled, V4 shapes, bf16
# ---------------------------------------------------------------------------------------------

V4 = dict(heads=64, dim=128, topk=512)


def v4_inputs(batch, rows, seed, num_slots=None):
    num_slots = num_slots or batch + 5
    # weights_proj output times 128^-0.5 * 64^-0.5, as in the model
    return random_inputs(batch, V4["heads"], V4["dim"], num_slots, rows, torch.bfloat16, "cuda", seed, 1 / 90.0)


def score_tolerance(scores):
    # fp32 sums of 128-term bf16 products in another order differ by ~1e-6 of the scale; near
    # ties closer than this may swap.
    return 1e-4 * float(scores.abs().max())



@pytest.mark.gpu
@pytest.mark.parametrize("rows", [8192, 65536])
def test_v4_shapes_bf16(rows):
    visible = torch.tensor([0, 1, 511, 512, 513, 1000, 4096, rows - 1, rows, 10**7] + [2048] * 22, device="cuda")
    visible[10:] = torch.randint(0, rows, (22,), device="cuda")
    q, weights, cache, slots = v4_inputs(len(visible), rows, seed=7)
    picks = indexer_topk(q, weights, cache, slots, visible, V4["topk"])
    expected = indexer_topk_reference(q, weights, cache, slots, visible, V4["topk"])
    scores = fp64_scores(q, weights, cache, slots, visible)
    assert_same_picks(picks.cpu(), expected.cpu(), scores.cpu(), visible.cpu(), V4["topk"], score_tolerance(scores))


@pytest.mark.gpu
def test_cuda_graph_replay_with_new_visible_counts():
    batch, rows, topk = 16, 4096, V4["topk"]
    q, weights, cache, slots = v4_inputs(batch, rows, seed=8)
    visible = torch.randint(0, rows, (batch,), device="cuda")
    graph, picks = capture(lambda: indexer_topk(q, weights, cache, slots, visible, topk))
    for seed in (9, 10, 11):
        new_q, new_w, _, new_slots = v4_inputs(batch, rows, seed=seed)
        q.copy_(new_q)
        weights.copy_(new_w)
        slots.copy_(new_slots)
        visible.copy_(torch.randint(0, rows + 1, (batch,), device="cuda"))
        visible[0] = 0
        visible[1] = topk - 3
        graph.replay()
        expected = indexer_topk_reference(q, weights, cache, slots, visible, topk)
        scores = fp64_scores(q, weights, cache, slots, visible)
        assert_same_picks(picks.cpu(), expected.cpu(), scores.cpu(), visible.cpu(), topk, score_tolerance(scores))


@pytest.mark.gpu
def test_v4_split_heads_bf16():
    """Index heads split 2, 4 and 8 ways at V4 widths: the summed scores' picks are the whole
    heads' top-k (up to near-ties), and every part's scores are 0 past the visible entries."""
    rows = 16384
    visible = torch.tensor([0, 7, 511, 512, 513, 4000, rows] + [1000] * 9, device="cuda")
    visible[7:] = torch.randint(0, rows, (9,), device="cuda")
    q, weights, cache, slots = v4_inputs(len(visible), rows, seed=17)
    reference_scores = fp64_scores(q, weights, cache, slots, visible)
    expected = indexer_topk_reference(q, weights, cache, slots, visible, V4["topk"])
    for parts in (2, 4, 8):
        scores, picks = split_heads_picks(q, weights, cache, slots, visible, V4["topk"], parts, impl="auto")
        assert bool((scores[torch.arange(rows, device="cuda")[None, :] >= visible[:, None]] == 0).all())
        assert_same_picks(picks.cpu(), expected.cpu(), reference_scores.cpu(), visible.cpu(), V4["topk"],
                          score_tolerance(reference_scores))


@pytest.mark.gpu
def test_no_host_sync_and_opcheck_cuda():
    q, weights, cache, slots = v4_inputs(8, 2048, seed=12)
    visible = torch.randint(0, 2048, (8,), device="cuda")
    indexer_topk(q, weights, cache, slots, visible, V4["topk"])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        indexer_topk(q, weights, cache, slots, visible, V4["topk"])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.library.opcheck(torch.ops.v4.indexer_topk.default, (q, weights, cache, slots, visible, V4["topk"]))
    torch.library.opcheck(torch.ops.v4.indexer_scores.default, (q, weights, cache, slots, visible))
    scores = indexer_scores(q, weights, cache, slots, visible)
    torch.library.opcheck(torch.ops.v4.indexer_select.default, (scores, visible, V4["topk"]))
