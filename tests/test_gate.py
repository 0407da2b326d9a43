"""The compiled gate's top-k (rounds of argmax) against torch.topk + gather."""
from __future__ import annotations

import pytest
import torch

from model.moe import top_k_by_rounds


@pytest.mark.parametrize("batch, experts, k", [(33, 16, 6), (5, 256, 6), (4, 8, 1)])
def test_top_k_by_rounds_matches_topk(batch, experts, k):
    g = torch.Generator().manual_seed(experts)
    values = torch.rand(batch, experts, generator=g) + 0.1
    keys = values + torch.randn(experts, generator=g)  # selection-only bias, as the gate adds
    ids, picked = top_k_by_rounds(keys, values, k)
    expected = keys.topk(k, dim=-1).indices
    assert torch.equal(ids, expected)
    assert torch.equal(picked, values.gather(1, expected))


def test_ties_go_to_the_lower_index():
    keys = torch.tensor([[1.0, 3.0, 2.0, 3.0, 2.0]])
    ids, picked = top_k_by_rounds(keys, keys * 10, 4)
    assert ids.tolist() == [[1, 3, 2, 4]]
    assert picked.tolist() == [[30.0, 30.0, 20.0, 20.0]]
