"""`fuse soak` on the CPU, short: random traffic through the compiled tiny runner, watched."""
from __future__ import annotations

import dataclasses
import itertools
import json
import weakref

import pytest
import torch

from fuse import soak
from fuse.__main__ import main
from fuse.numerics import Check, judge
from decoders import TINY_SHAPE

TINY_SOAK = dict(preset="tiny", device="cpu", max_batch=TINY_SHAPE["max_batch"], max_seq_len=TINY_SHAPE["max_seq_len"])


@pytest.fixture(scope="module")
def tiny_subject():
    """The compiled tiny runner, built once for the soaks here (a build takes most of a soak's time).
    The tests' tiny shape, so that Inductor's cache serves the graphs other tests compiled."""
    return soak.build(soak.SoakSettings(**TINY_SOAK))


def test_short_soak_on_the_cpu(tmp_path, monkeypatch, tiny_subject):
    monkeypatch.setattr(soak, "build", lambda settings: tiny_subject)
    settings = soak.SoakSettings(**TINY_SOAK, steps=50, check_every=10, out_dir=str(tmp_path))
    result = soak.run_soak(settings, log=lambda line: None)
    assert result["recompiles"] == 0 and result["compiles_after_warmup"] == 0 and result["graph_breaks"] == 0
    assert result["non_finite_steps"] == 0
    assert [m["step"] for m in result["memory"]] == [0, 1, 11, 21, 31, 41, 50]
    assert all(m["rss_bytes"] > 0 and m["allocated_bytes"] is None for m in result["memory"])  # no device allocator here
    assert [c["step"] for c in result["checks"]] == [0, 10, 20, 30, 40]
    assert all(c["passed"] for c in result["checks"]), result["checks"]
    assert result["checks_failed"] == 0 and result["first_failed_check"] is None
    assert result["verdict"] == {"passed": True, "reason": ""}
    pooled = result["pooled"]
    assert pooled["passed"] and pooled["rows"] == sum(c["batch"] for c in result["checks"])
    assert pooled["error"] <= pooled["bound"] == 1e-4  # fp32: exact to summation order

    soak.write_outputs(result, str(tmp_path))
    assert json.loads((tmp_path / "soak.json").read_text())["checks"] == result["checks"]
    markdown = (tmp_path / "soak.md").read_text()
    assert "| 50 | " in markdown and "| 0 | 0 | 0 | - | 0 of 5 | pass |" in markdown
    assert "All checked rows together: pass, " in markdown


@pytest.mark.parametrize("failing_step", [None, 20])
def test_a_failed_check_fails_the_soak_and_its_exit_status(tmp_path, monkeypatch, tiny_subject, failing_step):
    monkeypatch.setattr(soak, "build", lambda settings: tiny_subject)
    real_check_step, calls = soak.check_step, itertools.count()

    def check_step(*args, **kwargs):
        check = real_check_step(*args, **kwargs)
        step = next(calls) * 10  # one call per checked step, every 10 steps
        return dataclasses.replace(check, error=check.error + 1.0) if step == failing_step else check

    monkeypatch.setattr(soak, "check_step", check_step)
    out, results = tmp_path / "out", tmp_path / "results.md"
    argv = (f"soak --preset tiny --device cpu --steps 30 --check-every 10 --max-batch {TINY_SHAPE['max_batch']} "
            f"--max-seq-len {TINY_SHAPE['max_seq_len']} --out {out} --results {results}")
    status = main(argv.split())

    result = json.loads((out / "soak.json").read_text())
    assert result["non_finite_steps"] == 0 and result["recompiles"] == 0  # the exit status is the check's alone
    if failing_step is None:
        assert status == 0 and result["verdict"]["passed"] and result["checks_failed"] == 0
        assert "| 0 of 3 | pass |" in results.read_text()
        return
    failed = next(c for c in result["checks"] if c["step"] == failing_step)
    assert status == 1 and not result["verdict"]["passed"]
    assert result["checks_failed"] == 1 and result["first_failed_check"] == failed and not failed["passed"]
    assert "worst row" in failed["reason"] and result["worst_check"] == failed
    assert result["verdict"]["reason"].startswith("1 of 3 checks failed")
    for markdown in ((out / "soak.md").read_text(), results.read_text()):
        assert f"| 1 of 3, first step {failing_step} (batch {failed['batch']}): {failed['reason']} | FAIL: 1 of 3" in markdown


def test_the_verdict_fails_a_check_that_pooling_hides():
    # The H200 case: one check's median row over its bound, diluted below it among the others' rows.
    rows, log = 8, lambda line: None
    good = Check(error=torch.full((rows,), 1e-6), noise=torch.zeros(rows), top1_agree=rows)
    # Every row 5e-4: the median fails 1e-4; one eager row's noise of 1e-3 widens the worst row's bound to 2e-3.
    off = Check(error=torch.full((rows,), 5e-4), noise=torch.tensor([1e-3] + [0.0] * (rows - 1)), top1_agree=rows)
    watch = soak.Watch(memory=[])
    for step, check in enumerate([good, good, off, good, good]):
        watch.add_check(step * 250, check, torch.float32, log)
    pooled = judge(watch.checks, torch.float32)
    assert pooled.passed, pooled.reason  # the premise: pooled, the failing check goes unseen
    assert [v["passed"] for v in watch.verdicts] == [True, True, False, True, True]
    assert watch.verdicts[2]["reason"].startswith("median row")
    verdict = soak.overall_verdict(watch.verdicts, pooled)
    assert not verdict["passed"] and verdict["reason"] == "1 of 5 checks failed"
    assert soak.worst_check(watch.verdicts)["step"] == 500
    assert soak.overall_verdict(watch.verdicts[:2], judge(watch.checks[:2], torch.float32)) == {"passed": True, "reason": ""}


