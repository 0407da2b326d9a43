"""Sparse MLA decode as custom ops (semantics: kernels/sparse_mla/ref.py) and the choice of
implementation.

On CUDA the op runs, on a Hopper GPU with enough 64-head blocks to fill it (plan.wgmma_splits),
the Gluon wgmma kernel (gluon.py), and otherwise the Triton plan (triton.py): tiles and split
count from the shapes and the SM count, so one CUDA-graph capture per batch bucket stays valid.
The CPU runs the plain-torch reference.
"""
from __future__ import annotations

import torch

from kernels.impl import COMMON_IMPLS, check_impl
from kernels.sparse_mla.ref import check_sparse_mla_inputs, sparse_mla_decode_reference


def sparse_mla_decode_cuda(q, kv_cache, indices, sink, scale, workspace=None):
    """The CUDA path: on Hopper at large batches (plan.wgmma_splits) the Gluon wgmma kernel with
    its split count, otherwise the Triton plan. Returns (out, lse)."""
    from kernels.sparse_mla.plan import WGMMA_BLOCK_N, WGMMA_STAGES, device_capability, wgmma_splits
    from kernels.triton_util import num_sms  # triton only where CUDA runs

    batch, heads, head_dim = q.shape
    wgmma = wgmma_splits(
        batch, heads, indices.shape[1], num_sms(q.device), head_dim, q.element_size(), device_capability(q.device)
    )
    if wgmma is not None and q.stride(2) == 1 and kv_cache.stride(2) == 1:
        from kernels.sparse_mla.gluon import sparse_mla_decode_wgmma  # Gluon only where it runs

        return sparse_mla_decode_wgmma(
            q, kv_cache, indices, sink, scale, wgmma, workspace, block_n=WGMMA_BLOCK_N, stages=WGMMA_STAGES
        )
    from kernels.sparse_mla.triton import sparse_mla_decode_triton

    return sparse_mla_decode_triton(q, kv_cache, indices, sink, scale, workspace)


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
    return sparse_mla_decode_cuda(q, kv_cache, indices, sink, scale)


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
    return sparse_mla_decode_cuda(q, kv_cache, indices, sink, scale, workspace)


@sparse_mla_decode_with_workspace_op.register_fake
def _(q, kv_cache, indices, sink, scale, workspace):
    return _fake_outputs(q)


IMPLS = COMMON_IMPLS + ("simt", "head_batched", "split_k", "wgmma")


def sparse_mla_workspace(batch: int, heads: int, head_dim: int, topk: int, device, dtype=torch.bfloat16) -> torch.Tensor:
    """Split-K scratch for the CUDA path at these shapes, to allocate per batch bucket before a
    CUDA-graph capture and pass as `workspace` (empty when the plan needs no split). A captured
    graph writes into it on every replay: keep it alive as long as the graph."""
    from kernels.sparse_mla.plan import sparse_mla_workspace as plan_workspace

    return plan_workspace(batch, heads, head_dim, topk, device, dtype)


def sparse_mla_decode(
    q, kv_cache, indices, sink, scale, return_lse: bool = False, *, impl: str = "auto", workspace=None
):
    """Attention output [B,H,D] (and the fp32 LSE [B,H] when return_lse). Valid indices must be
    below slots * rows of kv_cache; that is not checked (it would need a device sync).

    impl: "auto" (the custom op: the reference on CPU, the CUDA path of sparse_mla_decode_cuda on
    CUDA), "reference", "triton" (the Triton plan, also under TRITON_INTERPRET=1), or one kernel
    directly: "simt", "head_batched", "split_k" or "wgmma" (Hopper only). `workspace` (from
    sparse_mla_workspace) lets a CUDA-graph caller preallocate the split-K scratch per batch
    bucket; without it the scratch is allocated per call."""
    check_impl("sparse_mla_decode", impl, IMPLS)
    check_sparse_mla_inputs(q, kv_cache, indices, sink)
    if impl == "auto":
        if workspace is None:
            out, lse = sparse_mla_decode_op(q, kv_cache, indices, sink, float(scale))
        else:
            out, lse = sparse_mla_decode_with_workspace_op(q, kv_cache, indices, sink, float(scale), workspace)
    elif impl == "reference":
        out, lse = sparse_mla_decode_reference(q, kv_cache, indices, sink, float(scale))
    elif impl == "wgmma":
        from kernels.sparse_mla.gluon import sparse_mla_decode_wgmma

        out, lse = sparse_mla_decode_wgmma(q, kv_cache, indices, sink, scale, workspace=workspace)
    else:
        from kernels.sparse_mla.triton import (
            sparse_mla_decode_head_batched,
            sparse_mla_decode_simt,
            sparse_mla_decode_split_k,
            sparse_mla_decode_triton,
        )

        if impl == "triton":
            out, lse = sparse_mla_decode_triton(q, kv_cache, indices, sink, scale, workspace)
        elif impl == "simt":
            out, lse = sparse_mla_decode_simt(q, kv_cache, indices, sink, scale)
        elif impl == "head_batched":
            out, lse = sparse_mla_decode_head_batched(q, kv_cache, indices, sink, scale)
        else:
            out, lse = sparse_mla_decode_split_k(q, kv_cache, indices, sink, scale, workspace=workspace)
    return (out, lse) if return_lse else out
