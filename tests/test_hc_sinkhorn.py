"""hc_split_sinkhorn: the plain-torch reference and the Triton kernel against an independent fp64
reference (Python floats, one token at a time) on fresh random inputs.

CPU tests run the kernel in the interpreter (TRITON_INTERPRET=1). GPU tests run it compiled at
V4 sizes, replayed in CUDA graphs of two batch sizes, and inside torch.compile(fullgraph=True),
where the op must stay one opaque call."""
from __future__ import annotations

import math

import pytest
import torch

import kernels.hc_sinkhorn.triton as hc_sinkhorn_triton
from kernels.hc_sinkhorn import hc_split_sinkhorn, hc_split_sinkhorn_reference
from kernels.cuda_graph import capture

V4_HC, V4_ITERS, V4_EPS = 4, 20, 1e-6
# fp32 against fp64: a logit of size L (up to ~30 here) carries a rounding of ~6e-8 * L, which
# exp turns into a relative error of that size in comb (~2e-6; the GPU's approximate exp adds
# about as much again); the normalisations add a few ulps each but do not amplify it.
RTOL, ATOL = 1e-5, 1e-9


def sigmoid64(x: float) -> float:
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    e = math.exp(x)
    return e / (1.0 + e)


def normalise_rows(m: list[list[float]], eps: float) -> list[list[float]]:
    return [[v / (sum(row) + eps) for v in row] for row in m]


def normalise_columns(m: list[list[float]], eps: float) -> list[list[float]]:
    sums = [sum(col) for col in zip(*m)]
    return [[v / (s + eps) for v, s in zip(row, sums)] for row in m]


def sinkhorn_fp64(logits: list[list[float]], iters: int, eps: float) -> tuple[list[list[float]], list[float]]:
    """(comb, the column sums that the last column step divided by)."""
    comb = []
    for row in logits:
        top = max(row)
        exps = [math.exp(v - top) for v in row]
        comb.append([e / sum(exps) + eps for e in exps])
    for _ in range(iters - 1):
        comb = normalise_columns(comb, eps)
        comb = normalise_rows(comb, eps)
    last_sums = [sum(col) for col in zip(*comb)]
    return normalise_columns(comb, eps), last_sums


