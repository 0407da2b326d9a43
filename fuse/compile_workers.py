"""The decode step's graphs compiled in worker processes, one layer kind and batch shape each
where there are workers enough, before this process compiles them.

A regional compile (fuse/step.py) compiles one graph per layer kind and batch shape, one after
another: Dynamo and Inductor compile in one thread. Each worker builds a decoder of only its
kinds' first layers (`model.Decoder(layer_ids=...)`; on CUDA it maps this process's weights of
those layers through CUDA IPC instead of holding its own, and copies their buffers; on the CPU
it draws random weights) and runs compile_decode's warm-up of its buckets on it without
capturing. That leaves the graphs in Inductor's and AOTAutograd's caches; this process then
traces each graph and loads its compiled code from them (a layer kind's graph is the same
whichever decoder holds the layer). Every worker compiles the head's graph of its buckets too
(small, and no worker waits for another).

The custom ops' Triton kernels compile in this process meanwhile (fuse/precompile.py, with the
runner's threads, which would otherwise wait): it records every bucket's op calls and compiles
them while the workers start and trace, so that a worker finds them in Triton's cache at its
first calls (one it reaches first it compiles itself, which only costs time).

A start that compiles its frames ahead for an artifact (fuse/frames.py) gets the workers' frames
instead: each worker compiles its kinds' frames and writes them to a file, and this process loads
them (frames compiled ahead do not go through the caches).

Only where it can help: a model.Decoder in one process, the regional compile, Inductor's caches
on. A worker that fails costs its time only: this process compiles what it did not, with a
warning naming the worker's error."""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import logging
import os
import pickle
from multiprocessing.reduction import ForkingPickler
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass

import torch
import torch.multiprocessing  # registers the CUDA tensors' reductions (IPC handles) with ForkingPickler
from torch import nn

from fuse.frames import Frames, frames_apply
from fuse.options import CompileOptions
from fuse.step import compilation_for, layer_kinds, split_ranks
from model import Decoder

log = logging.getLogger("fuse")

# A worker's CUDA context, allocator slack and the compile's workspace, besides its decoder's buffers.
WORKER_OVERHEAD_BYTES = 2 * 2**30
# The last line of a worker's output, as JSON after this prefix: the wall-clock times (time.time())
# at which it reached each of WORKER_PHASES ("reached") and its allocator's peak ("peak_bytes",
# CUDA only: the memory a worker holds besides its CUDA context, which WORKER_OVERHEAD_BYTES counts).
REPORT_LINE = "fuse compile worker: "
# A worker writes its frames here first, then renames them: a reader never sees half a file.
PARTIAL_SUFFIX = ".partial"
# How long a worker stopped by a failed start gets to end on SIGTERM before it is killed.
STOP_WAIT_S = 10
# How often the wait for the workers looks for one that ended.
FINISH_POLL_S = 0.05
# A worker's phases, each ending at the time its name is recorded under: the interpreter and the
# imports, its decoder (weights mapped or drawn), its buckets' first calls (the graphs compiled),
# the frames written (a start building an artifact).
WORKER_PHASES = ("start-up", "decoder", "graphs", "frames written")


@dataclass(frozen=True)
class Job:
    """What one worker compiles: the graphs of its layers' kinds for its buckets."""

    layer_ids: tuple[int, ...]  # the first layer of each of its kinds
    buckets: tuple[int, ...]  # one batch shape's buckets where there are workers enough, else all


@dataclass
class Worker:
    job: Job
    process: subprocess.Popen
    log_path: str
    spec_path: str
    frames_path: str | None  # where it writes its frames (a start that compiles frames ahead)
    launched: float  # time.time() at its launch
    succeeded: bool = False
    seconds: dict[str, float] = dataclasses.field(default_factory=dict)  # per WORKER_PHASES entry it reached
    peak_bytes: int = 0  # its CUDA allocator's peak reservation

    @property
    def layer_ids(self) -> tuple[int, ...]:
        return self.job.layer_ids

    @property
    def files(self) -> tuple[str, ...]:
        """Every file the worker may leave: its log, its spec, its frames (and their partial write)."""
        frames = (self.frames_path, self.frames_path + PARTIAL_SUFFIX) if self.frames_path else ()
        return (self.log_path, self.spec_path, *frames)


