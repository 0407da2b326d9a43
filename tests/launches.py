"""torchrun launches of tests/parallel_worker.py, one process per rank, each with a time limit
so that a hang fails.

The CPU launches the tests read (CPU_LAUNCHES) start when collection ends (tests/conftest.py),
beside the tests before theirs: a split step's ranks wait while rank 0 compiles on one core
(fuse/step.py), and most tests keep one core busy, so on a small machine the launches take
little of the tier's time. A test then waits for its launch's end."""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

WORKER = pathlib.Path(__file__).with_name("parallel_worker.py")

# The CPU launches by the name of the fixture that reads each: (world size, the worker's checks).
# Each launch starts torch in every rank again, so the checks that pass share one launch of two ranks.
CPU_LAUNCHES = {
    "two_ranks": (2, ["load", "decode", "fuse-commands"]),
    "four_ranks": (4, ["decode"]),
    "failing_ranks": (2, ["corrupt", "compile-failure"]),
}
CPU_LAUNCH_SECONDS = 900  # from the start, which is before the tests ahead of them run


class Launch:
    """torchrun with `world_size` ranks running the worker's `checks` into `out`, started now;
    `result()` waits for it, until `timeout` seconds after the start. Past them torchrun and every
    rank it started are killed and the test fails."""

    def __init__(self, world_size: int, out: pathlib.Path, checks: list[str], timeout: float):
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world_size}",
                   str(WORKER), str(out), *checks]
        path = os.pathsep.join(filter(None, [str(WORKER.parents[1]), os.environ.get("PYTHONPATH")]))
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}  # this checkout's packages first
        self.world_size, self.out, self.deadline = world_size, out, time.monotonic() + timeout
        self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                     start_new_session=True)

    def result(self) -> tuple[int, str, list[dict]]:
        """(exit status, output, each rank's report)."""
        try:
            output, _ = self.proc.communicate(timeout=max(self.deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            self.stop()
            output, _ = self.proc.communicate()
            pytest.fail(f"torchrun with {self.world_size} ranks ran past its time (a hang?):\n{output[-3000:]}")
        reports = [json.loads(path.read_text()) for path in sorted(self.out.glob("rank*.json"))]
        return self.proc.returncode, output, reports

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)  # torchrun and every rank it started


class CpuLaunches:
    """The CPU launches of one session, each started once: `start(names)` those not yet started,
    `get(name)` one (started then if it was not), `stop()` every one at the session's end."""

    def __init__(self):
        self.root = pathlib.Path(tempfile.mkdtemp(prefix="fuse-launches-"))
        self.started: dict[str, Launch] = {}

    def start(self, names) -> None:
        for name in sorted(set(names) - set(self.started)):
            world_size, checks = CPU_LAUNCHES[name]
            out = self.root / name.replace("_", "-")
            out.mkdir()
            self.started[name] = Launch(world_size, out, checks, CPU_LAUNCH_SECONDS)

    def get(self, name: str) -> Launch:
        self.start([name])
        return self.started[name]

    def stop(self) -> None:
        for launched in self.started.values():
            launched.stop()
        shutil.rmtree(self.root, ignore_errors=True)
