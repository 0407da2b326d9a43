"""linear / grouped_linear: the one-launch Triton product for decode batches against F.linear
and einsum on fresh random inputs (ragged row counts, N and K that are not multiples of the
tiles, several groups), the routing rule that keeps batch sizes out of it, and failure paths.

CPU tests run the kernel in the interpreter (TRITON_INTERPRET=1, fp32/fp16: the interpreter's
bf16 dot is wrong). GPU tests run it compiled at the model's projection shapes in bf16, through
opcheck, and replayed in CUDA graphs for several batch buckets with new inputs."""
from __future__ import annotations

import pytest
import torch

from kernels.linear import grouped_linear, grouped_linear_op, linear, takes_kernel
from kernels.cuda_graph import capture


def operands(rows, n, k, dtype, device="cpu", seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(rows, k, generator=g, device=device).to(dtype)
    w = (torch.randn(n, k, generator=g, device=device) * k**-0.5).to(dtype)
    return x, w


def expected(x, w):
    return (x.double() @ w.double().t()).float()


@pytest.mark.interpreter
@pytest.mark.parametrize("rows", [1, 5, 16, 33])
@pytest.mark.parametrize("n,k", [(24, 96), (40, 70)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_matches_the_reference(rows, n, k, dtype):
    x, w = operands(rows, n, k, dtype, seed=rows * 1000 + n)
    out = linear(x, w, impl="triton")
    assert out.shape == (rows, n) and out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    ref = expected(x, w)
    assert (out.float() - ref).abs().max() <= tol * ref.abs().max() + tol


@pytest.mark.interpreter
@pytest.mark.parametrize("rows,groups", [(1, 3), (6, 2)])
def test_grouped_triton_matches_einsum(rows, groups):
    g = torch.Generator().manual_seed(rows + 10 * groups)
    x = torch.randn(rows, groups, 80, generator=g)
    w = torch.randn(groups, 24, 80, generator=g) * 80**-0.5
    out = grouped_linear(x, w, impl="triton")
    assert out.shape == (rows, groups, 24)
    torch.testing.assert_close(out, torch.einsum("mgk,gnk->mgn", x.double(), w.double()).float(), rtol=1e-5, atol=1e-5)


@pytest.mark.interpreter
@pytest.mark.parametrize("n,groups,takes_gemv", [(30, 1, True), (24, 3, True), (200, 1, False), (40, 4, False)])
def test_one_row_takes_the_gemv_where_strips_leave_sms_idle(monkeypatch, n, groups, takes_gemv):
    # The interpreter counts 8 SMs: fewer than 8 strips of 16 columns in all groups -> the GEMV.
    import kernels.linear.triton as lt

    launched = []
    real = lt._launch_gemv
    monkeypatch.setattr(lt, "_launch_gemv", lambda *a: (launched.append(True), real(*a)))
    g = torch.Generator().manual_seed(n + groups)
    x = torch.randn(1, groups, 70, generator=g)  # K = 70: a ragged last strip of K
    w = torch.randn(groups, n, 70, generator=g) * 70**-0.5
    out = grouped_linear(x, w, impl="triton")
    assert bool(launched) == takes_gemv
    torch.testing.assert_close(out, torch.einsum("mgk,gnk->mgn", x.double(), w.double()).float(), rtol=1e-5, atol=1e-5)


@pytest.mark.interpreter
def test_triton_reads_a_column_slice_of_a_wider_input():
    x, w = operands(3, 24, 128, torch.float32, seed=7)
    wide = torch.randn(3, 200)
    wide[:, 40:168] = x
    out = linear(wide[:, 40:168], w, impl="triton")
    torch.testing.assert_close(out, expected(x, w), rtol=1e-5, atol=1e-5)


def test_routing_depends_on_weight_and_device_only():
    x, w = operands(4, 32, 64, torch.bfloat16)
    assert not takes_kernel(x, w)  # CPU: F.linear
    if torch.cuda.is_available():
        xc, wc = x.cuda(), w.cuda()
        assert takes_kernel(xc, wc)  # K >= N, bf16
        assert takes_kernel(xc[:1], wc) == takes_kernel(xc, wc)  # the batch never decides
        assert not takes_kernel(xc[:, :32], torch.randn(64, 32, device="cuda", dtype=torch.bfloat16))  # K < N
        assert not takes_kernel(xc.float(), wc.float())  # fp32 products keep cuBLAS
        assert takes_kernel(xc.float(), wc)  # fp32 rows, bf16 weight: one row takes the GEMV


def test_auto_on_cpu_equals_f_linear_exactly():
    x, w = operands(6, 48, 32, torch.float32, seed=3)
    assert torch.equal(linear(x, w), torch.nn.functional.linear(x, w))


@pytest.mark.parametrize(
    "x_shape,w_shape,dtype_x,dtype_w,match",
    [
        ((4, 64), (32, 48), torch.float32, torch.float32, "agree on K"),
        ((4, 64), (32, 64), torch.float16, torch.bfloat16, "one dtype"),
        ((4, 64), (32, 64), torch.bfloat16, torch.float32, "one dtype"),  # only the weight is upcast
        ((4, 64), (32, 64, 1), torch.float32, torch.float32, "agree on K"),
    ],
)
def test_bad_operands_are_named(x_shape, w_shape, dtype_x, dtype_w, match):
    with pytest.raises(ValueError, match=match):
        linear(torch.randn(x_shape).to(dtype_x), torch.randn(w_shape).to(dtype_w))


@pytest.mark.interpreter
@pytest.mark.parametrize("n,k,dtype", [(24, 96, torch.bfloat16), (40, 70, torch.float16)])
def test_fp32_rows_upcast_a_half_weight_as_read(n, k, dtype):
    """fp32 x with a half weight: one row through the GEMV, fp32 out and fp32 math, against the
    product of the weight upcast first; more rows are refused by the kernel."""
    g = torch.Generator().manual_seed(n + k)
    x = torch.randn(1, k, generator=g)
    w = (torch.randn(n, k, generator=g) * k**-0.5).to(dtype)
    out = linear(x, w, impl="triton")
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, expected(x, w), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="takes one row"):
        linear(torch.randn(2, k), w, impl="triton")


def test_fp32_rows_with_a_half_weight_on_cpu_are_f_linear_of_the_upcast():
    x, w = operands(3, 48, 32, torch.float32, seed=4)
    w = w.to(torch.bfloat16)
    assert torch.equal(linear(x, w), torch.nn.functional.linear(x, w.float()))


def test_unknown_impl_is_named():
    with pytest.raises(ValueError, match="impl must be one of"):
        linear(torch.randn(2, 8), torch.randn(4, 8), impl="cublas")


def test_grouped_operands_must_agree_on_groups():
    with pytest.raises(ValueError, match="agree on G and K"):
        grouped_linear(torch.randn(2, 3, 8), torch.randn(4, 5, 8))


@pytest.mark.interpreter
def test_triton_refuses_more_than_64_rows():
    x, w = operands(65, 16, 32, torch.float32)
    with pytest.raises(ValueError, match="at most 64 rows"):
        linear(x, w, impl="triton")


def test_fake_gives_the_output_shape_under_compile():
    x, w = operands(5, 24, 40, torch.float32, seed=9)
    compiled = torch.compile(lambda a, b: grouped_linear_op(a[:, None], b[None]) * 2, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x, w), torch.nn.functional.linear(x, w)[:, None] * 2)


# The model's projections that cuBLAS splits over K at decode batches (bench widths): the fused
# x projection, wo_b, the shared expert's w1/w3; plus K == N and a ragged N.
GPU_SHAPES = [(1600, 4096), (4096, 8192), (4096, 4096), (1000, 1000)]


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 2, 7, 16, 32, 64])
@pytest.mark.parametrize("n,k", GPU_SHAPES)
def test_gpu_matches_the_reference_in_bf16(rows, n, k):
    x, w = operands(rows, n, k, torch.bfloat16, device="cuda", seed=rows + n)
    out = linear(x, w)
    ref = expected(x, w)
    assert takes_kernel(x, w)
    # bf16 output rounding (2^-8 relative) on top of fp32 accumulation in another order
    assert (out.float() - ref).abs().max() <= 8e-3 * ref.abs().max()


