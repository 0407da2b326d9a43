"""moe_gate: the plain-torch reference against an fp64 computation row by row, and the Triton
kernel against the reference on fresh random inputs: top-k and hash layers, ties, the far tails
of softplus, widths that are not whole blocks.

CPU tests run the kernel in the interpreter (TRITON_INTERPRET=1; fp16 and fp32 rows). GPU tests run
it compiled at V4-Flash's widths in bf16, replayed in a CUDA graph with new rows, inside
torch.compile, and through opcheck."""
from __future__ import annotations

import math

import pytest
import torch

from kernels.cuda_graph import capture
from kernels.gate import MAX_ROWS, moe_gate, moe_gate_op, moe_gate_reference
from kernels.gate.triton import MAX_DIM

RTOL = 1e-5  # fp32 sums of up to 4096 products in another order


def gate_fp64(x, weight, bias, hashed_ids, topk, route_scale):
    """(weights [B, k], ids [B, k]) in fp64, a row at a time with Python floats."""
    logits = (x.double() @ weight.double().t()).tolist()
    weights, ids = [], []
    for b, row in enumerate(logits):
        scores = [math.sqrt(v if v > 20 else math.log1p(math.exp(v))) for v in row]
        if hashed_ids is None:
            keys = [s + float(c) for s, c in zip(scores, bias.tolist())]
            picked = sorted(range(len(keys)), key=lambda e: -keys[e])[:topk]  # a stable sort: ties to the lower index
        else:
            picked = [int(e) for e in hashed_ids[b].tolist()]
        total = sum(scores[e] for e in picked)
        weights.append([scores[e] / total * route_scale for e in picked])
        ids.append(picked)
    return torch.tensor(weights, dtype=torch.float64), torch.tensor(ids)


def gate_inputs(batch, experts, dim, topk, hashed, dtype=torch.float16, device="cpu", seed=0, logit_scale=1.0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(batch, dim, generator=g) * logit_scale).to(dtype)
    weight = (torch.randn(experts, dim, generator=g) * dim**-0.5).to(torch.float16 if dtype == torch.float16 else torch.bfloat16)
    bias = None if hashed else torch.randn(experts, generator=g) * 0.1
    hashed_ids = torch.randint(0, experts, (batch, topk), generator=g, dtype=torch.int32) if hashed else None
    return [t.to(device) if t is not None else None for t in (x, weight, bias, hashed_ids)]


@pytest.mark.parametrize("hashed", [False, True])
def test_reference_matches_fp64(hashed):
    x, weight, bias, hashed_ids = gate_inputs(5, 40, 256, 6, hashed, dtype=torch.float32, seed=1)
    weights, ids = moe_gate_reference(x, weight, bias, hashed_ids, 6, 1.5)
    expected_weights, expected_ids = gate_fp64(x, weight, bias, hashed_ids, 6, 1.5)
    assert torch.equal(ids, expected_ids)
    torch.testing.assert_close(weights.double(), expected_weights, rtol=RTOL, atol=0)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64


@pytest.mark.parametrize(
    "batch, experts, dim, topk, hashed, dtype",
    [(1, 256, 1024, 6, False, torch.float16), (3, 20, 300, 4, False, torch.float32), (9, 64, 640, 6, False, torch.float16),
     (5, 16, 256, 3, True, torch.float16), (1, 7, 96, 7, False, torch.float32), (19, 24, 128, 5, True, torch.float16),
     (17, 33, 64, 6, False, torch.float32)],
)
def test_triton_matches_reference(batch, experts, dim, topk, hashed, dtype):
    """Widths that are not whole blocks (300, 96 inputs; 20, 7, 33 experts), more rows than a pick
    step ranks and than a row block holds (each ranked by its own block's last program), every
    expert picked (7 of 7), a hash layer's ids."""
    x, weight, bias, hashed_ids = gate_inputs(batch, experts, dim, topk, hashed, dtype, seed=batch + experts)
    expected_weights, expected_ids = moe_gate_reference(x, weight, bias, hashed_ids, topk, 2.5)
    weights, ids = moe_gate(x, weight, bias, hashed_ids, topk, 2.5, impl="triton")
    assert torch.equal(ids, expected_ids)
    torch.testing.assert_close(weights, expected_weights, rtol=RTOL, atol=0)


def test_ties_go_to_the_lower_index():
    """Experts with equal rows of the weight and equal bias tie exactly: the lower index first,
    in the reference and the kernel alike."""
    x, weight, _, _ = gate_inputs(3, 12, 128, 4, False, seed=4)
    weight[7], weight[9] = weight[2], weight[2]
    bias = torch.zeros(12)
    bias[[2, 7, 9]] = 10.0  # the three tied experts lead every row
    for impl in ("reference", "triton"):
        _, ids = moe_gate(x, weight, bias, None, 4, 1.0, impl=impl)
        assert ids[:, :3].tolist() == [[2, 7, 9]] * 3, impl


