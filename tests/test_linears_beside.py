"""kernels.linear.linears_beside (op v4::linears_beside): several products of one step's input in
weight formats that no one launch holds (fp32, FP8 block-scaled, bf16), against each product
computed on its own by an independent formula on fresh random inputs; bad inputs; on a GPU the
side stream's products equal the ops run one by one, in a CUDA graph too; and the attention's
products of its input, which run through it."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.blockscale.ref import act_quant_dequant, dequantize_weight, quantize_fp8_weight
from kernels.cuda_graph import capture
from kernels.linear import linears_beside

OPCHECKS = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")  # no fp8 in the schema test


def products(rows, dim, device, seed, dtype=torch.bfloat16, widths=(256, 384, 64)):
    """Inputs, weights and scales of an fp32 product, an FP8 one and a dense one in `dtype`."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(rows, dim, generator=g, device=device).to(dtype)
    fp32_w = torch.randn(widths[0], dim, generator=g, device=device) * dim**-0.5
    fp8_w, fp8_s = quantize_fp8_weight(torch.randn(widths[1], dim, generator=g, device=device) * dim**-0.5)
    dense_w = (torch.randn(widths[2], dim, generator=g, device=device) * dim**-0.5).to(dtype)
    return [x.float(), x, x], [fp32_w, fp8_w, dense_w], [None, fp8_s, None]


def by_formula(inputs, weights, scales):
    fp32 = F.linear(inputs[0], weights[0])
    fp8 = (act_quant_dequant(inputs[1], True) @ dequantize_weight(weights[1], scales[1]).T).to(inputs[1].dtype)
    dense = (inputs[2].float() @ weights[2].float().T).to(inputs[2].dtype)
    return [fp32, fp8, dense]


@pytest.mark.parametrize("rows", [1, 5])
def test_matches_each_product_alone(rows):
    inputs, weights, scales = products(rows, 256, "cpu", 500 + rows, torch.float32)
    expected = by_formula(inputs, weights, scales)
    for impl in ("auto", "reference"):
        outs = linears_beside(inputs, weights, scales, impl=impl)
        assert [o.dtype for o in outs] == [torch.float32] * 3
        for out, ref in zip(outs, expected):
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.interpreter
def test_triton_products_match_reference():
    inputs, weights, scales = products(2, 256, "cpu", 510, torch.float16, widths=(128, 256, 64))
    for out, ref in zip(linears_beside(inputs, weights, scales, impl="triton"), by_formula(inputs, weights, scales)):
        torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2 * ref.abs().max().item())


def test_bad_input_raises():
    inputs, weights, scales = products(2, 256, "cpu", 520, torch.float32)
    with pytest.raises(ValueError, match="needs as many inputs, weights and scales"):
        linears_beside(inputs, weights[:2], scales)
    with pytest.raises(ValueError, match="needs as many inputs, weights and scales"):
        linears_beside([], [], [])
    with pytest.raises(ValueError, match="product 1: blockscale_linear: x has 128 inputs"):
        linears_beside([inputs[0], inputs[1][:, :128], inputs[2]], weights, scales)
    with pytest.raises(ValueError, match="product 2: linear"):
        linears_beside(inputs, weights[:2] + [weights[2][:, :128]], scales)
    with pytest.raises(ValueError, match="impl must be one of"):
        linears_beside(inputs, weights, scales, impl="fast")


def test_opcheck_cpu():
    inputs, weights, scales = products(3, 256, "cpu", 530, torch.float32)
    torch.library.opcheck(torch.ops.v4.linears_beside.default, (inputs, weights, scales, True), test_utils=OPCHECKS)


def test_attention_products_of_its_input_run_beside_each_other():
    """A ratio-4 layer of tiny-fp8 (FP8 x projection, bf16 index weights, fp32 compressors): the
    products of its input equal each FusedLinear run on its own."""
    from model import Decoder, ModelConfig
    from model.layers import fused_products

    decoder = Decoder(ModelConfig.preset("tiny-fp8"), max_batch=3, max_seq_len=32, dtype=torch.bfloat16).init_random(6)
    attn = decoder.layers[2].attn
    assert attn.x32_proj is not None and attn.x_dense_proj is not None
    x = torch.randn(3, decoder.config.dim, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    calls = [(attn.x32_proj, x.float()), (attn.x_proj, x), (attn.x_dense_proj, x)]
    together = fused_products(calls)
    alone = {name: t for fused, inp in calls for name, t in fused(inp).items()}
    assert together.keys() == alone.keys() and len(alone) == 7
    for name in alone:
        assert torch.equal(together[name], alone[name]), name


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 16])
def test_gpu_side_stream_equals_the_ops_one_by_one(rows):
    """V4-Flash's widths (the compressors' fp32 2560 x 4096, the FP8 x projection 1536 x 4096, the
    index weights 64 x 4096): the same kernels as the ops alone, so equal bit for bit; captured
    with the fork and join and replayed with a new x."""
    inputs, weights, scales = products(rows, 4096, "cuda", 540 + rows, widths=(2560, 1536, 64))
    from kernels.blockscale import blockscale_linear
    from kernels.linear import linear

    alone = [linear(inputs[0], weights[0]), blockscale_linear(inputs[1], weights[1], scales[1]), linear(inputs[2], weights[2])]
    outs = linears_beside(inputs, weights, scales)
    for out, ref in zip(outs, alone):
        assert torch.equal(out, ref)
    static = [t.clone() for t in inputs]
    graph, captured = capture(lambda: linears_beside(static, weights, scales))
    fresh = products(rows, 4096, "cuda", 550 + rows, widths=(2560, 1536, 64))[0]
    for dst, src in zip(static, fresh):
        dst.copy_(src)
    graph.replay()
    for out, ref in zip(captured, linears_beside(fresh, weights, scales)):
        assert torch.equal(out, ref)


@pytest.mark.gpu
def test_gpu_two_products_either_way():
    """Two products (a ratio-128 layer), which the op keeps on one stream (MIN_SIDE_PRODUCTS): on
    the side stream the results are the same bit for bit."""
    from kernels.linear.op import run_products

    inputs, weights, scales = products(1, 4096, "cuda", 560, widths=(1024, 1536, 64))
    inputs, weights, scales = inputs[:2], weights[:2], scales[:2]
    one_stream = run_products(inputs, weights, scales, True, beside=False)
    for out in (run_products(inputs, weights, scales, True, beside=True), linears_beside(inputs, weights, scales)):
        assert all(torch.equal(a, b) for a, b in zip(out, one_stream))
