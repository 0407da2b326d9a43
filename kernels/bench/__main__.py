"""GPU benchmark of the decode kernels: checks each variant against its reference, then times it.

    python -m kernels.bench [--only sparse_mla,indexer,moe,moe_tiles,linear,router,linears_beside,blockscale,blockscale_plans,hc_sinkhorn,hc_mix,launch_cost]
        [--out FILE]
        [--results docs/results.md] [--sparse-mla-parts main,split,tiles,plan,overlap,stages]

Each section is a module `kernels.bench.<name>` with `run(copy_gbs) -> str` returning markdown;
`--results` writes each into its own section of docs/results.md (kernels/bench/results.py). A
section that fails (a variant off its reference, say) is reported and leaves its results section
as it was; the sections after it still run, and the command then exits naming the failures."""
from __future__ import annotations

import argparse
import datetime
import importlib
import sys
import traceback

import torch

from kernels.bench.results import machine, write_section
from kernels.bench.timing import copy_bandwidth_gbs

SECTIONS = ("sparse_mla", "indexer", "moe", "moe_tiles", "linear", "router", "linears_beside", "blockscale", "blockscale_plans", "hc_sinkhorn",
            "hc_mix", "launch_cost")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kernels.bench", description=__doc__)
    parser.add_argument("--only", default=",".join(SECTIONS), help="comma-separated sections")
    parser.add_argument("--out", default=None, help="also write the markdown results here")
    parser.add_argument("--results", default=None, help="write each section's tables into this results file (docs/results.md)")
    parser.add_argument(
        "--sparse-mla-parts", default="main,split,tiles,plan,overlap,stages",
        help="tables of the sparse_mla section (comma-separated)",
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("kernels.bench needs a CUDA device")
    import triton

    props = torch.cuda.get_device_properties(0)
    copy_gbs = copy_bandwidth_gbs()
    head = (
        f"# Decode kernel benchmark\n\n`python -m kernels.bench {' '.join(argv or sys.argv[1:])}` on "
        f"{props.name} ({props.multi_processor_count} SMs), torch {torch.__version__}, triton {triton.__version__}, "
        f"{datetime.date.today()}. Measured copy bandwidth (read + write): {copy_gbs:.0f} GB/s.\n"
    )
    parts, failed = [head], []
    for name in args.only.split(","):
        section = importlib.import_module(f"kernels.bench.{name}")
        try:
            if name == "sparse_mla":
                parts.append(section.run(copy_gbs, tuple(args.sparse_mla_parts.split(","))))
            else:
                parts.append(section.run(copy_gbs))
        except Exception:  # noqa: BLE001 - reported, and the exit status says so
            traceback.print_exc()
            failed.append(name)
            continue
        print(parts[-1], flush=True)
        if args.results:
            command = f"python -m kernels.bench --only {name}" + (
                f" --sparse-mla-parts {args.sparse_mla_parts}" if name == "sparse_mla" else "")
            write_section(args.results, f"kernels {name}", f"`{command}` on {machine()}; copy bandwidth "
                          f"(read + write) {copy_gbs:.0f} GB/s.\n\n{parts[-1].strip()}")
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n\n".join(parts) + "\n")
    if failed:
        sys.exit(f"kernels.bench: failed: {', '.join(failed)} (their results sections left as they were)")


if __name__ == "__main__":
    main()
