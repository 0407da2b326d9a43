"""`python -m kernels.bench` when a section fails: the failure is reported, the sections after it
still run and write their results, the failed section's results stay as they were, and the
command exits naming it. Sections and the device stood in for on the CPU."""
from __future__ import annotations

import sys
import types

import pytest
import torch

import kernels.bench.__main__ as bench_main
from kernels.bench.results import read_section, write_section


def stand_in_section(monkeypatch, name, run):
    module = types.ModuleType(f"kernels.bench.{name}")
    module.run = run
    monkeypatch.setitem(sys.modules, module.__name__, module)


def off_its_reference(copy_gbs):
    raise AssertionError("moe scaled B=16: max error 1.2e+01 of the output scale")


def test_a_failing_section_leaves_the_others_measured(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: types.SimpleNamespace(name="GPU", multi_processor_count=2))
    monkeypatch.setattr(bench_main, "copy_bandwidth_gbs", lambda: 3000.0)
    monkeypatch.setattr(bench_main, "machine", lambda: "a stand-in GPU")
    stand_in_section(monkeypatch, "stand_in_fails", off_its_reference)
    stand_in_section(monkeypatch, "stand_in_runs", lambda copy_gbs: f"| table | at {copy_gbs:.0f} GB/s |")
    results = tmp_path / "results.md"
    write_section(results, "kernels stand_in_fails", "the last good measurement")

    with pytest.raises(SystemExit) as exit_:
        bench_main.main(["--only", "stand_in_fails,stand_in_runs", "--results", str(results), "--out", str(tmp_path / "out.md")])

    assert "stand_in_fails" in str(exit_.value.code) and "stand_in_runs" not in str(exit_.value.code)
    assert "max error 1.2e+01" in capsys.readouterr().err
    assert read_section(results, "kernels stand_in_fails") == "the last good measurement"
    assert "| table | at 3000 GB/s |" in read_section(results, "kernels stand_in_runs")
    assert "| table | at 3000 GB/s |" in (tmp_path / "out.md").read_text()
