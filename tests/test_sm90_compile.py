"""Every Triton and Gluon kernel compiles for sm_90 (Hopper) on a machine without a GPU, at the
launch plans and shapes of a V4-Flash decode step (tests/sm90_compile.py, in a new process
without the interpreter). Catches what only a GPU's compile would: a layout Triton cannot lower,
an API the installed Triton lacks, a program over an SM's shared memory. The kernels compile
ahead (kernels/precompile.py), as a CUDA start does, and the launches must then compile none.
About a minute cold on
2 cores, so it runs when asked for: `python3 -m pytest -m sm90`. Another Triton first on the
path compiles them with that version instead (a GPU machine's Triton may refuse what the
installed one accepts): `pip install --no-deps --target DIR triton==3.6.0`, then
`PYTHONPATH=DIR python3 -m pytest -m sm90`."""
from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from kernels.registry import launched_kernels

HARNESS = pathlib.Path(__file__).with_name("sm90_compile.py")
# Instructions per 16 x 16 weights a warp multiplies (tests/sm90_compile.py's k16) in the FP4
# products' innermost loops (mma.sync 19-25, wgmma 17-18 with Triton 3.6 and 3.9): a change to
# the decoding that costs more shows here first.
FP4_LOOP_BUDGET = 27


def has_ptxas() -> bool:
    if importlib.util.find_spec("triton") is None:
        return False
    import triton

    return (pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists()


@pytest.mark.sm90
@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU compiles the kernels for real: pytest -m gpu")
@pytest.mark.skipif(not has_ptxas(), reason="needs Triton with its NVIDIA backend (ptxas)")
def test_every_kernel_compiles_for_sm90(tmp_path):
    out = tmp_path / "sm90.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # Through the compiles ahead (kernels/precompile.py), two at a time: the launches after them
    # must find every kernel in memory, which they do only where its keys are theirs.
    done = subprocess.run([sys.executable, str(HARNESS), str(out), "--ahead", "2"], capture_output=True, text=True, env=env, timeout=1200)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(out.read_text())
    assert not result["failures"], json.dumps(result["failures"], indent=1)[:6000]
    assert result["ahead"]["submitted"] > 0 and result["compiled_in_launches"] == 0, result["ahead"]
    # Every kernel the op packages launch (device helpers aside: they compile inside them).
    launchable = {name for name in launched_kernels() if name.endswith("_kernel")}
    assert launchable and launchable <= set(result["kernels"]), sorted(launchable - set(result["kernels"]))
    over = {name: variant for name, variants in result["kernels"].items() for variant in variants
            if variant["shared"] > result["shared_memory_limit"]}
    assert not over, over
    # The FP4 experts' products decode every weight byte in registers: at batches 16 and up they
    # measured as slow on an H200 as on an H100, whose memory is slower, so the work on the SMs
    # bounds them there and their loops hold an instruction budget (per 16 x 16 weights a warp
    # multiplies: their decoding and scales, the copies, the scaling).
    for name in ("_mma_gate_up_kernel", "_mma_down_kernel"):
        loops = [loop for variant in result["kernels"][name] for loop in variant["mma_loops"]]
        assert loops, f"{name}: no loop with tensor-core instructions in its SASS"
        worst = max(loop["instructions"] / loop["k16"] for loop in loops)
        assert worst <= FP4_LOOP_BUDGET, f"{name}: {worst:.1f} instructions per 16 x 16 weights in its loop: {loops}"
