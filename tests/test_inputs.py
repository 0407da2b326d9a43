"""Bad input raises a clear error before any cache is written."""
from __future__ import annotations

import pytest
import torch

from model import Decoder, ModelConfig


@pytest.fixture(scope="module")
def decoder():
    cfg = ModelConfig.preset("tiny")
    d = Decoder(cfg, max_batch=3, max_seq_len=64, dtype=torch.float32).init_random(seed=0)
    for p in range(10):  # caches hold real data, so "unchanged" means something
        d(torch.randint(0, cfg.vocab_size, (3,)), torch.full((3,), p), torch.tensor([0, 1, 2]))
    return d


def snapshot(decoder: Decoder) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in decoder.named_buffers()}


def ok_inputs():
    return torch.tensor([1, 2]), torch.tensor([10, 3]), torch.tensor([0, 2])


BAD = {
    "float tokens": (lambda t, p, s: (t.float(), p, s), "tokens must be int64"),
    "int32 positions": (lambda t, p, s: (t, p.int(), s), "positions must be int64"),
    "2-d slots": (lambda t, p, s: (t, p, s[None]), r"slots must have shape \[B\]"),
    "length mismatch": (lambda t, p, s: (t, p[:1], s), "same length"),
    "empty batch": (lambda t, p, s: (t[:0], p[:0], s[:0]), r"batch size must be in \[1, 3\]"),
    "too many rows": (lambda t, p, s: (t.repeat(2), p.repeat(2), torch.arange(4)), r"batch size must be in \[1, 3\]"),
    "token >= vocab": (lambda t, p, s: (torch.tensor([1, 512]), p, s), r"tokens must be in \[0, 512\).*512"),
    "negative token": (lambda t, p, s: (torch.tensor([-1, 2]), p, s), r"tokens must be in \[0, 512\).*-1"),
    "negative position": (lambda t, p, s: (t, torch.tensor([-3, 1]), s), r"positions must be in \[0, 64\).*-3"),
    "position >= max_seq_len": (lambda t, p, s: (t, torch.tensor([64, 1]), s), r"positions must be in \[0, 64\).*64"),
    "slot >= max_batch": (lambda t, p, s: (t, p, torch.tensor([0, 3])), r"slots must be in \[0, 3\).*3"),
    "negative slot": (lambda t, p, s: (t, p, torch.tensor([-1, 0])), r"slots must be in \[0, 3\)"),
    "repeated slot": (lambda t, p, s: (t, p, torch.tensor([2, 2])), r"repeated: \[2\]"),
    "not a tensor": (lambda t, p, s: ([1, 2], p, s), "tokens must be a torch.Tensor"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_rejected_before_any_write(decoder, case):
    change, message = BAD[case]
    before = snapshot(decoder)
    with pytest.raises(ValueError, match=message):
        decoder(*change(*ok_inputs()))
    after = snapshot(decoder)
    assert all(torch.equal(before[k], after[k]) for k in before), "a cache changed"


def test_good_input_does_write(decoder):
    before = snapshot(decoder)
    decoder(*ok_inputs())
    after = snapshot(decoder)
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_unchecked_step_skips_value_checks_but_not_computation(decoder):
    """`step` is the checked-elsewhere entry point: same result as the checked call."""
    tokens, positions, slots = ok_inputs()
    state = snapshot(decoder)
    checked = decoder(tokens, positions, slots)
    for name, buf in decoder.named_buffers():
        buf.copy_(state[name])
    unchecked = decoder.step(tokens, positions, slots)
    torch.testing.assert_close(checked, unchecked, rtol=0, atol=0)
