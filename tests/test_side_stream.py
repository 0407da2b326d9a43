"""kernels/side_stream.py: which work is side work (and so which split-K counters it takes)
follows from run_beside's calls, whatever stream the caller is on, including a stream that torch's
stream pool hands out again and that is the side stream itself; the side stream is never the
caller's; a run_beside inside side work runs inline. On the CPU with torch.cuda's streams stood
in for by a small pool handed out in turn; on a GPU with torch's own."""
from __future__ import annotations

import contextlib
import itertools

import pytest
import torch

import kernels.side_stream as side_stream_module
from kernels.arrival import split_counters
from kernels.side_stream import in_side_work, run_beside, side_stream

CUDA = torch.device("cuda")


# ---------------------------------------------------------------------------------------------
# CPU: torch.cuda's streams stood in for by a pool of four handed out in turn
# ---------------------------------------------------------------------------------------------

class PooledStream:
    """A stream of a pool of `size`, handed out in turn as torch's stream pool does."""

    turn = itertools.count()
    size = 4

    def __init__(self, device=None, priority=0):
        self.slot = (priority, next(PooledStream.turn) % PooledStream.size)

    def __eq__(self, other):
        return isinstance(other, PooledStream) and self.slot == other.slot

    def __hash__(self):
        return hash(self.slot)

    def wait_stream(self, other):
        pass


@pytest.fixture
def pooled_streams(monkeypatch):
    """torch.cuda's stream calls on a pool of PooledStream; yields the log of (work, stream, side flag)."""
    current = [PooledStream()]
    log = []

    @contextlib.contextmanager
    def stream(s):
        before, current[0] = current[0], s
        try:
            yield
        finally:
            current[0] = before

    monkeypatch.setattr(side_stream_module, "_SIDE_STREAMS", {})
    monkeypatch.setattr(torch.cuda, "Stream", PooledStream)
    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[0])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)

    def work(name):
        def run():
            log.append((name, current[0], in_side_work(CUDA)))
            return []
        return run

    yield work, log, stream


def test_side_work_is_flagged_by_the_call_from_every_stream_of_the_pool(pooled_streams):
    work, log, stream = pooled_streams
    for _ in range(3 * PooledStream.size):  # every pooled stream the caller, the side stream among them
        caller = PooledStream()
        with stream(caller):
            run_beside(work("side"), work("main"), CUDA)
        (_, side_on, side_flag), (_, main_on, main_flag) = log[-2:]
        assert side_flag and not main_flag and not in_side_work(CUDA)
        assert main_on == caller and side_on != caller
    assert not in_side_work(torch.device("cpu"))


def test_side_stream_other_than_the_callers(pooled_streams):
    first = side_stream(0)
    assert side_stream(0) == first and side_stream(0, current=first) != first
    assert side_stream(0, priority=-1) != first


def test_run_beside_in_side_work_runs_inline_on_its_stream(pooled_streams):
    work, log, stream = pooled_streams

    def side_work():
        run_beside(work("inner side"), work("inner main"), CUDA)
        return []

    run_beside(side_work, work("main"), CUDA)
    (_, inner_side_on, inner_side_flag), (_, inner_main_on, inner_main_flag), (_, main_on, main_flag) = log
    assert inner_side_on == inner_main_on != main_on
    assert inner_side_flag and inner_main_flag and not main_flag


def test_side_work_flag_restored_when_it_raises(pooled_streams):
    def failing():
        raise RuntimeError("side work failed")

    with pytest.raises(RuntimeError, match="side work failed"):
        run_beside(failing, lambda: None, CUDA)
    assert not in_side_work(CUDA)


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------


def issued_beside():
    """run_beside from the current stream: each half's stream, side-work flag and counters."""
    def seen():
        return torch.cuda.current_stream(), in_side_work(CUDA), split_counters(CUDA, 4)

    side, main = {}, {}

    def side_work():
        side["stream"], side["flag"], counters = seen()
        return counters

    def main_work():
        main["stream"], main["flag"], main["counters"] = seen()

    side["counters"], _ = run_beside(side_work, main_work, CUDA)
    return side, main


@pytest.mark.gpu
@pytest.mark.parametrize("caller", ["default", "side stream", "high-priority side stream", "pool"])
def test_side_work_follows_the_calls_not_the_stream(caller):
    first = side_stream(torch.cuda.current_device())  # made once, as a warm-up call does
    stream = {"default": torch.cuda.default_stream(), "side stream": first,
              "high-priority side stream": side_stream(torch.cuda.current_device(), priority=-1),
              "pool": torch.cuda.Stream()}[caller]
    with torch.cuda.stream(stream):
        side, main = issued_beside()
    assert side["stream"] != main["stream"] and main["stream"] == stream
    assert side["flag"] and not main["flag"] and not in_side_work(CUDA)
    assert side["counters"].data_ptr() != main["counters"].data_ptr()
    assert main["counters"].data_ptr() == split_counters(CUDA, 4).data_ptr()


@pytest.mark.gpu
def test_pool_streams_coming_round_never_share_the_side_stream():
    """torch's pool holds 32 streams a priority and hands them out in turn: over 70 new streams
    (as many captures' warm-ups make) one is the side stream; run_beside from it still forks."""
    for _ in range(70):
        with torch.cuda.stream(torch.cuda.Stream()):
            side, main = issued_beside()
        assert side["stream"] != main["stream"]
        assert side["counters"].data_ptr() != main["counters"].data_ptr()


@pytest.mark.gpu
def test_run_beside_inside_side_work_runs_inline():
    def side_work():
        outer = torch.cuda.current_stream()
        inner_side, inner_main = run_beside(lambda: torch.zeros(1, device=CUDA) + in_side_work(CUDA),
                                            lambda: torch.cuda.current_stream(), CUDA)
        assert inner_main == outer and bool(inner_side.item())
        return inner_side

    run_beside(side_work, lambda: None, CUDA)
