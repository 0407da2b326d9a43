"""kernels/side_stream.py: which work is side work (and so which split-K counters it takes)
follows from run_beside's calls, whatever stream the caller is on, including a stream that torch's
stream pool hands out again and that is the side stream itself; the side stream is never the
caller's; a run_beside inside side work runs inline."""
from __future__ import annotations

import pytest
import torch

from kernels.arrival import split_counters
from kernels.side_stream import on_side_stream, run_beside, side_stream

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


def issued_beside():
    """run_beside from the current stream: each half's stream, side-work flag and counters."""
    def seen():
        return torch.cuda.current_stream(), on_side_stream(CUDA), split_counters(CUDA, 4)

    side, main = {}, {}

    def side_work():
        side["stream"], side["flag"], counters = seen()
        return counters

    def main_work():
        main["stream"], main["flag"], main["counters"] = seen()

    side["counters"], _ = run_beside(side_work, main_work, CUDA)
    return side, main


@pytest.mark.parametrize("caller", ["default", "side stream", "high-priority side stream", "pool"])
def test_side_work_follows_the_calls_not_the_stream(caller):
    first = side_stream(torch.cuda.current_device())  # made once, as a warm-up call does
    stream = {"default": torch.cuda.default_stream(), "side stream": first,
              "high-priority side stream": side_stream(torch.cuda.current_device(), priority=-1),
              "pool": torch.cuda.Stream()}[caller]
    with torch.cuda.stream(stream):
        side, main = issued_beside()
    assert side["stream"] != main["stream"] and main["stream"] == stream
    assert side["flag"] and not main["flag"] and not on_side_stream(CUDA)
    assert side["counters"].data_ptr() != main["counters"].data_ptr()
    assert main["counters"].data_ptr() == split_counters(CUDA, 4).data_ptr()


def test_pool_streams_coming_round_never_share_the_side_stream():
    """torch's pool holds 32 streams a priority and hands them out in turn: over 70 new streams
    (as many captures' warm-ups make) one is the side stream; run_beside from it still forks."""
    for _ in range(70):
        with torch.cuda.stream(torch.cuda.Stream()):
            side, main = issued_beside()
        assert side["stream"] != main["stream"]
        assert side["counters"].data_ptr() != main["counters"].data_ptr()


def test_run_beside_inside_side_work_runs_inline():
    def side_work():
        outer = torch.cuda.current_stream()
        inner_side, inner_main = run_beside(lambda: torch.zeros(1, device=CUDA) + on_side_stream(CUDA),
                                            lambda: torch.cuda.current_stream(), CUDA)
        assert inner_main == outer and bool(inner_side.item())
        return inner_side

    run_beside(side_work, lambda: None, CUDA)
