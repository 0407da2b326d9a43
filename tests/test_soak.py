"""`fuse soak` on the CPU, short: random traffic through the compiled tiny runner, watched."""
from __future__ import annotations

import json

from fuse import soak
from decoders import TINY_SHAPE


def test_short_soak_on_the_cpu(tmp_path):
    # The tests' tiny shape, so that Inductor's cache serves the graphs other tests compiled.
    settings = soak.SoakSettings(
        preset="tiny", device="cpu", steps=50, check_every=10, max_batch=TINY_SHAPE["max_batch"],
        max_seq_len=TINY_SHAPE["max_seq_len"], out_dir=str(tmp_path),
    )
    result = soak.run_soak(settings, log=lambda line: None)
    assert result["recompiles"] == 0 and result["compiles_after_warmup"] == 0 and result["graph_breaks"] == 0
    assert result["non_finite_steps"] == 0
    assert [m["step"] for m in result["memory"]] == [0, 1, 11, 21, 31, 41, 50]
    assert all(m["rss_bytes"] > 0 and m["allocated_bytes"] is None for m in result["memory"])  # no device allocator here
    assert [c["step"] for c in result["checks"]] == [0, 10, 20, 30, 40]
    assert all(c["passed"] for c in result["checks"]), result["checks"]
    assert result["verdict"]["passed"] and result["verdict"]["rows"] == sum(c["batch"] for c in result["checks"])
    assert result["verdict"]["error"] <= result["verdict"]["bound"] == 1e-4  # fp32: exact to summation order

    soak.write_outputs(result, str(tmp_path))
    assert json.loads((tmp_path / "soak.json").read_text())["checks"] == result["checks"]
    markdown = (tmp_path / "soak.md").read_text()
    assert "| 50 | " in markdown and "| 0 | 0 | 0 | - | 5 | pass |" in markdown


def test_allocated_growth_counts_from_the_first_sample_after_warm_up():
    samples = [{"allocated_bytes": b} for b in (0, 100, 100, 2**20 + 100, 100)]
    assert soak.allocated_growth(samples) == 2**20
    assert soak.allocated_growth([{"allocated_bytes": None}, {"allocated_bytes": None}]) is None


def test_traffic_starts_and_ends_sequences_on_random_slots():
    traffic = soak.Traffic(max_batch=8, max_seq_len=6, vocab=100, seed=1)
    seen_positions, sizes = set(), set()
    for _ in range(200):
        tokens, positions, slots = traffic.next_batch()
        assert len(set(slots.tolist())) == len(slots) and 0 <= positions.min() and positions.max() <= 5
        seen_positions |= set(positions.tolist())
        sizes.add(len(slots))
    assert seen_positions == set(range(6))  # up to max_seq_len - 1
    assert traffic.started > 8 * 3 and len(sizes) == 8  # sequences end and new ones start; every batch size
