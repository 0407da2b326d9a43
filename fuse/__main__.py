"""Command-line interface: `python -m fuse <command>` (also installed as `fuse`).

A bad value ends the run before any work with one line naming the flag and what it allows, and
exit status 2."""
from __future__ import annotations

import argparse
import ast
import json
import os
import sys

from fuse.options import COMPILATIONS
from model.config import PRESETS



class _Parser(argparse.ArgumentParser):
    """One line per error (no usage block), exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _ints(text: str) -> tuple[int, ...]:
    """A comma list of positive integers."""
    try:
        values = tuple(int(t) for t in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of positive integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected a comma list of positive integers, got {text!r}")
    return values


def _workers(text: str) -> int | None:
    """CompileOptions.compile_workers: "auto" (None) or an integer >= 0."""
    return None if text == "auto" else _non_negative(text)


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _inductor_option(text: str) -> tuple[str, object]:
    """KEY=VALUE with VALUE a Python literal (True, 4, 'name'); anything else is taken as a string."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key, value


def _variants(text: str) -> tuple[str, ...]:
    from fuse.bench import VARIANTS

    names = tuple(text.split(","))
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    return names


def _device(text: str) -> str:
    """`cpu`, `cuda` or `cuda:N`, where that device exists."""
    import torch

    kind, _, index = text.partition(":")
    if kind not in ("cpu", "cuda") or (index and (kind == "cpu" or not index.isdigit())):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(f"{text}: no CUDA device here (torch {torch.__version__}); use --device cpu")
        if index and int(index) >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(f"{text}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return text


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The parser and its commands' parsers."""
    defaults = argparse.ArgumentDefaultsHelpFormatter
    parser = _Parser(prog="fuse", description=__doc__.splitlines()[0], formatter_class=defaults)
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    def model_flags(p, preset: str, device: str) -> None:
        p.add_argument("--preset", default=preset, choices=PRESETS, help="model: tiny (CPU), tiny-fp8 (tiny with the checkpoint's FP8/FP4 formats), bench (V4-Flash widths, 16 experts, bf16), flash (V4-Flash, FP8/FP4)")
        p.add_argument("--layers", type=_positive, default=None, help="use the first N layers of the preset (default: all)")
        p.add_argument("--device", type=_device, default=device, help="cpu, cuda or cuda:N")
        p.add_argument("--seed", type=int, default=0, help="seed of the random weights and inputs")

    report = commands.add_parser(
        "report", formatter_class=defaults,
        help="the main job: compile, check against eager, count and time kernels, dump the generated code",
        description="Compile the decode step, check it against eager, count its kernels by category (eager vs "
        "compiled), time both, and write report.json, report.md, launches.png, the profiler timeline of one step of each "
        "(trace-eager.json, trace-compiled.json) and the generated code (inspect/).",
    )
    model_flags(report, "tiny", "cpu")
    report.add_argument("--batch", type=_positive, default=4, help="batch size (one bucket)")
    report.add_argument("--steps", type=_positive, default=4, help="decode steps checked against eager")
    report.add_argument("--timing-steps", type=_positive, default=5, help="timed steps per variant")
    report.add_argument("--out", default=None, help="output folder (default: fuse-out/report-<preset>-<device>)")
    report.add_argument("--no-inspect", action="store_true", help="skip the dump of the generated code")
    report.add_argument("--results", default=None, help="also write the report's tables into this results file (docs/results.md)")

    bench = commands.add_parser(
        "bench", formatter_class=defaults,
        help="GPU: eager, eager in CUDA graphs, reduce-overhead and compile_decode, side by side",
        description="Time the decode step as users run it today against compile_decode, interleaved, with the "
        "bytes-read floor; write bench.json, bench.md and bench.png. Under torchrun the model is split across the ranks "
        "(docs/parallel.md) and rank 0 writes every rank's times, floors and collectives.",
    )
    model_flags(bench, "bench", "cuda")
    bench.add_argument("--contexts", type=_ints, default=(4096, 32768), help="context lengths (comma list)")
    bench.add_argument("--batches", type=_ints, default=(1, 16, 32, 64), help="batch sizes (comma list)")
    bench.add_argument("--variants", type=_variants, default=None,
                       help="comma list of eager, eager-graphs, reduce-overhead, fuse, fuse-static, fuse-nested, "
                       "fuse-regional, fuse-batch1-shared, fuse-no-pdl, fuse-combo, fuse-dequantised (fuse/bench.py's "
                       "docstring says what each is; default: the first four)")
    bench.add_argument("--steps", type=_positive, default=10, help="steps per variant, shape and round")
    bench.add_argument("--eager-steps", type=_positive, default=4, help="steps of the (slow) eager variant")
    bench.add_argument("--repeats", type=_positive, default=5, help="interleaved rounds; the median is reported")
    bench.add_argument("--fp32-products", default="exact", choices=["exact", "fast"], help="ModelConfig.fp32_products")
    bench.add_argument("--start-times", action="store_true", help="only: cold, warm and artifact start of compile_decode for 7 buckets, each in a new process")
    bench.add_argument("--compare-precision", action="store_true", help="only: fp32 products fast vs exact")
    bench.add_argument("--out", default="fuse-out/bench", help="output folder")
    bench.add_argument("--results", default=None, help="also write the tables into this results file (docs/results.md)")
    bench.add_argument("--inductor-option", action="append", type=_inductor_option, default=[], metavar="KEY=VALUE",
                       help="an Inductor config patch for the compile_decode variant, e.g. combo_kernels=True (repeatable)")
    bench.add_argument("--starts", type=lambda v: tuple(v.split(",")), default=None,
                       help="with --start-times: which starts, among cold, warm, artifact, workers, stock (default all)")
    bench.add_argument("--start-time-child", action="store_true", help=argparse.SUPPRESS)
    bench.add_argument("--stock-start", action="store_true", help=argparse.SUPPRESS)  # the child times reduce-overhead
    bench.add_argument("--compile-workers", action="store_true", help=argparse.SUPPRESS)  # the child compiles in workers
    bench.add_argument("--buckets", type=_ints, default=None, help=argparse.SUPPRESS)
    bench.add_argument("--artifact", default=None, help=argparse.SUPPRESS)

    precompile = commands.add_parser(
        "precompile", formatter_class=defaults,
        help="build the artifact a later start loads instead of compiling (compile_decode's artifact option)",
        description="Compile the decode step for the buckets, as compile_decode(..., artifact=PATH) does, and save "
        "what a later start needs into PATH: a start of the same decoder shape, options, device and versions "
        "then compiles nothing. An artifact already at PATH that matches is loaded (nothing to do); one that does "
        "not is refused, or rebuilt with --rebuild.",
    )
    model_flags(precompile, "bench", "cuda")
    precompile.add_argument("--artifact", required=True, help="the artifact file to write (a zip)")
    precompile.add_argument("--buckets", type=_ints, default=(1, 2, 4, 8, 16, 32, 64), help="batch buckets (comma list)")
    precompile.add_argument("--dtype", default=None, choices=["float32", "bfloat16"], help="weights and activations; unset: bfloat16 on cuda, float32 on cpu")
    precompile.add_argument("--max-batch", type=_positive, default=None, help="the decoder's max_batch; unset: the largest bucket")
    precompile.add_argument("--max-seq-len", type=_positive, default=4096, help="the decoder's max_seq_len")
    precompile.add_argument("--fp32-products", default="exact", choices=["exact", "fast"], help="ModelConfig.fp32_products")
    precompile.add_argument("--compilation", default="auto", choices=list(COMPILATIONS), help="CompileOptions.compilation")
    precompile.add_argument("--static-batch", action="store_true", help="one graph per bucket (CompileOptions.dynamic_batch=False)")
    precompile.add_argument("--batch-one-shared", action="store_true", help="batch 1 in the symbolic batch's graph (CompileOptions.batch_one_shared)")
    precompile.add_argument("--skinny-product-columns", type=_non_negative, default=64, help="CompileOptions.skinny_product_columns")
    precompile.add_argument("--mode", default=None, help="an Inductor mode (CompileOptions.mode)")
    precompile.add_argument("--inductor-option", action="append", type=_inductor_option, default=[], metavar="KEY=VALUE",
                            help="an Inductor config patch (CompileOptions.inductor_options; repeatable)")
    precompile.add_argument("--cache-dir", default=None, help="CompileOptions.cache_dir: persistent compile caches to compile from")
    # A build is a start that waits for nothing else: its graphs compile in workers by default.
    precompile.add_argument("--compile-workers", type=_workers, default=None, metavar="N|auto",
                            help="CompileOptions.compile_workers: worker processes compiling the graphs (auto: one per layer kind "
                                 "and batch shape, as many as fit in the GPU's free memory; none on the CPU; 0: none)")
    precompile.add_argument("--rebuild", action="store_true", help="rebuild an artifact at PATH that does not match, instead of refusing")

    soak = commands.add_parser(
        "soak", formatter_class=defaults,
        help="the compiled runner under random traffic for many steps: recompiles, graph breaks, memory, NaNs, accuracy",
        description="Run the compiled runner for --steps steps of random batch sizes, slots and sequence lengths, check "
        "a step every --check-every steps against the fp32 yardstick, and write soak.json and soak.md.",
    )
    model_flags(soak, "bench", "cuda")
    soak.add_argument("--steps", type=_positive, default=10000, help="decode steps")
    soak.add_argument("--check-every", type=_positive, default=250, help="steps between checks against the fp32 reference")
    soak.add_argument("--max-batch", type=_positive, default=64, help="cache slots; batches are 1 to this many sequences")
    soak.add_argument("--max-seq-len", type=_positive, default=2048, help="longest sequence (positions up to this - 1)")
    soak.add_argument("--out", default="fuse-out/soak", help="output folder")
    soak.add_argument("--results", default=None, help="also write the summary into this results file (docs/results.md)")

    demo = commands.add_parser("demo", formatter_class=defaults, help="a short eager decode run: tokens/s and logits statistics")
    model_flags(demo, "tiny", "cpu")
    demo.add_argument("--batch", type=_positive, default=4, help="sequences decoded at once")
    demo.add_argument("--steps", type=_positive, default=32, help="decode steps")
    demo.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="weights and activations")
    return parser, {"report": report, "bench": bench, "precompile": precompile, "soak": soak, "demo": demo}


