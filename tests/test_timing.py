"""kernels/bench/timing.py on a GPU: the side-by-side timer tells apart ways whose work differs by
a known factor, and names every way it was given."""
from __future__ import annotations

import pytest
import torch


@pytest.mark.gpu
def test_interleaved_times_track_the_work():
    from kernels.bench.timing import interleaved_graph_times_us

    a = torch.randn(2048, 2048, device="cuda")
    sets = [(torch.randn(2048, 2048, device="cuda"),) for _ in range(2)]
    ways = {"one product": lambda b: a @ b, "three products": lambda b: a @ (a @ (a @ b))}
    us = interleaved_graph_times_us(ways, sets, rounds=3, reps=10)
    assert set(us) == set(ways)
    assert 2.0 < us["three products"] / us["one product"] < 4.0, us
