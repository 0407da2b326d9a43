"""The mHC boundary ops (semantics: kernels/hc_mix/ref.py).

`v4::hc_pre_norm` is the boundary without the write-back (a block's first sublayer reads the
copies as they came in), `v4::hc_post_pre_norm` the whole of it. At decode batch sizes each is a
chain of latency-bound steps (a 1.5 MB fp32 GEMV with 24 outputs, a 20-round Sinkhorn on a 4x4
matrix per token, a weighted sum and a norm) that Inductor writes as 4-5 kernels with a skinny
reduction that occupies a few SMs. On CUDA (hc = 4) the op is Triton (kernels/hc_mix/triton.py):
every program of a first kernel owns a slice of the flattened copies, writes the new copies there
and sums its slice's share of the 24 mixes and of the mean square; per token the slices are then
added and the Sinkhorn rounds, the weighted sum and the norm run, by the token's last slice to
arrive (small batches: one launch) or by a second kernel. The CPU and other shapes run the
plain-torch reference.
"""
from __future__ import annotations

import torch

from kernels.hc_mix.ref import (
    KERNEL_HC,
    check_hc_mix_inputs,
    hc_post_pre_norm_reference,
    hc_pre_norm_reference,
    tiles,
)
from kernels.impl import COMMON_IMPLS, check_impl

IMPLS = COMMON_IMPLS


def takes_kernel(streams: torch.Tensor, fn: torch.Tensor) -> bool:
    """Whether the boundary runs the Triton kernels: CUDA, hc = 4 and a width the first kernel's
    slices tile. Depends on shapes other than the batch, so a symbolic-batch graph gets no guard."""
    return (
        streams.is_cuda and streams.shape[1] == KERNEL_HC and tiles(streams.shape[2])
        and streams.stride(-1) == 1 and fn.stride(-1) == 1
    )


@torch.library.custom_op("v4::hc_pre_norm", mutates_args=())
def hc_pre_norm_op(
    streams: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, norm_weight: torch.Tensor,
    iters: int, hc_eps: float, hc_norm_eps: float, norm_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return hc_pre_norm_reference(streams, fn, scale, base, norm_weight, iters, hc_eps, hc_norm_eps, norm_eps)


@hc_pre_norm_op.register_fake
def _(streams, fn, scale, base, norm_weight, iters, hc_eps, hc_norm_eps, norm_eps):
    batch, hc, dim = streams.shape
    return (
        streams.new_empty((batch, dim)),
        streams.new_empty((batch, hc), dtype=torch.float32),
        streams.new_empty((batch, hc, hc), dtype=torch.float32),
    )


@hc_pre_norm_op.register_kernel("cuda")
def _(streams, fn, scale, base, norm_weight, iters, hc_eps, hc_norm_eps, norm_eps):
    if not takes_kernel(streams, fn):
        return hc_pre_norm_reference(streams, fn, scale, base, norm_weight, iters, hc_eps, hc_norm_eps, norm_eps)
    from kernels.hc_mix.triton import hc_mix_triton

    _, *rest = hc_mix_triton(streams, fn, scale, base, norm_weight, iters, hc_eps, hc_norm_eps, norm_eps)
    return tuple(rest)


@torch.library.custom_op("v4::hc_post_pre_norm", mutates_args=())
def hc_post_pre_norm_op(
    out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
    fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, norm_weight: torch.Tensor,
    iters: int, hc_eps: float, hc_norm_eps: float, norm_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return hc_post_pre_norm_reference(out, streams, post, comb, fn, scale, base, norm_weight, iters, hc_eps, hc_norm_eps, norm_eps)


@hc_post_pre_norm_op.register_fake
def _(out, streams, post, comb, fn, scale, base, norm_weight, iters, hc_eps, hc_norm_eps, norm_eps):
    batch, hc, dim = streams.shape
    return (
        streams.new_empty((batch, hc, dim)),
        streams.new_empty((batch, dim)),
        streams.new_empty((batch, hc), dtype=torch.float32),
        streams.new_empty((batch, hc, hc), dtype=torch.float32),
    )


@hc_post_pre_norm_op.register_kernel("cuda")
def _(out, streams, post, comb, fn, scale, base, norm_weight, iters, hc_eps, hc_norm_eps, norm_eps):
    if not takes_kernel(streams, fn) or out.stride(-1) != 1:
        return hc_post_pre_norm_reference(out, streams, post, comb, fn, scale, base, norm_weight, iters, hc_eps, hc_norm_eps, norm_eps)
    from kernels.hc_mix.triton import hc_mix_triton

    return hc_mix_triton(streams, fn, scale, base, norm_weight, iters, hc_eps, hc_norm_eps, norm_eps, out=out, post=post, comb=comb)


def hc_pre_norm(
    streams: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, norm_weight: torch.Tensor,
    iters: int, hc_eps: float, hc_norm_eps: float, norm_eps: float, impl: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The boundary without the write-back (kernels/hc_mix/ref.py): (normed x [B, D], post [B, hc], comb [B, hc, hc]).
    impl: "auto" (the custom op: Triton on CUDA where `takes_kernel`, else the reference),
    "triton" (the Triton path directly, e.g. under TRITON_INTERPRET=1) or "reference"."""
    check_impl("hc_pre_norm", impl, IMPLS)
    check_hc_mix_inputs(streams, fn, scale, base, norm_weight, iters)
    args = (streams, fn, scale, base, norm_weight, int(iters), float(hc_eps), float(hc_norm_eps), float(norm_eps))
    if impl == "triton":
        from kernels.hc_mix.triton import hc_mix_triton

        return hc_mix_triton(*args)[1:]
    if impl == "reference":
        return hc_pre_norm_reference(*args)
    return hc_pre_norm_op(*args)


def hc_post_pre_norm(
    out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
    fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, norm_weight: torch.Tensor,
    iters: int, hc_eps: float, hc_norm_eps: float, norm_eps: float, impl: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The whole boundary (kernels/hc_mix/ref.py): (new streams [B, hc, D], normed x [B, D], post [B, hc],
    comb [B, hc, hc]). impl as for `hc_pre_norm`."""
    check_impl("hc_post_pre_norm", impl, IMPLS)
    check_hc_mix_inputs(streams, fn, scale, base, norm_weight, iters, out, post, comb)
    rest = (fn, scale, base, norm_weight, int(iters), float(hc_eps), float(hc_norm_eps), float(norm_eps))
    if impl == "triton":
        from kernels.hc_mix.triton import hc_mix_triton

        return hc_mix_triton(streams, *rest, out=out, post=post, comb=comb)
    if impl == "reference":
        return hc_post_pre_norm_reference(out, streams, post, comb, *rest)
    return hc_post_pre_norm_op(out, streams, post, comb, *rest)
