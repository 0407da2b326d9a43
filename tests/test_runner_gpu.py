"""compile_decode on a GPU with the bench preset (V4-Flash widths, 43 layers, 16 experts): every
bucket captures, random batch sizes replay without recompiling, outputs pass the accuracy
yardstick (fuse/numerics.py: against an fp32 eager run of the same weights), memory is flat after
warm-up, and a warm start loads every graph from the compile caches. These are marked slow (run
with -m "gpu and slow"); the tiny-preset fp32 runner test runs with -m gpu."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
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
    return decoder, runner


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


def _start_in_a_new_process(cache_dir: str) -> tuple[float, dict[str, int]]:
    """compile_decode of the bench preset in a fresh Python process with `cache_dir`: its start
    time and its Inductor and AOTAutograd cache counters. A fresh process, because Triton serves a
    kernel this process compiled earlier from memory, and never writes it to a cache set later."""
    code = (
        "import json, time, torch, fuse\n"
        "from torch._dynamo.utils import counters\n"
        "from model import Decoder, ModelConfig\n"
        "d = Decoder(ModelConfig.preset('bench'), max_batch=64, max_seq_len=2048, dtype=torch.bfloat16, device='cuda')\n"
        "d.init_random(0)\n"
        f"t = time.perf_counter(); r = fuse.compile_decode(d, buckets={BUCKETS!r}, dynamic_batch=True, cache_dir={cache_dir!r}, progress=False)\n"
        "print(r.describe())\n"
        "print(f'START {time.perf_counter() - t:.1f}')\n"
        "print('COUNTERS ' + json.dumps({\n"
        "    'fxgraph_cache_hit': counters['inductor']['fxgraph_cache_hit'],\n"
        "    'fxgraph_cache_miss': counters['inductor']['fxgraph_cache_miss'],\n"
        "    'fxgraph_cache_bypass': counters['inductor']['fxgraph_cache_bypass'],\n"
        "    'autograd_cache_hit': counters['aot_autograd']['autograd_cache_hit'],\n"
        "    'autograd_cache_miss': counters['aot_autograd']['autograd_cache_miss'],\n"
        "    'autograd_cache_bypass': counters['aot_autograd']['autograd_cache_bypass'],\n"
        "}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=500)
    assert out.returncode == 0, out.stderr[-2000:]
    return float(out.stdout.split("START")[-1].split()[0]), json.loads(out.stdout.split("COUNTERS ")[-1])


@pytest.mark.slow
def test_warm_start_loads_every_graph_from_the_caches(tmp_path):
    """A second process with the cache a first one filled compiles nothing: Inductor's FX graph
    cache and AOTAutograd's cache only hit (by their counters), and no custom-op kernel is
    compiled into Triton's cache again."""
    cache_dir = str(tmp_path / "compile-cache")
    triton_cache = os.path.join(cache_dir, "triton")
    cold, cold_counts = _start_in_a_new_process(cache_dir)
    before = _custom_kernel_cache_files(triton_cache)
    assert before and cold_counts["fxgraph_cache_miss"] > 0, cold_counts  # the cold start filled the cache
    warm, counts = _start_in_a_new_process(cache_dir)
    print(f"\ncold start {cold:.1f} s, warm start {warm:.1f} s, {len(BUCKETS)} buckets; warm cache counters {counts}")
    # The custom-op kernels and their autotune choices come from the cold start's Triton cache:
    # the warm start compiles and tunes none of them again.
    compiled_again = sorted(_custom_kernel_cache_files(triton_cache) - before)
    assert not compiled_again, compiled_again[:10]
    misses = {k: v for k, v in counts.items() if not k.endswith("_hit") and v}
    assert not misses, f"the warm start compiled again: {misses}"
    assert counts["fxgraph_cache_hit"] + counts["autograd_cache_hit"] > 0, counts


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
