"""The cached decode step against a from-scratch reference that recomputes every position from
the full token history (tests/v4_reference.py), over hundreds of steps with slots at different
positions, slot reuse, window wrap-around and ratio-4 / ratio-128 boundaries."""
from __future__ import annotations

import random

import torch

from model import Decoder, ModelConfig
from v4_reference import V4Reference


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).abs().max() / expected.abs().max()).item()


def run_schedule(decoder: Decoder, sequences: list[dict], steps: int, seed: int):
    """Decode `sequences` ({slot, start, length, skip}) in mixed batches; returns each sequence's
    tokens and the logits the decoder produced at each of its positions."""
    rng = random.Random(seed)
    vocab = decoder.config.vocab_size
    for s in sequences:
        s["tokens"] = torch.randint(0, vocab, (s["length"],), generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
        s["logits"], s["pos"] = [], 0
    batch_sizes = set()
    for step in range(steps):
        active = [s for s in sequences if s["start"] <= step and s["pos"] < s["length"] and step % s.get("skip", 10**9) != 0]
        if not active:
            continue
        rng.shuffle(active)
        batch_sizes.add(len(active))
        tokens = torch.stack([s["tokens"][s["pos"]] for s in active])
        positions = torch.tensor([s["pos"] for s in active])
        slots = torch.tensor([s["slot"] for s in active])
        logits = decoder(tokens, positions, slots)
        for s, row in zip(active, logits):
            s["logits"].append(row)
            s["pos"] += 1
    return batch_sizes


def compare_with_reference(decoder: Decoder, sequences: list[dict], tolerance: float) -> float:
    reference = V4Reference(decoder.config, decoder.state_dict(), torch.float32)
    worst = 0.0
    for s in sequences:
        assert s["pos"] == s["length"], "schedule did not finish a sequence"
        expected = reference.logits(s["tokens"])
        for position, actual in enumerate(s["logits"]):
            err = relative_error(actual, expected[position])
            worst = max(worst, err)
            assert err <= tolerance, f"slot {s['slot']} position {position}: relative error {err:.2e}"
    assert worst > 0, "suspicious: bit-identical to an independent reference"
    return worst


def test_decode_matches_from_scratch_reference():
    """Exact arithmetic (QAT simulation off), fp32, 320 steps."""
    cfg = ModelConfig.preset("tiny").replace(qat=False)
    decoder = Decoder(cfg, max_batch=4, max_seq_len=320, dtype=torch.float32).init_random(seed=11)
    sequences = [
        dict(slot=2, start=0, length=300),  # crosses 128 and 256, wraps the window many times
        dict(slot=0, start=20, length=140),
        dict(slot=0, start=170, length=131),  # reuses slot 0: must not see the previous sequence
        dict(slot=3, start=5, length=260, skip=7),  # sits out every 7th step
    ]
    batch_sizes = run_schedule(decoder, sequences, steps=320, seed=3)
    assert batch_sizes >= {1, 2, 3}, batch_sizes
    compare_with_reference(decoder, sequences, tolerance=1e-4)


def test_decode_with_qat_simulation_matches_reference():
    """QAT on: fp8 KV and fp4 indexer rounding. Rounding is discontinuous, so a 1e-7 difference
    in summation order occasionally lands a value on the other side of an fp8/fp4 rounding
    boundary; the changed cache row then stays (and can change the indexer's picks). Over a
    short horizon that is rare, so the bound stays tight; long runs are compared with QAT off."""
    cfg = ModelConfig.preset("tiny")
    assert cfg.qat
    decoder = Decoder(cfg, max_batch=3, max_seq_len=64, dtype=torch.float32).init_random(seed=14)
    sequences = [dict(slot=1, start=0, length=40), dict(slot=0, start=3, length=36, skip=5)]
    run_schedule(decoder, sequences, steps=48, seed=1)
    compare_with_reference(decoder, sequences, tolerance=1e-4)


def test_reference_is_sensitive_to_the_cache_contents():
    """The comparison above can fail: corrupting one compressed entry changes later logits."""
    cfg = ModelConfig.preset("tiny").replace(qat=False)
    decoder = Decoder(cfg, max_batch=1, max_seq_len=160, dtype=torch.float32).init_random(seed=2)
    tokens = torch.randint(0, cfg.vocab_size, (140,), generator=torch.Generator().manual_seed(0))
    for p in range(139):
        decoder(tokens[p : p + 1], torch.tensor([p]), torch.tensor([0]))
    window = cfg.window_size
    decoder.layers[3].attn.kv_cache[0, window] += 1.0  # the first ratio-128 entry
    logits = decoder(tokens[139:140], torch.tensor([139]), torch.tensor([0]))[0]
    expected = V4Reference(cfg, decoder.state_dict(), torch.float32).logits(tokens)[139]
    assert relative_error(logits, expected) > 1e-3
