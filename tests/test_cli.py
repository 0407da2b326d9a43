"""The command line: a bad value ends the run with one line naming the flag, exit status 2."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from fuse.__main__ import main

BAD = [
    ("report --batch 0", "--batch", "positive integer"),
    ("report --batch -3", "--batch", "positive integer"),
    ("report --device tpu", "--device", "cpu, cuda or cuda:N"),
    ("demo --steps 0", "--steps", "positive integer"),
    ("report --steps 0", "--steps", "positive integer"),
    ("report --timing-steps 0", "--timing-steps", "positive integer"),
    ("report --layers 7", "--layers", "tiny preset has 6 layers"),
    ("report --preset huge", "--preset", "choose from"),
    ("bench --device cpu --variants eager,fuse-turbo", "--variants", "unknown variants ['fuse-turbo']"),
    ("bench --device cpu --batches 1,0", "--batches", "comma list of positive integers"),
    ("bench --device cpu --inductor-option combo_kernels", "--inductor-option", "KEY=VALUE"),
    ("bench --device cpu --starts cold", "--starts", "only with --start-times"),
    ("bench --device cpu --start-times --starts cold,bogus", "--starts", "choose among cold, warm, artifact, workers, stock"),
    ("bench --device cpu --start-times --starts artifact", "--starts", "artifact needs cold"),
    ("precompile --device cpu --preset tiny --artifact a.zip --buckets 2,x", "--buckets", "comma list of positive integers"),
    ("precompile --device cpu --preset tiny --artifact a.zip --buckets 8 --max-batch 4", "--buckets", "no bucket fits --max-batch 4"),
    ("precompile --device cpu --preset tiny --artifact a.zip --max-seq-len 0", "--max-seq-len", "positive integer"),
    ("precompile --device cpu --preset tiny --artifact a.zip --skinny-product-columns -1", "--skinny-product-columns", ">= 0"),
    ("precompile --device cpu --preset tiny --artifact a.zip --compilation flat", "--compilation", "choose from"),
    ("precompile --device cpu --preset tiny --artifact a.zip --inductor-option no_such_setting=1", "--inductor-option", "no_such_setting"),
    ("precompile --device cpu --preset tiny --artifact . ", "--artifact", "is a folder"),
    ("soak --device cpu --steps 0", "--steps", "positive integer"),
    ("soak --device cpu --check-every 0", "--check-every", "positive integer"),
    ("soak --device cpu --max-seq-len 1", "--max-seq-len", "at least 2"),
    ("soak --preset tiny --device cpu --layers 9", "--layers", "tiny preset has 6 layers"),
]
if not torch.cuda.is_available():
    BAD += [("report --device cuda", "--device", "no CUDA device here"), ("bench", "--device", "no CUDA device here")]


@pytest.mark.parametrize("argv, flag, allowed", BAD, ids=[b[0] for b in BAD])
def test_bad_values_end_in_one_line_naming_the_flag(argv, flag, allowed, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv.split())
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert f"argument {flag}" in err and allowed in err, err


def test_the_installed_entry_point_reports_the_same_way():
    done = subprocess.run([sys.executable, "-m", "fuse", "report", "--batch", "0"], capture_output=True, text=True)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == ["fuse report: error: argument --batch: expected a positive integer, got 0"]


def test_every_option_has_help_with_its_default():
    from fuse.__main__ import build_parser

    _, commands = build_parser()
    for name, command in commands.items():
        for action in command._actions:
            if action.help == "==SUPPRESS==" or action.dest == "help":
                continue
            assert action.help, f"{name} {action.option_strings}"
        text = command.format_help()
        assert "(default:" in text, name


ONE_PROCESS_ONLY = [  # each small, so that a missing refusal fails fast rather than runs long
    ("soak --device cpu --preset tiny --layers 1 --steps 1", "fuse soak: error: "),
    ("precompile --device cpu --preset tiny --layers 1 --buckets 1 --artifact a.zip", "fuse precompile: error: "),
    ("demo --layers 1 --steps 1", "fuse demo: error: "),
    ("bench --device cpu --preset tiny --layers 1 --contexts 16 --batches 1 --start-times", "fuse bench: error: argument --start-times: "),
    ("bench --device cpu --preset tiny --layers 1 --contexts 16 --batches 1 --compare-precision",
     "fuse bench: error: argument --compare-precision: "),
]


@pytest.mark.parametrize("argv, prefix", ONE_PROCESS_ONLY, ids=[c[0] for c in ONE_PROCESS_ONLY])
def test_commands_of_one_process_refuse_torchrun_ranks(argv, prefix, capsys, monkeypatch):
    """Where torchrun started two ranks (WORLD_SIZE, as it sets it), the commands that build an
    unsplit model of their own stop before any work with one line, exit status 2."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as exit_:
        main(argv.split())
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err == prefix + "runs in one process only, and torchrun started 2 ranks: run it without torchrun\n", err


def test_one_rank_under_torchrun_is_one_process(capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert main("demo --layers 1 --steps 1 --batch 1".split()) == 0
    assert "eager decode, preset tiny" in capsys.readouterr().out


def test_precompile_compiles_in_workers_unless_told_not_to():
    from fuse.__main__ import build_parser

    parser, _ = build_parser()
    base = ["precompile", "--artifact", "a.zip", "--device", "cpu"]
    assert parser.parse_args(base).compile_workers is None  # as many as fit (none on the CPU)
    assert parser.parse_args(base + ["--compile-workers", "0"]).compile_workers == 0
    assert parser.parse_args(base + ["--compile-workers", "3"]).compile_workers == 3
