"""Decode-shaped projections: `ref` (the plain-torch references, input checks, the row bound),
`triton` (the CUDA kernels: the tensor-core product and the one-row GEMV), `op` (the custom ops
`v4::grouped_linear` and `v4::linears_beside`, the routing rule and the choice of implementation)."""
from kernels.linear.op import IMPLS, grouped_linear, grouped_linear_op, linear, linears_beside, takes_kernel
from kernels.linear.ref import MAX_ROWS, grouped_linear_reference, linear_reference

__all__ = [
    "IMPLS", "MAX_ROWS", "grouped_linear", "grouped_linear_op", "grouped_linear_reference", "linear", "linear_reference",
    "linears_beside",
    "takes_kernel",
]
