"""mHC split + Sinkhorn: turn each token's (2+hc)*hc hyper-connection mixes into the pre weights,
the post weights and the doubly-stochastic combination matrix.

With hc copies, mixes[b] holds hc pre logits, hc post logits and hc*hc comb logits (row major):
    pre  = sigmoid(m[:hc] * scale[0] + base[:hc]) + eps                          [B, hc]
    post = 2 * sigmoid(m[hc:2hc] * scale[1] + base[hc:2hc])                      [B, hc]
    comb = softmax over each row of (m[2hc:] * scale[2] + base[2hc:]) + eps      [B, hc, hc]
    comb /= column sums + eps, then iters - 1 rounds of: comb /= row sums + eps; comb /= column sums + eps

`torch.ops.v4.hc_split_sinkhorn` runs the plain-torch reference on CPU and one Triton kernel
(kernels/hc_sinkhorn_triton.py) on CUDA. Unfused, every half-iteration is its own kernel (a row
normalisation reads what other threads wrote in the column step before it); the Triton kernel
keeps each matrix in registers through all iterations.
"""
from __future__ import annotations

import torch


def hc_split_sinkhorn_reference(
    mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int, iters: int, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plain-torch fp32 reference. mixes [B, (2+hc)*hc], scale [3], base [(2+hc)*hc], all fp32.
    Returns (pre [B, hc], post [B, hc], comb [B, hc, hc])."""
    pre = torch.sigmoid(mixes[:, :hc] * scale[0] + base[:hc]) + eps
    post = 2 * torch.sigmoid(mixes[:, hc : 2 * hc] * scale[1] + base[hc : 2 * hc])
    logits = (mixes[:, 2 * hc :] * scale[2] + base[2 * hc :]).unflatten(-1, (hc, hc))
    comb = torch.softmax(logits, dim=-1) + eps
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return pre, post, comb


@torch.library.custom_op("v4::hc_split_sinkhorn", mutates_args=())
def hc_split_sinkhorn_op(
    mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int, iters: int, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # Custom-op outputs may not alias inputs or each other: the slices of the reference do not,
    # as every output comes out of an arithmetic op.
    return hc_split_sinkhorn_reference(mixes, scale, base, hc, iters, eps)


@hc_split_sinkhorn_op.register_fake
def _(mixes, scale, base, hc, iters, eps):
    batch = mixes.shape[0]
    return (
        mixes.new_empty((batch, hc), dtype=torch.float32),
        mixes.new_empty((batch, hc), dtype=torch.float32),
        mixes.new_empty((batch, hc, hc), dtype=torch.float32),
    )


@hc_split_sinkhorn_op.register_kernel("cuda")
def _(mixes, scale, base, hc, iters, eps):
    from kernels.hc_sinkhorn_triton import hc_split_sinkhorn_triton  # triton only where the kernel runs

    return hc_split_sinkhorn_triton(mixes, scale, base, hc, iters, eps)


IMPLS = ("auto", "triton", "reference")


def check_hc_inputs(mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int, iters: int) -> None:
    """Raise ValueError naming the first problem with the arguments (shapes only, no host sync)."""
    if hc < 1:
        raise ValueError(f"hc_split_sinkhorn: hc must be >= 1, got {hc}")
    width = (2 + hc) * hc
    if mixes.dim() != 2:
        raise ValueError(f"hc_split_sinkhorn: mixes must be [B, (2+hc)*hc], got shape {tuple(mixes.shape)}")
    if mixes.shape[1] != width:
        raise ValueError(
            f"hc_split_sinkhorn: mixes width {mixes.shape[1]} != (2+hc)*hc = {width} for hc={hc}"
        )
    if tuple(scale.shape) != (3,):
        raise ValueError(f"hc_split_sinkhorn: scale must have shape (3,), got {tuple(scale.shape)}")
    if tuple(base.shape) != (width,):
        raise ValueError(f"hc_split_sinkhorn: base must have shape ({width},), got {tuple(base.shape)}")
    for name, t in (("mixes", mixes), ("scale", scale), ("base", base)):
        if t.dtype != torch.float32:
            raise ValueError(f"hc_split_sinkhorn: {name} dtype must be float32, got {t.dtype}")
    if not (mixes.device == scale.device == base.device):
        raise ValueError(
            f"hc_split_sinkhorn: mixes, scale and base must share a device, got "
            f"{mixes.device}, {scale.device}, {base.device}"
        )
    if iters < 1:
        raise ValueError(f"hc_split_sinkhorn: iters must be >= 1, got {iters}")


def hc_split_sinkhorn(
    mixes: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    hc: int,
    iters: int,
    eps: float,
    impl: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pre [B, hc], post [B, hc], comb [B, hc, hc]) in fp32 (see the module docstring).
    impl: "auto" (the custom op: Triton on CUDA, reference on CPU), "triton" (the Triton path
    directly, e.g. on CPU under TRITON_INTERPRET=1) or "reference"."""
    if impl not in IMPLS:
        raise ValueError(f"hc_split_sinkhorn: impl must be one of {IMPLS}, got {impl!r}")
    hc, iters, eps = int(hc), int(iters), float(eps)
    check_hc_inputs(mixes, scale, base, hc, iters)
    if impl == "triton":
        from kernels.hc_sinkhorn_triton import hc_split_sinkhorn_triton

        return hc_split_sinkhorn_triton(mixes, scale, base, hc, iters, eps)
    if impl == "reference":
        return hc_split_sinkhorn_reference(mixes, scale, base, hc, iters, eps)
    return hc_split_sinkhorn_op(mixes, scale, base, hc, iters, eps)
