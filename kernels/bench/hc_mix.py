"""GPU benchmark of the mHC boundary ops (kernels/hc_mix/) at V4 widths (hc=4, D=4096, bf16
copies, fp32 fn): `v4::hc_post_pre_norm` and `v4::hc_pre_norm` against the same math in plain
torch compiled by Inductor (what the model's blocks ran before: hc_post, hc_pre with the Sinkhorn
op, the RMSNorm).

One CUDA graph per rotating input set (each set its own fn, as each layer has its own), and one
graph calling every set in turn (chained: per call, as a step runs them); the calls are
latency-bound, so the time is what a decode step pays per boundary. Every path is
checked against the plain-torch reference first. 'one launch' / 'two launches': the op with the
slices' last arrival finishing each token, or with the second kernel (the op picks by batch:
kernels/hc_mix/triton.py ONE_LAUNCH_MAX_BATCH)."""
from __future__ import annotations

import torch

from kernels.bench.tables import markdown_table
from kernels.bench.timing import chained_time_us, graph_time_us, rotation_count
from kernels.hc_mix.ref import hc_post_pre_norm_reference, hc_post_reference, hc_pre_norm_reference
from kernels.hc_mix.triton import hc_mix_triton
import kernels.hc_sinkhorn  # noqa: F401 (registers v4::hc_split_sinkhorn, which the composition calls)

HC, DIM, ITERS, EPS = 4, 4096, 20, 1e-6
BATCHES = (1, 2, 4, 16, 64)
TOLERANCE = 2e-2  # relative, on every output: bf16 copies and normed inputs, fp32 post and comb


def _inputs(batch: int) -> tuple:
    copies = lambda *shape: torch.randn(*shape, device="cuda").to(torch.bfloat16)  # noqa: E731
    return (
        copies(batch, DIM), copies(batch, HC, DIM), 2 * torch.rand(batch, HC, device="cuda"),
        torch.softmax(torch.randn(batch, HC, HC, device="cuda"), -1),
        torch.randn((2 + HC) * HC, HC * DIM, device="cuda") / DIM**0.5, 0.5 + torch.rand(3, device="cuda"),
        0.5 * torch.randn((2 + HC) * HC, device="cuda"), 0.5 + torch.rand(DIM, device="cuda"),
    )


def _composition(out, streams, post, comb, fn, scale, base, weight):
    """The boundary as the model wrote it before the op, for Inductor to fuse (Sinkhorn as the
    plain function, which Inductor compiles into its own kernels)."""
    new = hc_post_reference(out, streams, post, comb)
    return (new, *_pre_composition(new, fn, scale, base, weight))


def _pre_composition(streams, fn, scale, base, weight):
    flat = streams.flatten(1).float()
    mixes = torch.nn.functional.linear(flat, fn) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + EPS)
    pre, post, comb = torch.ops.v4.hc_split_sinkhorn(mixes, scale, base, HC, ITERS, EPS)
    x = (pre.unsqueeze(-1) * flat.view(streams.shape)).sum(1).to(streams.dtype).float()
    x = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + EPS)
    return (weight * x).to(streams.dtype), post, comb


def _op(write_back: bool, one_launch: bool | None = None):
    def call(out, streams, post, comb, fn, scale, base, weight):
        extra = dict(out=out, post=post, comb=comb) if write_back else {}
        result = hc_mix_triton(streams, fn, scale, base, weight, ITERS, EPS, EPS, EPS, **extra, one_launch=one_launch)
        return result if write_back else result[1:]
    return call


def _check(label: str, got, want) -> None:
    for g, w in zip(got, want):
        err = ((g.float() - w.float()).norm() / w.float().norm()).item()
        if err > TOLERANCE:
            raise AssertionError(f"hc_mix {label}: relative error {err:.2e}")


def run(copy_gbs: float) -> str:
    del copy_gbs  # kilobytes per call: latency, not bandwidth
    inductor = torch.compile(_composition, fullgraph=True, dynamic=False)
    inductor_pre = torch.compile(
        lambda out, streams, post, comb, fn, scale, base, weight: _pre_composition(streams, fn, scale, base, weight),
        fullgraph=True, dynamic=False,
    )
    paths = [
        ("post + pre, Inductor", inductor, True),
        ("post + pre, op", _op(True), True),
        ("post + pre, op one launch", _op(True, one_launch=True), True),
        ("post + pre, op two launches", _op(True, one_launch=False), True),
        ("pre, Inductor", inductor_pre, False),
        ("pre, op", _op(False), False),
    ]
    rows, chained_rows = [], []
    for batch in BATCHES:
        first = _inputs(batch)
        sets = [first] + [_inputs(batch) for _ in range(rotation_count(first[4].nbytes) - 1)]
        want_post = hc_post_pre_norm_reference(*first[:4], *first[4:], ITERS, EPS, EPS, EPS)
        want_pre = hc_pre_norm_reference(first[1], *first[4:], ITERS, EPS, EPS, EPS)
        times, chained = [], []
        for label, fn, write_back in paths:
            _check(f"B={batch} {label}", fn(*first), want_post if write_back else want_pre)
            times.append(graph_time_us(fn, sets))
            chained.append(chained_time_us(fn, sets))
        rows.append([batch] + [f"{t:.1f}" for t in times])
        chained_rows.append([batch] + [f"{t:.1f}" for t in chained])
    return (
        f"## mHC boundary ops (hc={HC}, D={DIM}, {ITERS} Sinkhorn iterations)\n\n"
        "us per call: one CUDA graph per rotating input set, median over sets and replays; every "
        "path matched the plain-torch reference first.\n\n"
        + markdown_table(["B"] + [label + " us" for label, _, _ in paths], rows) + "\n\n"
        "Chained: one CUDA graph calling the path on every input set in turn, time per call (no graph "
        "launch per call, as boundaries run in a step).\n\n"
        + markdown_table(["B"] + [label + " us" for label, _, _ in paths], chained_rows) + "\n"
    )
