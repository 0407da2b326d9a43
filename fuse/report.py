"""`fuse report`: build a decoder, compile it, check compiled against eager, count kernels per
decode step by category (eager vs compiled), time both, and write the results (JSON, markdown,
a PNG chart and, where depyf works, the dump of the generated code) into one folder."""
from __future__ import annotations

import datetime
import json
import os
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch

from fuse.launches import CATEGORIES, LaunchReport, count_launches, diff_markdown, median_step_ms
from fuse.runner import compile_decode
from kernels.linear import MAX_ROWS
from model import Decoder, ModelConfig


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


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected.float()).abs().max() / expected.float().abs().max()).item()


def restore_point(decoder: Decoder) -> Callable[..., None]:
    """Copies of `decoder.recurrent_state()`; the returned function writes them back into
    `decoder` or into another decoder of the same shape, so that the next step there starts
    from this state (cache rows a repeated step rewrites need no copy)."""
    saved = {name: buf.clone() for name, buf in decoder.recurrent_state().items()}

    def restore(target: Decoder = decoder) -> None:
        for name, buf in target.recurrent_state().items():
            buf.copy_(saved[name])

    return restore


def run_report(settings: ReportSettings) -> dict:
    cfg = ModelConfig.preset(settings.preset, layers=settings.layers)
    folder = settings.folder()
    os.makedirs(folder, exist_ok=True)
    shape = dict(max_batch=settings.batch, max_seq_len=max(64, settings.steps + 8), dtype=settings.dtype, device=settings.device)
    eager = Decoder(cfg, **shape).init_random(settings.seed)
    compiled_model = Decoder(cfg, **shape)
    compiled_model.load_state_dict(eager.state_dict())

    start = time.perf_counter()
    runner = compile_decode(compiled_model, buckets=(settings.batch,))
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
    one_step = one_step_errors(eager, compiled_model, runner, *args)
    eager_launches = count_launches(eager.step, *args, label="eager", layers=cfg.n_layers)
    compiled_launches = count_launches(runner.run_checked, *args, label="compiled", layers=cfg.n_layers)
    eager_ms = median_step_ms(eager.step, *args, steps=settings.timing_steps)
    compiled_ms = median_step_ms(runner.run_checked, *args, steps=settings.timing_steps)

    inspection = None
    if settings.inspect:
        inspection = _inspect(runner, os.path.join(folder, "inspect"))

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
        "eager": eager_launches.to_dict(),
        "compiled": compiled_launches.to_dict(),
        "step_ms": {"eager": eager_ms, "compiled": compiled_ms},
        "inspect": inspection,
    }
    write_outputs(folder, result, eager_launches, compiled_launches)
    return result


@torch.no_grad()
def one_step_errors(eager, compiled_model, runner, tokens, positions, slots) -> dict[str, float]:
    """One step from identical state (the compiled model's buffers copied from the eager one's):
    compiled against eager, and, as the yardstick, eager against the same eager step with padding
    rows added (on the scratch slot), which changes only kernel choices and summation orders. In
    bf16 a deep random-weight model amplifies such rounding differences, so the first number
    means something only next to the second."""
    buffers = dict(compiled_model.named_buffers())
    for name, buf in eager.named_buffers():
        buffers[name].copy_(buf)
    restore = restore_point(eager)
    expected = eager.step(tokens, positions, slots)
    restore()
    padded = eager.step(*padded_inputs(eager, tokens, positions, slots))[: len(tokens)]
    restore()
    compiled = runner.run_checked(tokens, positions, slots)
    return {"compiled_vs_eager": relative_error(compiled, expected), "eager_padding_noise": relative_error(padded, expected)}


def padded_batch_size(batch: int) -> int:
    """Rows of padded_inputs for a batch of `batch`: at least one padding row, and past the decode
    GEMM's row limit."""
    return max(batch + 1, MAX_ROWS + 1)


