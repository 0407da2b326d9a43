"""compile_decode at V4-Flash widths and all 43 layers of the bench preset, in fp32 with QAT off:
the captured step equals the eager step to summation order (fuse/numerics.py: with QAT a rounding
flip is the official arithmetic, not a bug, so the exact check runs without it). An fp32 copy of
43 layers takes ~94 GiB: a GPU with more memory than an H100 runs it. Marked slow; a module of
its own, so that no bf16 model of another module's fixture is held beside it."""
from __future__ import annotations

import gc

import pytest
import torch

import fuse
from fuse.bench import synthesize_context
from fuse.numerics import check_step, judge
from model import Decoder, ModelConfig

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

BATCH = 8
EXACT = 1e-5  # worst row, relative: fp32 differs from fp32 by summation order only


def test_43_layers_compiled_fp32_matches_eager_fp32():
    if torch.cuda.get_device_properties(0).total_memory < 120e9:
        pytest.skip("43 layers in fp32 need ~94 GiB of weights")
    cfg = ModelConfig.preset("bench").replace(qat=False)
    decoder = Decoder(cfg, max_batch=BATCH, max_seq_len=1024, dtype=torch.float32, device="cuda").init_random(seed=3)
    try:
        synthesize_context(decoder, seed=4)
        runner = fuse.compile_decode(decoder, buckets=(BATCH,), progress=False)
        generator = torch.Generator().manual_seed(5)
        checks = []
        for batch in (BATCH, 3):  # the bucket full, and padded
            tokens = torch.randint(0, cfg.vocab_size, (batch,), generator=generator)
            positions = torch.randint(0, 1024, (batch,), generator=generator)
            slots = torch.randperm(BATCH, generator=generator)[:batch]
            inputs = decoder.check_inputs(tokens, positions, slots)
            checks.append(check_step(decoder, runner.run_checked, inputs))
        verdict = judge(checks, torch.float32)
        print(f"\n43 layers, compiled fp32 vs eager fp32, QAT off: {verdict.summary()}")
        assert verdict.passed and verdict.error <= EXACT, verdict
        assert runner.stats.recompiles == 0
    finally:
        # Dynamo's caches hold the model: let the next slow test have the GPU's memory back.
        runner = decoder = None
        torch._dynamo.reset()
        gc.collect()
        torch.cuda.empty_cache()
