"""`fuse bench --start-times`: compile_decode's start, each start in a new process, split into the
runner's phases (fuse/stats.py): cold (empty compile caches; it saves an artifact), warm (the
caches the cold start filled), artifact (other, empty caches and the cold start's artifact only),
and on CUDA a cold start with compile workers and stock reduce-overhead's."""
from __future__ import annotations

import contextlib
import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from typing import Callable

import torch

from fuse.bench import BenchSettings, reduce_overhead_step, step_inputs
from fuse.runner import compile_decode
from fuse.stats import compile_timer_totals, dynamo_totals
from kernels.triton_util import triton_version
from model import Decoder

START_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
# Stock reduce-overhead's cold start is stopped after this long (it traces and compiles the whole
# step as one graph), so that the start-time measurement fits one call of a GPU machine.
STOCK_START_LIMIT_S = 240
# The measured starts: the key `--starts` picks it by, its name, the compile-cache folder its process
# uses, the child's flag (ARTIFACT: --artifact with the cold start's file) and whether it needs CUDA.
ARTIFACT = "--artifact"
STARTS = (
    ("cold", "cold", "caches", ARTIFACT, False),
    ("warm", "warm", "caches", None, False),
    ("artifact", "artifact", "empty-caches", ARTIFACT, False),
    ("workers", "cold, compile workers", "worker-caches", "--compile-workers", True),
    ("stock", "reduce-overhead cold", "stock-caches", "--stock-start", True),
)
START_KEYS = tuple(start[0] for start in STARTS)
# Stock reduce-overhead's start is stopped after this multiple of the cold start (enough to rank them).
STOCK_START_COLD_MULTIPLE = 1.5
# How long the processes a start left running (its compile pools' and workers') get to end before
# they are stopped and the next start begins.
SETTLE_S = 30.0


def timed_start(
    settings: BenchSettings, buckets: tuple[int, ...], artifact: str | None = None, stock: bool = False, compile_workers: bool = False,
) -> dict:
    """One timed start in this fresh process: compile_decode (with `compile_workers`, its graphs
    compiled in as many worker processes as fit), or with `stock` torch.compile's reduce-overhead
    mode, warmed up until cudagraph trees recorded every bucket (its third call)."""
    cfg = settings.config()
    decoder = Decoder(cfg, max_batch=max(buckets), max_seq_len=max(settings.contexts) + 8, dtype=settings.dtype, device=settings.device)
    decoder.init_random(settings.seed)
    if stock:
        compiles0, _ = dynamo_totals()
        timers0 = compile_timer_totals()
        start = time.perf_counter()
        reduce_overhead_step(decoder, buckets, lambda batch: step_inputs(batch, min(settings.contexts), cfg.vocab_size, decoder.device, settings.seed))
        if decoder.device.type == "cuda":
            torch.cuda.synchronize(decoder.device)
        seconds = time.perf_counter() - start
        timers = compile_timer_totals()
        return {"seconds": seconds, "compiles": dynamo_totals()[0] - compiles0, "captured": None,
                "phases": {name: timers.get(name, 0.0) - timers0.get(name, 0.0) for name in timers}}
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:  # a failed compile worker's, say: the table names them
        warnings.simplefilter("always")
        runner = compile_decode(decoder, buckets=buckets, dynamic_batch=True, progress=False, artifact=artifact,
                                compile_workers=None if compile_workers else 0)  # caches: see measure
    seconds = time.perf_counter() - start
    s = runner.stats
    return {
        "seconds": seconds, "compiles": s.compiles, "captured": len(s.captured), "phases": s.start_seconds,
        "inductor_compiles": s.inductor_compiles, "aot_compiles": s.aot_compiles, "triton_compiles": s.triton_compiles,
        "compile_workers": [s.compile_workers, s.compile_workers_started],
        "compile_worker_seconds": s.compile_worker_seconds,
        "compile_worker_peak_bytes": s.compile_worker_peak_bytes,
        "artifact": runner.artifact.describe() if runner.artifact else None,
        "warnings": [str(w.message) for w in caught if "fuse" in str(w.message)],
    }


def check_starts(starts: tuple[str, ...]) -> None:
    """Raises ValueError naming a start whose key is not among START_KEYS, or warm or artifact without
    the cold start they start from."""
    unknown = sorted(set(starts) - set(START_KEYS))
    if unknown:
        raise ValueError(f"choose among {', '.join(START_KEYS)}, got {','.join(starts)}")
    after_cold = [key for key in ("warm", "artifact") if key in starts and "cold" not in starts]
    if after_cold:
        raise ValueError(f"{' and '.join(after_cold)} {'need' if len(after_cold) > 1 else 'needs'} cold "
                         "(the caches or the artifact it starts from)")


