"""Sparse MLA decode: one query token per sequence attends to a gathered set of cache rows.

Semantics (the official V4 decode): K and V are the same 512-wide row; scores are fp32 and
scaled; index -1 is masked; a per-head learned sink adds exp(sink - max) to the softmax
denominator only; probabilities are rounded to the activation dtype before P·V. A row whose
indices are all masked returns zeros, and its LSE is the sink.
"""
from __future__ import annotations

import torch


def sparse_mla_decode_reference(
    q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor, sink: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch reference. q [B,H,D]; kv_cache [S,R,D]; indices [B,K] global rows into
    kv_cache viewed as [S*R, D] (-1 = masked); sink [H] fp32. Returns (out [B,H,D] in q.dtype,
    lse [B,H] fp32 natural log of the denominator including the sink)."""
    rows = kv_cache.reshape(-1, kv_cache.shape[-1])
    valid = indices >= 0
    gathered = rows[indices.clamp(min=0).long()].float()  # [B,K,D]
    scores = torch.einsum("bhd,bkd->bhk", q.float(), gathered) * scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    sink = sink.float()[None, :]
    row_max = torch.maximum(scores.amax(-1), sink)  # finite even when every index is masked
    probs = torch.exp(scores - row_max[..., None])
    denom = probs.sum(-1) + torch.exp(sink - row_max)
    probs = probs.to(q.dtype).float()
    out = torch.einsum("bhk,bkd->bhd", probs, gathered) / denom[..., None]
    return out.to(q.dtype), row_max + torch.log(denom)


# Two ops, one computation. The model calls the functional one: the split-K scratch is allocated
# per call (from the capturing pool inside a CUDA graph). A caller that preallocates the scratch
# per batch bucket passes it to the second, which declares it mutated. Mutable arguments stay out
# of the op the model traces: torch.compiler.nested_compile_region cannot functionalise them.
@torch.library.custom_op("v4::sparse_mla_decode", mutates_args=())
def sparse_mla_decode_op(
    q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor, sink: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """CPU (and any non-CUDA device): the reference."""
    return sparse_mla_decode_reference(q, kv_cache, indices, sink, scale)


@sparse_mla_decode_op.register_kernel("cuda")
def _(q, kv_cache, indices, sink, scale):
    from kernels.sparse_mla_triton import sparse_mla_decode_triton  # triton only where CUDA runs

    return sparse_mla_decode_triton(q, kv_cache, indices, sink, scale)


def _fake_outputs(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # Both implementations return a contiguous out, whatever q's strides.
    return q.new_empty(q.shape), q.new_empty(q.shape[:2], dtype=torch.float32)


@sparse_mla_decode_op.register_fake
def _(q, kv_cache, indices, sink, scale):
    return _fake_outputs(q)


@torch.library.custom_op("v4::sparse_mla_decode_with_workspace", mutates_args=("workspace",))
def sparse_mla_decode_with_workspace_op(
    q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor, sink: torch.Tensor, scale: float, workspace: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`workspace` is split-K scratch for the CUDA kernels (see sparse_mla_workspace); it carries
    no result, and the CPU path does not touch it."""
    return sparse_mla_decode_reference(q, kv_cache, indices, sink, scale)


@sparse_mla_decode_with_workspace_op.register_kernel("cuda")
def _(q, kv_cache, indices, sink, scale, workspace):
    from kernels.sparse_mla_triton import sparse_mla_decode_triton

    return sparse_mla_decode_triton(q, kv_cache, indices, sink, scale, workspace=workspace)


@sparse_mla_decode_with_workspace_op.register_fake
def _(q, kv_cache, indices, sink, scale, workspace):
    return _fake_outputs(q)


def check_sparse_mla_inputs(q, kv_cache, indices, sink) -> None:
    if q.dim() != 3 or kv_cache.dim() != 3 or indices.dim() != 2 or sink.dim() != 1:
        raise ValueError(
            "sparse_mla_decode expects q [B,H,D], kv_cache [S,R,D], indices [B,K], sink [H]; got "
            f"{tuple(q.shape)}, {tuple(kv_cache.shape)}, {tuple(indices.shape)}, {tuple(sink.shape)}"
        )
    if q.shape[-1] != kv_cache.shape[-1] or indices.shape[0] != q.shape[0] or sink.shape[0] != q.shape[1]:
        raise ValueError("sparse_mla_decode: q, kv_cache, indices and sink disagree on B, H or D")
    if indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"sparse_mla_decode: indices must be int32 or int64, got {indices.dtype}")
    if not q.is_floating_point() or not kv_cache.is_floating_point() or not sink.is_floating_point():
        raise ValueError(
            f"sparse_mla_decode: q, kv_cache and sink must be floating point, got {q.dtype}, {kv_cache.dtype}, {sink.dtype}"
        )
    if len({t.device for t in (q, kv_cache, indices, sink)}) != 1:
        raise ValueError(
            "sparse_mla_decode: q, kv_cache, indices and sink must be on one device, got "
            f"{q.device}, {kv_cache.device}, {indices.device}, {sink.device}"
        )


