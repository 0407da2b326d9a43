"""`fuse soak`: the compiled runner serving random traffic for many steps, watched.

Each step decodes a random number of sequences (1 to max_batch) on random slots; a slot's sequence
starts at position 0 with a random length (up to max_seq_len) and ends there, after which the
slot takes a new one, so positions run up to max_seq_len - 1. Every `check_every` steps one step
is checked against the accuracy yardstick (fuse/numerics.py: the fp32 eager reference of the same
weights from the same state). Reported: recompiles and graph breaks after warm-up, steps with
non-finite logits, allocated and reserved device memory (on the CPU, the process's resident
memory) over time, sampled where no tensor of a step is alive, each check's verdict with the
worst, how many checks failed, and the verdict: pass only if every check passed on its own and
all checked rows together pass. Writes soak.json and soak.md."""
from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import random
import resource
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from fuse.numerics import Check, Verdict, check_step, fp32_reference, judge
from fuse.padding import Inputs
from fuse.runner import DecodeRunner, compile_decode
from fuse.stats import dynamo_totals
from model import Decoder, ModelConfig

BUCKETS = (1, 2, 4, 8, 16, 32, 64)


@dataclass
class SoakSettings:
    preset: str = "bench"
    layers: int | None = None
    device: str = "cuda"
    seed: int = 0
    steps: int = 10000
    check_every: int = 250
    max_batch: int = 64
    max_seq_len: int = 2048
    out_dir: str = "fuse-out/soak"

    def __post_init__(self):
        for name in ("steps", "check_every", "max_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_seq_len < 2:
            raise ValueError(f"max_seq_len must be at least 2, got {self.max_seq_len}")

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.device.startswith("cuda") else torch.float32


def memory_sample(step: int, device: torch.device) -> dict:
    """Allocated and reserved bytes of the device's caching allocator (CUDA), and the process's
    resident bytes."""
    sample = {"step": step, "allocated_bytes": None, "reserved_bytes": None, "rss_bytes": _resident_bytes()}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        sample["allocated_bytes"] = torch.cuda.memory_allocated(device)
        sample["reserved_bytes"] = torch.cuda.memory_reserved(device)
    return sample


def growth_after_warm_up(memory: list[dict], key: str) -> int | None:
    """How far `key` of the memory samples moved after warm-up: max - min over the samples from the
    one after the first step on (None where the samples have no value for it)."""
    after = [m[key] for m in memory[1:]]
    if not after or after[0] is None:
        return None
    return max(after) - min(after)


# How far allocated memory may move after warm-up and still count as flat: the runner's graphs
# and buffers are allocated once, so any steady growth is a leak.
FLAT_BYTES = 2**20


def problems(result: dict) -> list[str]:
    """What makes a soak fail: a failed check, non-finite logits, recompiles, graph breaks, or
    allocated memory that moved more than FLAT_BYTES after warm-up."""
    found = [] if result["verdict"]["passed"] else [f"yardstick: {result['verdict']['reason']}"]
    found += [f"{result[key]} {what}" for key, what in (
        ("non_finite_steps", "steps with non-finite logits"), ("recompiles", "recompiles"), ("graph_breaks", "graph breaks")) if result[key]]
    growth = result.get("allocated_growth_bytes")
    if growth is not None and growth > FLAT_BYTES:
        found.append(f"allocated memory moved {growth / 2**20:.2f} MiB after warm-up (flat: {FLAT_BYTES / 2**20:.0f} MiB)")
    return found


def allocated_growth(memory: list[dict]) -> int | None:
    """`growth_after_warm_up` of the device allocator's allocated bytes (None without one)."""
    return growth_after_warm_up(memory, "allocated_bytes")


def _resident_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # the peak, where statm is missing


class Traffic:
    """Random batches over the slots: which slots, their tokens and positions."""

    def __init__(self, max_batch: int, max_seq_len: int, vocab: int, seed: int):
        self.rng = random.Random(seed)
        self.max_batch, self.max_seq_len, self.vocab = max_batch, max_seq_len, vocab
        self.position = [0] * max_batch
        self.length = [0] * max_batch  # 0: no sequence on the slot
        self.started = 0

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        size = self.rng.randint(1, self.max_batch)
        slots = self.rng.sample(range(self.max_batch), size)
        for s in slots:
            if self.position[s] >= self.length[s]:  # the slot's sequence ended: a new one starts there
                self.position[s], self.length[s] = 0, self.rng.randint(1, self.max_seq_len)
                self.started += 1
        tokens = [self.rng.randrange(self.vocab) for _ in slots]
        positions = [self.position[s] for s in slots]
        for s in slots:
            self.position[s] += 1
        return torch.tensor(tokens), torch.tensor(positions), torch.tensor(slots)


@dataclass
class Subject:
    """What the soak serves traffic through: the compiled runner, its decoder and the fp32
    reference of the same weights."""

    decoder: Decoder
    runner: DecodeRunner
    reference: Decoder
    start_seconds: float


def build(settings: SoakSettings) -> Subject:
    cfg = ModelConfig.preset(settings.preset, layers=settings.layers)
    decoder = Decoder(cfg, settings.max_batch, settings.max_seq_len, dtype=settings.dtype, device=settings.device)
    decoder.init_random(settings.seed)
    buckets = tuple(b for b in BUCKETS if b < settings.max_batch) + (settings.max_batch,)
    start = time.perf_counter()
    # strict=False: a recompile is counted, not raised, so that the soak reports it and goes on
    runner = compile_decode(decoder, buckets=buckets, strict=False, progress=False)
    start_seconds = time.perf_counter() - start
    return Subject(decoder, runner, fp32_reference(decoder), start_seconds)


@dataclass
class Watch:
    """What the loop keeps across steps: host values only (a check's per-row errors are host
    tensors), so that the memory samples see what the runner and the model hold."""

    memory: list[dict]
    checks: list[Check] = field(default_factory=list)  # for judging all checked rows together
    verdicts: list[dict] = field(default_factory=list)  # each check's own verdict, with its step and batch
    non_finite_steps: int = 0

    def add_check(self, step: int, check: Check, dtype: torch.dtype, log: Callable[[str], None]) -> None:
        self.checks.append(check)
        # The median row's noise from every check so far: one step's few eager rows give a noisy median.
        verdict = judge([check], dtype, noise_from=self.checks)
        self.verdicts.append({"step": step, "batch": len(check.error), **verdict.to_dict()})
        log(f"step {step:>6}: batch {len(check.error):>3}, {verdict.summary()}")


def serve(settings: SoakSettings, device: torch.device, next_inputs: Callable[[], Inputs],
          run: Callable[..., torch.Tensor], check: Callable[[Inputs], Check],
          log: Callable[[str], None] = print) -> Watch:
    """The soak's loop: `settings.steps` steps of `run(*next_inputs())`, one in `check_every`
    through `check` instead, memory sampled after each checked step and at the end. No tensor of
    a step is bound in this frame (the steps' inputs and logits live in call arguments and
    `_any_non_finite`), so at a sample none is alive: a batch-sized output held there would
    make the allocated bytes move with the batch rather than with what the runner keeps."""
    watch = Watch(memory=[memory_sample(0, device)])
    non_finite = torch.zeros((), dtype=torch.int64, device=device)  # summed on the device: no sync per step
    with torch.no_grad():
        for step in range(settings.steps):
            if step % settings.check_every:
                non_finite += _any_non_finite(run, next_inputs())
                continue
            watch.add_check(step, check(next_inputs()), settings.dtype, log)
            watch.memory.append(memory_sample(step + 1, device))
    if watch.memory[-1]["step"] != settings.steps:
        watch.memory.append(memory_sample(settings.steps, device))
    watch.non_finite_steps = int(non_finite.item()) + sum(c.non_finite for c in watch.checks)
    return watch


def _any_non_finite(run: Callable[..., torch.Tensor], inputs: Inputs) -> torch.Tensor:
    """The step; whether its logits hold a non-finite value, as a device bool (no sync). The logits
    die with this frame."""
    return (~torch.isfinite(run(*inputs))).any()


def overall_verdict(verdicts: list[dict], pooled: Verdict) -> dict:
    """Pass only if every check passed on its own and all checked rows pass together: pooled, one
    step's failing median row hides among the good rows of the others."""
    failed = [v for v in verdicts if not v["passed"]]
    reasons = [f"{len(failed)} of {len(verdicts)} checks failed"] if failed else []
    if not pooled.passed:
        reasons.append(f"all checked rows together: {pooled.reason}")
    return {"passed": not reasons, "reason": "; ".join(reasons)}


def _closeness(verdict: dict) -> float:
    """How near a check came to its bounds: the larger of worst row / its bound and median row /
    its bound (infinite where an error is NaN)."""
    ratios = [verdict["error"] / verdict["bound"]]
    if verdict["typical_bound"] is not None:
        ratios.append(verdict["typical_error"] / verdict["typical_bound"])
    return math.inf if any(math.isnan(r) for r in ratios) else max(ratios)


def worst_check(verdicts: list[dict]) -> dict:
    """A failed check before any passed one, then the one nearest its bounds."""
    return max(verdicts, key=lambda v: (not v["passed"], _closeness(v)))


def run_soak(settings: SoakSettings, log: Callable[[str], None] = print) -> dict:
    subject = build(settings)
    decoder, runner = subject.decoder, subject.runner
    log(f"{decoder.config.n_layers} layers on {decoder.device}, buckets {list(runner.buckets)}, "
        f"ready in {subject.start_seconds:.1f} s")

    traffic = Traffic(settings.max_batch, settings.max_seq_len, decoder.config.vocab_size, settings.seed)
    compiles0, breaks0 = dynamo_totals()
    start = time.perf_counter()
    watch = serve(
        settings, decoder.device, lambda: decoder.check_inputs(*traffic.next_batch()), runner.run_checked,
        lambda inputs: check_step(decoder, runner.run_checked, inputs, subject.reference), log,
    )
    seconds = time.perf_counter() - start
    compiles1, breaks1 = dynamo_totals()
    pooled = judge(watch.checks, decoder.dtype)
    failed = [v for v in watch.verdicts if not v["passed"]]
    return {
        "settings": {**dataclasses.asdict(settings), "dtype": str(settings.dtype).removeprefix("torch.")},
        "date": datetime.date.today().isoformat(),
        "device_name": torch.cuda.get_device_name(decoder.device) if decoder.device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "layers": decoder.config.n_layers,
        "buckets": list(runner.buckets),
        "start_seconds": subject.start_seconds,
        "seconds": seconds,
        "sequences": traffic.started,
        "recompiles": runner.stats.recompiles,
        "compiles_after_warmup": compiles1 - compiles0,
        "graph_breaks": runner.stats.graph_breaks + breaks1 - breaks0,
        "non_finite_steps": watch.non_finite_steps,
        "memory": watch.memory,
        "allocated_growth_bytes": allocated_growth(watch.memory),
        "checks": watch.verdicts,
        "checks_failed": len(failed),
        "first_failed_check": failed[0] if failed else None,
        "worst_check": worst_check(watch.verdicts),
        "pooled": pooled.to_dict(),  # all checked rows judged together
        "verdict": overall_verdict(watch.verdicts, pooled),  # `fuse soak`'s exit status reads its "passed"
        "runner": runner.describe(),
    }


def _gib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**30:.3f}"