def main(argv: list[str] | None = None) -> int:
    parser, commands = build_parser()
    args = parser.parse_args(argv)
    command = commands[args.command]
    _check_layers(command, args)
    if args.command == "report":
        return _report(args)
    if args.command == "bench":
        return _bench(command, args)
    if args.command == "precompile":
        return _precompile(command, args)
    if args.command == "soak":
        return _soak(command, args)
    return _demo(command, args)


def _check_layers(command: argparse.ArgumentParser, args) -> None:
    from model import ModelConfig

    if args.layers is not None:
        total = ModelConfig.preset(args.preset).n_layers
        if args.layers > total:
            command.error(f"argument --layers: the {args.preset} preset has {total} layers, got {args.layers}")


def _report(args) -> int:
    from fuse.report import ReportSettings, format_console, run_report

    settings = ReportSettings(
        preset=args.preset, device=args.device, batch=args.batch, steps=args.steps,
        timing_steps=args.timing_steps, seed=args.seed, out_dir=args.out, inspect=not args.no_inspect,
        layers=args.layers,
    )
    result = run_report(settings)
    if result.get("ranks") is None:
        return 0  # under torchrun: rank 0 writes and prints
    if args.results:
        from fuse.report import results_markdown
        from kernels.bench.results import write_section

        write_section(args.results, f"fuse report {args.preset} {args.device.split(':')[0]}", results_markdown(settings.folder()))
    print(format_console(result, result["eager"], result["compiled"]))
    written = "report.json, report.md, launches.png, trace-eager.json, trace-compiled.json" + (", inspect/ (the generated code; start at inspect/index.md)" if result["index_entries"] is not None else "")
    print(f"wrote {written} to {settings.folder()}")
    return 0


