"""The mHC boundary between two sublayers as one op: write the finished sublayer's output back into
the hc residual copies (hc_post), mix the copies into the next sublayer's input (hc_pre: the
normalised mixes GEMV, split + Sinkhorn, the pre-weighted sum) and apply that sublayer's RMSNorm.

    new copy j   = post_j * out + sum_i comb[i, j] * copy_i                  (fp32, stored in the copies' dtype)
    mixes        = (flat copies @ fn^T) * rsqrt(mean(flat copies^2) + hc_norm_eps)
    pre, post', comb' = hc_split_sinkhorn(mixes, scale, base, hc, iters, hc_eps)
    x            = sum_h pre_h * copy_h                                      (rounded to the copies' dtype)
    normed x     = norm_weight * x * rsqrt(mean(x^2) + norm_eps)             (in the copies' dtype)

`v4::hc_pre_norm` is the boundary without the write-back (a block's first sublayer reads the
copies as they came in), `v4::hc_post_pre_norm` the whole of it. At decode batch sizes each is a
chain of latency-bound steps (a 1.5 MB fp32 GEMV with 24 outputs, a 20-round Sinkhorn on a 4x4
matrix per token, a weighted sum and a norm) that Inductor writes as 4-5 kernels with a skinny
reduction that occupies a few SMs. On CUDA (hc = 4) the op is two Triton kernels
(kernels/hc_mix_triton.py): every program of the first owns a slice of the flattened copies, writes
the new copies there and sums its slice's share of the 24 mixes and of the mean square; the second
adds the slices per token and runs the Sinkhorn rounds, the weighted sum and the norm. The CPU and
other shapes run the plain-torch reference.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.hc_sinkhorn.ref import hc_split_sinkhorn_reference

IMPLS = ("auto", "triton", "reference")
# The Triton path's Sinkhorn is written out for the model's hc; its first kernel takes the
# flattened copies in slices of SLICE values.
KERNEL_HC = 4
SLICE = 256


def hc_post_reference(out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """The write-back: new copy j = post_j * out + sum_i comb[i, j] * copy_i (fp32 math, the
    copies' dtype as result); also the model's hc_post."""
    mixed = torch.einsum("bij,bid->bjd", comb, streams.float())
    return (post.unsqueeze(-1) * out.float().unsqueeze(1) + mixed).to(streams.dtype)


def hc_pre_norm_reference(
    streams: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, norm_weight: torch.Tensor,
    iters: int, hc_eps: float, hc_norm_eps: float, norm_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """streams [B, hc, D] -> (normed sublayer input [B, D] in the streams' dtype, post [B, hc], comb [B, hc, hc])."""
    hc = streams.shape[1]
    flat = streams.flatten(1).float()
    inv_rms = torch.rsqrt(flat.square().mean(-1, keepdim=True) + hc_norm_eps)
    mixes = F.linear(flat.to(fn.dtype), fn).float() * inv_rms
    pre, post, comb = hc_split_sinkhorn_reference(mixes, scale, base, hc, iters, hc_eps)
    x = (pre.unsqueeze(-1) * flat.view(streams.shape)).sum(1).to(streams.dtype).float()
    x = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + norm_eps)
    return (norm_weight * x).to(streams.dtype), post, comb


def hc_post_pre_norm_reference(
    out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
    fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, norm_weight: torch.Tensor,
    iters: int, hc_eps: float, hc_norm_eps: float, norm_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (new streams [B, hc, D], normed next sublayer input [B, D], its post [B, hc], its comb [B, hc, hc])."""
    new = hc_post_reference(out, streams, post, comb)
    return (new, *hc_pre_norm_reference(new, fn, scale, base, norm_weight, iters, hc_eps, hc_norm_eps, norm_eps))


def check_hc_mix_inputs(streams, fn, scale, base, norm_weight, out=None, post=None, comb=None) -> None:
    """Raise ValueError naming the first argument whose shape, dtype or device does not fit (no host sync)."""
    if streams.dim() != 3:
        raise ValueError(f"hc_mix: streams must be [B, hc, D], got shape {tuple(streams.shape)}")
    batch, hc, dim = streams.shape
    width = (2 + hc) * hc
    expected = {"fn": (width, hc * dim), "scale": (3,), "base": (width,), "norm_weight": (dim,)}
    if out is not None:
        expected |= {"out": (batch, dim), "post": (batch, hc), "comb": (batch, hc, hc)}
    given = {"fn": fn, "scale": scale, "base": base, "norm_weight": norm_weight, "out": out, "post": post, "comb": comb}
    for name, shape in expected.items():
        if tuple(given[name].shape) != shape:
            raise ValueError(f"hc_mix: {name} must have shape {shape} for streams of shape {tuple(streams.shape)}, got {tuple(given[name].shape)}")
        if given[name].device != streams.device:
            raise ValueError(f"hc_mix: {name} is on {given[name].device}, streams on {streams.device}")
    for name in ("scale", "base", "norm_weight", "post", "comb"):
        if name in expected and given[name].dtype != torch.float32:
            raise ValueError(f"hc_mix: {name} must be float32, got {given[name].dtype}")
    if out is not None and out.dtype != streams.dtype:
        raise ValueError(f"hc_mix: out and streams must have one dtype, got {out.dtype} and {streams.dtype}")


def tiles(dim: int) -> bool:
    """Whether copies of width `dim` split into whole slices, a power of two of them (so `dim`
    itself is a power of two)."""
    slices = KERNEL_HC * dim // SLICE
    return dim % SLICE == 0 and slices & (slices - 1) == 0


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
    from kernels.hc_mix_triton import hc_mix_triton

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
    from kernels.hc_mix_triton import hc_mix_triton

    return hc_mix_triton(streams, fn, scale, base, norm_weight, iters, hc_eps, hc_norm_eps, norm_eps, out=out, post=post, comb=comb)


def _check_impl(impl: str, iters: int) -> None:
    if impl not in IMPLS:
        raise ValueError(f"hc_mix: impl must be one of {IMPLS}, got {impl!r}")
    if iters < 1:
        raise ValueError(f"hc_mix: iters must be >= 1, got {iters}")


def hc_pre_norm(
    streams: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, norm_weight: torch.Tensor,
    iters: int, hc_eps: float, hc_norm_eps: float, norm_eps: float, impl: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The boundary without the write-back (module docstring): (normed x [B, D], post [B, hc], comb [B, hc, hc]).
    impl: "auto" (the custom op: Triton on CUDA where `takes_kernel`, else the reference),
    "triton" (the Triton path directly, e.g. under TRITON_INTERPRET=1) or "reference"."""
    _check_impl(impl, iters)
    check_hc_mix_inputs(streams, fn, scale, base, norm_weight)
    args = (streams, fn, scale, base, norm_weight, int(iters), float(hc_eps), float(hc_norm_eps), float(norm_eps))
    if impl == "triton":
        from kernels.hc_mix_triton import hc_mix_triton

        return hc_mix_triton(*args)[1:]
    if impl == "reference":
        return hc_pre_norm_reference(*args)
    return hc_pre_norm_op(*args)


def hc_post_pre_norm(
    out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
    fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, norm_weight: torch.Tensor,
    iters: int, hc_eps: float, hc_norm_eps: float, norm_eps: float, impl: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The whole boundary (module docstring): (new streams [B, hc, D], normed x [B, D], post [B, hc],
    comb [B, hc, hc]). impl as for `hc_pre_norm`."""
    _check_impl(impl, iters)
    check_hc_mix_inputs(streams, fn, scale, base, norm_weight, out, post, comb)
    rest = (fn, scale, base, norm_weight, int(iters), float(hc_eps), float(hc_norm_eps), float(norm_eps))
    if impl == "triton":
        from kernels.hc_mix_triton import hc_mix_triton

        return hc_mix_triton(streams, *rest, out=out, post=post, comb=comb)
    if impl == "reference":
        return hc_post_pre_norm_reference(out, streams, post, comb, *rest)
    return hc_post_pre_norm_op(out, streams, post, comb, *rest)