def padded_inputs(eager, tokens, positions, slots) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The step's inputs with padding rows appended, enough to pass the decode GEMM's row limit:
    the padded step then runs every projection through the library GEMM rather than
    `v4::grouped_linear`, whose per-row summation order does not depend on the batch (one extra
    row would often change nothing and calibrate nothing)."""
    rows = padded_batch_size(len(tokens)) - len(tokens)
    pad = lambda t, value: torch.cat([t, t.new_full((rows,), value)])
    return pad(tokens, 0), pad(positions, 0), pad(slots, eager.pad_slot)


def _inspect(runner, folder: str) -> str | None:
    """Dump the generated code with depyf where `fuse.inspect` is available; the reason if not."""
    try:
        from fuse.inspect import inspect
    except ImportError as error:
        return f"skipped: {error}"
    try:
        inspect(runner, folder)
        return folder
    except Exception as error:  # the report stands without the dump; say why it is missing
        return f"failed: {type(error).__name__}: {error}"


def summary_markdown(result: dict, eager: LaunchReport, compiled: LaunchReport) -> str:
    s = result["settings"]
    lines = [
        f"# fuse report: {s['preset']} preset on {result['device_name']}",
        "",
        f"`python -m fuse report --preset {s['preset']} --device {s['device']} --batch {s['batch']}"
        + (f" --layers {s['layers']}" if s.get("layers") else "") + "`, "
        f"torch {result['torch']}, {result['date']}, {s['dtype']}, batch {s['batch']}, {result['layers']} layers.",
        "",
        f"- compiled vs eager over {s['steps']} steps: max relative logit error {result['max_relative_error']:.2e}",
        f"- one step from identical state: compiled vs eager {result['one_step']['compiled_vs_eager']:.2e}; "
        f"eager vs eager with padding rows (rounding noise) {result['one_step']['eager_padding_noise']:.2e}",
        f"- step time (median of {s['timing_steps']}): eager {result['step_ms']['eager']:.2f} ms, "
        f"compiled {result['step_ms']['compiled']:.2f} ms "
        f"({result['step_ms']['eager'] / result['step_ms']['compiled']:.2f}x)",
        f"- glue kernels per step: eager {eager.glue:g}, compiled {compiled.glue:g}",
        f"- compile + warm-up: {result['compile_seconds']:.1f} s",
        "",
        "## Kernels per decode step",
        "",
        diff_markdown(eager, compiled),
        "",
        "## Compiled step: the kernels that take the most time",
        "",
        compiled.top_kernels_markdown(),
    ]
    return "\n".join(lines) + "\n"


def write_outputs(folder: str, result: dict, eager: LaunchReport, compiled: LaunchReport) -> None:
    with open(os.path.join(folder, "report.json"), "w") as f:
        json.dump(result, f, indent=2)
    with open(os.path.join(folder, "report.md"), "w") as f:
        f.write(summary_markdown(result, eager, compiled))
    plot_launches(os.path.join(folder, "launches.png"), eager, compiled)


def plot_launches(path: str, eager: LaunchReport, compiled: LaunchReport) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    x = range(len(CATEGORIES))
    width = 0.4
    ax.bar([i - width / 2 for i in x], [eager.counts[c] for c in CATEGORIES], width, label=eager.label)
    ax.bar([i + width / 2 for i in x], [compiled.counts[c] for c in CATEGORIES], width, label=compiled.label)
    ax.set_xticks(list(x), CATEGORIES)
    ax.set_ylabel("kernels per decode step")
    ax.set_title(f"Kernels per decode step by category ({eager.device})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def format_console(result: dict, eager: dict, compiled: dict) -> str:
    lines = [f"{'category':<12}{'eager':>10}{'compiled':>10}"]
    for c in CATEGORIES:
        lines.append(f"{c:<12}{eager['counts'][c]:>10g}{compiled['counts'][c]:>10g}")
    lines.append(f"{'glue':<12}{eager['glue']:>10g}{compiled['glue']:>10g}")
    lines.append(f"{'total':<12}{eager['total']:>10g}{compiled['total']:>10g}")
    ms = result["step_ms"]
    lines.append(
        f"step time: eager {ms['eager']:.2f} ms, compiled {ms['compiled']:.2f} ms; "
        f"compiled vs eager max relative error {result['max_relative_error']:.2e}"
    )
    one = result["one_step"]
    lines.append(
        f"one step from the same state: compiled vs eager {one['compiled_vs_eager']:.2e}, "
        f"eager with padding rows vs eager (rounding noise) {one['eager_padding_noise']:.2e}"
    )
    return "\n".join(lines)
