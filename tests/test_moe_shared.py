"""A shared expert of its own FP8 format beside block-scaled routed experts (kernels.moe_experts'
shared_weights, the op v4::moe_experts_scaled_shared): against a dequantise-then-multiply
reference of the official MLP on fresh random inputs; its SwiGLU kernel; the bad inputs; on a GPU
at V4-Flash widths with the shared expert on a side stream, in a CUDA graph and under
torch.compile; and the model's MoE, which runs it this way."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels.blockscale.ref import act_quant_dequant, dequantize_weight, quantize_fp8_weight
from kernels.cuda_graph import capture
from kernels.moe import SharedExpertWeights, moe_experts, moe_experts_reference
from model import Decoder, ModelConfig
from test_moe import E8M0, LIMIT, SCALED_OPCHECKS, assert_scaled_close, routed_ids, scaled_experts

SMALL = dict(dim=256, inter=128, num_experts=9)


def shared_weights(dim, inter, device, seed, scale_dtype=E8M0) -> SharedExpertWeights:
    g = torch.Generator(device=device).manual_seed(seed)
    gate_up = torch.randn(2 * inter, dim, generator=g, device=device) * dim**-0.5
    down = torch.randn(dim, inter, generator=g, device=device) * inter**-0.5
    return SharedExpertWeights(*quantize_fp8_weight(gate_up, scale_dtype), *quantize_fp8_weight(down, scale_dtype))


def shared_by_dequantising(x, weights: SharedExpertWeights, limit, pow2=True):
    """The official MLP written out: act_quant, dequantised weights, fp32 products rounded to x's dtype."""
    gate_up = (act_quant_dequant(x, pow2) @ dequantize_weight(weights.gate_up, weights.gate_up_scale).T).to(x.dtype).float()
    gate, up = gate_up.chunk(2, dim=-1)
    if limit > 0:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    h = (F.silu(gate) * up).to(x.dtype)
    return (act_quant_dequant(h, pow2) @ dequantize_weight(weights.down, weights.down_scale).T).to(x.dtype)


def small_inputs(batch, seed, dtype=torch.float32, fmt="fp4"):
    c = SMALL
    w1, w2, w3, scales = scaled_experts(fmt, E8M0, c["num_experts"], c["dim"], c["inter"], "cpu", seed)
    ids, weights = routed_ids("random", batch, 3, c["num_experts"], seed + 1)
    x = torch.randn(batch, c["dim"], generator=torch.Generator().manual_seed(seed + 2)).to(dtype)
    return x, ids, weights, (w1, w2, w3), scales, shared_weights(c["dim"], c["inter"], "cpu", seed + 3)


@pytest.mark.parametrize("batch,limit", [(1, LIMIT), (5, 0.3), (5, 0.0)])
def test_reference_adds_the_official_mlp_after_the_routed_sum(batch, limit):
    x, ids, weights, (w1, w2, w3), scales, shared = small_inputs(batch, 400 + batch)
    x = x * 3  # a limit of 0.3 clamps
    routed = moe_experts_reference(x, ids, weights, w1, w2, w3, limit, scales=scales)
    expected = routed + shared_by_dequantising(x, shared, limit).float()
    out = moe_experts(x, ids, weights, w1, w2, w3, limit, scales=scales, shared_weights=shared)  # the op: CPU reference
    assert shared_by_dequantising(x, shared, limit).abs().mean() > 0.1 * routed.abs().mean()
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.interpreter
@pytest.mark.parametrize("batch,dtype,fmt", [(1, torch.float32, "fp4"), (5, torch.float16, "fp4"), (4, torch.float32, "fp8")])
def test_triton_path_matches_reference(batch, dtype, fmt):
    x, ids, weights, (w1, w2, w3), scales, shared = small_inputs(batch, 410 + batch, dtype, fmt)
    out = moe_experts(x, ids, weights, w1, w2, w3, LIMIT, impl="triton", scales=scales, shared_weights=shared)
    ref = moe_experts_reference(x, ids, weights, w1, w2, w3, LIMIT, scales=scales, shared_weights=shared)
    assert_scaled_close(out, ref, dtype)
    if batch == 1:  # the shared expert issued before the routing, as the op did once: the same sum
        from kernels.moe.scaled import moe_experts_scaled_triton

        before = moe_experts_scaled_triton(x, ids, weights, w1, w2, w3, scales, LIMIT, shared_weights=shared,
                                           shared_after_routing=False)
        assert torch.equal(before, out)


