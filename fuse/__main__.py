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
    args = parser.parse_args(argv)

    if args.command == "demo":
        from fuse.demo import format_demo, run_demo

        stats = run_demo(args.preset, args.batch, args.steps, args.device, args.dtype, args.seed)
        print(format_demo(stats))
        return 0 if stats["finite"] else 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
