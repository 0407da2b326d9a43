"""Opaque decode kernels for DeepSeek-V4-class models, registered as torch.library custom ops.

One package per op (gate, hc_mix, hc_sinkhorn, indexer, linear, moe, sparse_mla): `ref` holds the
plain-torch reference (the CPU path) and the input checks, `triton` / `gluon` the kernels, `op`
the custom op and the choice of implementation (`impl`, see kernels/impl.py). `bench` holds the
GPU benchmarks (`python -m kernels.bench`), `cuda_graph` the one CUDA-graph capture helper,
`registry` the kernel names each op launches. The one-matrix `linear` is imported from
`kernels.linear`, so that the name `kernels.linear` stays the package."""
from kernels.gate import moe_gate, moe_gate_reference
from kernels.hc_mix import hc_post_pre_norm, hc_post_pre_norm_reference, hc_pre_norm, hc_pre_norm_reference
from kernels.hc_sinkhorn import hc_split_sinkhorn, hc_split_sinkhorn_reference
from kernels.indexer import indexer_scores, indexer_select, indexer_topk, indexer_topk_reference
from kernels.linear import grouped_linear, grouped_linear_reference
from kernels.moe import moe_experts, moe_experts_reference
from kernels.registry import launched_kernels
from kernels.sparse_mla import sparse_mla_decode, sparse_mla_decode_reference

__all__ = [
    "hc_post_pre_norm", "hc_post_pre_norm_reference", "hc_pre_norm", "hc_pre_norm_reference",
    "hc_split_sinkhorn", "hc_split_sinkhorn_reference",
    "indexer_scores",
    "indexer_select",
    "indexer_topk",
    "indexer_topk_reference",
    "grouped_linear",
    "grouped_linear_reference",
    "launched_kernels",
    "moe_experts",
    "moe_experts_reference",
    "moe_gate",
    "moe_gate_reference",
    "sparse_mla_decode",
    "sparse_mla_decode_reference",
]
