"""torchrun launches of tests/parallel_worker.py, one process per rank, each with a time limit
so that a hang fails.

The CPU launches the tests read (CPU_LAUNCHES) start when collection ends (tests/conftest.py),
one after another beside the tests before theirs: most tests keep one core busy, and one launch
at a time mostly the other (a split step's ranks wait while rank 0 compiles, fuse/step.py); all
at once they slowed the tests beside them several times over. A test then waits for its
launch's end (started then, if it was still queued)."""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
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
CPU_LAUNCH_SECONDS = 900  # from a launch's start


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
        self.output = out / "torchrun.log"  # a file, not a pipe: nobody needs to read it while it runs
        with open(self.output, "w") as log:
            self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def wait(self) -> bool:
        """Wait for the end, until the deadline; whether it ended."""
        try:
            self.proc.wait(timeout=max(self.deadline - time.monotonic(), 1))
            return True
        except subprocess.TimeoutExpired:
            return False

    def result(self) -> tuple[int, str, list[dict]]:
        """(exit status, output, each rank's report)."""
        if not self.wait():
            self.stop()
            self.proc.wait()
            pytest.fail(f"torchrun with {self.world_size} ranks ran past its time (a hang?):\n{self.output.read_text()[-3000:]}")
        reports = [json.loads(path.read_text()) for path in sorted(self.out.glob("rank*.json"))]
        return self.proc.returncode, self.output.read_text(), reports

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)  # torchrun and every rank it started


class CpuLaunches:
    """The CPU launches of one session, each started once: `start(names)` queues those not yet
    started, run one at a time in CPU_LAUNCHES' order; `get(name)` one (started now if it was
    still queued); `stop()` every one at the session's end."""

    def __init__(self):
        self.root = pathlib.Path(tempfile.mkdtemp(prefix="fuse-launches-"))
        self.started: dict[str, Launch] = {}
        self.queued: list[str] = []
        self.lock = threading.Lock()
        self.queue_thread: threading.Thread | None = None

    def start(self, names) -> None:
        with self.lock:
            self.queued += [name for name in CPU_LAUNCHES if name in set(names) - set(self.started) - set(self.queued)]
            if self.queue_thread is None and self.queued:
                self.queue_thread = threading.Thread(target=self._run_queued, daemon=True)
                self.queue_thread.start()

    def get(self, name: str) -> Launch:
        with self.lock:
            if name not in self.started:
                if name in self.queued:
                    self.queued.remove(name)
                self._launch(name)
            return self.started[name]

    def stop(self) -> None:
        with self.lock:
            self.queued.clear()
            for launched in self.started.values():
                launched.stop()
        shutil.rmtree(self.root, ignore_errors=True)

    def _launch(self, name: str) -> Launch:
        world_size, checks = CPU_LAUNCHES[name]
        out = self.root / name.replace("_", "-")
        out.mkdir()
        self.started[name] = Launch(world_size, out, checks, CPU_LAUNCH_SECONDS)
        return self.started[name]

    def _run_queued(self) -> None:
        while True:
            with self.lock:
                if not self.queued:
                    self.queue_thread = None
                    return
                launched = self._launch(self.queued.pop(0))
            launched.wait()
