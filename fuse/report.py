"""`fuse report`: build a decoder, compile it, check compiled against eager, count kernels per
decode step by category (eager vs compiled), time both, and write the results (JSON, markdown,
a PNG chart and, where depyf works, the dump of the generated code) into one folder.

Under torchrun the decoder is split across the ranks it started (docs/parallel.md): every rank
runs the report on its part, and rank 0 writes it (its own kernels, trace and dump) with what
every rank measured: kernels per step, time in collectives, step time against the bytes the
rank must read."""
from __future__ import annotations

import datetime
import importlib.util
import json
import os
import time
from dataclasses import asdict, dataclass

import torch

from fuse.floor import copy_bandwidth_gbs, step_floor
from fuse.launches import CATEGORIES, LaunchReport, count_launches, diff_markdown, time_markdown
from fuse.numerics import (
    StreamedReference, Verdict, check_step, copy_state, fp32_reference, judge, one_step_errors, relative_error, sharing_weights,
    without_qat,
)
from fuse.ranks import gather_to_first, launched_ranks
from fuse.runner import compile_decode
from kernels.bench.timing import NOISY_SPREAD, Samples, wall_samples
from model import Decoder, ModelConfig


# The profiler's timeline of one step of each, in the report folder (Chrome trace JSON).
TRACES = {"eager": "trace-eager.json", "compiled": "trace-compiled.json"}


@dataclass
class ReportSettings:
    preset: str = "tiny"
    device: str = "cpu"
    batch: int = 4
    steps: int = 4  # decode steps checked against eager before counting
    timing_steps: int = 5
    seed: int = 0
    out_dir: str | None = None
    inspect: bool = True
    layers: int | None = None  # the first N layers of the preset (default: all)

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32 if self.device == "cpu" else torch.bfloat16

    def folder(self) -> str:
        return self.out_dir or os.path.join("fuse-out", f"report-{self.preset}-{self.device.split(':')[0]}")


def run_report(settings: ReportSettings) -> dict:
    """The report's result; written to the folder by rank 0 (of one process: by it)."""
    parallel, device = launched_ranks(settings.device)
    writes = parallel.rank == 0
    cfg = ModelConfig.preset(settings.preset, layers=settings.layers)
    folder = settings.folder()
    if writes:
        os.makedirs(folder, exist_ok=True)
    shape = dict(max_batch=settings.batch, max_seq_len=max(64, settings.steps + 8), dtype=settings.dtype, device=device)
    eager = Decoder(cfg, parallel=parallel, **shape).init_random(settings.seed)
    compiled_model = sharing_weights(eager)  # its own caches, the weights once: the widths that fit one decoder fit both

    dump_dir, inspection = None, "skipped: --no-inspect"
    if not writes:
        inspection = "rank 0's"
    elif settings.inspect:
        if importlib.util.find_spec("depyf") is None:
            inspection = "skipped: depyf is not installed"
        else:
            dump_dir = inspection = os.path.join(folder, "inspect")
    start = time.perf_counter()
    # The dump is of this runner's own compile: the kernels profiled below are the ones indexed.
    runner = compile_decode(compiled_model, buckets=(settings.batch,), dump_dir=dump_dir)
    compile_seconds = time.perf_counter() - start

    # Compiled against eager, step by step from position 0, the same greedy tokens for both.
    generator = torch.Generator().manual_seed(settings.seed)
    tokens = torch.randint(0, cfg.vocab_size, (settings.batch,), generator=generator)
    slots = torch.arange(settings.batch)
    errors = []
    for position in range(settings.steps):
        positions = torch.full((settings.batch,), position)
        expected = eager(tokens, positions, slots)
        errors.append(relative_error(runner(tokens, positions, slots), expected))
        tokens = expected.argmax(-1).cpu()

    # Counting and timing repeat one step at the next position (it rewrites the same rows).
    args = eager.check_inputs(tokens, torch.full((settings.batch,), settings.steps), slots)
    one_step = one_step_errors(eager, compiled_model, runner.run_checked, args)
    against_fp32 = fp32_checks(eager, compiled_model, runner, args)
    # Each count also writes its profiled step's timeline (trace-eager.json, trace-compiled.json).
    trace = lambda name: os.path.join(folder, TRACES[name]) if writes else None  # noqa: E731
    eager_launches = count_launches(eager.step, *args, label="eager", layers=cfg.n_layers, trace_path=trace("eager"))
    compiled_launches = count_launches(runner.run_checked, *args, label="compiled", layers=cfg.n_layers, trace_path=trace("compiled"))
    index_entries = None
    if runner.inspection is not None:
        # Replayed graphs hide which op launched a library kernel; a direct call shows it.
        origins = dict(compiled_launches.origins)
        if args[0].is_cuda:
            direct = count_launches(runner.run_without_graph, *args).origins
            origins.update((name, op) for name, op in direct.items() if op or name not in origins)
        index_entries = index_entries_of(runner.inspection, compiled_launches, origins, settings.batch)
    # Interleaved rounds, so that load that comes and goes hits both alike.
    eager_times, compiled_times = [], []
    eager.step(*args), runner.run_checked(*args)  # warm-up
    for _ in range(settings.timing_steps):
        eager_times += wall_samples(eager.step, *args, steps=1, warmup=0).values
        compiled_times += wall_samples(runner.run_checked, *args, steps=1, warmup=0).values
    timings = {"eager": Samples(tuple(eager_times)), "compiled": Samples(tuple(compiled_times))}

    result = {
        "settings": {**asdict(settings), "dtype": str(settings.dtype).removeprefix("torch.")},
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "device_name": torch.cuda.get_device_name() if settings.device.startswith("cuda") else "cpu",
        "layers": cfg.n_layers,
        "compile_seconds": compile_seconds,
        "runner": runner.describe(),
        "max_relative_error": max(errors),
        "relative_errors": errors,
        "one_step": one_step,
        "against_fp32": against_fp32,
        "eager": eager_launches.to_dict(),
        "compiled": compiled_launches.to_dict(),
        "step_ms": {name: t.median for name, t in timings.items()},
        "step_ms_range": {name: t.to_dict() for name, t in timings.items()},
        "timing_warning": timing_warning(timings),
        "threads": torch.get_num_threads(),
        "inspect": inspection,
        "index_entries": index_entries,
        "traces": dict(TRACES),
        "world_size": parallel.world_size,
    }
    result["ranks"] = gather_to_first(parallel, rank_summary(eager, args, eager_launches, compiled_launches, result, parallel.rank))
    if writes:
        write_outputs(folder, result, eager_launches, compiled_launches)
    return result


