"""Sparse MLA decode: `ref` (the plain-torch reference and input checks), `plan` (launch planning
of the CUDA path), `common` (what the Triton and Gluon kernels share: index loads, scratch, the
split combine), `triton` (the SIMT, head-batched and split-K kernels), `gluon` (the Hopper wgmma
kernel), `op` (the custom ops and the choice of implementation)."""
from kernels.sparse_mla.op import (
    IMPLS,
    sparse_mla_decode,
    sparse_mla_decode_op,
    sparse_mla_decode_with_workspace_op,
    sparse_mla_workspace,
)
from kernels.sparse_mla.ref import sparse_mla_decode_reference

__all__ = [
    "IMPLS", "sparse_mla_decode", "sparse_mla_decode_op", "sparse_mla_decode_reference",
    "sparse_mla_decode_with_workspace_op", "sparse_mla_workspace",
]
