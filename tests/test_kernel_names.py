"""The map from device kernel names to the custom ops that launch them (kernels.launched_kernels),
which the launch accounting (fuse.launches) counts kernels by: every kernel each op launches must
be in it under that op, the Gluon one included, or a profile would count it as "other"."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from fuse.launches import MATRIX_PRODUCT_OPS, _custom_kernel_names, _gemm_kernel_names, classify_kernel  # noqa: E402
from kernels import launched_kernels  # noqa: E402
from kernels.registry import OPS  # noqa: E402

# The kernels each op launches (device helpers left out: they are never launched on their own).
LAUNCHED = {
    "v4::sparse_mla_decode": {"_simt_kernel", "_head_batched_kernel", "_combine_kernel", "_sparse_mla_wgmma_kernel"},
    "v4::indexer_topk": {"_indexer_score_kernel", "_indexer_select_kernel"},
    # The block-scaled experts (v4::moe_experts_scaled) share the routing and combine kernels and
    # count under v4::moe_experts with them (kernels/registry.py: one op per package); their
    # act_quant pre-pass, where not launched with the routing, is the block-scaled linear's.
    "v4::moe_experts": {
        "_route_pairs_kernel", "_route_and_quant_kernel", "_gate_up_kernel", "_down_kernel", "_moe_combine_kernel",
        "_scaled_gate_up_kernel", "_scaled_down_kernel", "_mma_gate_up_kernel", "_mma_down_kernel", "_shared_swiglu_kernel",
    },
    "v4::hc_split_sinkhorn": {"_hc_split_sinkhorn_kernel"},
    "v4::moe_gate": {"_moe_gate_kernel"},
    "v4::hc_post_pre_norm": {"_hc_mix_slices_kernel", "_hc_mix_finish_kernel"},
    "v4::grouped_linear": {"_linear_kernel", "_gemv_kernel"},
    "v4::blockscale_linear": {"_act_quant_kernel", "_blockscale_linear_kernel", "_mma_linear_kernel", "_blockscale_gemv_kernel"},
}


@pytest.mark.parametrize("op", list(LAUNCHED))
def test_each_kernel_maps_to_the_op_that_launches_it(op):
    mapping = launched_kernels()
    for name in sorted(LAUNCHED[op]):
        assert mapping.get(name) == op, f"{name}: {mapping.get(name)!r}, expected {op!r}"


def test_every_kernel_of_the_map_is_listed_here():
    """A new kernel (by the `_kernel` naming of the packages) must join LAUNCHED above."""
    listed = set().union(*LAUNCHED.values())
    assert {name for name in launched_kernels() if name.endswith("_kernel")} == listed


def test_the_ops_exist():
    for op in set(OPS.values()) | set(LAUNCHED):
        namespace, name = op.split("::")
        assert hasattr(getattr(torch.ops, namespace), name), op


def test_launch_accounting_counts_them_as_custom_or_gemm():
    custom = _custom_kernel_names()
    for op, names in LAUNCHED.items():
        for name in names:
            expected = "gemm" if op in MATRIX_PRODUCT_OPS else "custom"
            assert classify_kernel(name, custom) == expected, (name, op)
    assert _gemm_kernel_names() == frozenset(n for n, op in launched_kernels().items() if op in MATRIX_PRODUCT_OPS)
