"""Test tiers and markers, in one place.

- `python3 -m pytest`: the CPU tier (what CI runs); Triton kernels run in Triton's interpreter.
- `python3 -m pytest -m gpu`: every kernel compiled on a CUDA GPU and a captured runner.
- `python3 -m pytest -m "gpu and slow"`: the 43-layer runs.
- `python3 -m pytest -m sm90`: every kernel compiled for sm_90 on a machine without a GPU.

Markers: `gpu` needs CUDA (skipped without it, and under the interpreter); `interpreter` runs
Triton kernels in the interpreter (skipped where CUDA runs them compiled); `slow` runs only when
the `-m` expression names it; `sm90` compiles the kernels for Hopper without a GPU and, like `slow`,
runs only when named."""
import os
import sys

import pytest
import torch

# Triton picks the interpreter when it is first imported: set it before any test module loads it.
if not torch.cuda.is_available():
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("triton was imported before tests/conftest.py could set TRITON_INTERPRET=1")
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # Inductor's C++ kernels without SIMD: the CPU tier checks what the code computes, not its
    # speed, and scalar kernels take about a third less time to generate and build. Set before
    # Inductor's config is read; the tests' new processes (torchrun ranks, starts) inherit it.
    os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
HAS_GPU = torch.cuda.is_available() and not INTERPRET


def pytest_collection_modifyitems(config, items):
    named = config.getoption("-m") or ""
    skips = {
        "gpu": None if HAS_GPU else pytest.mark.skip(reason="needs CUDA (without TRITON_INTERPRET)"),
        "interpreter": None if INTERPRET else pytest.mark.skip(reason="needs TRITON_INTERPRET=1 (set without CUDA)"),
        "slow": None if "slow" in named else pytest.mark.skip(reason='slow: run with -m "gpu and slow"'),
        "sm90": None if "sm90" in named else pytest.mark.skip(reason="sm90: run with -m sm90"),
    }
    for item in items:
        for marker, skip in skips.items():
            if skip is not None and marker in item.keywords:
                item.add_marker(skip)


# -- torchrun launches (tests/launches.py): started when collection ends ---------------------
_LAUNCHES = pytest.StashKey()


def pytest_collection_finish(session):
    """The CPU launches the selected tests read start now, one after another beside the tests
    before theirs. Not in a pytest-xdist worker (each collects every test): there the tests start theirs."""
    from launches import CPU_LAUNCHES, CpuLaunches

    wanted = {name for item in session.items for name in getattr(item, "fixturenames", ()) if name in CPU_LAUNCHES}
    if wanted and not hasattr(session.config, "workerinput"):
        session.config.stash[_LAUNCHES] = launches = CpuLaunches()
        launches.start(wanted)


def pytest_sessionfinish(session):
    launches = session.config.stash.get(_LAUNCHES, None)
    if launches is not None:
        launches.stop()


@pytest.fixture(scope="session")
def cpu_launches(request):
    """The session's CPU launches (tests/launches.py), stopped at the session's end."""
    from launches import CpuLaunches

    if _LAUNCHES not in request.config.stash:
        request.config.stash[_LAUNCHES] = CpuLaunches()
    return request.config.stash[_LAUNCHES]


@pytest.fixture(autouse=True)
def _compile_cache_folders_kept():
    """compile_decode(cache_dir=...) points this process's compile caches there; after the test
    they point back, so that every test shares the session's caches."""
    saved = {name: os.environ.get(name) for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


# -- compiled tiny decoders, shared: each compile costs minutes on a small CPU ------------------
@pytest.fixture(scope="session")
def tiny_nested(tmp_path_factory):
    """Nested compilation, buckets 1, 2, 4 (a batch-1 graph and a batch-symbolic one)."""
    from decoders import compiled_tiny

    return compiled_tiny(tmp_path_factory.mktemp("dump") / "inspect", seed=21, buckets=(1, 2, 4), compilation="nested")


@pytest.fixture(scope="session")
def tiny_regional(tmp_path_factory):
    """Regional compilation, buckets 1, 2, 4, batch 1 sharing the symbolic batch's graph
    (batch_one_shared): one graph per layer kind and one for the head, with the batch unbacked."""
    from decoders import compiled_tiny

    return compiled_tiny(tmp_path_factory.mktemp("dump") / "inspect", seed=22, buckets=(1, 2, 4), compilation="regional",
                         batch_one_shared=True)