def measure(settings: BenchSettings, buckets: tuple[int, ...] = START_BUCKETS,
            starts: tuple[str, ...] = START_KEYS, on_start: Callable[[dict], None] | None = None) -> dict:
    """compile_decode for `buckets`, each of STARTS in a new process: cold (empty compile caches; it
    saves an artifact), warm (the caches the cold start filled) and artifact (other, empty caches
    and the cold start's artifact only); on CUDA also the cold start with compile workers and
    stock reduce-overhead's (each with its own empty caches, stock stopped after
    STOCK_START_COLD_MULTIPLE times the cold start, or STOCK_START_LIMIT_S). `starts`: the
    START_KEYS of those to run (warm and artifact need cold). `on_start(results)` after each start,
    with the starts measured so far (a run cut short keeps them)."""
    check_starts(starts)
    on_cuda = settings.device.startswith("cuda")
    results = {
        "gpu": torch.cuda.get_device_name() if on_cuda else "cpu",
        "torch": torch.__version__, "triton": triton_version() or "-", "date": datetime.date.today().isoformat(),
        "buckets": list(buckets), "layers": settings.config().n_layers,
        "command": (f"python -m fuse bench --start-times --preset {settings.preset}"
                    + (f" --layers {settings.layers}" if settings.layers else "")
                    + (f" --contexts {','.join(map(str, settings.contexts))}" if settings.contexts != BenchSettings.contexts else "")
                    + (f" --starts {','.join(starts)}" if set(starts) != set(START_KEYS) else "")),
    }
    with tempfile.TemporaryDirectory(prefix="fuse-start-") as folder, sigterm_exits():
        artifact = os.path.join(folder, "artifact.zip")
        for key, which, caches, flag, cuda_only in STARTS:
            if cuda_only and not on_cuda or key not in starts:
                continue
            command = [
                sys.executable, "-m", "fuse", "bench", "--start-time-child",
                "--preset", settings.preset, "--contexts", ",".join(map(str, settings.contexts)),
                "--buckets", ",".join(map(str, buckets)), "--fp32-products", settings.fp32_products, "--device", settings.device,
            ] + (["--layers", str(settings.layers)] if settings.layers else [])
            command += [ARTIFACT, artifact] if flag == ARTIFACT else [flag] if flag else []
            if flag == "--compile-workers":  # a cold start building an artifact of its own, as `fuse precompile --compile-workers` does
                command += [ARTIFACT, os.path.join(folder, "workers-artifact.zip")]
            # The compile caches are chosen before the child imports torch (Inductor reads them once).
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": os.path.join(folder, caches, "inductor"),
                   "TRITON_CACHE_DIR": os.path.join(folder, caches, "triton")}
            limit = None
            if flag == "--stock-start":  # stock compiles the whole step inline: bounded, reported as "more than"
                limit = STOCK_START_LIMIT_S
                if "cold" in results:
                    limit = min(limit, round(STOCK_START_COLD_MULTIPLE * results["cold"]["seconds"]))
            done = run_start(command, env, limit)
            if done is not None and done.returncode:
                raise RuntimeError(f"{which} start failed:\n{done.stderr[-3000:]}")
            results[which] = {"timed_out_after": limit} if done is None else json.loads(done.stdout.strip().splitlines()[-1])
            if on_start is not None:
                on_start(results)
    return results