def batch_shapes(options: CompileOptions, buckets: tuple[int, ...]) -> list[tuple[int, ...]]:
    """The buckets grouped by the graph they run: batch 1's and the symbolic batch's, one for all
    with batch_one_shared, one per bucket without dynamic_batch."""
    if not options.dynamic_batch:
        return [(b,) for b in buckets]
    if options.batch_one_shared:
        return [tuple(buckets)]
    return [shape for shape in ((1,) if 1 in buckets else (), tuple(b for b in buckets if b > 1)) if shape]


def worker_jobs(model, options: CompileOptions, buckets: tuple[int, ...]) -> list[Job]:
    """What each worker compiles: nothing where workers cannot help; else one job per layer kind
    and batch shape where options.compile_workers allows that many (None: as many as fit in the
    device's free memory, one per CPU, on CUDA only), else the kinds spread over the workers,
    every bucket each. A worker builds the first layer of each of its kinds."""
    requested = options.compile_workers
    if requested == 0 or not options.compile or type(model) is not Decoder or split_ranks(model) is not None:
        return []
    if compilation_for(model, options) != "regional" or not _inductor_caches_on():
        return []
    firsts = [kind[0] for kind in layer_kinds(model)]
    shapes = batch_shapes(options, tuple(buckets))
    if requested is None:
        if model.device.type != "cuda":
            return []
        requested = min(len(firsts) * len(shapes), _workers_that_fit(model, firsts), os.cpu_count() or 1)
    if requested >= len(firsts) * len(shapes):
        return [Job((first,), shape) for first in firsts for shape in shapes]
    count = min(requested, len(firsts))
    return [Job(tuple(firsts[i::count]), tuple(buckets)) for i in range(count)]


def start(model, options: CompileOptions, buckets: tuple[int, ...]) -> list[Worker]:
    """One process per entry of worker_jobs, started; `finish` waits for them."""
    jobs = worker_jobs(model, options, buckets)
    with_frames = frames_apply(model, options)
    worker_options = dataclasses.replace(
        options, compilation=compilation_for(model, options), cuda_graphs=False, compile_workers=0,
        progress=False, artifact=None, dump_dir=None, strict=False,
    )
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)}
    # Inductor's pool of compile processes sized to the worker's share of the CPUs (by default
    # each worker starts one per CPU), unless the user chose its size.
    env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(max(1, (os.cpu_count() or 1) // max(1, len(jobs)))))
    workers = []
    for job in jobs:
        spec = {
            "config": model.config, "max_batch": model.max_batch, "max_seq_len": model.max_seq_len,
            "dtype": model.dtype, "device": str(model.device), "layer_ids": job.layer_ids,
            "options": dataclasses.replace(worker_options, buckets=job.buckets),
            "tensors": worker_tensors(model, job.layer_ids) if model.device.type == "cuda" else None,
        }
        handle, spec_path = tempfile.mkstemp(prefix="fuse-compile-worker-", suffix=".pkl")
        with os.fdopen(handle, "wb") as f:
            try:
                f.write(ForkingPickler.dumps(spec, pickle.HIGHEST_PROTOCOL))  # CUDA tensors as IPC handles
            except RuntimeError as error:  # an allocator whose memory cannot be shared
                warnings.warn(f"fuse: the compile workers draw weights of their own: this process's could not be shared ({error})")
                pickle.dump({**spec, "tensors": None}, f)
        log_path = spec_path[: -len(".pkl")] + ".log"
        frames_path = spec_path[: -len(".pkl")] + ".frames" if with_frames else None
        with open(log_path, "w") as output:
            command = [sys.executable, "-m", "fuse.compile_workers", spec_path] + ([frames_path] if frames_path else [])
            launched = time.time()
            process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, env=env)
        workers.append(Worker(job, process, log_path, spec_path, frames_path, launched))
    if workers and options.progress:
        log.warning("fuse: compiling the graphs in %d worker processes", len(workers))
    return workers


def worker_tensors(model, layer_ids: tuple[int, ...]) -> dict[str, torch.Tensor]:
    """`model`'s parameters and buffers outside its layers and those of `layer_ids`, named as in a
    worker's decoder of `layer_ids` (its layer j is layers[layer_ids[j]] here)."""
    renamed = {f"layers.{i}.": f"layers.{j}." for j, i in enumerate(layer_ids)}
    tensors = {}
    for name, tensor in (*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)):
        if name.startswith("layers."):
            layer = name[: name.index(".", len("layers.")) + 1]
            if layer not in renamed:
                continue
            name = renamed[layer] + name[len(layer):]
        tensors[name] = tensor
    return tensors