def _bench(command: argparse.ArgumentParser, args) -> int:
    from fuse import bench, start_times

    try:
        settings = bench.BenchSettings(
            preset=args.preset, layers=args.layers, contexts=args.contexts, batches=args.batches,
            variants=args.variants or bench.DEFAULT_VARIANTS, steps=args.steps, eager_steps=args.eager_steps,
            repeats=args.repeats, fp32_products=args.fp32_products,
            device=args.device, seed=args.seed, out_dir=args.out, inductor_options=tuple(args.inductor_option),
        )
    except ValueError as error:
        command.error(str(error))
    for flag, given in (("--start-times", args.start_times), ("--compare-precision", args.compare_precision)):
        if given:
            _one_process_only(command, f"argument {flag}: ")
    if args.starts is not None and not args.start_times:
        command.error("argument --starts: only with --start-times")
    if args.starts is not None:
        try:
            start_times.check_starts(args.starts)
        except ValueError as error:
            command.error(f"argument --starts: {error}")
    if args.start_time_child:  # one timed start in this fresh process (see start_times.measure)
        print(json.dumps(start_times.timed_start(settings, args.buckets or start_times.START_BUCKETS, artifact=args.artifact,
                                                 stock=args.stock_start, compile_workers=args.compile_workers)))
        return 0
    from kernels.bench.results import write_section

    def write_start_times(result: dict) -> None:  # after each start: a run cut short keeps the starts it measured
        if args.results:
            some = f" ({','.join(args.starts)})" if args.starts and set(args.starts) != set(start_times.START_KEYS) else ""
            write_section(args.results, f"fuse bench start-times {args.preset}{some}", start_times.to_markdown(result))

    for flag, measure, name in (
        (args.start_times, lambda s: start_times.measure(s, starts=args.starts or start_times.START_KEYS, on_start=write_start_times),
         "start_times.json"),
        (args.compare_precision, bench.compare_precision, "precision.json"),
    ):
        if flag:
            result = measure(settings)
            os.makedirs(settings.out_dir, exist_ok=True)
            with open(os.path.join(settings.out_dir, name), "w") as f:
                json.dump(result, f, indent=2)
            print(json.dumps(result, indent=1))
            return 0
    result = bench.run_bench(settings)
    if result is None:
        return 0  # under torchrun: rank 0 writes and prints
    bench.write_outputs(result, settings.out_dir)
    if args.results:
        # A run with variants beyond the default ones (a comparison) gets a section of its own.
        extra = [v for v in settings.variants if v not in bench.DEFAULT_VARIANTS]
        section = f"fuse bench {args.preset} {result['layers']} layers" + (f" ({', '.join(extra)})" if extra else "")
        write_section(args.results, section, bench.to_markdown(result))
    print(bench.to_markdown(result))
    print(f"wrote bench.json, bench.md, bench.png to {settings.out_dir}")
    return 0