def split_sinkhorn_fp64(mixes, scale, base, hc, iters, eps):
    """(pre [B, hc], post [B, hc], comb [B, hc, hc], column sums before the last step [B, hc]) as
    fp64 CPU tensors, computed token by token with Python floats."""
    s = scale.double().tolist()
    bias = base.double().tolist()
    pres, posts, combs, last_sums = [], [], [], []
    for row in mixes.double().tolist():
        z = [m * s[min(k // hc, 2)] + bias[k] for k, m in enumerate(row)]  # scale 0, 1, then 2
        pres.append([sigmoid64(v) + eps for v in z[:hc]])
        posts.append([2.0 * sigmoid64(v) for v in z[hc : 2 * hc]])
        comb, sums = sinkhorn_fp64([z[2 * hc + i * hc : 2 * hc + (i + 1) * hc] for i in range(hc)], iters, eps)
        combs.append(comb)
        last_sums.append(sums)
    batch = len(pres)
    as64 = lambda x, *shape: torch.tensor(x, dtype=torch.float64).reshape(batch, *shape)  # noqa: E731
    return as64(pres, hc), as64(posts, hc), as64(combs, hc, hc), as64(last_sums, hc)


def random_inputs(batch, hc, seed, device="cpu"):
    """mixes of varied scale (randn * 3), random scale and base, all fp32."""
    g = torch.Generator().manual_seed(seed)
    width = (2 + hc) * hc
    mixes = torch.randn(batch, width, generator=g) * 3
    scale = torch.randn(3, generator=g)
    base = torch.randn(width, generator=g)
    return mixes.to(device), scale.to(device), base.to(device)


def assert_matches(outputs, expected, label=""):
    for name, got, want in zip(("pre", "post", "comb"), outputs, expected):
        assert got.dtype == torch.float32, f"{label} {name}: dtype {got.dtype}"
        assert got.shape == want.shape, f"{label} {name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
        torch.testing.assert_close(
            got.cpu().double(), want.cpu().double(), rtol=RTOL, atol=ATOL, msg=lambda m: f"{label} {name}: {m}"
        )


def assert_columns_normalised(comb, last_sums, eps):
    """The last step divides each column by its sum s + eps, so the columns of comb sum to
    s / (s + eps): 1 up to eps / s (large only where too few iterations left a column tiny)."""
    col_sums = comb.cpu().double().sum(-2)
    assert bool((comb >= 0).all()) and float(col_sums.max()) <= 1 + 1e-6
    torch.testing.assert_close(col_sums, last_sums / (last_sums + eps), rtol=RTOL, atol=0)


# ---------------------------------------------------------------------------------------------
# CPU: reference and interpreter
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("batch,hc,iters", [(1, 4, 20), (3, 4, 1), (33, 4, 20), (5, 2, 20), (3, 8, 20), (4, 1, 3)])
def test_reference_matches_fp64(batch, hc, iters):
    mixes, scale, base = random_inputs(batch, hc, seed=batch * 100 + hc * 10 + iters)
    outputs = hc_split_sinkhorn(mixes, scale, base, hc, iters, V4_EPS, impl="reference")
    *expected, last_sums = split_sinkhorn_fp64(mixes, scale, base, hc, iters, V4_EPS)
    assert_matches(outputs, expected, f"reference B={batch}")
    assert_columns_normalised(outputs[2], last_sums, V4_EPS)


def test_cpu_op_is_the_reference():
    mixes, scale, base = random_inputs(6, V4_HC, seed=1)
    got = torch.ops.v4.hc_split_sinkhorn(mixes, scale, base, V4_HC, V4_ITERS, V4_EPS)
    want = hc_split_sinkhorn_reference(mixes, scale, base, V4_HC, V4_ITERS, V4_EPS)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


@pytest.mark.interpreter
@pytest.mark.parametrize("hc", [1, 2, 4, 8])
@pytest.mark.parametrize("batch", [1, 3, 33])
@pytest.mark.parametrize("iters", [1, 20])
def test_triton_matches_fp64_and_reference(batch, hc, iters):
    """B=33 spans three programs at hc=4 (16 tokens each) and nine at hc=8 (4 tokens each), with
    a masked tail."""
    mixes, scale, base = random_inputs(batch, hc, seed=batch * 1000 + hc * 10 + iters)
    outputs = hc_split_sinkhorn(mixes, scale, base, hc, iters, V4_EPS, impl="triton")
    label = f"triton B={batch} hc={hc} iters={iters}"
    *expected, last_sums = split_sinkhorn_fp64(mixes, scale, base, hc, iters, V4_EPS)
    assert_matches(outputs, expected, label)
    assert_matches(outputs, hc_split_sinkhorn_reference(mixes, scale, base, hc, iters, V4_EPS), label)
    assert all(t.is_contiguous() for t in outputs)
    assert_columns_normalised(outputs[2], last_sums, V4_EPS)


@pytest.mark.interpreter
def test_strided_inputs_and_large_eps():
    """mixes a column window of a wider tensor, scale and base strided views (the kernel takes
    strides); a large eps makes each of its uses visible in the result."""
    hc, batch, eps = V4_HC, 19, 0.05
    width = (2 + hc) * hc
    mixes_wide, scale3, base_wide = random_inputs(batch, 2 * hc + hc, seed=2)  # wider than needed
    mixes = mixes_wide[:, 3 : 3 + width]
    base = base_wide[: 2 * width : 2]
    scale = torch.stack([scale3, scale3]).t().reshape(-1)[::2]  # stride 2
    assert not mixes.is_contiguous() and base.stride(0) == 2 and scale.stride(0) == 2
    expected = split_sinkhorn_fp64(mixes, scale, base, hc, 7, eps)
    for impl in ("triton", "reference"):
        assert_matches(hc_split_sinkhorn(mixes, scale, base, hc, 7, eps, impl=impl), expected, f"strided {impl}")


@pytest.mark.interpreter
def test_triton_large_logits():
    """Logits in the hundreds: exp overflows fp32 unless the row max is subtracted first, and
    the sigmoids saturate at both ends."""
    mixes, scale, base = random_inputs(9, V4_HC, seed=7)
    mixes = mixes * 40
    outputs = hc_split_sinkhorn(mixes, scale, base, V4_HC, V4_ITERS, V4_EPS, impl="triton")
    assert all(bool(t.isfinite().all()) for t in outputs)
    assert_matches(outputs, split_sinkhorn_fp64(mixes, scale, base, V4_HC, V4_ITERS, V4_EPS), "large logits")


@pytest.mark.interpreter
def test_triton_empty_batch():
    mixes, scale, base = random_inputs(0, V4_HC, seed=3)
    pre, post, comb = hc_split_sinkhorn(mixes, scale, base, V4_HC, V4_ITERS, V4_EPS, impl="triton")
    assert pre.shape == post.shape == (0, V4_HC) and comb.shape == (0, V4_HC, V4_HC)


def test_opcheck_cpu():
    mixes, scale, base = random_inputs(5, V4_HC, seed=4)
    torch.library.opcheck(torch.ops.v4.hc_split_sinkhorn.default, (mixes, scale, base, V4_HC, V4_ITERS, V4_EPS))


def test_bad_input_raises():
    hc = V4_HC
    mixes, scale, base = random_inputs(3, hc, seed=5)
    call = hc_split_sinkhorn
    with pytest.raises(ValueError, match="impl"):
        call(mixes, scale, base, hc, V4_ITERS, V4_EPS, impl="fast")
    with pytest.raises(ValueError, match="mixes must be"):
        call(mixes[0], scale, base, hc, V4_ITERS, V4_EPS)
    with pytest.raises(ValueError, match="width 20"):
        call(mixes[:, :20], scale, base, hc, V4_ITERS, V4_EPS)
    with pytest.raises(ValueError, match="width 24 .* hc=2"):
        call(mixes, scale, base, 2, V4_ITERS, V4_EPS)
    with pytest.raises(ValueError, match="scale"):
        call(mixes, scale[:2], base, hc, V4_ITERS, V4_EPS)
    with pytest.raises(ValueError, match="base"):
        call(mixes, scale, base[:-1], hc, V4_ITERS, V4_EPS)
    with pytest.raises(ValueError, match="mixes dtype"):
        call(mixes.double(), scale, base, hc, V4_ITERS, V4_EPS)
    with pytest.raises(ValueError, match="base dtype"):
        call(mixes, scale, base.half(), hc, V4_ITERS, V4_EPS)
    with pytest.raises(ValueError, match="device"):
        call(mixes, scale.to("meta"), base, hc, V4_ITERS, V4_EPS)
    with pytest.raises(ValueError, match="iters"):
        call(mixes, scale, base, hc, 0, V4_EPS)
    with pytest.raises(ValueError, match="hc must be >= 1"):
        call(mixes[:, :0], scale, base[:0], 0, V4_ITERS, V4_EPS)
    three = random_inputs(2, 3, seed=6)  # valid shapes, but the kernel wants a power of two
    with pytest.raises(ValueError, match="hc must be one of"):
        hc_sinkhorn_triton.hc_split_sinkhorn_triton(*three, 3, V4_ITERS, V4_EPS)
    assert_matches(call(*three, 3, V4_ITERS, V4_EPS, impl="reference"), split_sinkhorn_fp64(*three, 3, V4_ITERS, V4_EPS))


# ---------------------------------------------------------------------------------------------
# GPU: compiled kernel, CUDA graphs, torch.compile
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("batch,hc", [(1, 4), (32, 4), (128, 4), (1000, 4), (33, 1), (33, 2), (33, 8)])
def test_gpu_matches_fp64_and_reference(batch, hc):
    mixes, scale, base = random_inputs(batch, hc, seed=batch + hc, device="cuda")
    outputs = hc_split_sinkhorn(mixes, scale, base, hc, V4_ITERS, V4_EPS)  # the op: Triton on CUDA
    label = f"cuda B={batch} hc={hc}"
    *expected, last_sums = split_sinkhorn_fp64(mixes, scale, base, hc, V4_ITERS, V4_EPS)
    assert_matches(outputs, expected, label)
    assert_matches(outputs, hc_split_sinkhorn_reference(mixes, scale, base, hc, V4_ITERS, V4_EPS), label)
    assert_columns_normalised(outputs[2], last_sums, V4_EPS)


@pytest.mark.gpu
def test_cuda_graph_replay_two_batch_sizes():
    """One graph per batch size, each replayed on new mixes, scale and base written in place."""
    for batch in (5, 128):
        mixes, scale, base = random_inputs(batch, V4_HC, seed=batch, device="cuda")
        graph, outputs = capture(lambda: hc_split_sinkhorn(mixes, scale, base, V4_HC, V4_ITERS, V4_EPS))
        for seed in (11, 12, 13):
            for buf, new in zip((mixes, scale, base), random_inputs(batch, V4_HC, seed=seed, device="cuda")):
                buf.copy_(new)
            graph.replay()
            torch.cuda.synchronize()
            expected = split_sinkhorn_fp64(mixes, scale, base, V4_HC, V4_ITERS, V4_EPS)
            assert_matches(outputs, expected, f"graph B={batch} seed={seed}")


@pytest.mark.gpu
def test_no_host_sync_and_opcheck_cuda():
    mixes, scale, base = random_inputs(64, V4_HC, seed=20, device="cuda")
    hc_split_sinkhorn(mixes, scale, base, V4_HC, V4_ITERS, V4_EPS)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        hc_split_sinkhorn(mixes, scale, base, V4_HC, V4_ITERS, V4_EPS)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.library.opcheck(torch.ops.v4.hc_split_sinkhorn.default, (mixes, scale, base, V4_HC, V4_ITERS, V4_EPS))


def split_then_use(mixes, scale, base):
    """A caller around the op, so that Inductor has ops to fuse on both sides of it."""
    pre, post, comb = torch.ops.v4.hc_split_sinkhorn(mixes * 0.5, scale, base, V4_HC, V4_ITERS, V4_EPS)
    return pre * 2, post + 1, comb.sum(-1)


def test_torch_compile_traces_one_call_cpu():
    """Dynamo traces the op as one call in one graph (fullgraph: a break raises), and the fake
    implementation carries the traced graph through AOT autograd to the eager result. (Inductor
    itself: the GPU test below; a C++ compile here would cost more than the whole file.)"""
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")
    mixes, scale, base = random_inputs(32, V4_HC, seed=30)
    outputs = torch.compile(split_then_use, fullgraph=True, backend=counter)(mixes, scale, base)
    assert counter.frame_count == 1
    op = torch.ops.v4.hc_split_sinkhorn
    calls = [n for n in counter.graphs[0].graph.nodes if n.target in (op, op.default)]
    assert len(calls) == 1, counter.graphs[0].graph
    for got, want in zip(outputs, split_then_use(mixes, scale, base)):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.gpu
def test_torch_compile_keeps_one_opaque_call():
    """Inductor calls the op once, as an extern call around its own fused kernels, and gets the
    eager result."""
    from torch._inductor.utils import run_and_get_code

    mixes, scale, base = random_inputs(32, V4_HC, seed=30, device="cuda")
    compiled = torch.compile(split_then_use, fullgraph=True)
    outputs, sources = run_and_get_code(compiled, mixes, scale, base)
    code = "\n".join(sources)
    assert code.count("torch.ops.v4.hc_split_sinkhorn.default(") == 1, code
    for got, want in zip(outputs, split_then_use(mixes, scale, base)):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