@pytest.mark.interpreter
@pytest.mark.parametrize("rows,inter,limit", [(1, 128, LIMIT), (3, 1536, 0.5), (2, 96, 0.0)])
def test_swiglu_kernel(rows, inter, limit):
    from kernels.moe.shared import swiglu_rows

    gate_up = torch.randn(rows, 2 * inter, generator=torch.Generator().manual_seed(inter)) * 2
    h = swiglu_rows(gate_up, limit)
    torch.testing.assert_close(h, kernels.moe.swiglu(*gate_up.chunk(2, dim=-1), limit), rtol=1e-5, atol=1e-6)


def test_bad_shared_weights_raise():
    x, ids, weights, (w1, w2, w3), scales, shared = small_inputs(2, 420)
    args = (x, ids, weights, w1, w2, w3, LIMIT)
    with pytest.raises(ValueError, match="goes with block-scaled routed experts"):
        moe_experts(*args, scales=scales, shared_expert=SMALL["num_experts"] - 1, shared_weights=shared)
    with pytest.raises(ValueError, match="goes with block-scaled routed experts"):
        moe_experts(x, ids, weights, *(w.float() for w in scaled_experts("fp8", E8M0, 2, 256, 128, "cpu", 1)[:3]), LIMIT,
                    shared_weights=shared)
    with pytest.raises(ValueError, match=r"shared expert's gate_up must be \[2I, D\]"):
        moe_experts(*args, scales=scales, shared_weights=shared._replace(down=shared.down[:, :-1]))
    with pytest.raises(ValueError, match="shared expert down"):
        moe_experts(*args, scales=scales, shared_weights=shared._replace(down_scale=shared.down_scale[:1]))


def test_opcheck_cpu():
    x, ids, weights, (w1, w2, w3), scales, shared = small_inputs(3, 430)
    args = (x, ids, weights, w1, w2, w3, *scales, *shared, LIMIT, True)
    torch.library.opcheck(torch.ops.v4.moe_experts_scaled_shared.default, args, test_utils=SCALED_OPCHECKS)


@pytest.mark.parametrize("batch", [1, 5])
def test_model_runs_its_fp8_shared_expert_in_the_experts_op(batch):
    """tiny-fp8 (FP8 linears, FP4 experts): MoE's output is the routed picks plus SharedExpert.forward."""
    decoder = Decoder(ModelConfig.preset("tiny-fp8"), max_batch=batch, max_seq_len=32, dtype=torch.float32).init_random(5)
    moe = decoder.layers[3].ffn
    assert moe.shared_experts.own_weights() is not None
    generator = torch.Generator().manual_seed(batch)
    x = torch.randn(batch, decoder.config.dim, generator=generator)
    tokens = torch.randint(0, decoder.config.vocab_size, (batch,), generator=generator)
    weights, ids = moe.gate(x, tokens)
    experts = moe.experts
    routed = kernels.moe_experts(x, ids, weights, experts.w1, experts.w2, experts.w3, moe.swiglu_limit, scales=experts.scales())
    shared = moe.shared_experts(x).float()
    assert shared.abs().mean() > 0.1 * routed.abs().mean()
    torch.testing.assert_close(moe(x, tokens), routed + shared, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# GPU: V4-Flash widths, the shared expert on a side stream
# ---------------------------------------------------------------------------------------------

FLASH = dict(dim=4096, inter=2048, num_experts=33, picks=6)


@pytest.fixture(scope="module")
def flash_experts():
    c = FLASH
    routed = scaled_experts("fp4", E8M0, c["num_experts"], c["dim"], c["inter"], "cuda", seed=440)
    return routed, shared_weights(c["dim"], c["inter"], "cuda", seed=441)


def flash_inputs(batch, seed):
    ids, weights = routed_ids("random", batch, FLASH["picks"], FLASH["num_experts"], seed, "cuda")
    x = torch.randn(batch, FLASH["dim"], device="cuda", generator=torch.Generator("cuda").manual_seed(seed)).to(torch.bfloat16)
    return x, ids, weights


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 16, 64])
def test_flash_widths_against_reference(flash_experts, batch):
    (w1, w2, w3, scales), shared = flash_experts
    x, ids, weights = flash_inputs(batch, 450 + batch)
    out = moe_experts(x, ids, weights, w1, w2, w3, LIMIT, scales=scales, shared_weights=shared)
    ref = moe_experts_reference(x, ids, weights, w1, w2, w3, LIMIT, scales=scales, shared_weights=shared)
    assert_scaled_close(out, ref, torch.bfloat16)
    # The side stream's result is joined before the combine: the same sum as the two run apart.
    apart = moe_experts(x, ids, weights, w1, w2, w3, LIMIT, scales=scales)
    from kernels.moe.shared import shared_expert_triton

    expected = apart + shared_expert_triton(x, shared, LIMIT, True).float()
    for _ in range(3):  # the two streams' split-K arrivals must not meet
        torch.testing.assert_close(moe_experts(x, ids, weights, w1, w2, w3, LIMIT, scales=scales, shared_weights=shared),
                                   expected, rtol=0, atol=0)
    # The side stream forked before the routing kernel (the op forks after it): the same sum.
    from kernels.moe.scaled_gluon import moe_experts_scaled_mma

    before = moe_experts_scaled_mma(x, ids, weights, w1, w2, w3, scales, LIMIT, shared_weights=shared, shared_after_routing=False)
    torch.testing.assert_close(before, expected, rtol=0, atol=0)


