"""GPU sweep of the block-scaled FP8 product's launch plans (kernels/blockscale/triton.py `Plan`) at
V4-Flash's FP8 shapes and batches 1, 16 and 64: the plan `plan_launch` picks against column tiles,
warps, stages, the product (fp16 dot, e4m3 dot, or the Gluon mma product of
kernels/blockscale/gluon.py with its token and column tiles, programs per SM and blocks loaded ahead) and where the activations
are quantised (in every program or by the pre-pass), K split as `plan_launch` would for the tile
count. Every plan is checked against the reference first (a plan that fails to compile or to
match is listed, not timed); times are chained as in kernels/bench/blockscale.py. What the
default should become is read off this table."""
from __future__ import annotations

import itertools
from dataclasses import replace

import torch

from kernels.bench.blockscale import SHAPES, relative_error
from kernels.bench.tables import markdown_table
from kernels.bench.timing import chained_time_us, rotation_count
from kernels.blockscale import blockscale_linear_reference, quantize_fp8_weight
from kernels.blockscale import gluon
from kernels.blockscale.triton import PRODUCTS, Plan, blockscale_linear_triton, plan_launch, split_where_idle
from kernels.triton_util import converts_e4m3, num_sms

BATCHES = (1, 16, 64)
TOLERANCE = 8e-3  # as kernels/bench/blockscale.py; the e4m3 dot adds its groups with fewer bits
SHOWN = 3  # best plans listed per shape and batch


def candidate_plans(batch: int, n: int, k: int, sms: int) -> dict[str, Plan]:
    """The default and the swept plans, by a short name."""
    default = plan_launch(batch, n, k, sms, e4m3=converts_e4m3(torch.device("cuda")))
    plans = {"default": default}
    quantised = (False, True) if batch <= 16 else (True,)
    for block_n, warps, stages, product, pre in itertools.product((32, 64, 128), (4, 8), (2, 4), PRODUCTS, quantised):
        plan = replace(default, block_n=block_n, num_warps=warps, num_stages=stages, product=product, x_quantized=pre)
        plan = split_where_idle(plan, batch, n, k, sms)
        plans[describe(plan)] = plan
    mma = gluon.plan_mma(batch, n, k, sms)
    for block_n, block_m, per_sm, pre, ahead in itertools.product(gluon.COLUMN_TILES, gluon.TOKEN_TILES, (1, 2), quantised, (1, 2)):
        if n % block_n or (block_m > max(batch, gluon.TOKEN_TILES[0]) and block_m != mma.block_m):
            continue  # no tile wider than the rows but the default's
        plan = replace(mma, block_n=block_n, block_m=block_m, x_quantized=pre, blocks_per_step=ahead)
        plan = split_where_idle(plan, batch, n, k, sms, per_sm, gluon.MIN_BLOCKS_PER_SPLIT)
        plans[describe(plan)] = plan
    return plans


def run_plan(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, plan: Plan) -> torch.Tensor:
    product = gluon.blockscale_linear_mma if plan.product == "mma" else blockscale_linear_triton
    return product(x, q, scale, True, plan)


def describe(plan: Plan) -> str:
    quant = "pre-pass" if plan.x_quantized else "in-kernel"
    launch = f" {plan.blocks_per_step} ahead" if plan.product == "mma" else f" w{plan.num_warps} s{plan.num_stages}"
    return f"{plan.block_m}x{plan.block_n} {plan.product}{launch} x {quant} split {plan.split}"


def run(copy_gbs: float) -> str:
    sms = num_sms(torch.device("cuda"))
    rows, failed = [], []
    for label, (n, k) in SHAPES.items():
        weights = [quantize_fp8_weight(torch.randn(n, k, device="cuda") * k**-0.5) for _ in range(rotation_count(n * k))]
        scale_bytes = weights[0][1].numel()
        for batch in BATCHES:
            args = [(torch.randn(batch, k, device="cuda").to(torch.bfloat16), q, s) for q, s in weights]
            expected = blockscale_linear_reference(*args[0])
            nbytes = n * k + scale_bytes + batch * (k + n) * 2
            timed = []
            for name, plan in candidate_plans(batch, n, k, sms).items():
                call = lambda x, q, s, plan=plan: run_plan(x, q, s, plan)  # noqa: E731
                try:
                    err = relative_error(call(*args[0]), expected)
                    if err > TOLERANCE:
                        raise AssertionError(f"relative error {err:.1e}")
                    us = chained_time_us(call, args)
                except Exception as error:  # noqa: BLE001 - listed below, the sweep goes on
                    failed.append(f"{label} B={batch} {name}: {type(error).__name__}: {str(error).splitlines()[0][:120]}")
                    continue
                timed.append((us, describe(plan), name == "default"))
            timed.sort()
            default = next(((us, name) for us, name, is_default in timed if is_default), (float("nan"), "-"))
            share = lambda us: f"{us:.1f} ({100 * nbytes / us / 1e3 / copy_gbs:.0f}%)"  # noqa: E731
            rows.append([label, f"{n} x {k}", batch, default[1], share(default[0])]
                        + [f"{name}: {share(us)}" for us, name, _ in timed[:SHOWN]])
    header = ["projection", "N x K", "B", "default plan", "default us (% copy)"] + [f"best {i + 1}: us (% copy)" for i in range(SHOWN)]
    text = (
        "## Block-scaled FP8 product: launch plans swept\n\n"
        "Plans: rows x columns a program, the product (fp16: fp16 tensor-core dot; e4m3: e4m3 tensor-core dot; "
        "mma: the Gluon product), warps, pipeline stages, where the activations are quantised, K split. Chained times "
        f"as in the main table; each plan matched the reference within {TOLERANCE:g} of the output scale first.\n\n"
        + markdown_table(header, rows) + "\n"
    )
    if failed:
        text += "\nPlans that did not compile or match:\n\n" + "\n".join(f"- {line}" for line in failed) + "\n"
    return text
