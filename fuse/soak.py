"""`fuse soak`: the compiled runner serving random traffic for many steps, watched.

Each step decodes a random number of sequences (1 to max_batch) on random slots; a slot's sequence
starts at position 0 with a random length (up to max_seq_len) and ends there, after which the
slot takes a new one, so positions run up to max_seq_len - 1. Every `check_every` steps one step
is checked against the accuracy yardstick (fuse/numerics.py: the fp32 eager reference of the same
weights from the same state). Reported: recompiles and graph breaks after warm-up, steps with
non-finite logits, allocated and reserved device memory (on the CPU, the process's resident
memory) over time, and each check's verdict with the worst. Writes soak.json and soak.md."""
from __future__ import annotations

import dataclasses
import datetime
import json
import os
import random
import resource
import time
from dataclasses import dataclass
from typing import Callable

import torch

from fuse.numerics import check_step, fp32_reference, judge
from fuse.runner import compile_decode
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


def allocated_growth(memory: list[dict]) -> int | None:
    """How far allocated memory moved after warm-up: max - min over the samples from the one after
    the first step on (None without a device allocator)."""
    after = [m["allocated_bytes"] for m in memory[1:]]
    if not after or after[0] is None:
        return None
    return max(after) - min(after)


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


def run_soak(settings: SoakSettings, log: Callable[[str], None] = print) -> dict:
    cfg = ModelConfig.preset(settings.preset, layers=settings.layers)
    decoder = Decoder(cfg, settings.max_batch, settings.max_seq_len, dtype=settings.dtype, device=settings.device)
    decoder.init_random(settings.seed)
    buckets = tuple(b for b in BUCKETS if b < settings.max_batch) + (settings.max_batch,)
    start = time.perf_counter()
    # strict=False: a recompile is counted, not raised, so that the soak reports it and goes on
    runner = compile_decode(decoder, buckets=buckets, strict=False, progress=False)
    start_seconds = time.perf_counter() - start
    reference = fp32_reference(decoder)
    log(f"{cfg.n_layers} layers on {decoder.device}, buckets {list(runner.buckets)}, ready in {start_seconds:.1f} s")

    traffic = Traffic(settings.max_batch, settings.max_seq_len, cfg.vocab_size, settings.seed)
    compiles0, breaks0 = dynamo_totals()
    non_finite = torch.zeros((), dtype=torch.int64, device=decoder.device)
    memory, checks, verdicts = [memory_sample(0, decoder.device)], [], []
    start = time.perf_counter()
    with torch.no_grad():
        for step in range(settings.steps):
            inputs = decoder.check_inputs(*traffic.next_batch())
            if step % settings.check_every == 0:
                check = check_step(decoder, runner.run_checked, inputs, reference)
                verdict = judge([check], decoder.dtype)
                checks.append(check)
                verdicts.append({"step": step, "batch": len(inputs[0]), **verdict.to_dict()})
                non_finite += int(check.non_finite)
                memory.append(memory_sample(step + 1, decoder.device))
                log(f"step {step:>6}: batch {len(inputs[0]):>3}, {verdict.summary()}")
            else:
                logits = runner.run_checked(*inputs)
                non_finite += (~torch.isfinite(logits)).any()
    memory.append(memory_sample(settings.steps, decoder.device))
    seconds = time.perf_counter() - start
    compiles1, breaks1 = dynamo_totals()
    overall = judge(checks, decoder.dtype)
    worst = max(verdicts, key=lambda v: v["error"] / v["bound"])
    return {
        "settings": {**dataclasses.asdict(settings), "dtype": str(settings.dtype).removeprefix("torch.")},
        "date": datetime.date.today().isoformat(),
        "device_name": torch.cuda.get_device_name(decoder.device) if decoder.device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "layers": cfg.n_layers,
        "buckets": list(runner.buckets),
        "start_seconds": start_seconds,
        "seconds": seconds,
        "sequences": traffic.started,
        "recompiles": runner.stats.recompiles,
        "compiles_after_warmup": compiles1 - compiles0,
        "graph_breaks": runner.stats.graph_breaks + breaks1 - breaks0,
        "non_finite_steps": int(non_finite.item()),
        "memory": memory,
        "allocated_growth_bytes": allocated_growth(memory),
        "checks": verdicts,
        "worst_check": worst,
        "verdict": overall.to_dict(),
        "runner": runner.describe(),
    }


def _gib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**30:.3f}"


def to_markdown(result: dict) -> str:
    s = result["settings"]
    v, worst = result["verdict"], result["worst_check"]
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
        "| checks | yardstick | worst check |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| {s['steps']} | {result['seconds']:.1f} | {result['recompiles']} | {result['graph_breaks']} | "
        f"{result['non_finite_steps']} | {growth} | "
        f"{len(result['checks'])} | {'pass' if v['passed'] else 'FAIL: ' + v['reason']} | "
        f"step {worst['step']} (batch {worst['batch']}): worst row {worst['error']:.2e} of bound {worst['bound']:.2e} |",
        "",
        f"All checked rows together: worst row {v['error']:.2e} against fp32 (bound {v['bound']:.2e}), median row "
        f"{v['typical_error']:.2e}" + (f" (bound {v['typical_bound']:.2e})" if v["typical_bound"] is not None else "")
        + f", top-1 agreement {v['top1_agreement']:.3f} over {v['rows']} rows; the eager {s['dtype']} step's own: "
        f"worst row {v['noise']:.2e}, median row {v['typical_noise']:.2e}.",
        "",
        "Memory over the run, GiB (allocated and reserved: the device's caching allocator; resident: the process):",
        "",
        "| after step | allocated | reserved | resident |",
        "|---|---|---|---|",
    ]
    lines += [f"| {m['step']} | {_gib(m['allocated_bytes'])} | {_gib(m['reserved_bytes'])} | {_gib(m['rss_bytes'])} |"
              for m in result["memory"]]
    return "\n".join(lines) + "\n"


def write_outputs(result: dict, folder: str) -> None:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "soak.json"), "w") as f:
        json.dump(result, f, indent=2)
    with open(os.path.join(folder, "soak.md"), "w") as f:
        f.write(to_markdown(result))
