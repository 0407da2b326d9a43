"""compile_decode: the decode step compiled (fuse/step.py) and, on CUDA, one CUDA graph per batch
bucket captured around it (fuse/graphs.py), called the way serving stacks call decode.

A call picks the smallest bucket that fits, pads the batch with rows that use only the model's
scratch slot, replays, and returns a tensor the caller owns; batches larger than the largest
bucket run in chunks. After warm-up a recompile is an error naming the failed guard (or, with
`strict=False`, a warning and a count)."""
from __future__ import annotations

import contextlib
import logging
import os
import time
import warnings

import torch
import torch._dynamo
import torch._inductor.config

from fuse.artifact import (
    ArtifactUse, CompileCacheWatch, expected_manifest, load_artifact, manifest_details, open_artifact, save_artifact,
    watching_compile_caches,
)
from fuse.backend import pin_triton_toolchain, use_cache_dir, warm_compile_pool
from fuse import compile_workers
from fuse.frames import Frames, frames_apply
from fuse.graphs import build_buckets, supports_graphs
from fuse.inspection import CodeDump, Inspection
from fuse.output_code import Kernel
from fuse.options import CompileOptions
from fuse.padding import fill_padded
from fuse.stats import RunnerStats, dynamo_totals
from fuse.step import DecodeModel, build_step, check_decode_model, decode_mode, split_ranks
from kernels.triton_util import plain_launches


log = logging.getLogger("fuse")

# What a call launches besides the step: its batch copied into the bucket's inputs, the rest
# filled with padding rows, the output copied out.
AROUND_THE_STEP = (
    Kernel("aten.copy_", "runner", 3, ops=("aten.copy_",), modules=("(runner)",)),
    Kernel("aten.fill_", "runner", 3, ops=("aten.fill_",), modules=("(runner)",)),
    Kernel("aten.clone", "runner", 1, ops=("aten.clone",), modules=("(runner)",)),
)