def test_the_op_returns_the_contiguous_result_its_fake_promises():
    """The CPU implementation (the reference, whose einsum leaves [M, G, N] strided) passes
    opcheck, fake and strides included: compiled graphs assert the fake's strides."""
    x, w = operands(8, 48, 64, torch.float32, device="cpu", seed=3)
    grouped = (x.view(8, 1, 64).expand(8, 2, 64).contiguous(), w.view(2, 24, 64))
    torch.library.opcheck(grouped_linear_op, grouped)
    assert grouped_linear_op(*grouped).is_contiguous()


@pytest.mark.gpu
def test_gpu_opcheck():
    x, w = operands(8, 256, 256, torch.bfloat16, device="cuda", seed=1)
    torch.library.opcheck(grouped_linear_op, (x.view(8, 1, 256).expand(8, 2, 256).contiguous(), w.view(2, 128, 256)))


@pytest.mark.gpu
def test_gpu_captured_per_bucket_and_replayed_with_new_inputs():
    n, k = 1600, 4096
    w = operands(1, n, k, torch.bfloat16, device="cuda", seed=11)[1]
    for bucket in (1, 4, 32, 64):
        x = torch.zeros(bucket, k, dtype=torch.bfloat16, device="cuda")
        graph, out = capture(lambda: linear(x, w))
        for seed in (1, 2):
            fresh = operands(bucket, n, k, torch.bfloat16, device="cuda", seed=100 * bucket + seed)[0]
            x.copy_(fresh)
            graph.replay()
            ref = expected(fresh, w)
            assert (out.float() - ref).abs().max() <= 8e-3 * ref.abs().max(), f"bucket {bucket}"


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 32, 64])
def test_gpu_grouped_output_projection_shape(rows):
    # wo_a of the bench preset: 8 groups of [1024, 4096]
    g = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, 8, 4096, generator=g, device="cuda").to(torch.bfloat16)
    w = (torch.randn(8, 1024, 4096, generator=g, device="cuda") * 4096**-0.5).to(torch.bfloat16)
    out = grouped_linear(x, w)
    ref = torch.einsum("mgk,gnk->mgn", x.double(), w.double()).float()
    assert (out.float() - ref).abs().max() <= 8e-3 * ref.abs().max()


