"""QAT rounding and rotary helpers against brute-force versions written here."""
from __future__ import annotations

import math

import pytest
import torch

from model.quant import fp4_qdq, fp8_qdq, hadamard_matrix, round_to_e2m1
from model.rope import apply_rope, rope_frequencies, rope_table
from v4_reference import fp4_round_trip, fp8_round_trip, nearest_e2m1


def test_e2m1_rounding_matches_brute_force_including_ties():
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    values = torch.cat([ties, -ties, torch.empty(20000).uniform_(-6, 6)])
    torch.testing.assert_close(round_to_e2m1(values), nearest_e2m1(values), rtol=0, atol=0)
    assert round_to_e2m1(ties).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_qdq_matches_brute_force(dtype):
    x = (torch.randn(16, 256) * torch.logspace(-3, 2, 16)[:, None]).to(dtype)
    torch.testing.assert_close(fp4_qdq(x, 32), fp4_round_trip(x, 32), rtol=0, atol=0)
    torch.testing.assert_close(fp8_qdq(x, 64), fp8_round_trip(x, 64, True), rtol=0, atol=0)
    # amax/448 vs amax*(1/448): the non-power-of-two scale may differ in its last bit, which
    # decides exact fp8 ties (frequent for bf16 inputs); so compare on fp32 inputs only
    if dtype == torch.float32:
        torch.testing.assert_close(fp8_qdq(x, 64, pow2_scale=False), fp8_round_trip(x, 64, False), rtol=3e-7, atol=0)
    assert not torch.equal(fp8_qdq(x, 64), x)


def test_pow2_scale_just_above_a_power_of_two():
    # amax / 448 just above 2**-3: the scale must round up to 2**-2
    x = torch.zeros(1, 64)
    x[0, 0] = 448 * 2**-3 * (1 + 2**-20)
    y = fp8_qdq(x, 64)
    assert y[0, 0] == pytest.approx(x[0, 0].item(), rel=0.07)
    assert (y[0, 0] / 2**-2).item() == pytest.approx(round(x[0, 0].item() / 2**-2), abs=1e-6)


def test_hadamard_is_orthogonal():
    h = hadamard_matrix(64)
    torch.testing.assert_close(h @ h.t(), torch.eye(64), rtol=0, atol=1e-6)


def test_rope_is_a_rotation_of_interleaved_pairs():
    freqs = rope_frequencies(16, 160000.0, original_seq_len=64, factor=16)
    table = rope_table(200, freqs)
    x = torch.randn(5, 3, 24)
    pos = torch.tensor([0, 1, 17, 150, 199])
    y = apply_rope(x, table[pos])
    torch.testing.assert_close(y[..., :8], x[..., :8])  # channels before the rope part are untouched
    torch.testing.assert_close(y[0], x[0])  # position 0 is the identity
    xc = torch.view_as_complex(x[..., 8:].reshape(5, 3, 8, 2).contiguous())
    angle = pos[:, None].float() * freqs[None, :]
    expected = torch.view_as_real(xc * torch.polar(torch.ones_like(angle), angle)[:, None, :]).flatten(-2)
    torch.testing.assert_close(y[..., 8:], expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(apply_rope(y, table[pos], inverse=True), x, rtol=1e-5, atol=1e-5)
    # YaRN slows the low frequencies by the factor and leaves the high ones
    plain = rope_frequencies(16, 160000.0)
    assert freqs[0] == plain[0] and math.isclose(freqs[-1].item(), plain[-1].item() / 16, rel_tol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(5, 96), (5, 3, 96), (5, 2, 64)])
def test_rope_forms_are_bitwise_equal(dtype, shape):
    """The eager (rotated tail + concatenation) and compiled (all channels) forms of apply_rope."""
    from model.rope import _rope_full_width, _rope_tail

    table = rope_table(300, rope_frequencies(32, 10000.0))
    g = torch.Generator().manual_seed(sum(shape))
    x = (3 * torch.randn(*shape, generator=g)).to(dtype)
    cos_sin = table[torch.randint(0, 300, (shape[0],), generator=g)]
    for inverse in (False, True):
        assert torch.equal(_rope_full_width(x, cos_sin, inverse), _rope_tail(x, cos_sin, inverse))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", ["fp8", "fp8-linear-scale", "fp8-rope-tail", "fp4"])
def test_block_qdq_forms_are_bitwise_equal(dtype, fmt):
    """The eager (blocked amax) and compiled (one masked row reduction per block) forms."""
    from model.quant import FP4_MAX, FP8_MAX, _block_qdq, _to_e4m3

    g = torch.Generator().manual_seed(len(fmt))
    x = (torch.randn(6, 3, 224, generator=g) * torch.logspace(-4, 3, 6)[:, None, None]).to(dtype)
    x[0, 0, :32] = 0  # an all-zero block: its scale comes from the amax floor
    if fmt == "fp4":
        args = (32, FP4_MAX, FP4_MAX * 2.0**-126, True, round_to_e2m1, 0)
    else:
        pow2, keep_last = fmt != "fp8-linear-scale", 32 if fmt == "fp8-rope-tail" else 0
        args = (64 if keep_last else 32, FP8_MAX, 1e-4, pow2, _to_e4m3, keep_last)
    blocked, rowwise = _block_qdq(x, *args, rowwise=False), _block_qdq(x, *args, rowwise=True)
    assert torch.equal(blocked, rowwise)
    assert not torch.equal(blocked, x)
    if fmt == "fp8-rope-tail":
        assert torch.equal(rowwise[..., -32:], x[..., -32:])
