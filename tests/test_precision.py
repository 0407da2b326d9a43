"""ModelConfig.fp32_products: "exact" keeps the official fp32 products (hyper-connection mixes,
gate, compressor projections, LM head); "fast" runs them in the model dtype."""
from __future__ import annotations

import statistics

import pytest
import torch

from model import Decoder, ModelConfig

PRODUCT_WEIGHTS = ("hc_attn_fn", "hc_ffn_fn", "hc_head_fn", "compressor.wkv.weight", "compressor.wgate.weight", "head.weight")


def is_product_weight(name: str) -> bool:
    return name.endswith(PRODUCT_WEIGHTS)


def build(fp32_products: str, dtype=torch.bfloat16) -> Decoder:
    cfg = ModelConfig.preset("tiny").replace(fp32_products=fp32_products)
    return Decoder(cfg, max_batch=3, max_seq_len=40, dtype=dtype)


def test_unknown_setting_is_named():
    with pytest.raises(ValueError, match="fp32_products must be 'exact' or 'fast', got 'tf32'"):
        ModelConfig.preset("tiny").replace(fp32_products="tf32")


def test_fast_stores_product_weights_in_the_model_dtype():
    exact, fast = build("exact"), build("fast")
    exact_state, fast_state = exact.state_dict(), fast.state_dict()
    assert list(exact_state) == list(fast_state)  # same names, loadable from the same checkpoint
    products = [k for k in exact_state if is_product_weight(k)]
    assert len(products) > 20  # every layer's mixes and compressors, plus the head
    for key, value in exact_state.items():
        assert fast_state[key].shape == value.shape
        if is_product_weight(key):
            assert (value.dtype, fast_state[key].dtype) == (torch.float32, torch.bfloat16), key
        else:
            assert fast_state[key].dtype == value.dtype, key


def test_fast_error_is_of_the_size_of_bf16_noise():
    """Against an fp32 model with the same (bf16-rounded) weights, the fast bf16 model errs about
    as much as the exact bf16 model does: the switch costs no more than bf16 itself."""
    fast = build("fast").init_random(seed=3)
    models = {"fp32": build("exact", torch.float32), "bf16 exact": build("exact")}
    for model in models.values():
        model.load_state_dict(fast.state_dict())
    generator = torch.Generator().manual_seed(4)
    slots = torch.tensor([2, 0, 1])
    errors = {"fast": [], "bf16 exact": []}
    for position in range(16):
        tokens = torch.randint(0, fast.config.vocab_size, (3,), generator=generator)
        positions = torch.full((3,), position)
        want = models["fp32"](tokens, positions, slots)
        for name, model in (("fast", fast), ("bf16 exact", models["bf16 exact"])):
            errors[name].append(((model(tokens, positions, slots) - want).abs().max() / want.abs().max()).item())
    assert statistics.median(errors["fast"]) <= 2 * statistics.median(errors["bf16 exact"]), errors
    assert errors["fast"] != errors["bf16 exact"], "fast and exact computed the same thing: the switch did nothing"


def test_fast_equals_exact_for_an_fp32_model():
    exact = build("exact", torch.float32).init_random(seed=5)
    fast = build("fast", torch.float32)
    fast.load_state_dict(exact.state_dict())
    tokens, positions, slots = torch.tensor([7, 9]), torch.tensor([0, 0]), torch.tensor([0, 1])
    assert torch.equal(exact(tokens, positions, slots), fast(tokens, positions, slots))
