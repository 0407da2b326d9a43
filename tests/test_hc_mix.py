"""The mHC boundary ops (kernels/hc_mix/): the reference against the model's own hc_post, hc_pre
and RMSNorm composed, and the Triton kernels against the reference, on fresh random inputs.

CPU tests run the kernels in the interpreter (TRITON_INTERPRET=1) at a small width; GPU tests run
them compiled at V4 widths in bf16, replayed in CUDA graphs and inside torch.compile."""
from __future__ import annotations

import pytest
import torch

import model.hyper as hyper
from kernels.cuda_graph import capture
from kernels.hc_mix import hc_post_pre_norm, hc_pre_norm, takes_kernel, tiles
from model.layers import RMSNorm

HC, ITERS, HC_EPS, NORM_EPS = 4, 20, 1e-6, 1e-6


def random_boundary(batch: int, dim: int, dtype=torch.float32, seed: int = 0, device="cpu", fn_dtype=torch.float32):
    """(out, streams, post, comb) of a finished sublayer and (fn, scale, base, norm weight) of the next."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=g)
    tensors = dict(
        out=r(batch, dim).to(dtype), streams=r(batch, HC, dim).to(dtype),
        post=2 * torch.rand(batch, HC, generator=g), comb=torch.softmax(r(batch, HC, HC), -1),
        fn=(r((2 + HC) * HC, HC * dim) / dim**0.5).to(fn_dtype), scale=0.5 + torch.rand(3, generator=g),
        base=0.5 * r((2 + HC) * HC), weight=0.5 + torch.rand(dim, generator=g),
    )
    return {k: v.to(device) for k, v in tensors.items()}


def written_back(t: dict) -> torch.Tensor:
    """hc_post written out cell by cell (the model's hc_post is the op's reference itself)."""
    copies = t["streams"].float()
    mixed = sum(t["comb"][:, i, :, None] * copies[:, i, None, :] for i in range(HC))
    return (t["post"][:, :, None] * t["out"].float()[:, None, :] + mixed).to(t["streams"].dtype)


def model_composition(t: dict, write_back: bool):
    """What the model computed before the op: the write-back, its hc_pre (reference Sinkhorn) and RMSNorm."""
    norm = RMSNorm(t["weight"].shape[0], NORM_EPS, t["weight"].device)
    norm.weight.data.copy_(t["weight"])
    streams = written_back(t) if write_back else t["streams"]
    flat, mixes = hyper.normalized_mixes(streams, t["fn"], NORM_EPS)
    from kernels.hc_sinkhorn import hc_split_sinkhorn_reference

    pre, post, comb = hc_split_sinkhorn_reference(mixes, t["scale"], t["base"], HC, ITERS, HC_EPS)
    x = (pre.unsqueeze(-1) * flat.view(streams.shape)).sum(1).to(streams.dtype)
    outputs = (norm(x), post, comb)
    return (streams, *outputs) if write_back else outputs


def run_op(t: dict, write_back: bool, impl: str):
    common = (t["fn"], t["scale"], t["base"], t["weight"], ITERS, HC_EPS, NORM_EPS, NORM_EPS)
    if write_back:
        return hc_post_pre_norm(t["out"], t["streams"], t["post"], t["comb"], *common, impl=impl)
    return hc_pre_norm(t["streams"], *common, impl=impl)


def assert_outputs_close(got, want, dtype, what: str):
    names = ("new streams", "x", "post", "comb") if len(want) == 4 else ("x", "post", "comb")
    for name, g, w in zip(names, got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, f"{what} {name}: {g.shape} {g.dtype} vs {w.shape} {w.dtype}"
        # Outputs in the streams' dtype carry its rounding (one ulp where fp32 sums differ in order).
        # post and comb are fp32, but with half-precision copies written back a copy value that
        # rounded the other way moves the mixes GEMV by up to ~2^-8 of one term (~1e-4 relative).
        if g.dtype != torch.float32:
            tol = dict(rtol=2e-2, atol=2e-2)
        elif dtype == torch.float32:
            tol = dict(rtol=1e-5, atol=1e-5)
        else:
            tol = dict(rtol=2e-3, atol=2e-4)
        torch.testing.assert_close(g.float(), w.float(), **tol, msg=lambda m: f"{what} {name}: {m}")


@pytest.mark.parametrize("write_back", [False, True])
def test_reference_matches_model_composition(write_back):
    t = random_boundary(3, 64, seed=1)
    want = model_composition(t, write_back)
    got = run_op(t, write_back, impl="reference")
    assert_outputs_close(got, want, torch.float32, "reference")
    assert (got[-1].sum(-2) - 1).abs().max() < 1e-3  # comb came out doubly stochastic


def test_reference_with_half_width_fn_casts_the_streams():
    """ModelConfig.fp32_products="fast": fn in bf16, the GEMV on the copies cast to it."""
    t = random_boundary(2, 64, seed=2, fn_dtype=torch.bfloat16)
    want = model_composition(t, write_back=True)
    assert_outputs_close(run_op(t, True, impl="reference"), want, torch.float32, "fast fn")


@pytest.mark.interpreter
@pytest.mark.parametrize("write_back", [False, True])
@pytest.mark.parametrize("batch", [1, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_matches_reference_interpreter(write_back, batch, dtype):
    t = random_boundary(batch, 256, dtype=dtype, seed=10 + batch)
    want = run_op(t, write_back, impl="reference")
    assert_outputs_close(run_op(t, write_back, impl="triton"), want, dtype, f"B={batch} {dtype}")


@pytest.mark.interpreter
@pytest.mark.parametrize("write_back", [False, True])
def test_one_launch_equals_two_launches_interpreter(write_back):
    """The slices' last arrival finishing each token gives the second kernel's outputs bit for bit
    (the same partials, summed in the same order) and leaves the arrival counters at zero."""
    from kernels.arrival import split_counters
    from kernels.hc_mix.triton import hc_mix_triton

    t = random_boundary(3, 256, seed=20 + write_back)
    extra = dict(out=t["out"], post=t["post"], comb=t["comb"]) if write_back else {}
    args = (t["streams"], t["fn"], t["scale"], t["base"], t["weight"], ITERS, HC_EPS, NORM_EPS, NORM_EPS)
    one = hc_mix_triton(*args, **extra, one_launch=True)
    two = hc_mix_triton(*args, **extra, one_launch=False)
    for a, b in zip(one, two):
        assert (a is None and b is None) or torch.equal(a, b)
    assert_outputs_close(one[0 if write_back else 1:], run_op(t, write_back, impl="reference"), torch.float32, "one launch")
    assert not split_counters(torch.device("cpu"), 3).any()


@pytest.mark.interpreter
def test_triton_reads_strided_streams_interpreter():
    """Streams that are a view with a batch stride of their own (a slice of a larger buffer)."""
    t = random_boundary(6, 256, seed=30)
    t["streams"] = t["streams"][::2]
    t["out"], t["post"], t["comb"] = t["out"][:3], t["post"][:3], t["comb"][:3]
    want = run_op(t, True, impl="reference")
    assert_outputs_close(run_op(t, True, impl="triton"), want, torch.float32, "strided")


def test_takes_kernel_only_where_the_kernel_tiles():
    t = random_boundary(1, 64, seed=3)
    assert not takes_kernel(t["streams"], t["fn"])  # on the CPU: the reference
    assert tiles(256) and tiles(4096) and tiles(1024)
    assert not tiles(64) and not tiles(768)  # not whole slices / not a power of two of them


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda t: t.update(fn=t["fn"][:, :-1]), "fn must have shape"),
        (lambda t: t.update(weight=t["weight"][:-1]), "norm_weight must have shape"),
        (lambda t: t.update(comb=t["comb"][:, :2]), "comb must have shape"),
        (lambda t: t.update(post=t["post"].double()), "post must be float32"),
        (lambda t: t.update(out=t["out"].half()), "out and streams must have one dtype"),
        (lambda t: t.update(streams=t["streams"][0]), "streams must be"),
    ],
)
def test_bad_inputs_name_the_problem(change, message):
    t = random_boundary(2, 64, seed=4)
    change(t)
    with pytest.raises(ValueError, match=message):
        run_op(t, True, impl="reference")


def test_bad_impl_and_iters():
    t = random_boundary(1, 64, seed=5)
    with pytest.raises(ValueError, match="impl must be one of"):
        run_op(t, False, impl="fast")
    with pytest.raises(ValueError, match="iters must be >= 1"):
        hc_pre_norm(t["streams"], t["fn"], t["scale"], t["base"], t["weight"], 0, HC_EPS, NORM_EPS, NORM_EPS)


@pytest.mark.interpreter
def test_triton_rejects_widths_it_does_not_tile():
    t = random_boundary(1, 64, seed=6)
    with pytest.raises(ValueError, match="needs hc = 4 and D a multiple of 256"):
        run_op(t, True, impl="triton")


def test_torch_compile_traces_one_call_cpu():
    """Dynamo traces each op as one call in one graph (fullgraph: a break raises)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    t = random_boundary(2, 64, seed=7)
    counter = CompileCounterWithBackend("aot_eager")

    def boundary(t):
        common = (t["fn"], t["scale"], t["base"], t["weight"], ITERS, HC_EPS, NORM_EPS, NORM_EPS)
        new, x, post, comb = torch.ops.v4.hc_post_pre_norm(t["out"] * 2, t["streams"], t["post"], t["comb"], *common)
        return torch.ops.v4.hc_pre_norm(new, *common)[0] + x

    got = torch.compile(boundary, fullgraph=True, backend=counter)(t)
    assert counter.frame_count == 1
    targets = [n.target for n in counter.graphs[0].graph.nodes]
    for op in (torch.ops.v4.hc_post_pre_norm, torch.ops.v4.hc_pre_norm):
        assert sum(target in (op, op.default) for target in targets) == 1, counter.graphs[0].graph
    torch.testing.assert_close(got, boundary(t))


