"""Launch accounting on a GPU, op by op: every device kernel a registered custom op launches is
counted as custom (as gemm for the matrix products, fuse.launches.MATRIX_PRODUCT_OPS), so that no kernel of
ours lands in elementwise, copy, reduce or other in a report."""
from __future__ import annotations

import functools

import pytest

from fuse.launches import MATRIX_PRODUCT_OPS, count_launches
from kernels.registry import OPS
from op_calls import record_step_op_calls

pytestmark = [pytest.mark.gpu]

# The registry's ops, and v4::hc_pre_norm, whose kernels count under v4::hc_post_pre_norm.
CHECKED_OPS = sorted(set(OPS.values()) | {"v4::hc_pre_norm"})


@pytest.fixture(scope="module")
def op_calls() -> dict[str, tuple]:
    return record_step_op_calls()


@pytest.mark.parametrize("op", CHECKED_OPS)
def test_every_kernel_of_the_op_counts_as_custom(op, op_calls):
    from kernels import launched_kernels

    assert op in set(launched_kernels().values()) | {"v4::hc_pre_norm"}
    assert op in op_calls, f"the decode step did not call {op}; calls seen: {sorted(op_calls)}"
    func, args, kwargs = op_calls[op]
    report = count_launches(functools.partial(func, **kwargs), *args, label=op)
    expected = "gemm" if op in MATRIX_PRODUCT_OPS else "custom"
    assert report.total > 0, f"{op} launched no kernel"
    assert report.counts[expected] == report.total, f"{op}: {report.counts}, kernels {report.kernels}"
