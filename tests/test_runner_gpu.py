"""compile_decode on a GPU with the bench preset (V4-Flash widths, 43 layers, 16 experts): every
bucket captures, random batch sizes replay without recompiling, outputs stay within bf16 noise
of eager, and memory is flat after warm-up. Prints cold/warm start times. These are marked slow
(run with -m "gpu and slow"); the tiny-preset fp32 runner test runs with -m gpu."""
from __future__ import annotations

import os
import random
import statistics
import subprocess
import sys
import time

import pytest
import torch

import fuse
from fuse.report import one_step_errors, relative_error
from model import Decoder, ModelConfig

pytestmark = [pytest.mark.gpu]

BUCKETS = (1, 2, 4, 8, 16, 32, 64)
STEPS = int(os.environ.get("FUSE_GPU_STEPS", "1000"))


def compare_one_step(decoder, runner, tokens, positions, slots) -> tuple[float, float]:
    """From one cache state: (compiled vs eager, eager vs eager-with-padding-rows) relative errors
    of the logits. The second is the bf16 noise floor: the same function whose matrix products
    see more rows, so they run on other kernels with other reduction orders. The runner's
    decoder is the eager one, so the compiled step is the one that advances the state."""
    errors = one_step_errors(decoder, decoder, runner, *decoder.check_inputs(tokens, positions, slots))
    return errors["compiled_vs_eager"], errors["eager_padding_noise"]


@pytest.fixture(scope="module")
def bench_runner(tmp_path_factory):
    cfg = ModelConfig.preset("bench")
    decoder = Decoder(cfg, max_batch=64, max_seq_len=2048, dtype=torch.bfloat16, device="cuda").init_random(seed=0)
    cache_dir = str(tmp_path_factory.mktemp("compile-cache"))
    start = time.perf_counter()
    runner = fuse.compile_decode(decoder, buckets=BUCKETS, dynamic_batch=True, cache_dir=cache_dir)
    cold = time.perf_counter() - start
    print(f"\ncold start, {len(BUCKETS)} buckets: {cold:.1f} s\n{runner.describe()}")
    return decoder, runner, cache_dir, cold


@pytest.mark.slow
def test_every_bucket_captures(bench_runner):
    _, runner, _, _ = bench_runner
    assert sorted(runner.stats.captured) == list(BUCKETS), runner.stats.fallbacks
    assert runner.stats.graph_breaks == 0
    phases = runner.stats.start_seconds
    assert all(phases[name] > 0 for name in ("first calls", "warm-up and capture")), phases


@pytest.mark.slow
def test_random_batches_match_eager_without_recompiles_or_memory_growth(bench_runner):
    decoder, runner, _, _ = bench_runner
    rng = random.Random(0)
    vocab = decoder.config.vocab_size
    next_position = [0] * decoder.max_batch
    compiled_err, noise = [], []
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
            err, floor = compare_one_step(decoder, runner, tokens, positions, torch.tensor(slots))
            compiled_err.append(err)
            noise.append(floor)
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
    print(f"\ncompiled vs eager, relative error per check: {[f'{e:.3f}' for e in compiled_err]}")
    print(f"eager vs eager + padding rows (bf16 noise): {[f'{e:.3f}' for e in noise]}")
    # A random-weight 43-layer model is chaotic in bf16: any change of summation order moves the
    # logits by tens of percent. So the
    # compiled step must err no more than such a change does, on average over the checks (the
    # mean is steadier than the largest of ten); an unrelated answer would sit near sqrt(2).
    # The exactness of the compiled graph itself is checked in fp32 by tests/test_runner.py.
    assert min(noise) > 0, "the padded eager step ran the same kernels: the noise floor is uncalibrated"
    assert statistics.fmean(compiled_err) <= 1.25 * statistics.fmean(noise), (compiled_err, noise)
    assert max(compiled_err) < 1.0, compiled_err


@pytest.mark.slow
def test_warm_start_is_faster(bench_runner):
    """A second process with the same compile cache starts from the cache."""
    _, runner, cache_dir, cold = bench_runner
    code = (
        "import time, torch, fuse\n"
        "from model import Decoder, ModelConfig\n"
        "d = Decoder(ModelConfig.preset('bench'), max_batch=64, max_seq_len=2048, dtype=torch.bfloat16, device='cuda')\n"
        "d.init_random(0)\n"
        f"t = time.perf_counter(); r = fuse.compile_decode(d, buckets={BUCKETS!r}, dynamic_batch=True, cache_dir={cache_dir!r}, progress=False)\n"
        "print(r.describe())\n"
        "print(f'WARM {time.perf_counter() - t:.1f}')\n"
    )
    del runner
    torch.cuda.empty_cache()
    triton_cache = os.path.join(cache_dir, "triton")
    before = _custom_kernel_cache_files(triton_cache)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=500)
    assert out.returncode == 0, out.stderr[-2000:]
    warm = float(out.stdout.split("WARM")[-1])
    print(f"\nwarm start, {len(BUCKETS)} buckets: {warm:.1f} s\n{out.stdout.split('WARM')[0].strip()}")
    # The custom-op kernels and their autotune choices come from the cold start's Triton cache:
    # the warm start compiles and tunes none of them again.
    compiled_again = sorted(_custom_kernel_cache_files(triton_cache) - before)
    assert not compiled_again, compiled_again[:10]
    # A warm start near the cold one means the cache missed.
    assert warm < 0.6 * cold, (warm, cold)


def _custom_kernel_cache_files(triton_cache: str) -> set[str]:
    """Triton cache entries (key/file) of kernels not generated by Inductor (its are triton_*)."""
    found = set()
    for key in os.listdir(triton_cache) if os.path.isdir(triton_cache) else ():
        for name in os.listdir(os.path.join(triton_cache, key)):
            if not name.startswith(("triton_", "__grp__triton_")) and not name.startswith("tmp"):
                found.add(f"{key}/{name}")
    return found


@pytest.mark.parametrize(
    "qat, compilation", [(False, "nested"), (True, "whole"), (False, "regional")]
)
def test_tiny_fp32_graphs_match_eager_exactly(qat, compilation):
    """The captured graphs compute the eager function: fp32, tiny preset, mixed padded batches;
    with the fp8/fp4 rounding (compiled in its row-wise form on CUDA) in a whole-step graph too,
    and with Inductor's kernels launched as programmatic dependents (a kernel that read before
    waiting for the one before it would read stale values). A rounding flip moves a value by one
    fp8 step, so QAT gets a looser bound; a wrong form (scales of the wrong block, a lost rope
    tail) moves the logits by tens of percent."""
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
