"""A short eager decode run: builds a decoder with random weights, decodes a batch of sequences
from position 0 and prints tokens/s and logits statistics."""
from __future__ import annotations

import time

import torch

from model import Decoder, ModelConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def run_demo(
    preset: str = "tiny", batch: int = 4, steps: int = 32, device: str = "cpu", dtype: str = "float32", seed: int = 0,
    layers: int | None = None,
) -> dict:
    cfg = ModelConfig.preset(preset, layers=layers)
    decoder = Decoder(cfg, max_batch=batch, max_seq_len=max(steps, 1), dtype=DTYPES[dtype], device=device)
    decoder.init_random(seed)
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (batch,), generator=generator)
    slots = torch.arange(batch)
    logits = None
    start = time.perf_counter()
    for position in range(steps):
        logits = decoder(tokens, torch.full((batch,), position), slots)
        tokens = logits.argmax(-1).cpu()  # greedy: the next input is this step's output
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    stats = {
        "preset": preset, "batch": batch, "steps": steps, "device": device, "dtype": dtype,
        "tokens_per_s": batch * steps / seconds, "step_ms": 1e3 * seconds / steps,
        "logits_mean": logits.mean().item(), "logits_std": logits.std().item(),
        "logits_max_abs": logits.abs().max().item(), "finite": bool(logits.isfinite().all()),
    }
    return stats


def format_demo(stats: dict) -> str:
    return (
        f"eager decode, preset {stats['preset']}, batch {stats['batch']}, {stats['steps']} steps on "
        f"{stats['device']} ({stats['dtype']}): {stats['tokens_per_s']:.1f} tokens/s, {stats['step_ms']:.1f} ms/step\n"
        f"last-step logits: mean {stats['logits_mean']:+.4f}, std {stats['logits_std']:.4f}, "
        f"max |x| {stats['logits_max_abs']:.4f}, all finite: {stats['finite']}"
    )
