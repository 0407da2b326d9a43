"""Command-line interface: `python -m fuse <command>` (also installed as `fuse`)."""
from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fuse", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="short eager decode run: tokens/s and logits statistics")
    demo.add_argument("--preset", default="tiny", choices=["tiny", "bench", "flash"])
    demo.add_argument("--batch", type=int, default=4)
    demo.add_argument("--steps", type=int, default=32)
    demo.add_argument("--device", default="cpu")
    demo.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    demo.add_argument("--seed", type=int, default=0)
    report = commands.add_parser("report", help="the main job: compile, check against eager, count kernels, write a report")
    report.add_argument("--preset", default="tiny", choices=["tiny", "bench", "flash"])
    report.add_argument("--device", default="cpu")
    report.add_argument("--batch", type=int, default=4)
    report.add_argument("--steps", type=int, default=4, help="decode steps checked against eager")
    report.add_argument("--timing-steps", type=int, default=5)
    report.add_argument("--seed", type=int, default=0)
    report.add_argument("--out", default=None, help="output folder (default fuse-out/report-<preset>-<device>)")
    report.add_argument("--no-inspect", action="store_true", help="skip the depyf dump of the generated code")
    report.add_argument("--layers", type=int, default=None, help="use the first N layers of the preset (default: all)")
    bench = commands.add_parser("bench", help="GPU: eager, eager in CUDA graphs, reduce-overhead and compile_decode, side by side")
    bench.add_argument("--preset", default="bench", choices=["tiny", "bench", "flash"])
    bench.add_argument("--layers", type=int, default=None, help="use the first N layers of the preset (default: all)")
    bench.add_argument("--contexts", type=_ints, default=(4096, 32768))
    bench.add_argument("--batches", type=_ints, default=(1, 16, 32, 64))
    bench.add_argument("--variants", type=lambda s: tuple(s.split(",")), default=None, help="comma list of eager, eager-graphs, reduce-overhead, fuse, fuse-static, fuse-nested, fuse-regional (default: the first four)")
    bench.add_argument("--steps", type=int, default=10)
    bench.add_argument("--eager-steps", type=int, default=4)
    bench.add_argument("--repeats", type=int, default=5)
    bench.add_argument("--fp32-products", default="exact", choices=["exact", "fast"])
    bench.add_argument("--start-times", action="store_true", help="only: cold and warm start of compile_decode for 7 buckets, each in a new process")
    bench.add_argument("--compare-precision", action="store_true", help="only: fp32 products fast vs exact under compile_decode")
    bench.add_argument("--device", default="cuda")
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--out", default="fuse-out/bench")
    bench.add_argument(
        "--inductor-option", action="append", type=_inductor_option, default=[], metavar="KEY=VALUE",
        help="an Inductor config patch for the compile_decode variant, e.g. combo_kernels=True (repeatable)",
    )
    bench.add_argument("--start-time-child", action="store_true", help=argparse.SUPPRESS)
    bench.add_argument("--buckets", type=_ints, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.command == "bench":
        return _bench(args)

    if args.command == "report":
        from fuse.report import ReportSettings, format_console, run_report

        settings = ReportSettings(
            preset=args.preset, device=args.device, batch=args.batch, steps=args.steps,
            timing_steps=args.timing_steps, seed=args.seed, out_dir=args.out, inspect=not args.no_inspect,
            layers=args.layers,
        )
        result = run_report(settings)
        print(format_console(result, result["eager"], result["compiled"]))
        print(f"wrote report.json, report.md, launches.png to {settings.folder()}")
        return 0

    if args.command == "demo":
        from fuse.demo import format_demo, run_demo

        stats = run_demo(args.preset, args.batch, args.steps, args.device, args.dtype, args.seed)
        print(format_demo(stats))
        return 0 if stats["finite"] else 1
    return 2


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(t) for t in text.split(","))


def _inductor_option(text: str) -> tuple[str, object]:
    """KEY=VALUE with VALUE a Python literal (True, 4, 'name'); anything else is taken as a string."""
    import ast

    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key, value


def _bench(args) -> int:
    import json
    import os

    from fuse import bench

    settings = bench.BenchSettings(
        preset=args.preset, layers=args.layers, contexts=args.contexts, batches=args.batches,
        variants=args.variants or bench.DEFAULT_VARIANTS, steps=args.steps, eager_steps=args.eager_steps,
        repeats=args.repeats, fp32_products=args.fp32_products,
        device=args.device, seed=args.seed, out_dir=args.out, inductor_options=tuple(args.inductor_option),
    )
    if args.start_time_child:  # one timed start in this fresh process (see bench.measure_start_times)
        print(json.dumps(bench.start_time_child(settings, args.buckets or bench.START_BUCKETS)))
        return 0
    for flag, measure, name in (
        (args.start_times, bench.measure_start_times, "start_times.json"),
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
    bench.write_outputs(result, settings.out_dir)
    print(bench.to_markdown(result))
    print(f"wrote bench.json, bench.md, bench.png to {settings.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