@pytest.mark.gpu
def test_flash_cuda_graph_replay_and_compile(flash_experts):
    """Captured (fork and join recorded as two graph branches) and replayed with new inputs, and
    traced by Dynamo as one opaque op."""
    (w1, w2, w3, scales), shared = flash_experts
    x, ids, weights = flash_inputs(2, 460)

    def call(x, ids, weights):
        return moe_experts(x, ids, weights, w1, w2, w3, LIMIT, scales=scales, shared_weights=shared)

    graph, out = capture(lambda: call(x, ids, weights))
    for seed in (461, 462):
        new = flash_inputs(2, seed)
        for dst, src in zip((x, ids, weights), new):
            dst.copy_(src)
        graph.replay()
        assert torch.equal(out, call(*new))
    compiled = torch.compile(lambda x, ids, weights: call(x * 2, ids, weights) + 1, fullgraph=True)
    ref = moe_experts_reference(x * 2, ids, weights, w1, w2, w3, LIMIT, scales=scales, shared_weights=shared)
    assert_scaled_close(compiled(x, ids, weights) - 1, ref, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 16])
def test_split_k_beside_split_k_from_a_stream_the_pool_came_round_to(flash_experts, batch):
    """The routed experts (split-K gate/up) issued from the stream that is the side stream (torch's
    stream pool hands it out again, as to a capture's warm-up), the shared expert's split-K
    products beside them on another side stream: each must count on counters of its own, call
    after call with nothing between, and leave them zero."""
    from kernels.arrival import split_counters
    from kernels.moe.shared import shared_expert_triton
    from kernels.side_stream import run_beside, side_stream

    (w1, w2, w3, scales), shared = flash_experts
    x, ids, weights = flash_inputs(batch, 470 + batch)
    device = x.device
    expected = moe_experts(x, ids, weights, w1, w2, w3, LIMIT, scales=scales) + shared_expert_triton(x, shared, LIMIT, True).float()
    outs = []
    caller = side_stream(device.index or 0)
    caller.wait_stream(torch.cuda.current_stream())  # the inputs and `expected`, made on this stream
    with torch.cuda.stream(caller):
        for _ in range(20):
            side, routed = run_beside(lambda: shared_expert_triton(x, shared, LIMIT, True),
                                      lambda: moe_experts(x, ids, weights, w1, w2, w3, LIMIT, scales=scales), device, priority=-1)
            outs.append(routed + side.float())
    torch.cuda.synchronize()
    for out in outs:
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
    side_counters, _ = run_beside(lambda: split_counters(device, 1), lambda: None, device)
    assert not side_counters.any() and not split_counters(device, 1).any()


@pytest.mark.interpreter
@pytest.mark.parametrize("gate_up_gemv", [False, True])
def test_shared_expert_on_the_device_path(gate_up_gemv):
    """The shared expert as the routed op runs it (its SwiGLU kernel; at one row the gate/up
    product through the GEMV where asked) against the dequantise-then-multiply formula."""
    from kernels.moe.shared import shared_expert_triton

    x, *_, shared = small_inputs(1, 470, torch.float16)
    out = shared_expert_triton(x, shared, LIMIT, True, gate_up_gemv=gate_up_gemv)
    expected = shared_by_dequantising(x, shared, LIMIT)
    torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=2e-2 * expected.abs().max().item())