# -- GPU ----------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 7, 64])
@pytest.mark.parametrize("write_back", [False, True])
def test_triton_matches_reference_v4_widths(batch, write_back):
    t = random_boundary(batch, 4096, dtype=torch.bfloat16, seed=40 + batch, device="cuda")
    assert takes_kernel(t["streams"], t["fn"])
    want = run_op(t, write_back, impl="reference")
    assert_outputs_close(run_op(t, write_back, impl="auto"), want, torch.bfloat16, f"B={batch}")


@pytest.mark.gpu
def test_cuda_graph_replay_two_batch_sizes():
    """One graph per batch size, each replayed on new inputs written in place."""
    for batch in (1, 33):
        t = random_boundary(batch, 4096, dtype=torch.bfloat16, seed=batch, device="cuda")
        graph, outputs = capture(lambda: run_op(t, True, impl="auto"))
        for seed in (51, 52):
            for name, new in random_boundary(batch, 4096, dtype=torch.bfloat16, seed=seed, device="cuda").items():
                t[name].copy_(new)
            graph.replay()
            torch.cuda.synchronize()
            assert_outputs_close(outputs, run_op(t, True, impl="reference"), torch.bfloat16, f"graph B={batch} seed={seed}")


@pytest.mark.gpu
def test_no_host_sync_and_opcheck_cuda():
    t = random_boundary(4, 4096, dtype=torch.bfloat16, seed=60, device="cuda")
    run_op(t, True, impl="auto")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        run_op(t, True, impl="auto")
        run_op(t, False, impl="auto")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    common = (t["fn"], t["scale"], t["base"], t["weight"], ITERS, HC_EPS, NORM_EPS, NORM_EPS)
    torch.library.opcheck(torch.ops.v4.hc_post_pre_norm.default, (t["out"], t["streams"], t["post"], t["comb"], *common))
    torch.library.opcheck(torch.ops.v4.hc_pre_norm.default, (t["streams"], *common))


@pytest.mark.gpu
def test_torch_compile_keeps_each_op_opaque():
    from torch._inductor.utils import run_and_get_code

    t = random_boundary(3, 4096, dtype=torch.bfloat16, seed=70, device="cuda")

    def boundary(out, streams):
        common = (t["fn"], t["scale"], t["base"], t["weight"], ITERS, HC_EPS, NORM_EPS, NORM_EPS)
        new, x, post, comb = hc_post_pre_norm(out * 2, streams, t["post"], t["comb"], *common)
        return new, x + 1, post, comb

    got, sources = run_and_get_code(torch.compile(boundary, fullgraph=True), t["out"], t["streams"])
    assert "\n".join(sources).count("torch.ops.v4.hc_post_pre_norm.default(") == 1
    assert_outputs_close(got, boundary(t["out"], t["streams"]), torch.bfloat16, "compiled")
