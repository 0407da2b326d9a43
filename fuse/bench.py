"""`fuse bench`: the decode step as users run it today against `compile_decode`, side by side.

Variants, all on one decoder (same weights, same caches), timed interleaved in one process:
  eager            the step as written, one launch per op;
  eager-graphs     the eager step captured in one CUDA graph per batch bucket (serving stacks' default);
  reduce-overhead  stock `torch.compile(step, mode="reduce-overhead")` (whole step, cudagraph trees);
  fuse             `fuse.compile_decode()` (compilation "auto": each layer kind a nested region
                   of one whole-step compile where Dynamo reuses traced regions, else each block
                   and the head compiled as regions; a symbolic batch size; one CUDA graph per
                   bucket);
  fuse-static      `fuse.compile_decode(dynamic_batch=False)`: one compile per bucket (not run by
                   default; for the compile-time / step-time trade-off).
  fuse-nested      `fuse.compile_decode(compilation="nested")` (not run by default).
  fuse-regional    `fuse.compile_decode(compilation="regional")`: each block and the head
                   compiled on their own (not run by default).
  fuse-batch1-shared `fuse.compile_decode(batch_one_shared=True)`: batch 1 in the symbolic
                   batch's graph, one compile per layer kind (not run by default).
  fuse-no-pdl      `fuse` without programmatic dependent launch, neither Inductor's
                   (`triton.enable_pdl`) nor the custom ops' (`dependent_launches`), both on by
                   default on CUDA: on Hopper and later each kernel starts while the one before
                   it ends (not run by default).
  fuse-combo       `fuse` with Inductor's combo kernels (`combo_kernels`): independent small
                   kernels of a graph (cache writes, state updates) launched as one (not run by
                   default).
  fuse-dequantised `fuse` on a copy of the decoder whose FP8 and FP4 weights are dequantised to
                   the model dtype (as loading a checkpoint into a dense config does; its
                   activations are not quantised), from the same caches, with its own floor:
                   what the checkpoint-native weights save (presets in checkpoint formats, one
                   process, where the copy fits beside the decoder; its start counts making the
                   copy; not run by default).
Caches are filled with random rows as if every sequence were `context` tokens in (decode cost
depends on the positions, not on the values). The floor is the bytes a step must read (weights
it touches, attended KV rows, the indexer cache; fuse/floor.py) over a copy bandwidth measured in
the same run.

Under torchrun the decoder is split across the ranks it started (docs/parallel.md): every rank
times its part in lockstep with the others, and rank 0 writes the result with every rank's step
times, floor and, for the compile_decode variant, collectives and the time in them.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import gc
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch

from fuse.numerics import (
    NOISE_FACTOR, StreamedReference, accuracy, check_step, copy_state, fp32_reference, judge, padded_batch_size, padded_step,
    relative_error, restore_point, without_qat,
)
from fuse.floor import copy_bandwidth_gbs, step_floor
from fuse.launches import count_launches
from fuse.ranks import gather_to_first, launched_ranks, on_every_rank
from fuse.runner import compile_decode
from fuse.stats import dynamo_totals
from kernels.bench.timing import back_to_back_ms, call_ms
from kernels.triton_util import triton_version
from model import Decoder, ModelConfig
from model.parallel import ParallelError

VARIANTS = (
    "eager", "eager-graphs", "reduce-overhead", "fuse", "fuse-static", "fuse-nested", "fuse-regional",
    "fuse-batch1-shared", "fuse-no-pdl", "fuse-combo", "fuse-dequantised",
)
DEQUANTISED = "fuse-dequantised"  # compile_decode on a dequantised copy of the decoder (dequantised_copy)
# The compile_decode variants and the CompileOptions each asks for (the module docstring says what each is).
COMPILE_DECODE_VARIANTS = {
    "fuse": {}, "fuse-static": {"dynamic_batch": False},
    "fuse-nested": {"compilation": "nested"}, "fuse-regional": {"compilation": "regional"},
    "fuse-batch1-shared": {"batch_one_shared": True},
    "fuse-no-pdl": {"inductor_options": {"triton.enable_pdl": False}, "dependent_launches": False},
    "fuse-combo": {"inductor_options": {"combo_kernels": True}},
}
DEFAULT_VARIANTS = VARIANTS[:4]
YARDSTICK = "eager, padded"  # the accuracy checks' key for eager with padding rows
FP32 = "against_fp32"  # the accuracy checks' key for the errors against the fp32 eager reference
FP32_COMPILED = "fuse fp32"  # under FP32: the compile_decode variant compiled in fp32, against eager fp32


@dataclass
class BenchSettings:
    preset: str = "bench"
    layers: int | None = None  # None: the preset's depth
    contexts: tuple[int, ...] = (4096, 32768)
    batches: tuple[int, ...] = (1, 16, 32, 64)
    variants: tuple[str, ...] = DEFAULT_VARIANTS
    steps: int = 10  # steps per variant, shape and round: one back-to-back run and as many single synchronised steps
    repeats: int = 5
    eager_steps: int = 4  # the eager step is slow: fewer samples
    fp32_products: str = "exact"
    device: str = "cuda"  # "cpu" runs eager and fuse only (no CUDA graphs there), in fp32
    seed: int = 0
    out_dir: str = "fuse-out/bench"
    # Inductor config patches for the compile_decode variant (CompileOptions.inductor_options),
    # as (key, value) pairs: e.g. (("combo_kernels", True),) to time a setting against the default.
    inductor_options: tuple[tuple[str, object], ...] = ()

    def __post_init__(self):
        unknown = sorted(set(self.variants) - set(VARIANTS))
        if unknown:
            raise ValueError(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
        compiled = [v for v in self.variants if v in COMPILE_DECODE_VARIANTS]
        if self.inductor_options and not compiled:
            raise ValueError("inductor_options patch the compile_decode variant's compile; none of the variants runs it")
        if not self.batches or min(self.batches) < 1 or not self.contexts or min(self.contexts) < 1:
            raise ValueError(f"batches and contexts must be positive, got {self.batches} and {self.contexts}")

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.device.startswith("cuda") else torch.float32

    def config(self) -> ModelConfig:
        return ModelConfig.preset(self.preset, layers=self.layers).replace(fp32_products=self.fp32_products)


@torch.no_grad()
def synthesize_context(decoder: Decoder, seed: int) -> None:
    """Fill every cache and compressor state with random values (what is there does not change
    the cost of a step; all-equal scores would give the top-k selection an unusual tie pattern)."""
    generator = torch.Generator(device=decoder.device).manual_seed(seed)
    for name, buf in decoder.named_buffers():
        if name.endswith(("kv_cache", "kv_state", "score_state")):
            buf.copy_(torch.randn(buf.shape, generator=generator, device=buf.device, dtype=torch.float32).to(buf.dtype))


# -- variants -----------------------------------------------------------------------------------
@contextlib.contextmanager
def counting_graph_captures():
    """Counts CUDA graph captures started inside (ours, and PyTorch's cudagraph trees)."""
    counter = {"captures": 0}
    original = torch.cuda.CUDAGraph.capture_begin

    def capture_begin(self, *args, **kwargs):
        counter["captures"] += 1
        return original(self, *args, **kwargs)

    torch.cuda.CUDAGraph.capture_begin = capture_begin
    try:
        yield counter
    finally:
        torch.cuda.CUDAGraph.capture_begin = original


@dataclass
class Variant:
    name: str
    run: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    start_seconds: float = 0.0
    compiles: int = 0
    captures: int = 0
    graph_memory_gib: float = 0.0
    note: str = ""
    decoder: Decoder | None = None  # a decoder of its own (DEQUANTISED); None: the bench's decoder


def dequantised_copy(decoder: Decoder) -> Decoder:
    """A decoder of the same widths and shapes whose FP8 / FP4 weights are `decoder`'s dequantised
    to its dtype (its own official tensors loaded into the dense config), in `decoder`'s state."""
    if not decoder.config.weight_formats:
        raise ValueError(f"{DEQUANTISED}: the decoder's weights are dense already; it takes a preset in checkpoint formats")
    if decoder.parallel.world_size > 1:
        raise ValueError(f"{DEQUANTISED}: one process only (a rank holds part of each tensor)")
    dense = decoder.config.replace(dtype="bf16", expert_dtype=None)
    copy = Decoder(dense, max_batch=decoder.max_batch, max_seq_len=decoder.max_seq_len, dtype=decoder.dtype,
                   device=decoder.device, check_device_values=decoder.check_device_values)
    copy.load_official(decoder.state_dict())
    copy_state(decoder, copy)
    return copy


def graph_pool_gib() -> float:
    """GiB of CUDA memory in private pools: what CUDA graphs (bucket graphs and cudagraph trees
    alike) hold. Memory a build keeps in the default pool, or frees there, does not count, so
    each variant's delta is its graphs' alone."""
    if not torch.cuda.is_available():
        return 0.0
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    private = [seg for seg in torch.cuda.memory_snapshot() if tuple(seg.get("segment_pool_id", (0, 0))) != (0, 0)]
    return sum(seg["total_size"] for seg in private) / 2**30


def reduce_overhead_step(decoder: Decoder, batches: tuple[int, ...], warm_inputs: Callable[[int], tuple]) -> Callable:
    """Stock `torch.compile(step, mode="reduce-overhead")`, warmed up for every batch size:
    cudagraph trees record on the third call of each shape."""
    step = torch.compile(decoder.step, mode="reduce-overhead", fullgraph=True)
    for batch in sorted(batches, reverse=True):
        for _ in range(3):
            step(*warm_inputs(batch))
    return step


def build_variant(
    name: str, decoder: Decoder, batches: tuple[int, ...], warm_inputs: Callable[[int], tuple],
    inductor_options: tuple[tuple[str, object], ...] = (),
) -> Variant:
    """Build, compile and capture one variant for every batch size; time and count doing so."""
    memory0 = graph_pool_gib()
    compiles0, _ = dynamo_totals()
    start = time.perf_counter()
    note = ""
    with counting_graph_captures() as counter:
        if name == "eager":
            run = decoder.step
        elif name == "eager-graphs":
            runner = compile_decode(decoder, buckets=batches, compile=False, progress=False)
            run = runner.run_checked
            note = runner.describe().replace("\n", "; ")
        elif name in COMPILE_DECODE_VARIANTS:
            options = dict(COMPILE_DECODE_VARIANTS[name])
            patches = dict(inductor_options) | options.pop("inductor_options", {})
            runner = compile_decode(decoder, buckets=batches, progress=False, inductor_options=patches or None, **options)
            run = runner.run_checked
            note = runner.describe().replace("\n", "; ")
        elif name == DEQUANTISED:
            own = dequantised_copy(decoder)
            runner = compile_decode(own, buckets=batches, progress=False, inductor_options=dict(inductor_options) or None)
            run = runner.run_checked
            note = runner.describe().replace("\n", "; ")
        elif name == "reduce-overhead":
            step = reduce_overhead_step(decoder, batches, warm_inputs)
            run = lambda *inputs: step(*inputs).clone()  # cudagraph trees overwrite the output next replay
            skips = torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]  # e.g. on the CPU: no graphs
            note = f"cudagraph skips: {skips}" if skips else ""
        else:
            raise ValueError(name)
        if decoder.device.type == "cuda":
            torch.cuda.synchronize(decoder.device)
    seconds = time.perf_counter() - start
    compiles1, _ = dynamo_totals()
    return Variant(
        name, run, start_seconds=seconds, compiles=compiles1 - compiles0, captures=counter["captures"],
        graph_memory_gib=max(0.0, graph_pool_gib() - memory0) if name != "eager" else 0.0, note=note,
        decoder=own if name == DEQUANTISED else None,
    )


