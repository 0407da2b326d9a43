"""The mHC boundary ops: `ref` (the plain-torch references, input checks, the shapes the kernels
tile), `triton` (the two CUDA kernels), `op` (the custom ops `v4::hc_pre_norm` and
`v4::hc_post_pre_norm` and the choice of implementation)."""
from kernels.hc_mix.op import IMPLS, hc_post_pre_norm, hc_pre_norm, takes_kernel
from kernels.hc_mix.ref import hc_post_pre_norm_reference, hc_post_reference, hc_pre_norm_reference, tiles

__all__ = [
    "IMPLS", "hc_post_pre_norm", "hc_post_pre_norm_reference", "hc_post_reference", "hc_pre_norm",
    "hc_pre_norm_reference", "takes_kernel", "tiles",
]