def run_start(command: list[str], env: dict, limit: float | None, settle_s: float = SETTLE_S) -> subprocess.CompletedProcess | None:
    """One start's process, in a session of its own; None where it ran past `limit` seconds.
    Afterwards what it left running there (Inductor's compile processes, compile workers) gets
    `settle_s` to end and is then stopped, and the files it wrote are flushed, so that the next
    start finds the machine as a fresh process would, not busy with this one's leftovers. Its
    output goes through files: a leftover holding a pipe would keep a reader waiting."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        process = subprocess.Popen(command, stdout=out, stderr=err, text=True, env=env, start_new_session=True)
        timed_out = False
        try:
            process.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            _end_session(process.pid, settle_s if process.poll() is not None else 0.0)  # a start stopped: all at once
            process.wait()
            os.sync()
        if timed_out:
            return None
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(command, process.returncode, out.read(), err.read())


@contextlib.contextmanager
def sigterm_exits():
    """Inside, SIGTERM (a time limit's) raises SystemExit, so that run_start's clean-up stops the
    start it waits for, which runs in a session of its own and would outlive this process."""
    if threading.current_thread() is not threading.main_thread():  # only there can it take signals
        yield
        return
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _end_session(session: int, settle_s: float) -> None:
    """Wait up to `settle_s` for the processes of `session` (its leader's id) to end, then kill
    those left (the leader's process group)."""
    deadline = time.monotonic() + settle_s
    while session_running(session) and time.monotonic() < deadline:
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(session, signal.SIGKILL)


def session_running(session: int) -> bool:
    """Whether a process of `session` runs (zombies, which an init process may never reap, aside);
    False where /proc cannot say."""
    if not os.path.isdir("/proc"):
        return False
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                state, _, _, sid = f.read().rsplit(")", 1)[1].split()[:4]
        except (OSError, ValueError):
            continue  # ended meanwhile
        if sid == str(session) and state != "Z":
            return True
    return False


def to_markdown(result: dict) -> str:
    """The cold, warm and artifact starts, each split into the runner's phases (fuse/stats.py)."""
    from fuse.stats import COMPILE_PHASES, START_PHASES

    phases = list(START_PHASES) + list(COMPILE_PHASES)
    starts = [start[1] for start in STARTS if start[1] in result]
    machine = f" on {result['gpu']}, torch {result['torch']}, triton {result['triton']}, {result['date']}" if "gpu" in result else ""
    lines = [
        f"`{result['command']}`{machine}: compile_decode for buckets {result['buckets']} at {result['layers']} layers, each start "
        "in a new process, begun once the one before it and what it left running had ended (fuse/start_times.py run_start): cold with empty compile caches (it saves an artifact: on a torch that saves Dynamo's frames, it "
        "compiles the regional step's frames ahead, fuse/frames.py, which bypasses Inductor's graph cache), warm with the "
        "caches the cold start filled and no artifact, artifact with other, empty caches and the cold start's artifact only; "
        "cold, compile workers: `compile_workers=None` building an artifact of its own "
        "(the graphs compiled in worker processes, fuse/compile_workers.py) with its own empty caches; reduce-overhead cold: stock "
        "`torch.compile(step, mode=\"reduce-overhead\")` with its own empty caches, until cudagraph trees recorded every "
        f"bucket (stopped after {STOCK_START_COLD_MULTIPLE}x the cold start). Seconds; the compile timers are torch's own, parts of the first calls. Compiles: graphs Dynamo traced; "
        "Inductor, AOTAutograd: graphs compiled rather than loaded from a cache; Triton: the custom ops' kernels compiled or tuned.",
        "",
        "| start | total s | compiles | Inductor / AOTAutograd / Triton compiles | captured | " + " | ".join(phases) + " |",
        "|---|---|---|---|---|" + "---|" * len(phases),
    ]
    for which in starts:
        r = result[which]
        if "timed_out_after" in r:
            lines.append(f"| {which} | > {r['timed_out_after']:.0f} (stopped) | - | - | - | " + " | ".join("-" for _ in phases) + " |")
            continue
        cells = [f"{r['phases'].get(p, 0.0):.1f}" for p in phases]
        backend = " / ".join(str(r[k]) if k in r else "-" for k in ("inductor_compiles", "aot_compiles", "triton_compiles"))
        captured = "-" if r.get("captured") is None else r["captured"]
        lines.append(f"| {which} | {r['seconds']:.1f} | {r['compiles']} | {backend} | {captured} | " + " | ".join(cells) + " |")
    notes = []
    for which in starts:
        succeeded, started = result[which].get("compile_workers", (0, 0))
        if started:
            notes.append(f"- {which}: {succeeded} of {started} compile workers succeeded.")
        reported = result[which].get("compile_worker_seconds") or []
        if reported:
            slowest = max(reported, key=lambda seconds: sum(seconds.values()))
            notes.append(f"- {which}: the slowest compile worker, {sum(slowest.values()):.1f} s from its launch: "
                         + ", ".join(f"{phase} {s:.1f}" for phase, s in slowest.items()) + ".")
        if result[which].get("compile_worker_peak_bytes"):
            notes.append(f"- {which}: the largest compile worker's allocator peak "
                         f"{result[which]['compile_worker_peak_bytes'] / 2**30:.2f} GiB (its CUDA context besides).")
        notes += [f"- {which}: {' '.join(w.split())[:600]}" for w in result[which].get("warnings", ())]
    return "\n".join(lines + ([""] + notes if notes else []))