def to_markdown(result: dict) -> str:
    s = result["settings"]
    v, pooled = result["verdict"], result["pooled"]
    command = (f"python -m fuse soak --preset {s['preset']}" + (f" --layers {s['layers']}" if s["layers"] else "")
               + f" --device {s['device']} --steps {s['steps']} --check-every {s['check_every']}"
               f" --max-batch {s['max_batch']} --max-seq-len {s['max_seq_len']}")
    growth = "-" if result["allocated_growth_bytes"] is None else f"{result['allocated_growth_bytes'] / 2**20:.2f}"
    lines = [
        f"## Soak: {s['preset']} preset, {result['layers']} layers, {s['steps']} steps",
        "",
        f"`{command}` on {result['device_name']}, torch {result['torch']}, {result['date']}, {s['dtype']}. Random batches "
        f"of 1 to {s['max_batch']} sequences on random slots, {result['sequences']} sequences of random length up to "
        f"{s['max_seq_len']}; one step in {s['check_every']} checked against the fp32 eager reference (fuse/numerics.py).",
        "",
        "| steps | seconds | recompiles | graph breaks | steps with non-finite logits | allocated growth after warm-up, MiB "
        "| checks failed | yardstick | worst check |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| {s['steps']} | {result['seconds']:.1f} | {result['recompiles']} | {result['graph_breaks']} | "
        f"{result['non_finite_steps']} | {growth} | {_checks_failed(result)} | "
        f"{'pass' if v['passed'] else 'FAIL: ' + v['reason']} | {_check_errors(result['worst_check'])} |",
        "",
        "The yardstick passes only if every check passes on its own and all checked rows together pass.",
        "",
        f"All checked rows together: {'pass' if pooled['passed'] else 'FAIL (' + pooled['reason'] + ')'}, worst row "
        f"{pooled['error']:.2e} against fp32 (bound {pooled['bound']:.2e}), median row {pooled['typical_error']:.2e}"
        + (f" (bound {pooled['typical_bound']:.2e})" if pooled["typical_bound"] is not None else "")
        + f", top-1 agreement {pooled['top1_agreement']:.3f} over {pooled['rows']} rows; the eager {s['dtype']} "
        f"step's own: worst row {pooled['noise']:.2e}, median row {pooled['typical_noise']:.2e}.",
        "",
        "Memory over the run, GiB (allocated and reserved: the device's caching allocator; resident: the process), "
        "sampled after the step's logits and inputs are freed:",
        "",
        "| after step | allocated | reserved | resident |",
        "|---|---|---|---|",
    ]
    lines += [f"| {m['step']} | {_gib(m['allocated_bytes'])} | {_gib(m['reserved_bytes'])} | {_gib(m['rss_bytes'])} |"
              for m in result["memory"]]
    return "\n".join(lines) + "\n"


def _checks_failed(result: dict) -> str:
    """"k of n", and where k > 0 the first failed check's step, batch and reason."""
    count = f"{result['checks_failed']} of {len(result['checks'])}"
    first = result["first_failed_check"]
    return count if first is None else f"{count}, first step {first['step']} (batch {first['batch']}): {first['reason']}"


def _check_errors(check: dict) -> str:
    median = "" if check["typical_bound"] is None else (
        f", median row {check['typical_error']:.2e} of bound {check['typical_bound']:.2e}")
    return (f"step {check['step']} (batch {check['batch']}): worst row {check['error']:.2e} of bound "
            f"{check['bound']:.2e}{median}")


def write_outputs(result: dict, folder: str) -> None:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "soak.json"), "w") as f:
        json.dump(result, f, indent=2)
    with open(os.path.join(folder, "soak.md"), "w") as f:
        f.write(to_markdown(result))
