"""mHC split + Sinkhorn: `ref` (the plain-torch reference and input checks), `triton` (the CUDA
kernel), `op` (the custom op `v4::hc_split_sinkhorn` and the choice of implementation)."""
from kernels.hc_sinkhorn.op import IMPLS, hc_split_sinkhorn, hc_split_sinkhorn_op
from kernels.hc_sinkhorn.ref import hc_split_sinkhorn_reference

__all__ = ["IMPLS", "hc_split_sinkhorn", "hc_split_sinkhorn_op", "hc_split_sinkhorn_reference"]
