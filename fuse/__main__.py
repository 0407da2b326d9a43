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
    args = parser.parse_args(argv)

    if args.command == "report":
        from fuse.report import ReportSettings, format_console, run_report

        settings = ReportSettings(
            preset=args.preset, device=args.device, batch=args.batch, steps=args.steps,
            timing_steps=args.timing_steps, seed=args.seed, out_dir=args.out, inspect=not args.no_inspect,
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


if __name__ == "__main__":
    sys.exit(main())