def _one_process_only(command: argparse.ArgumentParser, what: str = "") -> None:
    """Exit status 2 where torchrun started more than one rank: for a command (or option) that
    builds an unsplit model of its own, each rank would run all of it and write the same files."""
    from fuse.ranks import launched_world_size

    ranks = launched_world_size()
    if ranks > 1:
        command.error(f"{what}runs in one process only, and torchrun started {ranks} ranks: run it without torchrun")


def _precompile(command: argparse.ArgumentParser, args) -> int:
    import torch

    from fuse.options import CompileOptions
    from fuse.runner import DecodeRunner
    from model import Decoder, ModelConfig

    _one_process_only(command)
    max_batch = args.max_batch or max(args.buckets)
    if min(args.buckets) > max_batch:
        command.error(f"argument --buckets: no bucket fits --max-batch {max_batch}, got {','.join(map(str, args.buckets))}")
    if os.path.isdir(args.artifact):
        command.error(f"argument --artifact: {args.artifact} is a folder; an artifact is one file")
    try:
        options = CompileOptions(
            buckets=args.buckets, dynamic_batch=not args.static_batch, batch_one_shared=args.batch_one_shared,
            compilation=args.compilation,
            skinny_product_columns=args.skinny_product_columns, mode=args.mode,
            inductor_options=dict(args.inductor_option) or None, cache_dir=args.cache_dir, compile_workers=args.compile_workers,
            artifact=args.artifact, artifact_mode="rebuild" if args.rebuild else "refuse",
        )
    except ValueError as error:
        flag = next((f for name, f in (("inductor_options", "--inductor-option"), ("mode", "--mode")) if name in str(error)), None)
        command.error(f"argument {flag}: {error}" if flag else str(error))
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32"))
    config = ModelConfig.preset(args.preset, layers=args.layers).replace(fp32_products=args.fp32_products)
    decoder = Decoder(config, max_batch=max_batch, max_seq_len=args.max_seq_len, dtype=dtype, device=args.device)
    decoder.init_random(args.seed)
    try:
        runner = DecodeRunner(decoder, options)
    except ValueError as error:  # an artifact at PATH that does not match, or is not one
        print(f"fuse precompile: {str(error).removeprefix('fuse: ')}", file=sys.stderr)
        return 1
    print(runner.describe())
    return 0


def _soak(command: argparse.ArgumentParser, args) -> int:
    from fuse import soak

    _one_process_only(command)
    if args.max_seq_len < 2:
        command.error(f"argument --max-seq-len: expected at least 2, got {args.max_seq_len}")
    settings = soak.SoakSettings(
        preset=args.preset, layers=args.layers, device=args.device, seed=args.seed, steps=args.steps,
        check_every=args.check_every, max_batch=args.max_batch, max_seq_len=args.max_seq_len, out_dir=args.out,
    )
    result = soak.run_soak(settings)
    soak.write_outputs(result, settings.out_dir)
    if args.results:
        from kernels.bench.results import write_section

        write_section(args.results, f"fuse soak {args.preset} {args.device.split(':')[0]}", soak.to_markdown(result))
    print(soak.to_markdown(result))
    print(f"wrote soak.json, soak.md to {settings.out_dir}")
    failures = soak.problems(result)
    if failures:
        print("soak FAILED: " + "; ".join(failures))
    return 1 if failures else 0


def _demo(command: argparse.ArgumentParser, args) -> int:
    from fuse.demo import format_demo, run_demo

    _one_process_only(command)
    stats = run_demo(args.preset, args.batch, args.steps, args.device, args.dtype, args.seed, layers=args.layers)
    print(format_demo(stats))
    return 0 if stats["finite"] else 1


if __name__ == "__main__":
    sys.exit(main())