IMPLS = ("default", "reference", "simt", "head_batched", "split_k", "wgmma")


def sparse_mla_workspace(batch: int, heads: int, head_dim: int, topk: int, device, dtype=torch.bfloat16) -> torch.Tensor:
    """Split-K scratch for the CUDA path at these shapes, to allocate per batch bucket before a
    CUDA-graph capture and pass as `workspace` (empty when the plan needs no split). A captured
    graph writes into it on every replay: keep it alive as long as the graph."""
    from kernels.sparse_mla_plan import sparse_mla_workspace as plan_workspace

    return plan_workspace(batch, heads, head_dim, topk, device, dtype)


def sparse_mla_decode(
    q, kv_cache, indices, sink, scale, return_lse: bool = False, *, impl: str = "default", workspace=None
):
    """Attention output [B,H,D] (and the fp32 LSE [B,H] when return_lse). Valid indices must be
    below slots * rows of kv_cache; that is not checked (it would need a device sync).

    impl="default" goes through the custom op (reference on CPU, the default CUDA path on CUDA);
    "reference", "simt", "head_batched", "split_k" and "wgmma" (Hopper only) call that
    implementation directly (for benchmarks and tests). `workspace` (from sparse_mla_workspace)
    lets a CUDA-graph caller preallocate the split-K scratch per batch bucket; without it the
    scratch is allocated per call."""
    check_sparse_mla_inputs(q, kv_cache, indices, sink)
    if impl == "default" and workspace is None:
        out, lse = sparse_mla_decode_op(q, kv_cache, indices, sink, float(scale))
    elif impl == "default":
        out, lse = sparse_mla_decode_with_workspace_op(q, kv_cache, indices, sink, float(scale), workspace)
    elif impl == "reference":
        out, lse = sparse_mla_decode_reference(q, kv_cache, indices, sink, float(scale))
    elif impl in ("simt", "head_batched", "split_k"):
        from kernels import sparse_mla_triton as triton_impl

        if impl == "simt":
            out, lse = triton_impl.sparse_mla_decode_simt(q, kv_cache, indices, sink, scale)
        elif impl == "head_batched":
            out, lse = triton_impl.sparse_mla_decode_head_batched(q, kv_cache, indices, sink, scale)
        else:
            out, lse = triton_impl.sparse_mla_decode_split_k(q, kv_cache, indices, sink, scale, workspace=workspace)
    elif impl == "wgmma":
        from kernels.sparse_mla_gluon import sparse_mla_decode_wgmma

        out, lse = sparse_mla_decode_wgmma(q, kv_cache, indices, sink, scale, workspace=workspace)
    else:
        raise ValueError(f"sparse_mla_decode: impl must be one of {IMPLS}, got {impl!r}")
    return (out, lse) if return_lse else out