# -- memory sampling, with steps that need no model -----------------------------------------------
# Past glibc's largest mmap threshold (32 MiB): a freed tensor of this size leaves the resident memory
# rather than staying in malloc's heap.
LOGITS_ROW_BYTES = 36 * 2**20


class FakeSteps:
    """Batches of 1, 2, 3 rows in turn; each step's logits a fresh tensor of LOGITS_ROW_BYTES a row, so
    that a sample taken while one is alive moves with the batch. `leak`: each unchecked step also
    keeps a tensor of that size."""

    def __init__(self, leak: bool = False):
        self.batches = itertools.cycle((1, 2, 3))
        self.leak, self.leaked = leak, []
        self.logits = []  # weakrefs to every step's logits

    def next_inputs(self):
        batch = next(self.batches)
        return torch.zeros(batch, dtype=torch.int64), torch.zeros(batch, dtype=torch.int64), torch.arange(batch)

    def _logits(self, batch: int) -> torch.Tensor:
        # Bytes: the soak's isfinite temporaries (a bool per element) are then as large, so mmapped
        # too. Ones, not empty: the pages are touched, so resident.
        logits = torch.ones(batch, LOGITS_ROW_BYTES, dtype=torch.uint8)
        self.logits.append(weakref.ref(logits))
        return logits

    def run(self, tokens, positions, slots) -> torch.Tensor:
        if self.leak:
            self.leaked.append(torch.ones(LOGITS_ROW_BYTES, dtype=torch.uint8))
        return self._logits(len(tokens))

    def check(self, inputs) -> Check:
        batch = len(inputs[0])
        self._logits(batch)  # like check_step: logits made, reduced to per-row errors, dropped
        return Check(error=torch.zeros(batch), noise=torch.zeros(batch), top1_agree=batch)


def serve(fake: FakeSteps, monkeypatch) -> tuple[soak.Watch, list[int]]:
    """`soak.serve` through `fake`, and how many of its logits were alive at each memory sample."""
    alive, sample = [], soak.memory_sample

    def watched_sample(step, device):
        alive.append(sum(ref() is not None for ref in fake.logits))
        return sample(step, device)

    monkeypatch.setattr(soak, "memory_sample", watched_sample)
    settings = soak.SoakSettings(preset="tiny", device="cpu", steps=12, check_every=4, max_batch=3)
    watch = soak.serve(settings, torch.device("cpu"), fake.next_inputs, fake.run, fake.check, log=lambda line: None)
    return watch, alive


def test_memory_samples_do_not_count_the_steps_logits(monkeypatch):
    watch, alive = serve(FakeSteps(), monkeypatch)
    assert [m["step"] for m in watch.memory] == [0, 1, 5, 9, 12]
    assert alive == [0] * len(watch.memory)
    # Held at a sample, the previous step's logits (1 to 3 rows) would move it by a row or more.
    assert soak.growth_after_warm_up(watch.memory, "rss_bytes") < LOGITS_ROW_BYTES / 2


def test_memory_samples_show_what_the_steps_keep(monkeypatch):
    fake = FakeSteps(leak=True)
    watch, _ = serve(fake, monkeypatch)
    # Step 0 is checked, not run: every leak comes after the first sample after warm-up.
    leaked_bytes = sum(t.nbytes for t in fake.leaked)
    assert leaked_bytes > 0
    assert soak.growth_after_warm_up(watch.memory, "rss_bytes") >= 0.9 * leaked_bytes


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


def test_the_soak_fails_on_memory_that_moves_graph_breaks_or_recompiles():
    clean = {"verdict": {"passed": True, "reason": ""}, "non_finite_steps": 0, "recompiles": 0, "graph_breaks": 0,
             "allocated_growth_bytes": soak.FLAT_BYTES}
    assert soak.problems(clean) == []
    assert soak.problems({**clean, "allocated_growth_bytes": None}) == []  # no device allocator (the CPU)
    grown = soak.problems({**clean, "allocated_growth_bytes": soak.FLAT_BYTES + 1})
    assert len(grown) == 1 and "allocated memory moved" in grown[0]
    assert soak.problems({**clean, "graph_breaks": 2, "recompiles": 1}) == ["1 recompiles", "2 graph breaks"]
    failed = soak.problems({**clean, "verdict": {"passed": False, "reason": "1 of 40 checks failed"}})
    assert failed == ["yardstick: 1 of 40 checks failed"]