def test_the_far_tails_of_softplus():
    """Logits far below zero (softplus near exp(l), where log(1 + e) alone rounds to nothing) and
    above the threshold of 20 (softplus = l): the kernel's scores as torch's."""
    x, weight, bias, _ = gate_inputs(4, 32, 512, 6, False, dtype=torch.float32, seed=5, logit_scale=40.0)
    logits = x @ weight.float().t()
    assert logits.min() < -25 and logits.max() > 25
    hashed_ids = torch.stack([logits.argsort(1)[:, :3], logits.argsort(1)[:, -3:]], 1).flatten(1).int()  # both tails picked
    for bias_, ids_ in ((bias, None), (None, hashed_ids)):
        expected = moe_gate_reference(x, weight, bias_, ids_, 6, 1.0)
        got = moe_gate(x, weight, bias_, ids_, 6, 1.0, impl="triton")
        assert torch.equal(got[1], expected[1])
        torch.testing.assert_close(got[0], expected[0], rtol=RTOL, atol=1e-12)


def test_bad_inputs_are_named():
    x, weight, bias, _ = gate_inputs(2, 8, 64, 2, False)
    cases = [
        ((x[0], weight, bias, None, 2), "x must be \\[B, D\\]"),
        ((x[:, :32], weight, bias, None, 2), "x has 32 features, weight 64"),
        ((x, weight.float(), bias, None, 2), "weight bf16 or fp16"),
        ((x, weight, bias, None, 9), "topk must be in \\[1, 8\\]"),
        ((x, weight, None, None, 2), "exactly one of them"),
        ((x, weight, bias, torch.zeros(2, 2, dtype=torch.int32), 2), "exactly one of them"),
        ((x, weight, bias.double(), None, 2), "bias must be fp32 \\[8\\]"),
        ((x, weight, None, torch.zeros(2, 3, dtype=torch.int32), 2), "hashed_ids must be integer \\[2, 2\\]"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            moe_gate(*args, 1.0)
    with pytest.raises(ValueError, match="impl must be one of"):
        moe_gate(x, weight, bias, None, 2, 1.0, impl="cuda")
    wide, wide_weight, wide_bias, _ = gate_inputs(1, 4, MAX_DIM + 128, 2, False)
    with pytest.raises(ValueError, match=f"at most {MAX_DIM} features, got {MAX_DIM + 128}"):
        moe_gate(wide, wide_weight, wide_bias, None, 2, 1.0, impl="triton")


def test_the_op_on_the_cpu_is_the_reference_and_passes_opcheck():
    x, weight, bias, hashed_ids = gate_inputs(3, 16, 128, 4, False, dtype=torch.float32, seed=6)
    expected = moe_gate_reference(x, weight, bias, None, 4, 1.5)
    got = moe_gate(x, weight, bias, None, 4, 1.5)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    torch.library.opcheck(moe_gate_op, (x, weight, bias, None, 4, 1.5))
    _, _, _, hashed_ids = gate_inputs(3, 16, 128, 4, True, dtype=torch.float32, seed=6)
    torch.library.opcheck(moe_gate_op, (x, weight, None, hashed_ids, 4, 1.5))


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 16, MAX_ROWS, MAX_ROWS + 1])
@pytest.mark.parametrize("hashed", [False, True])
def test_gpu_matches_reference_at_flash_widths(batch, hashed):
    """V4-Flash's gate (256 experts x 4096, bf16 rows and weight, top-6), past MAX_ROWS the
    reference's kernels; the same result twice."""
    x, weight, bias, hashed_ids = gate_inputs(batch, 256, 4096, 6, hashed, torch.bfloat16, "cuda", seed=batch)
    expected_weights, expected_ids = moe_gate_reference(x, weight, bias, hashed_ids, 6, 2.5)
    weights, ids = moe_gate(x, weight, bias, hashed_ids, 6, 2.5)
    assert torch.equal(ids, expected_ids)
    torch.testing.assert_close(weights, expected_weights, rtol=RTOL, atol=0)
    again = moe_gate(x, weight, bias, hashed_ids, 6, 2.5)
    assert torch.equal(again[0], weights) and torch.equal(again[1], ids)


@pytest.mark.gpu
def test_gpu_graph_replay_compile_and_opcheck():
    x, weight, bias, _ = gate_inputs(4, 256, 4096, 6, False, torch.bfloat16, "cuda", seed=7)
    graph, (weights, ids) = capture(lambda: moe_gate(x, weight, bias, None, 6, 2.5))
    for seed in (8, 9):
        x.copy_(gate_inputs(4, 256, 4096, 6, False, torch.bfloat16, "cuda", seed=seed)[0])
        graph.replay()
        expected = moe_gate_reference(x, weight, bias, None, 6, 2.5)
        assert torch.equal(ids, expected[1])
        torch.testing.assert_close(weights, expected[0], rtol=RTOL, atol=0)
    compiled = torch.compile(lambda x: moe_gate(x, weight, bias, None, 6, 2.5), fullgraph=True)
    got = compiled(x)
    assert torch.equal(got[1], moe_gate(x, weight, bias, None, 6, 2.5)[1])
    torch.library.opcheck(moe_gate_op, (x, weight, bias, None, 6, 2.5))