class DecodeRunner:
    """`runner(tokens, positions, slots) -> logits [B, vocab]`, the model's signature and checks."""

    def __init__(self, decoder: DecodeModel, options: CompileOptions):
        check_decode_model(decoder)
        parallel = getattr(decoder, "parallel", None)
        if options.artifact is not None and parallel is not None and parallel.world_size > 1:
            # An artifact's manifest does not name the part of the model a rank holds.
            raise ValueError(
                f"compile_decode(artifact=...) runs in one process only: this decoder is split across "
                f"{parallel.world_size} ranks"
            )
        self.decoder = decoder
        self.options = options
        self.device = decoder.device
        self.stats = RunnerStats()
        buckets = tuple(b for b in options.buckets if b <= decoder.max_batch)
        if not buckets:
            raise ValueError(f"no bucket fits max_batch={decoder.max_batch}: {options.buckets}")
        self.buckets = buckets
        self.use_graphs = options.cuda_graphs and supports_graphs(self.device)
        self.artifact: ArtifactUse | None = None  # what this start did with options.artifact
        if options.compile and options.cache_dir:
            use_cache_dir(options.cache_dir)
        match, reason = self._load_artifact() if options.artifact else (None, "")
        saving = options.artifact is not None and self.artifact is None
        loaded = self.artifact is not None and self.artifact.action == "loaded"
        # A start from the artifact compiles nothing: Inductor's pool of compile processes, which its
        # kernels' loading would start, would only take CPU time from it.
        one_thread = torch._inductor.config.patch(compile_threads=1) if loaded else contextlib.nullcontext()
        watching = watching_compile_caches(fresh_record=saving) if options.compile else contextlib.nullcontext(CompileCacheWatch())
        with one_thread, watching as watch, self._launches():
            self.frames = self._frames() if frames_apply(decoder, options) else None
            dump = CodeDump(options.dump_dir, model=decoder) if options.dump_dir else None
            if options.compile and self.device.type == "cuda":
                pin_triton_toolchain()
            with dump or contextlib.nullcontext():
                self.step = build_step(
                    decoder, options, after_block=dump.after_block if dump else None,
                    on_graph=dump.record_graph if dump else None, frames=self.frames,
                )
                if dump:
                    dump.watch(self.step.once_per_step)
                if not loaded:  # from an artifact nothing compiles (and the fake steps alone would take seconds)
                    self._compile_ahead(buckets)
                self._buckets = build_buckets(
                    self.step.run, decoder, buckets, self.use_graphs, self.stats, eager=decoder.step,
                    progress=options.progress, first_call=dump.first_call if dump else None,
                )
            self.stats.triton_compiles = watch.triton_compiles()
            if self.frames is not None:
                self.stats.inductor_compiles += self.frames.uncounted_inductor_compiles
                self.stats.add_seconds(self.frames.seconds)
            if saving:  # inside the watch: it holds what the start used
                self._save_artifact(watch, match, reason)
        if loaded:
            self._check_nothing_compiled()
        self.inspection: Inspection | None = None
        if dump:
            settings = {"device": str(self.device), "dynamic_batch": options.dynamic_batch, "mode": options.mode}
            self.inspection = dump.inspection(self.step.compilation, buckets, settings, AROUND_THE_STEP)

    def _compile_ahead(self, buckets: tuple[int, ...]) -> None:
        """Before the buckets' first calls: their graphs in compile workers (fuse/compile_workers.py)
        and, on CUDA, the custom ops' kernels in a pool of threads here (fuse/precompile.py), beside
        the workers, which find them in Triton's cache."""
        decoder, options = self.decoder, self.options
        workers = compile_workers.start(decoder, options, buckets)
        self.stats.compile_workers_started = len(workers)
        if not workers:  # the graphs compile here (with workers, they load from the caches)
            warm_compile_pool(self.device)
        with compile_workers.stopped_on_error(workers):
            if self.device.type == "cuda" and options.kernel_compile_workers != 0 and split_ranks(decoder) is None:
                from fuse.precompile import bucket_op_calls, compile_op_calls  # imports Triton

                with self.stats.phase("kernel compiles ahead", self.device):
                    calls = bucket_op_calls(decoder, buckets)
                    self.stats.kernels_compiled_ahead = compile_op_calls(calls, options.kernel_compile_workers)
            if workers:
                with self.stats.phase("waiting for compile workers", self.device):
                    self.stats.compile_workers = compile_workers.finish(workers, progress=options.progress)
                    self.stats.compile_worker_seconds = [w.seconds for w in workers if w.seconds]
                    self.stats.compile_worker_peak_bytes = max(w.peak_bytes for w in workers)
                    if self.frames is not None:
                        self._load_worker_frames(workers)

    def _load_artifact(self) -> tuple[dict, str]:
        """Load options.artifact into the compile caches where it is there and matches (else raise,
        per options.artifact_mode); returns what it must match and, where it is rebuilt, why."""
        options = self.options
        match = expected_manifest(self.decoder, options, self.buckets)
        start = time.perf_counter()
        archive, reason = open_artifact(options.artifact, match, options.artifact_mode, manifest_details(self.decoder))
        if archive is not None:
            self.artifact = load_artifact(archive, options.artifact)
            self.stats.start_seconds["artifact load"] = time.perf_counter() - start
            if options.progress:
                log.warning("fuse: %s, in %.1f s", self.artifact.describe(), self.stats.start_seconds["artifact load"])
        return match, reason

    def _frames(self) -> Frames:
        """The step's frames: the artifact's, loaded (timed with the artifact's load), else none yet."""
        saved = self.artifact.frames if self.artifact is not None else {}
        start = time.perf_counter()
        frames = Frames.for_options(self.decoder, self.options, saved)
        if saved:
            self.stats.start_seconds["artifact load"] += time.perf_counter() - start
        return frames

    def _load_worker_frames(self, workers: list[compile_workers.Worker]) -> None:
        """The frames the compile workers compiled, loaded; counted with this start's compiles."""
        took = compile_workers.load_frames(workers, self.frames)
        self.stats.compiles += took["compiled"]
        self.stats.inductor_compiles += took["inductor"]
        self.stats.aot_compiles += took["aot_autograd"]
        self.stats.add_seconds(took["seconds"])

    def _save_artifact(self, watch: CompileCacheWatch, match: dict, reason: str) -> None:
        s = self.stats
        built_by = {
            "compiles": s.compiles, "inductor_compiles": s.inductor_compiles, "aot_compiles": s.aot_compiles,
            "triton_compiles": s.triton_compiles, "start_seconds": {k: round(v, 3) for k, v in s.start_seconds.items()},
        }
        with s.phase("artifact save", self.device):
            self.artifact = save_artifact(
                self.options.artifact, match, watch, "rebuilt" if reason else "built", reason,
                info={**manifest_details(self.decoder), "built_by": built_by},
                frames=self.frames.saved() if self.frames is not None else None,
            )
        if self.options.progress:
            log.warning("fuse: %s", self.artifact.describe())

    def _check_nothing_compiled(self) -> None:
        s = self.stats
        if s.inductor_compiles or s.aot_compiles or s.triton_compiles:
            warnings.warn(
                f"fuse: the start from the artifact {self.options.artifact} still compiled: Inductor {s.inductor_compiles}, "
                f"AOTAutograd {s.aot_compiles}, Triton cache entries {s.triton_compiles} (something its manifest does not "
                "record differs, e.g. an environment variable that is part of a compile cache's key)"
            )

    def bucket_for(self, batch: int) -> int:
        return next(b for b in self.buckets if b >= batch)

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        return self.run_checked(*self.decoder.check_inputs(tokens, positions, slots))

    def run_checked(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """The step on inputs already checked by `model.check_inputs` (on the model's device)."""
        largest = self.buckets[-1]
        chunks = [
            self._run(tokens[i : i + largest], positions[i : i + largest], slots[i : i + largest])
            for i in range(0, tokens.shape[0], largest)
        ]
        return chunks[0] if len(chunks) == 1 else torch.cat(chunks)

    def _run(self, tokens, positions, slots) -> torch.Tensor:
        n = tokens.shape[0]
        bucket = self._buckets[self.bucket_for(n)]
        with decode_mode(), self._launches():
            fill_padded(self.decoder, bucket.inputs, (tokens, positions, slots))
            with self._recompile_guard():
                output = bucket.run()
            return output[:n].clone()  # the caller owns it; a graph's output is overwritten next replay

    def run_without_graph(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """The compiled step of the batch's bucket called directly rather than replayed (checked
        inputs, at most the largest bucket): a profiler then sees which op launched each kernel."""
        n = tokens.shape[0]
        bucket = self._buckets[self.bucket_for(n)]
        with decode_mode(), self._launches():
            fill_padded(self.decoder, bucket.inputs, (tokens, positions, slots))
            with self._recompile_guard():
                return self.step.run(*bucket.inputs)[:n].clone()

    def _launches(self):
        """Where the step's kernels launch (warm-up, capture, calls without a graph): plain launches
        unless options.dependent_launches."""
        return contextlib.nullcontext() if self.options.dependent_launches else plain_launches()

    @contextlib.contextmanager
    def _recompile_guard(self):
        if not self.options.compile or self.use_graphs and not self.stats.fallbacks:
            yield  # graph replays and eager runs never consult Dynamo
            return
        before, _ = dynamo_totals()
        if self.options.strict:
            try:
                with torch._dynamo.config.patch(error_on_recompile=True):
                    yield
            except torch._dynamo.exc.RecompileError as error:
                raise RuntimeError(
                    f"the compiled decode step would recompile after warm-up, which compile_decode forbids "
                    f"(pass CompileOptions(strict=False) to allow it with a warning):\n{error}"
                ) from error
            return
        yield
        after, _ = dynamo_totals()
        if after > before:
            self.stats.recompiles += after - before
            warnings.warn(f"fuse: the decode step recompiled after warm-up ({self.stats.recompiles} so far)")

    def describe(self) -> str:
        s = self.stats
        lines = [
            f"buckets {list(self.buckets)} on {self.device}: compiled={self.options.compile} "
            f"graphs={self.use_graphs} dynamic_batch={self.options.dynamic_batch}"
            + (f" compilation={self.step.compilation}" if self.options.compile else ""),
            f"compiles {s.compiles}, graph breaks {s.graph_breaks}, recompiles after warm-up {s.recompiles}",
        ]
        if self.options.compile:
            lines.append(
                f"compiled rather than loaded from caches: Inductor {s.inductor_compiles}, AOTAutograd {s.aot_compiles}, "
                f"Triton cache entries of the custom ops {s.triton_compiles}"
                + (f" ({s.kernels_compiled_ahead} kernels compiled ahead)" if s.kernels_compiled_ahead else "")
                + (f", graphs from {s.compile_workers} of {s.compile_workers_started} compile workers"
                   if s.compile_workers_started else "")
            )
        if self.artifact is not None:
            lines.append(self.artifact.describe())
        start = s.describe_start()
        if start:
            lines.append(start)
        lines += [f"bucket {b}: {reason}" for b, reason in sorted(s.fallbacks.items())]
        if self.inspection is not None:
            lines.append(f"generated code: {self.inspection.index_md}")
        return "\n".join(lines)


def compile_decode(decoder: DecodeModel, buckets=None, **options) -> DecodeRunner:
    """Compile `decoder`'s decode step and, on CUDA, capture one graph per batch bucket. Keyword
    options are the fields of CompileOptions."""
    if buckets is not None:
        options["buckets"] = tuple(buckets)
    return DecodeRunner(decoder, CompileOptions(**options))


def inspect(decoder: DecodeModel, out_dir: str | os.PathLike, *, batch: int = 1, **options) -> Inspection:
    """Compile `decoder`'s step for one bucket of `batch` rows with the code dump on (options as
    for compile_decode, without graphs) and return what the dump holds. Runs the step on padding
    rows only: no real cache slot is touched."""
    check_decode_model(decoder)
    if isinstance(batch, bool) or not isinstance(batch, int) or not 1 <= batch <= decoder.max_batch:
        raise ValueError(f"batch must be an int in [1, {decoder.max_batch}] (the decoder's max_batch), got {batch!r}")
    for name in ("buckets", "dump_dir"):
        if name in options:
            raise ValueError(f"inspect sets {name} itself (batch={batch}, out_dir={str(out_dir)!r})")
    options = {"cuda_graphs": False, "progress": False, **options}
    return compile_decode(decoder, buckets=(batch,), dump_dir=str(out_dir), **options).inspection
