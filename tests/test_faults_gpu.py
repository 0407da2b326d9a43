"""Faults on a GPU, tiny preset in fp32 with QAT off (the runner must equal eager to rounding):
a bucket whose capture really fails, running out of memory while capturing the largest bucket,
and bad input after capture. Each leaves a runner that serves every batch size like eager."""
from __future__ import annotations

import pytest
import torch

import fuse
from model import Decoder, ModelConfig

pytestmark = [pytest.mark.gpu]

BUCKETS = (1, 2, 4)
HELD = 4 << 30  # bytes the injected out-of-memory capture holds when it fails
BAD_INPUTS = [
    ("repeated", [1, 2], [0, 0], [2, 2]),
    ("positions must be in", [1], [64], [0]),
    ("tokens must be in", [512], [0], [0]),
    ("slots must be in", [1], [0], [-1]),
    ("batch size must be in", [1] * 5, [0] * 5, [0, 1, 2, 3, 0]),
]


def tiny_pair(seed: int) -> tuple[Decoder, Decoder]:
    """An eager decoder and a copy with the same weights, on the GPU."""
    cfg = ModelConfig.preset("tiny").replace(qat=False)
    shape = dict(max_batch=4, max_seq_len=64, dtype=torch.float32, device="cuda")
    eager = Decoder(cfg, **shape).init_random(seed)
    model = Decoder(cfg, **shape)
    model.load_state_dict(eager.state_dict())
    return eager, model


def assert_runs_like_eager(runner, eager: Decoder, position: int = 0) -> None:
    """Every batch size up to the largest bucket (3 runs padded in bucket 4), like eager."""
    for size in (1, 2, 3, 4):
        slots = torch.arange(size).flip(0)
        tokens, positions = torch.arange(size) + 7 * size, torch.full((size,), position)
        expected = eager(tokens, positions, slots)
        torch.testing.assert_close(runner(tokens, positions, slots), expected, rtol=1e-4, atol=1e-4)


def test_a_capture_that_really_fails_falls_back_for_that_bucket_only():
    """The step of bucket 4 synchronises the device, which a capturing stream does not permit:
    that capture fails for real, bucket 4 runs without a graph and says why, 1 and 2 replay."""
    eager, model = tiny_pair(3)
    step = model.step

    def synchronizing_step(tokens, positions, slots, layers=None, logits=None):
        if tokens.shape[0] == 4:
            torch.cuda.synchronize()
        return step(tokens, positions, slots, layers, logits)

    model.step = synchronizing_step  # compile=False runs model.step in the bucket graphs
    runner = fuse.compile_decode(model, buckets=BUCKETS, compile=False, progress=False)
    assert sorted(runner.stats.captured) == [1, 2], runner.stats.fallbacks
    assert list(runner.stats.fallbacks) == [4]
    assert runner.stats.fallbacks[4].startswith("capture failed: ")
    assert "bucket 4: capture failed" in runner.describe() and "runs eager without a graph" in runner.describe()
    assert_runs_like_eager(runner, eager)


def test_out_of_memory_while_capturing_the_largest_bucket_leaves_a_usable_runner(monkeypatch):
    """The capture of the largest bucket runs out of memory holding 4 GiB: the memory goes back
    (allocated and reserved), that bucket runs compiled without a graph, the others replay. The
    hold is far above what compiling and capturing the tiny model reserve (a few hundred MiB),
    so the reserved bytes tell the two apart."""
    import fuse.graphs

    capture = fuse.graphs.capture

    def out_of_memory_for_the_largest(fn, pool=None, warmup=1):
        if fn().shape[0] == max(BUCKETS):
            held = torch.empty(HELD, dtype=torch.uint8, device="cuda")  # what the capture had taken
            raise torch.OutOfMemoryError(f"CUDA out of memory (injected, {held.numel()} bytes held)")
        return capture(fn, pool=pool, warmup=warmup)

    monkeypatch.setattr(fuse.graphs, "capture", out_of_memory_for_the_largest)
    eager, model = tiny_pair(4)
    torch.cuda.synchronize()
    allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    runner = fuse.compile_decode(model, buckets=BUCKETS, progress=False)
    torch.cuda.synchronize()
    assert sorted(runner.stats.captured) == [1, 2], runner.stats.fallbacks
    reason = runner.stats.fallbacks[4]
    assert "capture failed: OutOfMemoryError" in reason and "runs compiled without a graph" in reason, reason
    grown = torch.cuda.memory_allocated() - allocated, torch.cuda.memory_reserved() - reserved
    assert grown[0] < HELD // 8, f"the failed capture's memory stayed allocated: {grown[0] >> 20} MiB"
    big = [(seg["total_size"] >> 20, seg["stream"], seg.get("segment_pool_id"), seg["allocated_size"] >> 20)
           for seg in torch.cuda.memory_snapshot() if seg["total_size"] >= HELD // 2]
    assert grown[1] < HELD // 2, (
        f"the failed capture's memory stayed reserved: {grown[1] >> 20} MiB; segments of half the hold or more "
        f"(MiB, stream, pool, MiB allocated): {big}"
    )
    assert_runs_like_eager(runner, eager)


@pytest.mark.parametrize("on_device", [False, True], ids=["host inputs", "device inputs"])
def test_bad_input_after_capture_is_refused_and_changes_nothing(on_device):
    eager, model = tiny_pair(5)
    runner = fuse.compile_decode(model, buckets=BUCKETS, progress=False)
    assert sorted(runner.stats.captured) == list(BUCKETS), runner.stats.fallbacks
    assert_runs_like_eager(runner, eager)
    before = {name: buf.clone() for name, buf in model.named_buffers()}
    for message, tokens, positions, slots in BAD_INPUTS:
        inputs = [torch.tensor(v, device="cuda" if on_device else "cpu") for v in (tokens, positions, slots)]
        with pytest.raises(ValueError, match=message):
            runner(*inputs)
    with pytest.raises(ValueError, match="must be int64"):
        runner(torch.tensor([1], dtype=torch.int32), torch.tensor([0]), torch.tensor([0]))
    torch.cuda.synchronize()
    for name, buf in model.named_buffers():
        assert torch.equal(buf, before[name]), f"{name} changed"
    assert_runs_like_eager(runner, eager, position=1)