# -- timing -------------------------------------------------------------------------------------
def step_inputs(batch: int, context: int, vocab: int, device, seed: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed * 7919 + batch)
    tokens = torch.randint(0, vocab, (batch,), generator=generator)
    positions = torch.full((batch,), context - 1)  # the step that makes each sequence `context` long
    slots = torch.arange(batch)
    return tuple(t.to(device) for t in (tokens, positions, slots))


def interleaved_ms(runs: dict[str, Callable], inputs: tuple, steps: dict[str, int], repeats: int) -> dict[str, dict[str, list[float]]]:
    """Per run, in `repeats` interleaved rounds (drift on a shared GPU hits every run alike):
    "step", one back-to-back time per round over steps[name] calls (`back_to_back_ms`), and
    "latency", the wall time of each of steps[name] single synchronised calls (the host's launch
    and the wait for the result included)."""
    samples = {name: {"step": [], "latency": []} for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            samples[name]["step"].append(back_to_back_ms(run, inputs, steps[name]))
            samples[name]["latency"] += [call_ms(run, *inputs) for _ in range(steps[name])]
    return samples


def check_against_eager(
    variants: dict[str, Variant], decoder: Decoder, inputs: tuple, reference: Decoder | None = None,
    exact: tuple[Decoder, Callable] | None = None,
) -> dict[str, dict]:
    """One step of every variant from the same state, against the eager step: max relative logit
    error and the share of rows whose top token agrees; the padded eager step under YARDSTICK
    (kernel choice and summation order only). With the fp32 eager `reference` (fuse/numerics.py),
    also under FP32: the eager step's own rounding against it, each variant's yardstick verdict,
    and, with `exact` (the reference without QAT and a compile_decode runner of it,
    `fp32_yardstick`), the step compiled in fp32 against eager fp32 under FP32_COMPILED."""
    rows = padded_batch_size(len(inputs[0]))
    if rows > decoder.max_batch:
        raise ValueError(
            f"the accuracy yardstick pads the batch to {rows} rows: build the decoder with "
            f"max_batch >= {rows} (it has {decoder.max_batch})"
        )
    restore = restore_point(decoder)
    expected = decoder.step(*inputs).float()
    restore()
    padded = padded_step(decoder, inputs).float()
    checks = {YARDSTICK: accuracy(padded, expected)}
    verdicts = {}
    for name, variant in variants.items():
        if name == "eager":
            continue
        restore()
        if variant.decoder is not None:  # its own weights: from the same caches, against eager only
            copy_state(decoder, variant.decoder)
        if reference is None or variant.decoder is not None:
            actual = variant.run(*inputs).float()
            if not torch.isfinite(actual).all():
                raise AssertionError(f"{name}: non-finite logits")
            checks[name] = accuracy(actual, expected)
            continue
        outputs = []

        def run(*step_inputs, variant=variant):
            outputs.append(variant.run(*step_inputs))
            return outputs[-1]

        check = check_step(decoder, run, inputs, reference)
        if check.non_finite:
            raise AssertionError(f"{name}: non-finite logits")
        checks[name] = accuracy(outputs[0].float(), expected)
        verdicts[name] = judge([check], decoder.dtype)
    if reference is not None:
        noise = next(iter(verdicts.values()), None)
        against = {"dtype": str(decoder.dtype).removeprefix("torch.")}
        if noise is not None:
            against["eager"] = {"worst_row": noise.noise, "median_row": noise.typical_noise}
        against.update((name, verdict.to_dict()) for name, verdict in verdicts.items())
        if exact is not None:
            restore()
            model, run = exact
            copy_state(decoder, model)  # the fp32 runner's model starts from the decoder's state
            against[FP32_COMPILED] = judge([check_step(model, run, inputs)], torch.float32).to_dict()
        checks[FP32] = against
    restore()
    return checks


# -- the run ------------------------------------------------------------------------------------
def run_bench(settings: BenchSettings, log: Callable[[str], None] = print) -> dict | None:
    """The bench's result. Under torchrun the decoder is split across the ranks it started
    (docs/parallel.md): every rank builds its part and runs the same variants, shapes and timed
    steps in the same order (the steps' collectives need every rank), and rank 0 returns the
    result with what every rank measured; the other ranks return None."""
    parallel, device = launched_ranks(settings.device)
    if parallel.rank:
        log = lambda line: None  # noqa: E731 - rank 0 speaks for all
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError("fuse bench --device cuda: no CUDA device here")
    cuda_only = {"eager-graphs", "reduce-overhead"}
    if not device.startswith("cuda") and cuda_only & set(settings.variants):
        settings = dataclasses.replace(settings, variants=tuple(v for v in settings.variants if v not in cuda_only))
        log(f"on {settings.device}: no CUDA graphs, running {list(settings.variants)} only")
    if DEQUANTISED in settings.variants and (parallel.world_size > 1 or not settings.config().weight_formats):
        settings = dataclasses.replace(settings, variants=tuple(v for v in settings.variants if v != DEQUANTISED))
        log(f"{DEQUANTISED} takes one process and a preset in checkpoint formats: running {list(settings.variants)} only")
    result = {
        "settings": {**{k: list(v) if isinstance(v, tuple) else v for k, v in asdict(settings).items()},
                     "dtype": str(settings.dtype).removeprefix("torch.")},
        "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
        "torch": torch.__version__,
        "triton": triton_version() or "-",
        "world_size": parallel.world_size,
    }
    cfg = settings.config()
    batches = tuple(sorted(set(settings.batches)))
    # room for the yardstick's padded step
    decoder = Decoder(cfg, max_batch=padded_batch_size(max(batches)), max_seq_len=max(settings.contexts) + 8, dtype=settings.dtype,
                      device=device, parallel=parallel)
    decoder.init_random(settings.seed)
    synthesize_context(decoder, settings.seed + 1)  # the caches every rank holds whole: the same on every rank
    result["layers"] = cfg.n_layers
    result["copy_gbs"] = copy_bandwidth_gbs(decoder.device)
    log(f"{cfg.n_layers} layers, {sum(p.numel() * p.element_size() for p in decoder.parameters()) / 2**30:.1f} GiB of weights"
        + (f" on rank 0 of {parallel.world_size}" if parallel.world_size > 1 else "") + f", copy bandwidth {result['copy_gbs']:.0f} GB/s")

    warm = lambda batch: step_inputs(batch, min(settings.contexts), cfg.vocab_size, decoder.device, settings.seed)
    variants: dict[str, Variant] = {}
    # compile_decode first: nothing compiled in this process yet, so its start time is as cold as
    # the process's compile cache (new processes with an empty one: --start-times).
    for name in sorted(settings.variants, key=lambda v: (v not in COMPILE_DECODE_VARIANTS, VARIANTS.index(v))):
        log(f"building {name} ...")
        try:
            variants[name] = build_variant(name, decoder, batches, warm, settings.inductor_options)
        except torch.OutOfMemoryError:
            if name != DEQUANTISED:
                raise
            gc.collect()
            torch.cuda.empty_cache()
            log(f"  {name}: the dequantised copy does not fit beside the decoder; not run")
            continue
        v = variants[name]
        log(f"  {name}: ready in {v.start_seconds:.1f} s, {v.compiles} compiles, {v.captures} graph captures, "
            f"{v.graph_memory_gib:.2f} GiB in graph pools {v.note}")

    reference, exact = fp32_yardstick(decoder, batches, settings.variants, log)
    ours = next((v for v in variants if v in COMPILE_DECODE_VARIANTS), None)
    rows = []
    for context in settings.contexts:
        for batch in batches:
            inputs = step_inputs(batch, context, cfg.vocab_size, decoder.device, settings.seed)
            checks = check_against_eager(variants, decoder, inputs, reference, exact)
            for variant in variants.values():  # warm-up at this shape
                variant.run(*inputs)
            runs = {name: variant.run for name, variant in variants.items()}
            # Fixed counts: every rank runs every step (and its collectives) in the same order.
            steps = {name: settings.eager_steps if name == "eager" else settings.steps for name in variants}
            samples = interleaved_ms(runs, inputs, steps, settings.repeats)
            floor, floor_ms = step_floor(decoder, batch, context, result["copy_gbs"])
            row = {"context": context, "batch": batch, "floor_ms": floor_ms, "floor_bytes": floor, "checks": checks}
            for name, times in samples.items():
                ms = statistics.median(times["step"])
                row[name] = {
                    "ms": ms, "latency_ms": statistics.median(times["latency"]), "tokens_per_s": batch / ms * 1e3,
                    "samples": len(times["step"]),
                }
                if variants[name].decoder is not None:  # the bytes its own weights make the step read
                    row[name]["floor_bytes"], row[name]["floor_ms"] = step_floor(variants[name].decoder, batch, context, result["copy_gbs"])
            if parallel.world_size > 1:
                profiled = variants[ours].run if ours else None
                add_ranks(row, gather_to_first(parallel, rank_row(parallel.rank, row, profiled, inputs, ours)))
            rows.append(row)
            log(format_row(row, variants))
    if parallel.rank:
        return None
    result["rows"] = rows
    result["variants"] = {
        name: {k: getattr(v, k) for k in ("start_seconds", "compiles", "captures", "graph_memory_gib", "note")}
        for name, v in variants.items()
    }
    return result


def rank_row(rank: int, row: dict, profiled: Callable | None, inputs: tuple, ours: str | None) -> dict:
    """What this rank measured at one shape: its step time per variant, its floor (its part of the
    weights, the caches it reads) and, from one profiled step of the compile_decode variant
    `ours` (every rank profiles the same step), its collectives and the time in them."""
    record = {
        "rank": rank, "ms": {n: row[n]["ms"] for n in VARIANTS if n in row},
        "latency_ms": {n: row[n]["latency_ms"] for n in VARIANTS if n in row},
        "floor_ms": row["floor_ms"], "floor_bytes": row["floor_bytes"], "launches": None,
    }
    if profiled is not None:
        record["launches"] = {ours: count_launches(profiled, *inputs, label=ours).rank_summary()}
    return record


def add_ranks(row: dict, ranks: list[dict] | None) -> None:
    """On rank 0: every rank's record under "ranks", and per variant the slowest rank's step time."""
    if ranks is None:
        return
    row["ranks"] = ranks
    for name in ranks[0]["ms"]:
        slowest = max(ranks, key=lambda r: r["ms"][name])
        row[name].update(slowest_ms=slowest["ms"][name], slowest_rank=slowest["rank"])


def fp32_yardstick(decoder: Decoder, batches: tuple[int, ...], variants: tuple[str, ...], log: Callable[[str], None]):
    """The fp32 eager reference of `decoder` (fuse/numerics.py) and, for a bf16 decoder whose fp32
    copy fits, that copy without QAT (`without_qat`, sharing its weights) with the first
    compile_decode variant compiled on it (its `run_checked`); None for what does not fit.
    Split across ranks, a check runs only where it fits on every rank."""
    parallel = decoder.parallel
    try:
        reference = fp32_reference(decoder)
    except torch.OutOfMemoryError:
        gc.collect()
        torch.cuda.empty_cache()
        reference = None
    if not on_every_rank(parallel, reference is not None):
        log("the fp32 reference does not fit beside the variants: no errors against fp32")
        return None, None
    ours = next((v for v in variants if v in COMPILE_DECODE_VARIANTS), None)
    if decoder.dtype == torch.float32 or ours is None:
        return reference, None  # fp32: the variants are the fp32 compiles
    if not on_every_rank(parallel, not isinstance(reference, StreamedReference)):
        log(f"fp32 reference streamed block by block (an fp32 copy does not fit): no {FP32_COMPILED} check")
        return reference, None
    log(f"compiling {ours} in fp32 for the {FP32_COMPILED} check ...")
    try:
        exact = without_qat(reference)
        runner = compile_decode(exact, buckets=batches, progress=False, **COMPILE_DECODE_VARIANTS[ours])
    except (torch.OutOfMemoryError, ParallelError) as error:
        # split: compile_decode raises the failing rank's error on every rank (model/parallel.py)
        if isinstance(error, ParallelError) and error.error_type != "OutOfMemoryError":
            raise
        gc.collect()
        torch.cuda.empty_cache()
        log(f"{ours} compiled in fp32 does not fit: no {FP32_COMPILED} check")
        return reference, None
    return reference, (exact, runner.run_checked)


def compare_precision(settings: BenchSettings, log: Callable[[str], None] = print, variant: str = "eager-graphs") -> dict:
    """ModelConfig.fp32_products "fast" against "exact" run as `variant`, at the first context:
    the same weights (fast rounds the fp32 product weights to bf16) and caches, one step from
    identical state: logit error of fast against exact, and both step times, interleaved."""
    context, batches = min(settings.contexts), tuple(sorted(set(settings.batches)))
    shape = dict(max_batch=max(batches), max_seq_len=context + 8, dtype=settings.dtype, device=settings.device)
    exact = Decoder(settings.config().replace(fp32_products="exact"), **shape).init_random(settings.seed)
    fast = Decoder(settings.config().replace(fp32_products="fast"), **shape)
    fast.load_state_dict(exact.state_dict())
    for decoder in (exact, fast):
        synthesize_context(decoder, settings.seed + 1)
    warm = lambda batch: step_inputs(batch, context, exact.config.vocab_size, exact.device, settings.seed)
    runs = {name: build_variant(variant, decoder, batches, warm) for name, decoder in (("exact", exact), ("fast", fast))}
    rows = []
    for batch in batches:
        inputs = warm(batch)
        restore = restore_point(exact)
        reference = runs["exact"].run(*inputs).float()
        restore(fast)
        actual = runs["fast"].run(*inputs).float()
        samples = interleaved_ms({name: built.run for name, built in runs.items()}, inputs, dict.fromkeys(runs, settings.steps), settings.repeats)
        row = {
            "batch": batch, "context": context,
            "exact_ms": statistics.median(samples["exact"]["step"]), "fast_ms": statistics.median(samples["fast"]["step"]),
            "max_relative_error": relative_error(actual, reference),
            "top1_agreement": (actual.argmax(-1) == reference.argmax(-1)).float().mean().item(),
        }
        rows.append(row)
        log(f"B {batch:>3}: exact {row['exact_ms']:.2f} ms, fast {row['fast_ms']:.2f} ms "
            f"({row['exact_ms'] / row['fast_ms']:.2f}x), fast vs exact max rel. error {row['max_relative_error']:.3f}, "
            f"top-1 agreement {row['top1_agreement']:.2f}")
    return {"context": context, "variant": variant, "layers": exact.config.n_layers, "rows": rows}


# -- output -------------------------------------------------------------------------------------
def format_row(row: dict, variants) -> str:
    parts = [f"ctx {row['context']:>6} B {row['batch']:>3}:"]
    parts += [f"{name} {row[name]['ms']:8.2f} ms" for name in variants]
    parts.append(f"floor {row['floor_ms']:.2f} ms")
    return "  ".join(parts)


def ratio(row: dict, a: str, b: str) -> str:
    return f"{row[b]['ms'] / row[a]['ms']:.2f}x" if a in row and b in row else "-"


_COUNTED_OPTIONS = ("steps", "eager_steps", "repeats", "seed")  # written into the command when not the default


def command_line(settings: dict, world_size: int = 1) -> str:
    """The `fuse bench` command that reproduces a run with these settings (asdict of BenchSettings)
    on `world_size` ranks."""
    launcher = f"torchrun --standalone --nproc-per-node {world_size} -m fuse" if world_size > 1 else "python -m fuse"
    return (
        f"{launcher} bench --preset {settings['preset']}" + (f" --layers {settings['layers']}" if settings["layers"] else "")
        + f" --contexts {','.join(map(str, settings['contexts']))} --batches {','.join(map(str, settings['batches']))}"
        + (f" --fp32-products {settings['fp32_products']}" if settings["fp32_products"] != "exact" else "")
        + (f" --variants {','.join(settings['variants'])}" if tuple(settings["variants"]) != DEFAULT_VARIANTS else "")
        + "".join(f" --{name.replace('_', '-')} {settings[name]}" for name in _COUNTED_OPTIONS
                  if name in settings and settings[name] != BenchSettings.__dataclass_fields__[name].default)
        + "".join(f" --inductor-option {key}={value!r}" for key, value in settings.get("inductor_options", ()))
    )


def weights_in_words(settings: dict) -> str:
    """The weights in words: their dtype, or for a preset in checkpoint formats those formats."""
    formats = ModelConfig.preset(settings["preset"]).weight_formats
    return f"{formats}; {settings['dtype']} activations and other weights" if formats else f"{settings['dtype']} weights"


def to_markdown(result: dict) -> str:
    s = result["settings"]
    names = [v for v in VARIANTS if v in result["variants"]]
    ours = next((v for v in names if v in COMPILE_DECODE_VARIANTS), "fuse")  # the compile_decode variant run
    world_size = result.get("world_size", 1)
    command = command_line(s, world_size)
    lines = [
        f"## Decode step benchmark: {s['preset']} preset, {result['layers']} layers",
        "",
        f"`{command}` on {result['gpu']}, torch {result['torch']}, triton {result['triton']}, {result['date']}. "
        f"{weights_in_words(s)}, fp32 products {s['fp32_products']}. Copy bandwidth measured in the same run: {result['copy_gbs']:.0f} GB/s. "
        f"Step time = time per step of {s['steps']} steps issued back to back ({s['eager_steps']} for eager), CUDA events "
        f"around them, median of {s['repeats']} interleaved rounds: what a serving loop that keeps the GPU fed pays per step. "
        f"Latency (table after it) = wall time of one synchronised step, host launch and wait included. "
        f"Floor = bytes the step must read / copy bandwidth."
        + (f" Split across {world_size} ranks: rank 0's times and floor (its part of the weights), in brackets the "
           "slowest rank's time where that is another rank; every rank's in the per-rank table." if world_size > 1 else ""),
        "",
        "| context | batch | " + " | ".join(f"{n} ms" for n in names)
        + f" | floor ms | {ours} vs eager-graphs | {ours} vs reduce-overhead | {ours} / floor | {ours} tokens/s |",
        "|---|---|" + "---|" * (len(names) + 5),
    ]
    for row in result["rows"]:
        cells = [str(row["context"]), str(row["batch"])] + [ms_cell(row[n]) for n in names]
        cells += [f"{row['floor_ms']:.2f}", ratio(row, ours, "eager-graphs"), ratio(row, ours, "reduce-overhead")]
        cells += [f"{row[ours]['ms'] / row['floor_ms']:.2f}x" if ours in row else "-"]
        cells += [f"{row[ours]['tokens_per_s']:.0f}" if ours in row else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Latency of one synchronised step, ms (median of the single steps of every round):", "",
              "| context | batch | " + " | ".join(f"{n} ms" for n in names) + f" | {ours} / floor |", "|---|---|" + "---|" * (len(names) + 1)]
    for row in result["rows"]:
        cells = [str(row["context"]), str(row["batch"])] + [f"{row[n]['latency_ms']:.2f}" for n in names]
        cells += [f"{row[ours]['latency_ms'] / row['floor_ms']:.2f}x" if ours in row else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ranks_markdown(result, names, ours)
    lines += dequantised_markdown(result, ours)
    lines += ["", "### Start-up, for the batch sizes above", "",
              "| variant | start s | compiles | graph captures | GiB in graph pools | note |", "|---|---|---|---|---|---|"]
    for name in names:
        v = result["variants"][name]
        lines.append(f"| {name} | {v['start_seconds']:.1f} | {v['compiles']} | {v['captures']} | {v['graph_memory_gib']:.2f} | {v['note']} |")
    checked = [YARDSTICK] + [n for n in names if n != "eager"]
    lines += ["", "### Accuracy (one step from identical caches, against eager)", "",
              f"'{YARDSTICK}' is the yardstick: the eager step with padding rows added, which changes only "
              "kernel choices and summation orders.", "",
              "| context | batch | " + " | ".join(f"{n} max rel. error / top-1 agree" for n in checked) + " |",
              "|---|---|" + "---|" * len(checked)]
    for row in result["rows"]:
        cells = [str(row["context"]), str(row["batch"])]
        cells += [f"{row['checks'][n]['max_relative_error']:.3f} / {row['checks'][n]['top1_agreement']:.2f}" for n in checked]
        lines.append("| " + " | ".join(cells) + " |")
    lines += fp32_markdown(result, [n for n in names if n != "eager"])
    return "\n".join(lines) + "\n"


def dequantised_markdown(result: dict, ours: str) -> list[str]:
    """The checkpoint-native step against the dequantised copy's, each with its own floor (none
    where the dequantised variant did not run)."""
    rows = [row for row in result["rows"] if DEQUANTISED in row and ours in row]
    if not rows:
        return []
    lines = [
        "", "### Checkpoint-native weights against the same weights dequantised", "",
        f"'{DEQUANTISED}': `compile_decode` on a copy of the decoder with its FP8 and FP4 weights dequantised to "
        f"{result['settings']['dtype']} (its activations not quantised), from the same caches, timed in the same "
        "rounds; each floor counts the bytes its own weights make the step read.", "",
        f"| context | batch | {ours} ms | floor ms | {DEQUANTISED} ms | its floor ms | {ours} speedup | {DEQUANTISED} / its floor |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        native, dense = row[ours], row[DEQUANTISED]
        lines.append(
            f"| {row['context']} | {row['batch']} | {native['ms']:.2f} | {row['floor_ms']:.2f} | {dense['ms']:.2f} | "
            f"{dense['floor_ms']:.2f} | {dense['ms'] / native['ms']:.2f}x | {dense['ms'] / dense['floor_ms']:.2f}x |"
        )
    return lines


def ms_cell(times: dict) -> str:
    """A variant's step time at one shape (rank 0's), with the slowest rank's where that is another."""
    slowest = times.get("slowest_rank", 0)
    return f"{times['ms']:.2f}" + (f" (rank {slowest}: {times['slowest_ms']:.2f})" if slowest else "")


def ranks_markdown(result: dict, names: list[str], ours: str) -> list[str]:
    """The per-rank table of a run split across ranks (none for one process)."""
    rows = [row for row in result["rows"] if "ranks" in row]
    if not rows:
        return []
    lines = [
        "", "### Per rank", "",
        "Each rank's step time per variant, its floor (the bytes its own step must read: its part of the weights, "
        "with its share of the experts and of the vocabulary, and the caches it reads, over the copy bandwidth it "
        f"measured), {ours}'s step time against it, and from one profiled step of {ours}: its collectives and the time "
        "in them (device time of NCCL's kernels on CUDA; on the CPU the collective ops' CPU time, waiting for the other "
        "ranks included).", "",
        "| context | batch | rank | " + " | ".join(f"{n} ms" for n in names)
        + f" | floor ms | {ours} / floor | {ours} collectives | {ours} ms in collectives |",
        "|---|---|---|" + "---|" * (len(names) + 4),
    ]
    for row in rows:
        for r in row["ranks"]:
            launches = (r["launches"] or {}).get(ours)
            cells = [str(row["context"]), str(row["batch"]), str(r["rank"])] + [f"{r['ms'][n]:.2f}" for n in names]
            cells += [f"{r['floor_ms']:.3f}", f"{r['ms'][ours] / r['floor_ms']:.2f}x" if ours in r["ms"] else "-"]
            cells += [f"{launches['collectives']:g}", f"{launches['collective_us'] / 1e3:.3f}"] if launches else ["-", "-"]
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def fp32_markdown(result: dict, names: list[str]) -> list[str]:
    """The table of errors against the fp32 eager reference, where the run measured them."""
    rows = [row for row in result["rows"] if FP32 in row["checks"]]
    if not rows:
        return []
    dtype = rows[0]["checks"][FP32]["dtype"]
    columns = [n for n in names + [FP32_COMPILED] if any(n in row["checks"][FP32] for row in rows)]
    # two significant digits: the fp32 column's errors are ~1e-7, bf16's ~1e-2
    verdict = lambda v: f"{v['error']:.1e} / {v['typical_error']:.1e} {'pass' if v['passed'] else 'FAIL'}"  # noqa: E731
    lines = [
        "", "### Against the fp32 eager reference (one step from the same state)", "",
        f"Worst row / median row relative error against an fp32 eager run of the same weights, and the yardstick's "
        f"verdict (fuse/numerics.py: within {NOISE_FACTOR:g}x the eager {dtype} step's own error and the dtype's floor). "
        f"'{FP32_COMPILED}': the compile_decode variant compiled in fp32, against eager fp32, both with QAT off (a "
        f"rounding flip is not a bug; fuse/numerics.py); with FP8/FP4 weights the products' activation quantisation "
        f"can still flip one fp32 row, so there the median row must be exact and the worst is held to the bfloat16 floor.", "",
        f"| context | batch | eager {dtype} | " + " | ".join(columns) + " |", "|---|---|---|" + "---|" * len(columns),
    ]
    for row in rows:
        against = row["checks"][FP32]
        eager = against.get("eager")
        cells = [str(row["context"]), str(row["batch"]), f"{eager['worst_row']:.1e} / {eager['median_row']:.1e}" if eager else "-"]
        cells += [verdict(against[n]) if against.get(n) else "-" for n in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contexts = result["settings"]["contexts"]
    names = [v for v in VARIANTS if v in result["variants"]]
    fig, axes = plt.subplots(1, len(contexts), figsize=(6 * len(contexts), 3.8), squeeze=False)
    for ax, context in zip(axes[0], contexts):
        rows = [r for r in result["rows"] if r["context"] == context]
        x = range(len(rows))
        width = 0.8 / (len(names) + 1)
        for i, name in enumerate(names):
            ax.bar([j + i * width for j in x], [r[name]["ms"] for r in rows], width, label=name)
        ax.bar([j + len(names) * width for j in x], [r["floor_ms"] for r in rows], width, label="floor", color="gray")
        ax.set_xticks([j + 0.4 for j in x], [str(r["batch"]) for r in rows])
        ax.set_yscale("log")
        ax.set_xlabel("batch size")
        ax.set_ylabel("ms per decode step")
        ax.set_title(f"context {context}")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"{result['gpu']}, {result['layers']} layers")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(result: dict, folder: str) -> None:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "bench.json"), "w") as f:
        json.dump(result, f, indent=2)
    with open(os.path.join(folder, "bench.md"), "w") as f:
        f.write(to_markdown(result))
    plot(result, os.path.join(folder, "bench.png"))
