"""compile_decode on a GPU with the bench preset (V4-Flash widths, 43 layers, 16 experts): every
bucket captures, random batch sizes replay without recompiling, outputs pass the accuracy
yardstick (fuse/numerics.py: against an fp32 eager run of the same weights), memory is flat after
warm-up. These are marked slow (run with -m "gpu and slow"); the tiny-preset fp32 runner test
runs with -m gpu."""
from __future__ import annotations

import gc
import os
import random
import time

import pytest
import torch

import fuse
from fuse.numerics import check_step, fp32_reference, judge, relative_error
from model import Decoder, ModelConfig

pytestmark = [pytest.mark.gpu]

BUCKETS = (1, 2, 4, 8, 16, 32, 64)
STEPS = int(os.environ.get("FUSE_GPU_STEPS", "1000"))


@pytest.fixture(scope="module")
def bench_runner():
    cfg = ModelConfig.preset("bench")
    decoder = Decoder(cfg, max_batch=64, max_seq_len=2048, dtype=torch.bfloat16, device="cuda").init_random(seed=0)
    start = time.perf_counter()
    runner = fuse.compile_decode(decoder, buckets=BUCKETS, dynamic_batch=True)
    print(f"\ncold start, {len(BUCKETS)} buckets: {time.perf_counter() - start:.1f} s\n{runner.describe()}")
    yield decoder, runner
    # Give the 43 layers and their graph pool back to the device for the modules after this one.
    del decoder, runner
    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.slow
def test_every_bucket_captures(bench_runner):
    _, runner = bench_runner
    assert sorted(runner.stats.captured) == list(BUCKETS), runner.stats.fallbacks
    assert runner.stats.graph_breaks == 0
    phases = runner.stats.start_seconds
    assert all(phases[name] > 0 for name in ("first calls", "warm-up and capture")), phases


@pytest.mark.slow
def test_random_batches_pass_the_yardstick_without_recompiles_or_memory_growth(bench_runner):
    """Every 100th step is checked from its state against the fp32 eager reference (streamed
    block by block: an fp32 copy of 43 layers does not fit beside the model), with the bf16 eager
    step's own error as the noise; the yardstick judges all checked rows together."""
    decoder, runner = bench_runner
    reference = fp32_reference(decoder)
    rng = random.Random(0)
    vocab = decoder.config.vocab_size
    next_position = [0] * decoder.max_batch
    checks = []
    memory = None
    for step in range(STEPS):
        size = rng.randint(1, decoder.max_batch)
        slots = rng.sample(range(decoder.max_batch), size)
        if any(next_position[s] >= decoder.max_seq_len - 1 for s in slots):
            for s in slots:
                next_position[s] = 0  # restart sequences that reached the end
        tokens = torch.tensor([rng.randrange(vocab) for _ in slots])
        positions = torch.tensor([next_position[s] for s in slots])
        if step % 100 == 0:
            inputs = decoder.check_inputs(tokens, positions, torch.tensor(slots))
            checks.append(check_step(decoder, runner.run_checked, inputs, reference))
        else:
            runner(tokens, positions, torch.tensor(slots))
        for s in slots:
            next_position[s] += 1
        if step == 10:
            torch.cuda.synchronize()
            memory = torch.cuda.memory_allocated()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == memory, "memory grew after warm-up"
    assert runner.stats.recompiles == 0
    verdict = judge(checks, torch.bfloat16)
    print(f"\ncompiled bf16 against fp32, worst row per check: {[f'{c.error.max().item():.3f}' for c in checks]}")
    print(f"eager bf16 against fp32 (the noise): {[f'{c.noise.max().item():.3f}' for c in checks]}")
    print(verdict.summary())
    assert min(c.noise.max().item() for c in checks) > 0, "bf16 eager equalled fp32: the noise is uncalibrated"
    assert verdict.passed, verdict
    # 43 layers of bf16 stay close to fp32: the typical row within 3e-2, eager and compiled alike
    # (the worst row is a discrete routing flip's, judged by the yardstick above)
    assert verdict.typical_error <= 3e-2 and verdict.typical_noise <= 3e-2, verdict


@pytest.mark.parametrize(
    "qat, compilation", [(False, "nested"), (True, "whole"), (False, "regional")]
)
def test_tiny_fp32_graphs_match_eager_exactly(qat, compilation):
    """The captured graphs compute the eager function: fp32, tiny preset, mixed padded batches;
    with the fp8/fp4 rounding (compiled in its row-wise form on CUDA) in a whole-step graph too.
    A rounding flip moves a value by one fp8 step, so QAT gets a looser bound; a wrong form
    (scales of the wrong block, a lost rope tail) moves the logits by tens of percent."""
    cfg = ModelConfig.preset("tiny").replace(qat=qat)
    eager = Decoder(cfg, max_batch=4, max_seq_len=64, dtype=torch.float32, device="cuda").init_random(seed=5)
    compiled = Decoder(cfg, max_batch=4, max_seq_len=64, dtype=torch.float32, device="cuda")
    compiled.load_state_dict(eager.state_dict())
    runner = fuse.compile_decode(compiled, buckets=(1, 4), progress=False, compilation=compilation)
    assert sorted(runner.stats.captured) == [1, 4], runner.stats.fallbacks
    rng = random.Random(1)
    next_position = [0] * 4
    worst = 0.0
    for _ in range(40):
        slots = rng.sample(range(4), rng.randint(1, 4))
        tokens = torch.tensor([rng.randrange(cfg.vocab_size) for _ in slots])
        positions = torch.tensor([next_position[s] for s in slots])
        expected = eager(tokens, positions, torch.tensor(slots))
        worst = max(worst, relative_error(runner(tokens, positions, torch.tensor(slots)), expected))
        for s in slots:
            next_position[s] += 1
    print(f"\ntiny fp32 compiled graphs vs eager (qat={qat}, {compilation}): worst relative error {worst:.2e}")
    assert worst <= (1e-2 if qat else 1e-4)


def test_the_compile_pool_is_up_before_the_first_graph_compiles(monkeypatch):
    """On CUDA the runner starts Inductor's pool of Triton compile processes before its first
    graph's compile (fuse.backend.warm_compile_pool), so that the graph's kernels compile in the
    pool rather than one at a time in this process while the pool starts."""
    from torch._inductor import async_compile

    import fuse.backend

    if async_compile.get_compile_threads() <= 1:
        pytest.skip("Inductor compiles in this process (one compile thread)")
    pool_up = []  # at each graph's compile
    compile_fx = fuse.backend.compile_fx

    def recording(graph, example_inputs, **kwargs):
        pool_up.append(async_compile.AsyncCompile.process_pool.cache_info().currsize > 0)
        return compile_fx(graph, example_inputs, **kwargs)

    monkeypatch.setattr(fuse.backend, "compile_fx", recording)
    decoder = Decoder(ModelConfig.preset("tiny", layers=1), max_batch=4, max_seq_len=64, dtype=torch.float32,
                      device="cuda").init_random(seed=5)
    fuse.compile_decode(decoder, buckets=(4,), progress=False, compile_workers=0)
    assert pool_up and all(pool_up), pool_up