def rank_summary(decoder: Decoder, args: tuple, eager: LaunchReport, compiled: LaunchReport, result: dict, rank: int) -> dict:
    """What one rank measured: its kernels per step, the time in collectives, its step time
    against the floor of the bytes its step must read (its part of the weights and the caches
    it reads, over the copy bandwidth measured here)."""
    context = int(args[1].max()) + 1
    floor, floor_ms = step_floor(decoder, len(args[0]), context, copy_bandwidth_gbs(decoder.device))
    launches = {report.label: report.rank_summary() for report in (eager, compiled)}
    return {"rank": rank, "device": str(decoder.device), "launches": launches, "step_ms": dict(result["step_ms"]),
            "floor_bytes": floor, "floor_ms": floor_ms}


def ranks_markdown(result: dict) -> list[str]:
    """The per-rank table of a report split across ranks (none for one process)."""
    if result.get("world_size", 1) == 1:
        return []
    lines = [
        "## Per rank", "",
        "Kernels per step, collectives and the time in them (device time on CUDA, the collective ops' CPU time "
        "on the CPU, waits included), and the step time against the rank's floor: the bytes its step must read "
        "(its part of the weights, the caches it reads) over the copy bandwidth.", "",
        "| rank | eager kernels | compiled kernels | compiled collectives | eager ms in collectives | compiled ms in collectives "
        "| compiled step ms | floor ms | compiled / floor |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["ranks"]:
        e, c = r["launches"]["eager"], r["launches"]["compiled"]
        step = r["step_ms"]["compiled"]
        lines.append(
            f"| {r['rank']} | {e['total']:g} | {c['total']:g} | {c['collectives']:g} | {e['collective_us'] / 1e3:.3f} "
            f"| {c['collective_us'] / 1e3:.3f} | {step:.2f} | {r['floor_ms']:.3f} | {step / r['floor_ms']:.1f}x |"
        )
    return lines + [""]


def fp32_checks(eager: Decoder, compiled_model: Decoder, runner, args: tuple) -> dict:
    """One step from the same state against the fp32 eager reference of the same weights
    (fuse/numerics.py): the eager step in the model's dtype (its rounding noise), the compiled
    step with the yardstick's verdict, and the step compiled in fp32 against eager fp32 (the
    compiled model itself when it is fp32; else a runner of the fp32 copy, where it fits)."""
    reference = fp32_reference(eager)
    copy_state(eager, compiled_model)
    compiled = judge([check_step(compiled_model, runner.run_checked, args, reference, eager=eager)], compiled_model.dtype)
    result = {
        "dtype": str(compiled_model.dtype).removeprefix("torch."),
        "eager_worst_row": compiled.noise,
        "eager_median_row": compiled.typical_noise,
        "compiled": compiled.to_dict(),
        "compiled_fp32": None,
        "compiled_fp32_note": "",
    }
    if compiled_model.dtype == torch.float32:
        result["compiled_fp32"] = compiled.to_dict()
        result["compiled_fp32_note"] = "the compiled model is fp32"
    elif isinstance(reference, StreamedReference):
        result["compiled_fp32_note"] = "skipped: an fp32 copy of the model does not fit beside it"
    else:
        exact = without_qat(reference)  # shares the reference's weights
        fp32_runner = compile_decode(exact, buckets=(len(args[0]),), progress=False)
        copy_state(compiled_model, exact)
        result["compiled_fp32"] = judge([check_step(exact, fp32_runner.run_checked, args)], torch.float32).to_dict()
        result["compiled_fp32_note"] = "QAT off in both"
    return result


def fp32_lines(result: dict) -> list[str]:
    """The fp32-reference checks as text lines (report.md and the console)."""
    fp32 = result.get("against_fp32")
    if not fp32:
        return []
    verdict = lambda d: Verdict(**d).summary()  # noqa: E731
    lines = [
        f"against the fp32 eager reference (one step from the same state): eager {fp32['dtype']} worst row "
        f"{fp32['eager_worst_row']:.2e}, median row {fp32['eager_median_row']:.2e}",
        f"compiled {fp32['dtype']}: {verdict(fp32['compiled'])}",
    ]
    if fp32["dtype"] != "float32":
        if fp32["compiled_fp32"]:
            note = f" ({fp32['compiled_fp32_note']})" if fp32["compiled_fp32_note"] else ""
            lines.append(f"compiled fp32 vs eager fp32{note}: " + verdict(fp32["compiled_fp32"]))
        else:
            lines.append("compiled fp32 vs eager fp32: " + fp32["compiled_fp32_note"])
    return lines


def timing_warning(timings: dict[str, "Samples"]) -> str | None:
    """A warning when repeats of one step spread beyond NOISY_SPREAD or the machine is loaded."""
    noisy = [f"{name} {t.low:.2f}-{t.high:.2f} ms" for name, t in timings.items() if t.noisy]
    if noisy:
        return (f"timings spread more than {NOISY_SPREAD}x between repeats ({', '.join(noisy)}): other load on this "
                "machine; compare medians of a quiet run")
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    if load > cores + 1:  # our own process accounts for about one
        return f"load average {load:.1f} on {cores} cores while timing: other processes compete for the CPU"
    return None


def index_entries_of(inspection, launches: LaunchReport, origins: dict[str, str], bucket: int) -> dict[str, dict | None]:
    """Each kernel of the compiled step -> its entry in the inspection index (graph and entry
    name), None where the index has none."""
    entries = {}
    for name in launches.kernels:
        entry = inspection.entry(name, origins.get(name, ""), bucket)
        entries[name] = None if entry is None else {"graph": entry.graph, "entry": entry.name, "kind": entry.kind}
    return entries


def _range(result: dict, name: str) -> str:
    t = result["step_ms_range"][name]
    return f"{t['median']:.2f} ms ({t['min']:.2f}-{t['max']:.2f})"


def summary_markdown(result: dict, eager: LaunchReport, compiled: LaunchReport) -> str:
    s = result["settings"]
    lines = [
        f"# fuse report: {s['preset']} preset on {result['device_name']}",
        "",
        f"`python -m fuse report --preset {s['preset']} --device {s['device']} --batch {s['batch']}"
        + (f" --layers {s['layers']}" if s.get("layers") else "") + "`, "
        f"torch {result['torch']}, {result['date']}, {s['dtype']}, batch {s['batch']}, {result['layers']} layers"
        + (f", split across {result['world_size']} ranks (torchrun; rank 0's numbers below the per-rank table)."
           if result.get("world_size", 1) > 1 else "."),
        "",
        f"- compiled vs eager over {s['steps']} steps: max relative logit error {result['max_relative_error']:.2e}",
        f"- one step from identical state: compiled vs eager {result['one_step']['compiled_vs_eager']:.2e}; "
        f"eager vs eager with padding rows (rounding noise) {result['one_step']['eager_padding_noise']:.2e}",
        *[f"- {line}" for line in fp32_lines(result)],
        f"- step time, median (min-max) of {s['timing_steps']} interleaved repeats on {result['threads']} threads: "
        f"eager {_range(result, 'eager')}, compiled {_range(result, 'compiled')} "
        f"({result['step_ms']['eager'] / result['step_ms']['compiled']:.2f}x)"
        + (f"\n- **warning**: {result['timing_warning']}" if result["timing_warning"] else ""),
        f"- glue kernels per step: eager {eager.glue:g}, compiled {compiled.glue:g}",
        f"- compile + warm-up: {result['compile_seconds']:.1f} s",
        "",
        *ranks_markdown(result),
        "## Kernels per decode step",
        "",
        diff_markdown(eager, compiled),
        "",
        f"## Time per decode step by category ({'device' if compiled.device == 'cuda' else 'CPU'} time)",
        "",
        time_markdown(eager, compiled),
        "",
        "## Compiled step: the kernels that take the most time",
        "",
        compiled.top_kernels_markdown(),
        "",
        "## Compiled step: the kernels the step waits for",
        "",
        ("The device's idle time between kernels, split by the kernel whose start ended each gap (in a "
         "CUDA graph: how long its launch took after the work before it ended)." if compiled.device == "cuda" else
         "The host time between ops and kernels, by the op or kernel that came after each gap."),
        "",
        compiled.waits_markdown(),
    ]
    return "\n".join(lines) + "\n"


def results_markdown(folder: str) -> str:
    """report.md of `folder` as a section of a results file (its headings one level down)."""
    with open(os.path.join(folder, "report.md")) as f:
        return "\n".join("#" + line if line.startswith("#") else line for line in f.read().splitlines())


def write_outputs(folder: str, result: dict, eager: LaunchReport, compiled: LaunchReport) -> None:
    with open(os.path.join(folder, "report.json"), "w") as f:
        json.dump(result, f, indent=2)
    with open(os.path.join(folder, "report.md"), "w") as f:
        f.write(summary_markdown(result, eager, compiled))
    plot_launches(os.path.join(folder, "launches.png"), eager, compiled)


def plot_launches(path: str, eager: LaunchReport, compiled: LaunchReport) -> None:
    import matplotlib.pyplot as plt

    fig = launches_figure(eager, compiled)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def launches_figure(eager: LaunchReport, compiled: LaunchReport):
    """launches.png: kernels per decode step by category (a log scale, so the compiled bars stay
    readable beside eager's thousands), and the step's time by category (device time on CUDA, CPU
    time on the CPU) with the glue share of each; every bar labelled with its value."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (counts, times) = plt.subplots(1, 2, figsize=(12, 4.2))
    x = range(len(CATEGORIES))
    width = 0.4
    panels = (
        (counts, lambda r, c: r.counts.get(c, 0.0), lambda v: f"{v:g}"),
        (times, lambda r, c: r.time_us.get(c, 0.0) / 1000, lambda v: f"{v:.3g}" if v < 100 else f"{v:.0f}"),
    )
    for ax, value, label in panels:
        for offset, launches in ((-width / 2, eager), (width / 2, compiled)):
            values = [value(launches, c) for c in CATEGORIES]
            bars = ax.bar([i + offset for i in x], values, width, label=launches.label)
            ax.bar_label(bars, labels=[label(v) for v in values], fontsize=7, padding=1)
        ax.set_xticks(list(x), CATEGORIES)
        ax.legend()
    counts.set_yscale("symlog", linthresh=1)  # log above 1, so that 0 still has a place
    counts.set_ylim(0, max(max(r.counts.values(), default=1) for r in (eager, compiled)) * 4)
    counts.set_ylabel("kernels per decode step (log scale)")
    counts.set_title(f"Kernels per decode step by category ({eager.device})")
    unit = "device" if eager.device == "cuda" else "CPU"
    times.set_ylabel(f"{unit} time per decode step, ms")
    times.set_title(f"{unit} time per decode step by category")
    shares = [(r.label, r.glue_time_share()) for r in (eager, compiled)]
    text = "glue share of the time: " + ", ".join(f"{label} {'-' if s is None else f'{100 * s:.0f}%'}" for label, s in shares)
    times.text(0.02, 0.97, text, transform=times.transAxes, va="top", fontsize=9,
               bbox=dict(boxstyle="round", facecolor="white", alpha=0.8))
    times.margins(y=0.2)
    fig.tight_layout()
    return fig


def format_console(result: dict, eager: dict, compiled: dict) -> str:
    lines = [f"{'category':<12}{'eager':>10}{'compiled':>10}"]
    for c in CATEGORIES:
        lines.append(f"{c:<12}{eager['counts'][c]:>10g}{compiled['counts'][c]:>10g}")
    lines.append(f"{'glue':<12}{eager['glue']:>10g}{compiled['glue']:>10g}")
    lines.append(f"{'total':<12}{eager['total']:>10g}{compiled['total']:>10g}")
    lines.append(
        f"step time, median (min-max): eager {_range(result, 'eager')}, compiled {_range(result, 'compiled')}; "
        f"compiled vs eager max relative error {result['max_relative_error']:.2e}"
    )
    if result["timing_warning"]:
        lines.append(f"warning: {result['timing_warning']}")
    one = result["one_step"]
    lines.append(
        f"one step from the same state: compiled vs eager {one['compiled_vs_eager']:.2e}, "
        f"eager with padding rows vs eager (rounding noise) {one['eager_padding_noise']:.2e}"
    )
    lines += fp32_lines(result)
    return "\n".join(lines)