def adopt_tensors(decoder: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Give `decoder` (built on the meta device) the tensors of `worker_tensors`: the parameters
    as they are (mapped, read only), each buffer as a copy of its own (the worker's steps write
    its caches)."""
    modules = dict(decoder.named_modules())
    for name, tensor in tensors.items():
        path, _, key = name.rpartition(".")
        module = modules[path]
        if key in module._parameters:
            module._parameters[key] = nn.Parameter(tensor, requires_grad=False)
        else:
            module._buffers[key] = tensor.clone()
    left = [name for name, t in (*decoder.named_parameters(), *decoder.named_buffers()) if t.is_meta]
    if left:
        raise RuntimeError(f"compile worker: no tensor given for {left[:5]}")


@contextlib.contextmanager
def stopped_on_error(workers: list[Worker]):
    """Inside: an exception or an interrupt ends the workers still running and removes their files
    before it propagates, so that a start that fails leaves no process compiling behind it."""
    try:
        yield
    except BaseException:
        stop(workers)
        raise


def stop(workers: list[Worker]) -> None:
    """End the workers still running (SIGTERM, then SIGKILL after STOP_WAIT_S) and remove their files."""
    for worker in workers:
        if worker.process.poll() is None:
            worker.process.terminate()
    for worker in workers:
        try:
            worker.process.wait(timeout=STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            worker.process.kill()
            worker.process.wait()
        for path in worker.files:
            if os.path.exists(path):
                os.remove(path)


def finish(workers: list[Worker], progress: bool = False) -> int:
    """Wait for every worker, in the order they end; the number that succeeded. With `progress`
    a log line for each as it ends; a failed one warns with its log's end."""
    pending = list(workers)
    while pending:
        ended = [worker for worker in pending if worker.process.poll() is not None]
        if not ended:
            time.sleep(FINISH_POLL_S)
        for worker in ended:
            pending.remove(worker)
            _collect(worker)
            if progress:
                log.warning("fuse: compile worker %d of %d (layers %s, buckets %s) %s in %5.1f s", len(workers) - len(pending),
                            len(workers), list(worker.layer_ids), list(worker.job.buckets),
                            "done" if worker.succeeded else "failed", time.time() - worker.launched)
    if workers and torch.cuda.is_initialized():
        torch.cuda.ipc_collect()  # the shared tensors' reference counts, released by the workers
    return sum(worker.succeeded for worker in workers)


def _collect(worker: Worker) -> None:
    """An ended worker's report read (its phases and peak), whether it succeeded, and its files
    removed; a failed one warns with its output's end."""
    status = worker.process.wait()
    with open(worker.log_path) as f:
        output = f.read()
    for path in (worker.log_path, worker.spec_path):
        os.remove(path)
    worker.seconds, worker.peak_bytes = read_report(output, worker.launched)
    worker.succeeded = status == 0
    if not worker.succeeded:
        warnings.warn(f"fuse: the compile worker of layers {list(worker.layer_ids)}, buckets {list(worker.job.buckets)}, "
                      f"failed (exit status {status}); "
                      f"this process compiles their graphs instead. Its output ended with:\n{output[-1500:]}")


def read_report(output: str, launched: float) -> tuple[dict[str, float], int]:
    """From a worker's output (its REPORT_LINE) and its launch time: seconds per WORKER_PHASES
    entry it reached, and its allocator's peak; ({}, 0) where it printed none (it failed before
    its end)."""
    lines = [line for line in output.splitlines() if line.startswith(REPORT_LINE)]
    if not lines:
        return {}, 0
    report = json.loads(lines[-1][len(REPORT_LINE):])
    seconds, before = {}, launched
    for phase in WORKER_PHASES:
        if phase in report["reached"]:
            seconds[phase] = report["reached"][phase] - before
            before = report["reached"][phase]
    return seconds, report["peak_bytes"]


def load_frames(workers: list[Worker], frames: Frames) -> dict:
    """Load into `frames` the frames the workers that succeeded wrote, renamed to `frames`' layer
    kinds (a worker's decoder numbers its kinds among its own layers), one head's; returns what
    compiling them took: frames compiled, Inductor and AOTAutograd compiles, seconds per compile timer."""
    written_frames, took = {}, {"compiled": 0, "inductor": 0, "aot_autograd": 0, "seconds": {}}
    for worker in workers:
        if worker.frames_path is None or not worker.succeeded:
            continue
        with open(worker.frames_path, "rb") as f:
            written = pickle.load(f)
        os.remove(worker.frames_path)
        for name, data in written["frames"].items():
            prefix, _, shape = name.partition("/")
            if prefix.startswith("block"):
                name = f"block{frames.kind_of[worker.layer_ids[int(prefix.removeprefix('block'))]]}/{shape}"
            written_frames.setdefault(name, data)
        for count in ("compiled", "inductor", "aot_autograd"):
            took[count] += written[count]
        for phase, seconds in written["seconds"].items():
            took["seconds"][phase] = max(took["seconds"].get(phase, 0.0), seconds)  # side by side: the longest
    frames.load(written_frames)
    return took


def _inductor_caches_on() -> bool:
    config = torch._inductor.config
    return bool(config.fx_graph_cache) and not getattr(config, "force_disable_caches", False)


def _workers_that_fit(model, firsts: list[int]) -> int:
    """How many workers fit in the device's free memory (with a tenth of it left over), each
    holding its copy of the decoder's buffers outside the layers and of the largest of the kinds'
    layers' (the weights it maps from this process). This process's cached, unused blocks go back
    to the device first."""
    def nbytes(module) -> int:
        return sum(t.numel() * t.element_size() for t in module.buffers())

    layers = sum(nbytes(layer) for layer in model.layers)
    per_worker = nbytes(model) - layers + max(nbytes(model.layers[i]) for i in firsts) + WORKER_OVERHEAD_BYTES
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(model.device)
    return int(0.9 * free // per_worker)


def _run_worker(spec_path: str, frames_path: str | None) -> None:
    """Build the spec's decoder and run each bucket's first call (the runner's warm-up, without
    capturing): every graph of its layers lands in the caches, or, with `frames_path`, its frames
    compiled ahead are written there."""
    from fuse.backend import pin_triton_toolchain, warm_compile_pool
    from fuse.graphs import build_buckets
    from fuse.stats import RunnerStats, compile_counts
    from fuse.step import build_step

    reached = {"start-up": time.time()}
    with open(spec_path, "rb") as f:
        spec = pickle.load(f)
    tensors, options = spec.pop("tensors"), spec["options"]
    warm_compile_pool(torch.device(spec["device"]))  # ready by the graphs' compile
    decoder = Decoder(spec["config"], max_batch=spec["max_batch"], max_seq_len=spec["max_seq_len"], dtype=spec["dtype"],
                      device=spec["device"] if tensors is None else "meta", layer_ids=spec["layer_ids"])
    if tensors is None:
        decoder.init_random(0)
    else:
        adopt_tensors(decoder, tensors)
        del tensors  # the buffers' mapped originals
    reached["decoder"] = time.time()
    frames = Frames.for_options(decoder, options) if frames_path else None
    step = build_step(decoder, options, frames=frames)
    if decoder.device.type == "cuda":
        pin_triton_toolchain()  # as the runner does: the kernels' cache keys carry the toolchain
    build_buckets(step.run, decoder, options.buckets, use_graphs=False, stats=RunnerStats(), eager=decoder.step, progress=False)
    reached["graphs"] = time.time()
    if frames is not None:
        counts = compile_counts()
        written = {"frames": frames.saved(), "compiled": len(frames.compiled), "seconds": frames.seconds,
                   "inductor": counts["inductor"] + frames.uncounted_inductor_compiles, "aot_autograd": counts["aot_autograd"]}
        with open(frames_path + PARTIAL_SUFFIX, "wb") as f:
            pickle.dump(written, f)
        os.replace(frames_path + PARTIAL_SUFFIX, frames_path)
        reached["frames written"] = time.time()
    peak = torch.cuda.max_memory_reserved(decoder.device) if decoder.device.type == "cuda" else 0
    print(REPORT_LINE + json.dumps({"reached": reached, "peak_bytes": peak}), flush=True)
    # The mapped weights released before the interpreter ends, so that this process's references
    # to the runner's memory are counted as gone (else the runner warns about them at its exit).
    del step, frames, decoder
    torch._dynamo.reset()
    gc.collect()


if __name__ == "__main__":
    _run_worker(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
