"""The compiled gate's top-k (rounds of argmax) against torch.topk + gather, and the MoE layer's
shared expert run inside the grouped experts against it run alone."""
from __future__ import annotations

import pytest
import torch

import kernels
from model import Decoder, ModelConfig
from model.moe import top_k_by_rounds


@pytest.mark.parametrize("batch, experts, k", [(33, 16, 6), (5, 256, 6), (4, 8, 1)])
def test_top_k_by_rounds_matches_topk(batch, experts, k):
    g = torch.Generator().manual_seed(experts)
    values = torch.rand(batch, experts, generator=g) + 0.1
    keys = values + torch.randn(experts, generator=g)  # selection-only bias, as the gate adds
    ids, picked = (torch.cat(t, -1) for t in top_k_by_rounds(keys, values, k))
    expected = keys.topk(k, dim=-1).indices
    assert torch.equal(ids, expected)
    assert torch.equal(picked, values.gather(1, expected))


def test_ties_go_to_the_lower_index():
    keys = torch.tensor([[1.0, 3.0, 2.0, 3.0, 2.0]])
    ids, picked = (torch.cat(t, -1) for t in top_k_by_rounds(keys, keys * 10, 4))
    assert ids.tolist() == [[1, 3, 2, 4]]
    assert picked.tolist() == [[30.0, 30.0, 20.0, 20.0]]


def test_compiled_gate_matches_eager_gate():
    """The gate compiled (rounds, renormalised pick by pick) against the gate run eagerly."""
    from model import ModelConfig
    from model.moe import Gate

    cfg = ModelConfig.preset("tiny")
    gate = Gate(cfg, hashed=False, dtype=torch.float32)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        gate.weight.copy_(torch.randn(gate.weight.shape, generator=g) * 0.1)
        gate.bias.copy_(torch.randn(gate.bias.shape, generator=g) * 0.1)
    x = torch.randn(5, cfg.dim, generator=g)
    weights, ids = gate(x, None)
    compiled_weights, compiled_ids = torch.compile(gate, fullgraph=True)(x, None)
    assert torch.equal(compiled_ids, ids)
    torch.testing.assert_close(compiled_weights, weights, rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", [1, 5])  # few pairs (gathered experts) and many (every expert densely)
def test_shared_expert_in_the_grouped_experts_matches_it_run_alone(dtype, batch):
    """MoE runs the shared expert as every token's last pick of the expert stacks; the same layer
    with the routed picks alone plus SharedExpert.forward (its own products) gives the same output."""
    decoder = Decoder(ModelConfig.preset("tiny"), max_batch=batch, max_seq_len=32, dtype=dtype).init_random(3)
    generator = torch.Generator().manual_seed(batch)
    for layer in (0, 3):  # hash-routed and score-routed
        moe = decoder.layers[layer].ffn
        x = torch.randn(batch, decoder.config.dim, generator=generator).to(dtype)
        tokens = torch.randint(0, decoder.config.vocab_size, (batch,), generator=generator)
        weights, ids = moe.gate(x, tokens)
        experts = moe.experts
        routed = kernels.moe_experts(x, ids, weights, experts.w1, experts.w2, experts.w3, moe.swiglu_limit)
        shared = moe.shared_experts(x).float()
        assert shared.abs().mean() > 0.1 * routed.abs().mean()  # a contribution a mistake would show
        tolerance = 1e-6 if dtype == torch.float32 else 8e-3  # bf16: one rounding of the fp32 sum
        torch.testing.assert_close(moe(x, tokens).float(), (routed + shared).to(dtype).float(), rtol=tolerance, atol=tolerance)