@pytest.mark.gpu
def test_gpu_grouped_one_row_gemv():
    # 2 groups x 500 columns: 64 strips of 16, fewer than the SMs -> the GEMV, ragged N
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(1, 2, 1024, generator=g, device="cuda").to(torch.bfloat16)
    w = (torch.randn(2, 500, 1024, generator=g, device="cuda") * 1024**-0.5).to(torch.bfloat16)
    out = grouped_linear(x, w)
    ref = torch.einsum("mgk,gnk->mgn", x.double(), w.double()).float()
    assert (out.float() - ref).abs().max() <= 8e-3 * ref.abs().max()


@pytest.mark.gpu
def test_gpu_op_falls_back_for_strided_k():
    x, w = operands(4, 64, 128, torch.bfloat16, device="cuda", seed=5)
    spread = torch.zeros(4, 1, 256, dtype=torch.bfloat16, device="cuda")
    spread[..., ::2] = x[:, None]
    out = grouped_linear_op(spread[..., ::2], w[None])
    torch.testing.assert_close(out[:, 0].float(), expected(x, w), rtol=1e-2, atol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 4])
def test_gpu_router_product_in_fp32_with_the_bf16_weight(rows):
    """The router's product (V4-Flash: 256 x 4096, bf16 weight, fp32 rows): one row through the
    GEMV with the weight upcast as read, more rows through the library's product of the upcast;
    both fp32 to within summation order, replayed in a CUDA graph with new rows."""
    x, w = operands(rows, 256, 4096, torch.float32, device="cuda", seed=13)
    w = w.to(torch.bfloat16)
    out = linear(x, w)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, expected(x, w), rtol=1e-5, atol=1e-5)
    graph, static_out = capture(lambda: linear(x, w))
    fresh = operands(rows, 256, 4096, torch.float32, device="cuda", seed=14)[0]
    x.copy_(fresh)
    graph.replay()
    torch.testing.assert_close(static_out, expected(fresh, w), rtol=1e-5, atol=1e-5)
