"""Skinny products compiled as reductions: the GEMM calls they replace disappear from the
compiled function, wide products keep theirs, and the results stay the product."""
from __future__ import annotations

import types

import pytest
import torch

import fuse
from torch._dynamo.utils import counters

from fuse.launches import count_launches
from fuse.backend import compile_backend

CPU = torch.device("cpu")


def products(x, skinny, wide, comb, streams, deep_a, deep_b):
    """Two mm (24 and 96 output columns) and two bmm (contraction depth 4 and 32)."""
    mixes = x @ skinny.t()
    projected = x @ wide.t()
    mixed = torch.einsum("bij,bid->bjd", comb, streams)
    deep = torch.bmm(deep_a, deep_b)
    return mixes, projected, mixed, deep


def inputs(dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    shapes = [(5, 320), (24, 320), (96, 320), (5, 4, 4), (5, 4, 48), (5, 6, 32), (5, 32, 7)]
    return [torch.randn(*s, generator=g).to(dtype) for s in shapes]


def fresh(fn):
    """`fn` with a code object of its own: Dynamo compiles it anew (its entries are per code
    object), with no reset that would drop other tests' compiled runners."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def compiled(max_columns: int):
    options = fuse.CompileOptions(skinny_product_columns=max_columns)
    return torch.compile(fresh(products), backend=compile_backend(options, CPU), fullgraph=True)


@pytest.mark.parametrize("max_columns, gemms", [(64, 2), (0, 4)])
def test_skinny_products_leave_the_gemm_calls(max_columns, gemms):
    args = inputs(torch.float32, seed=3)
    fn = compiled(max_columns)
    report = count_launches(fn, *args)
    library_calls = sum(n for name, n in report.kernels.items() if name in ("aten::mm", "aten::bmm"))
    assert library_calls == gemms, report.kernels
    assert report.counts["gemm"] == 4, report.kernels  # a product compiled as a reduction is still one
    for got, want in zip(fn(*args), products(*args)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("max_columns, gemms", [(64, 0), (0, 1)])
def test_shallow_wide_mm_is_summed_in_place(max_columns, gemms):
    """A 4-deep product with many columns (hc_post's at batch 1, traced as an mm) becomes
    pointwise code: no GEMM call is left, and the result is the product."""
    g = torch.Generator().manual_seed(5)
    comb, streams = torch.rand(4, 4, generator=g), torch.randn(4, 200, generator=g)
    product = lambda comb, streams: (comb.t() @ streams) * 2  # noqa: E731
    options = fuse.CompileOptions(skinny_product_columns=max_columns)
    fn = torch.compile(fresh(product), backend=compile_backend(options, CPU), fullgraph=True)
    report = count_launches(fn, comb, streams)
    assert sum(n for name, n in report.kernels.items() if name in ("aten::mm", "aten::bmm")) == gemms, report.kernels
    torch.testing.assert_close(fn(comb, streams), product(comb, streams), rtol=1e-5, atol=1e-5)


def test_bf16_products_accumulate_in_fp32():
    args = inputs(torch.bfloat16, seed=4)
    exact = products(*[a.double() for a in args])
    for got, want in zip(compiled(64)(*args), exact):
        assert got.dtype == torch.bfloat16
        # One bf16 rounding of the result, not one per partial sum.
        torch.testing.assert_close(got.double(), want, rtol=1e-2, atol=1e-2)


def test_a_users_post_grad_pre_pass_is_refused():
    with pytest.raises(ValueError, match="post_grad_custom_pre_pass"):
        fuse.CompileOptions(inductor_options={"post_grad_custom_pre_pass": lambda graph: None})


def test_the_pass_keeps_the_fx_graph_cache_on():
    """The pass is keyed by its uuid; nothing of compile_decode's backend makes Inductor bypass
    its FX graph cache (a second start would compile everything again)."""
    before = dict(counters["inductor"])
    args = inputs(torch.float32, seed=5)
    compiled(64)(*args)
    added = {key: counters["inductor"][key] - before.get(key, 0) for key in ("fxgraph_cache_bypass", "fxgraph_cache_miss", "fxgraph_cache_hit")}
    assert added["fxgraph_cache_bypass"] == 0, added
    assert added["fxgraph_cache_miss"] + added["fxgraph_cache_hit"] >= 1, added


@pytest.mark.parametrize("mode", ["max-autotune", "max-autotune-no-cudagraphs", None])
def test_cudagraph_trees_stay_off_in_every_mode(mode):
    patches = compile_backend(fuse.CompileOptions(mode=mode), CPU).config_patches
    assert patches["triton.cudagraphs"] is False
    if mode:
        assert patches["max_autotune"] is True  # the mode's own settings still apply
