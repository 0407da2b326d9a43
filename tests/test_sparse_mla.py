"""Sparse MLA decode: the Triton kernels against the plain-torch reference.

Without CUDA the Triton kernels run in the interpreter (TRITON_INTERPRET=1, set by conftest.py)
on small fp16/fp32 shapes; the interpreter's tl.dot is wrong for bf16, so bf16 is tested on the
GPU only, at the real shapes (H=64, D=512, K=640/2048) and under CUDA-graph capture.

Tolerances. The kernels round the probabilities to the activation dtype relative to the running
max of the online softmax, the reference relative to the final max; both are within half an ulp of
the exact value, so out may differ by about one ulp of its dtype plus its own rounding:
fp32 1e-5, fp16 2e-3 (two ulps at |x| ~ 1), bf16 2e-2, and a tenth of that on the mean. The LSE
uses fp32 scores in both (exact products of the inputs, only the summation order differs), so
it gets 1e-4 (2e-3 on the GPU, where the tensor cores sum 512 products in their own order).
A wrong mask, sink or split merge moves values by O(0.1) or more.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

triton = pytest.importorskip("triton")

from kernels.cuda_graph import capture  # noqa: E402
from kernels.sparse_mla import common, plan  # noqa: E402
from kernels.sparse_mla import triton as smt  # noqa: E402
from kernels.sparse_mla.op import sparse_mla_decode_cuda  # noqa: E402
from kernels.sparse_mla import (  # noqa: E402
    sparse_mla_decode,
    sparse_mla_decode_op,
    sparse_mla_decode_with_workspace_op,
    sparse_mla_decode_reference,
    sparse_mla_workspace,
)
from kernels.triton_util import INTERPRETER_NUM_SMS  # noqa: E402

OUT_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def make_indices(batch, topk, num_rows, gen, pattern="mixed"):
    """[B, K] int32 global rows. Patterns per sequence b (cycling): 0 all masked; 1 ragged (a
    random count of valid rows, then -1); 2+ about a quarter -1 scattered anywhere. Valid rows
    are drawn from the whole cache, so they land in several slots."""
    idx = torch.randint(0, num_rows, (batch, topk), generator=gen, dtype=torch.int32)
    for b in range(batch):
        kind = b % 3 if pattern == "mixed" else 2
        if kind == 0:
            idx[b] = -1
        elif kind == 1:
            valid = int(torch.randint(1, topk, (1,), generator=gen))
            idx[b, valid:] = -1
        else:
            idx[b, torch.rand(topk, generator=gen) < 0.25] = -1
    return idx


def make_inputs(batch, heads, dim, topk, dtype, device="cpu", slots=3, rows=24, seed=0, pattern="mixed"):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, dim, generator=gen).to(dtype)
    kv_cache = torch.randn(slots, rows, dim, generator=gen).to(dtype)
    indices = make_indices(batch, topk, slots * rows, gen, pattern)
    sink = torch.randn(heads, generator=gen)
    scale = 1.5 * dim**-0.5  # a little sharper than 1/sqrt(D) so the softmax is not flat
    return [t.to(device) for t in (q, kv_cache, indices, sink)] + [scale]


def assert_matches_reference(out, lse, q, kv_cache, indices, sink, scale):
    ref_out, ref_lse = sparse_mla_decode_reference(q, kv_cache, indices, sink, scale)
    assert out.dtype == q.dtype and out.shape == q.shape and lse.dtype == torch.float32 and lse.shape == q.shape[:2]
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    tol = OUT_TOL[q.dtype]
    torch.testing.assert_close(out.float(), ref_out.float(), atol=tol, rtol=tol)
    assert (out.float() - ref_out.float()).abs().mean() < tol / 10
    lse_tol = 1e-4 if q.device.type == "cpu" else 2e-3
    torch.testing.assert_close(lse, ref_lse, atol=lse_tol, rtol=lse_tol)


SMALL_TILES = plan.TileConfig(block_h=16, block_k=16, num_warps=4, num_stages=2)
DV_SPLIT_TILES = plan.TileConfig(block_h=16, block_k=16, num_warps=4, num_stages=2, dv_split=2)

# (name, call) with call(q, kv_cache, indices, sink, scale) -> (out, lse)
VARIANTS = {
    "simt": lambda *a: smt.sparse_mla_decode_simt(*a),
    "head_batched": lambda *a: smt.sparse_mla_decode_head_batched(*a),
    "head_batched_k16": lambda *a: smt.sparse_mla_decode_head_batched(*a, tiles=SMALL_TILES),
    "head_batched_dv_split": lambda *a: smt.sparse_mla_decode_head_batched(*a, tiles=DV_SPLIT_TILES),
    "split_k_default": lambda *a: smt.sparse_mla_decode_split_k(*a),
    "split_k_1": lambda *a: smt.sparse_mla_decode_split_k(*a, num_splits=1, tiles=SMALL_TILES),
    "split_k_2": lambda *a: smt.sparse_mla_decode_split_k(*a, num_splits=2, tiles=SMALL_TILES),
    "split_k_3": lambda *a: smt.sparse_mla_decode_split_k(*a, num_splits=3, tiles=SMALL_TILES),
    "split_k_7_some_empty": lambda *a: smt.sparse_mla_decode_split_k(*a, num_splits=7, tiles=SMALL_TILES),
    "split_k_3_dv_split": lambda *a: smt.sparse_mla_decode_split_k(*a, num_splits=3, tiles=DV_SPLIT_TILES),
    # 64 heads on two warpgroups, whole rows (the default plan's tiles at large batch); GPU only.
    "split_k_2_whole_rows": lambda *a: smt.sparse_mla_decode_split_k(*a, num_splits=2, tiles=plan.TileConfig(64, 64, 8, 2)),
    # Launch-order options (GPU: programmatic dependent launch; no-ops under the interpreter).
    "split_k_3_overlapped": lambda *a: smt.sparse_mla_decode_split_k(
        *a, num_splits=3, tiles=SMALL_TILES, pdl=True, overlap_launch=True
    ),
    "triton": lambda *a: smt.sparse_mla_decode_triton(*a),
    # What impl="auto" runs on CUDA (the Triton plan here; on Hopper at large batches the wgmma kernel).
    "auto": lambda *a: sparse_mla_decode_cuda(*a),
}


# ---------------------------------------------------------------------------------------------
# CPU: Triton interpreter
# ---------------------------------------------------------------------------------------------


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize(
    "batch,heads,dim,topk",
    [(3, 8, 64, 40), (2, 5, 48, 33)],  # the second: heads and dim not powers of two, K not a tile multiple
    ids=["b3h8d64k40", "b2h5d48k33"],
)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variant_matches_reference(variant, batch, heads, dim, topk, dtype):
    inputs = make_inputs(batch, heads, dim, topk, dtype, seed=sum(map(ord, variant)) + batch)
    out, lse = VARIANTS[variant](*inputs)
    assert_matches_reference(out, lse, *inputs)


@pytest.mark.interpreter
@pytest.mark.parametrize(
    "variant",
    ["simt", "head_batched", "head_batched_dv_split", "split_k_3", "split_k_7_some_empty", "triton", "auto"],
)
def test_all_masked_rows_give_zeros_and_the_sink_as_lse(variant):
    q, kv_cache, indices, sink, scale = make_inputs(2, 4, 32, 40, torch.float32, seed=7)
    indices.fill_(-1)
    out, lse = VARIANTS[variant](q, kv_cache, indices, sink, scale)
    assert torch.equal(out, torch.zeros_like(out))
    torch.testing.assert_close(lse, sink.expand(2, -1), atol=1e-6, rtol=1e-6)


@pytest.mark.interpreter
def test_masked_block_before_valid_rows():
    """A whole masked tile first, then valid rows: the running max starts at -inf and must recover."""
    q, kv_cache, indices, sink, scale = make_inputs(2, 4, 32, 48, torch.float32, seed=3, pattern="scattered")
    indices[:, :16] = -1
    for variant in ("simt", "head_batched_k16", "head_batched_dv_split", "split_k_2", "split_k_3_dv_split"):
        out, lse = VARIANTS[variant](q, kv_cache, indices, sink, scale)
        assert_matches_reference(out, lse, q, kv_cache, indices, sink, scale)


@pytest.mark.interpreter
@pytest.mark.parametrize("variant", ["simt", "head_batched", "head_batched_dv_split", "split_k_2", "auto", "split_k_3_overlapped"])
def test_probabilities_are_rounded_to_the_activation_dtype(variant):
    """Two rows with payloads +100 and -100: the output is 100 (1 - p) / denom, so the fp16
    rounding of p = exp(s2 - s1) (placed between two fp16 values) moves it far beyond the
    tolerance. The max row comes first, so the kernels round at the same max as the reference."""
    dim, heads = 16, 2
    q = torch.zeros(1, heads, dim, dtype=torch.float16)
    q[..., 0] = 1.0
    p_exact = torch.tensor(1 - 1.5 * 2**-11, dtype=torch.float64)
    kv_cache = torch.zeros(1, 2, dim, dtype=torch.float16)
    kv_cache[0, 0, 1], kv_cache[0, 1, 1] = 100.0, -100.0
    kv_cache[0, 1, 0] = torch.log(p_exact).to(torch.float16)
    p = torch.exp(kv_cache[0, 1, 0].float())
    assert abs(p.half().float() - p) > 2**-13  # at least a quarter of an fp16 step: rounding matters
    indices = torch.tensor([[0, 1, -1, -1]], dtype=torch.int32)
    sink = torch.full((heads,), -20.0)
    out, lse = VARIANTS[variant](q, kv_cache, indices, sink, 1.0)
    assert_matches_reference(out, lse, q, kv_cache, indices, sink, 1.0)
    unrounded = 100 * (1 - p) / (1 + p)
    assert (out[0, :, 1].float() - unrounded).abs().min() > 3 * OUT_TOL[torch.float16]


@pytest.mark.interpreter
@pytest.mark.parametrize("variant", ["simt", "head_batched_k16", "split_k_3_dv_split"])
def test_strided_inputs_and_int64_indices(variant):
    """q not contiguous, int64 indices, and a cache view whose slots are not evenly strided
    (slot stride != rows x row stride), which takes the (slot, row) addressing path."""
    q, kv_cache, indices, sink, scale = make_inputs(2, 4, 32, 40, torch.float16, seed=11)
    q_strided = torch.randn(4, 2, 32, dtype=torch.float16).transpose(0, 1)
    q_strided.copy_(q)
    padded = torch.randn(3, 30, 32, dtype=torch.float16)
    padded[:, :24] = kv_cache
    kv_view = padded[:, :24]
    assert not common._flat_rows(kv_view)
    out, lse = VARIANTS[variant](q_strided, kv_view, indices.long(), sink, scale)
    assert_matches_reference(out, lse, q, kv_cache, indices, sink, scale)


@pytest.mark.interpreter
def test_workspace_is_used_and_checked():
    q, kv_cache, indices, sink, scale = make_inputs(3, 8, 64, 40, torch.float32, seed=5)
    needed = plan.workspace_numel(3, 8, 64, 3)
    workspace = torch.full((needed + 100,), float("nan"))  # stale NaNs must never leak into the result
    out, lse = smt.sparse_mla_decode_split_k(q, kv_cache, indices, sink, scale, 3, workspace, SMALL_TILES)
    assert_matches_reference(out, lse, q, kv_cache, indices, sink, scale)
    assert not torch.isnan(workspace[:needed]).all()  # the partials went there
    with pytest.raises(ValueError, match="workspace holds"):
        smt.sparse_mla_decode_split_k(q, kv_cache, indices, sink, scale, 3, workspace[: needed - 1], SMALL_TILES)
    with pytest.raises(ValueError, match="fp32"):
        smt.sparse_mla_decode_split_k(q, kv_cache, indices, sink, scale, 3, workspace.double(), SMALL_TILES)


@pytest.mark.interpreter
def test_default_path_with_its_workspace():
    """One sequence and a long index list: the default plan splits it (checked), using the
    workspace sized by sparse_mla_workspace."""
    q, kv_cache, indices, sink, scale = make_inputs(1, 8, 64, 640, torch.float16, seed=9, pattern="scattered")
    workspace = plan.sparse_mla_workspace(1, 8, 64, 640, "cpu", torch.float16)
    splits = plan.choose_num_splits(1, 8, 640, INTERPRETER_NUM_SMS, 64, 2)
    assert splits > 1 and workspace.numel() == plan.workspace_numel(1, 8, 64, splits)
    out, lse = sparse_mla_decode_cuda(q, kv_cache, indices, sink, scale, workspace=workspace)
    assert_matches_reference(out, lse, q, kv_cache, indices, sink, scale)


@pytest.mark.interpreter
@pytest.mark.parametrize("impl", ["auto", "reference", "triton", "simt", "head_batched", "split_k"])
def test_impl_selection(impl):
    q, kv_cache, indices, sink, scale = make_inputs(2, 4, 32, 24, torch.float32, seed=13)
    out, lse = sparse_mla_decode(q, kv_cache, indices, sink, scale, return_lse=True, impl=impl)
    assert_matches_reference(out, lse, q, kv_cache, indices, sink, scale)
    assert torch.equal(sparse_mla_decode(q, kv_cache, indices, sink, scale, impl=impl), out)


# ---------------------------------------------------------------------------------------------
# CPU: the op, planning and input checks (no kernels run)
# ---------------------------------------------------------------------------------------------


def test_opcheck():
    q, kv_cache, indices, sink, scale = make_inputs(2, 4, 32, 16, torch.float32, seed=17)
    torch.library.opcheck(sparse_mla_decode_op, (q, kv_cache, indices, sink, scale))
    torch.library.opcheck(sparse_mla_decode_with_workspace_op, (q, kv_cache, indices, sink, scale, torch.empty(64)))


def test_plan_picks_tiles_by_batch_on_an_h200():
    """At 132 SMs, H=64, D=512: 16-head blocks where 64-head programs would leave SMs idle
    (batch 1), 64-head blocks with split output columns in between, and whole rows on two
    warpgroups once those programs fill the GPU on their own (batch 128)."""
    small, _ = plan.choose_plan(1, 64, 640, 132)
    middle, _ = plan.choose_plan(8, 64, 640, 132)
    large, splits = plan.choose_plan(128, 64, 2048, 132)
    assert small.block_h == 16
    # A long list at batch 1 goes in 64-row blocks (half the splits, half the fp32 partials); the
    # window's 128 rows in one-block splits of 32.
    assert (plan.choose_tiles(1, 64, 2048, 132).block_h, plan.choose_tiles(1, 64, 2048, 132).block_k) == (16, 64)
    assert plan.choose_plan(1, 64, 128, 132) == (plan.TileConfig(16, 32, 4, 1), 4)
    assert (middle.block_h, middle.dv_split) == (64, 2)
    assert (large.block_h, large.dv_split, large.num_warps, splits) == (64, 1, 8, 1)


def test_plan_pipelines_only_splits_of_several_blocks():
    """Splits of one KV block run unpipelined for the tiles measured faster so (16x32, and 64
    heads in two column halves of 64 rows); 16x64 tiles and longer splits keep two stages."""
    for batch, topk, tiles in ((1, 640, plan.TileConfig(16, 32, 4, 1)), (4, 640, plan.TileConfig(64, 64, 4, 1, 2)),
                               (2, 640, plan.TileConfig(16, 64, 4, 2)), (8, 640, plan.TileConfig(64, 64, 4, 2, 2))):
        assert plan.choose_plan(batch, 64, topk, 132)[0] == tiles, (batch, topk)


def test_fp32_candidates_fit_shared_memory():
    """fp32 inputs (a checking mode) keep small tiles: no 64-row block of 16 heads, whose two
    KV stages alone would take 256 KiB."""
    bf16 = plan.candidate_tiles(64, 512, 2)
    fp32 = plan.candidate_tiles(64, 512, 4)
    assert plan.TileConfig(16, 64, 4, 2) in bf16
    assert all(t.block_k <= 16 for t in fp32)
    width = 512 * 4
    assert all(t.block_h * width + t.num_stages * t.block_k * width <= plan._SMEM_BYTES for t in fp32)


@pytest.mark.parametrize("topk", [128, 640, 2048])
@pytest.mark.parametrize("batch", [1, 2, 4, 8, 16, 32, 64, 128, 256])
def test_plan_is_a_sane_pure_function(batch, topk):
    heads, num_sms = 64, 132
    tiles = plan.choose_tiles(batch, heads, topk, num_sms)
    splits = plan.choose_num_splits(batch, heads, topk, num_sms)
    assert splits == plan.choose_num_splits(batch, heads, topk, num_sms)  # no hidden state
    n_blocks = triton.cdiv(topk, tiles.block_k)
    assert 1 <= splits <= min(n_blocks, plan.MAX_SPLITS)
    blocks_per_split = triton.cdiv(n_blocks, splits)
    assert (splits - 1) * blocks_per_split < n_blocks  # the default never plans an empty split
    programs = batch * triton.cdiv(heads, tiles.block_h) * tiles.dv_split
    if programs >= num_sms:
        assert splits == 1  # the GPU is already full: partials would only add traffic
    if batch == 1 and topk >= 640:
        assert programs * splits >= 32  # one sequence is spread over many SMs


H200 = (9, 0)


def test_wgmma_plan_takes_large_batches_on_hopper_only():
    """The Gluon kernel from 16 64-head blocks and 512 indices up, on compute capability 9.x with
    16-bit activations, whole 64-head blocks and a supported head dim; its splits fill the 132
    SMs once and never outnumber the 64-row index blocks."""
    splits = {b: plan.wgmma_splits(b, 64, 2048, 132, 512, 2, H200) for b in (8, 16, 32, 64, 128, 256)}
    assert splits == {8: None, 16: 8, 32: 4, 64: 2, 128: 1, 256: 1}
    assert plan.wgmma_splits(16, 128, 2048, 132, 512, 2, H200) == 4  # two head blocks per sequence
    assert plan.wgmma_splits(32, 64, 512, 132, 512, 2, H200) == 4
    assert plan.wgmma_splits(32, 64, 128, 132, 512, 2, H200, min_topk=1) == 2  # two index blocks
    assert plan.wgmma_splits(1, 64, 640, 132, 512, 2, H200, min_head_blocks=1) == 10
    for args in (
        (64, 64, 640, 132, 512, 2, None),  # CPU or the interpreter
        (64, 64, 640, 132, 512, 2, (8, 0)),  # Ampere: no warpgroup MMA
        (64, 64, 640, 148, 512, 2, (10, 0)),  # Blackwell: no warpgroup MMA either
        (64, 64, 640, 132, 512, 4, H200),  # fp32
        (64, 48, 640, 132, 512, 2, H200),  # heads not a multiple of 64
        (64, 64, 640, 132, 64, 2, H200),  # head dim outside 128-512
        (64, 64, 160, 132, 512, 2, H200),  # the short lists of window-only and ratio-128 layers
    ):
        assert plan.wgmma_splits(*args) is None, args
    # The workspace follows the kernel the default path runs: none for the CPU path's sizes.
    assert plan.device_capability(torch.device("cpu")) is None


def test_workspace_holds_the_wgmma_splits(monkeypatch):
    """On an H200 at B=64, K=640 the Triton plan takes one split and the wgmma kernel two: the
    preallocated workspace must hold the kernel the default path runs."""
    monkeypatch.setattr(plan, "device_sm_count", lambda device: 132)
    monkeypatch.setattr(plan, "device_capability", lambda device: H200)
    assert plan.choose_num_splits(64, 64, 640, 132) == 1
    splits = plan.wgmma_splits(64, 64, 640, 132, 512, 2, H200)
    assert splits == 2
    workspace = plan.sparse_mla_workspace(64, 64, 512, 640, "cpu", torch.bfloat16)
    assert workspace.numel() == plan.workspace_numel(64, 64, 512, splits)


def test_wgmma_kernel_refuses_what_it_cannot_take():
    pytest.importorskip("triton.experimental.gluon")
    from kernels.sparse_mla.gluon import check_wgmma_inputs, launch_wgmma

    q, kv_cache, _, _, _ = make_inputs(2, 64, 512, 16, torch.bfloat16)
    with pytest.raises(ValueError, match="bf16 or fp16"):
        check_wgmma_inputs(q.float(), kv_cache.float())
    with pytest.raises(ValueError, match="differs from q dtype"):
        check_wgmma_inputs(q, kv_cache.half())
    with pytest.raises(ValueError, match="compute capability 9.x"):
        check_wgmma_inputs(q, kv_cache)
    with pytest.raises(ValueError, match="compute capability 9.x"):
        sparse_mla_decode(q, kv_cache, torch.zeros(2, 16, dtype=torch.int32), torch.zeros(64), 0.1, impl="wgmma")
    with pytest.raises(ValueError, match="num_splits"):
        launch_wgmma(q, kv_cache, None, None, 0.1, 0, None, None)
    with pytest.raises(ValueError, match="block_n"):
        launch_wgmma(q, kv_cache, None, None, 0.1, 1, None, None, block_n=48)


def test_bad_input_raises_value_error():
    q, kv_cache, indices, sink, scale = make_inputs(2, 4, 32, 16, torch.float32)
    with pytest.raises(ValueError, match="expects q"):
        sparse_mla_decode(q[0], kv_cache, indices, sink, scale)
    with pytest.raises(ValueError, match="disagree"):
        sparse_mla_decode(q, kv_cache[..., :16], indices, sink, scale)
    with pytest.raises(ValueError, match="disagree"):
        sparse_mla_decode(q, kv_cache, indices, sink[:3], scale)
    with pytest.raises(ValueError, match="int32 or int64"):
        sparse_mla_decode(q, kv_cache, indices.float(), sink, scale)
    with pytest.raises(ValueError, match="floating point"):
        sparse_mla_decode(q.int(), kv_cache, indices, sink, scale)
    with pytest.raises(ValueError, match="impl must be one of"):
        sparse_mla_decode(q, kv_cache, indices, sink, scale, impl="fastest")
    with pytest.raises(ValueError, match="differs from q dtype"):
        smt.sparse_mla_decode_head_batched(q, kv_cache.half(), indices, sink, scale)
    with pytest.raises(ValueError, match="bf16, fp16 or fp32"):
        smt.sparse_mla_decode_simt(q.double(), kv_cache.double(), indices, sink, scale)
    with pytest.raises(ValueError, match="num_splits"):
        smt.sparse_mla_decode_split_k(q, kv_cache, indices, sink, scale, num_splits=0)


# ---------------------------------------------------------------------------------------------
# GPU: real shapes, bf16, CUDA graphs
# ---------------------------------------------------------------------------------------------

WINDOW, COMPRESSED = 128, 4096  # rows per cache slot: the window ring, then compressed entries


def make_gpu_cache(slots, dtype=torch.bfloat16, dim=512, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(slots, WINDOW + COMPRESSED, dim, device="cuda", generator=gen).to(dtype)


def make_gpu_query(batch, topk, dtype=torch.bfloat16, heads=64, dim=512, seed=0):
    """q, indices, sink. Sequence b gathers from cache slot b + 1: the window part of its indices
    names ring rows, the rest random compressed rows; about 10% are -1 anywhere, and sequence 0
    is all masked when there are others (a lone sequence keeps its valid rows)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rows = WINDOW + COMPRESSED
    q = torch.randn(batch, heads, dim, device="cuda", generator=gen).to(dtype)
    sink = torch.randn(heads, device="cuda", generator=gen)
    window = torch.arange(min(WINDOW, topk), device="cuda").expand(batch, -1)
    compressed = WINDOW + torch.randint(0, COMPRESSED, (batch, topk - window.shape[1]), device="cuda", generator=gen)
    slot = torch.arange(batch, device="cuda")[:, None] + 1
    indices = (slot * rows + torch.cat([window, compressed], 1)).to(torch.int32)
    indices[torch.rand(batch, topk, device="cuda", generator=gen) < 0.1] = -1
    if batch > 1:
        indices[0] = -1
    return q, indices, sink


def make_gpu_inputs(batch, topk, dtype=torch.bfloat16, heads=64, dim=512, seed=0):
    q, indices, sink = make_gpu_query(batch, topk, dtype, heads, dim, seed)
    return q, make_gpu_cache(batch + 1, dtype, dim, seed), indices, sink, dim**-0.5


@pytest.mark.gpu
@pytest.mark.parametrize("topk", [640, 2048])
@pytest.mark.parametrize("batch", [1, 3, 16, 64])
@pytest.mark.parametrize(
    "variant",
    [
        "simt", "head_batched", "split_k_default", "split_k_2", "split_k_64", "split_k_3_dv_split", "split_k_2_whole_rows",
        "triton", "auto",
    ],
)
def test_gpu_variant_matches_reference(variant, batch, topk):
    """split_k_64 uses the default tiles: at K=640 that is 20 blocks, so 44 splits are empty."""
    inputs = make_gpu_inputs(batch, topk, seed=batch * 7 + topk)
    if variant == "split_k_64":
        out, lse = smt.sparse_mla_decode_split_k(*inputs, num_splits=64)
    else:
        out, lse = VARIANTS[variant](*inputs)
    assert_matches_reference(out, lse, *inputs)


def wgmma(**kwargs):
    def call(*args):
        from kernels.sparse_mla.gluon import sparse_mla_decode_wgmma

        return sparse_mla_decode_wgmma(*args, **kwargs)

    return call


# The Gluon kernel (Hopper only): its split rule, one split, splits some of which are empty at
# K=640 (10 blocks), and the other tile shapes it takes.
WGMMA_VARIANTS = {
    "wgmma": wgmma(),
    "wgmma_1": wgmma(num_splits=1),
    "wgmma_16_some_empty": wgmma(num_splits=16),
    "wgmma_32x4": wgmma(num_splits=3, block_n=32, stages=4),
    "wgmma_16x6": wgmma(num_splits=2, block_n=16, stages=6),
}
needs_hopper = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
    reason="needs a compute capability 9.x GPU",
)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("topk", [128, 640, 2048])
@pytest.mark.parametrize("batch", [1, 3, 16, 64])
@pytest.mark.parametrize("variant", list(WGMMA_VARIANTS))
def test_gpu_wgmma_matches_reference(variant, batch, topk):
    inputs = make_gpu_inputs(batch, topk, seed=batch * 11 + topk)
    out, lse = WGMMA_VARIANTS[variant](*inputs)
    assert_matches_reference(out, lse, *inputs)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("heads,dim", [(64, 512), (128, 256), (64, 128)])
def test_gpu_wgmma_masks_and_shapes(heads, dim, dtype):
    """All-masked, ragged and scattered -1 rows (make_indices), a cache whose slots are padded
    (rows not evenly strided), two head blocks, the smaller head dims, fp16."""
    q, kv_cache, indices, sink, scale = make_inputs(6, heads, dim, 300, dtype, device="cuda", slots=5, rows=200, seed=dim)
    padded = torch.zeros(5, 230, dim, dtype=dtype, device="cuda")
    padded[:, :200] = kv_cache
    for cache in (kv_cache, padded[:, :200]):
        for splits in (1, 4):
            out, lse = wgmma(num_splits=splits)(q, cache, indices, sink, scale)
            assert_matches_reference(out, lse, q, cache, indices, sink, scale)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("impl", ["simt", "head_batched", "split_k", "triton", "auto"])
def test_gpu_other_dtypes(impl, dtype):
    q, kv_cache, indices, sink, scale = make_gpu_inputs(5, 640, dtype=dtype, seed=21)
    out, lse = sparse_mla_decode(q, kv_cache, indices, sink, scale, return_lse=True, impl=impl)
    assert_matches_reference(out, lse, q, kv_cache, indices, sink, scale)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_gpu_tiny_model_shapes(dtype):
    """The tiny config (4 heads, 32-wide rows) through the op: heads and rows far below a tile."""
    q, kv_cache, indices, sink, scale = make_gpu_inputs(2, 24, dtype=dtype, heads=4, dim=32, seed=23)
    out, lse = sparse_mla_decode(q, kv_cache, indices, sink, scale, return_lse=True)
    assert_matches_reference(out, lse, q, kv_cache, indices, sink, scale)


@pytest.mark.gpu
@pytest.mark.parametrize("topk", [640, 2048])
def test_gpu_cuda_graph_per_batch_bucket(topk):
    """Preallocate each bucket's workspace, capture the op once per bucket, then replay with new
    inputs copied into the static tensors (and a rewritten cache) and compare to the reference."""
    heads, dim, scale = 64, 512, 512**-0.5
    buckets = [1, 8, 32, 128]
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits = [plan.choose_num_splits(b, heads, topk, num_sms) for b in buckets]
    assert splits[0] > 1 and splits[-1] == 1  # the graphs cover both the split-K and the single-split path
    if torch.cuda.get_device_capability()[0] == 9:  # and on Hopper the wgmma kernel with and without splits
        capability = plan.device_capability(torch.device("cuda"))
        assert [plan.wgmma_splits(b, heads, topk, num_sms, dim, 2, capability) for b in buckets[2:]] == [4, 1]
    kv_cache = make_gpu_cache(max(buckets) + 1)
    graphs = {}
    for batch in buckets:
        q, indices, sink = make_gpu_query(batch, topk, seed=batch)
        workspace = sparse_mla_workspace(batch, heads, dim, topk, "cuda", torch.bfloat16)
        graph, (out, lse) = capture(
            lambda: sparse_mla_decode(q, kv_cache, indices, sink, scale, return_lse=True, workspace=workspace)
        )
        # The graph writes into the workspace on every replay: it must live as long as the graph
        # (freed, its memory would go to the next bucket's tensors and be overwritten).
        graphs[batch] = (graph, dict(q=q, indices=indices, sink=sink, out=out, lse=lse, workspace=workspace))

    for round_ in range(3):
        kv_cache.copy_(make_gpu_cache(max(buckets) + 1, seed=round_ + 1))
        for batch, (graph, static) in graphs.items():
            q, indices, sink = make_gpu_query(batch, topk, seed=1000 * (round_ + 1) + batch)
            static["q"].copy_(q)
            static["indices"].copy_(indices)
            static["sink"].copy_(sink)
            graph.replay()
            torch.cuda.synchronize()
            assert_matches_reference(static["out"], static["lse"], q, kv_cache, indices, sink, scale)


def replay_on_fresh_inputs(graph, round_, kv_cache, q, indices, sink):
    """Rewrite the captured cache and query tensors with round `round_`'s fresh values, replay."""
    batch, topk = indices.shape
    kv_cache.copy_(make_gpu_cache(batch + 1, seed=round_ + 1))
    for static, fresh in zip((q, indices, sink), make_gpu_query(batch, topk, seed=1000 * (round_ + 1) + batch)):
        static.copy_(fresh)
    graph.replay()
    torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.parametrize("batch,topk", [(1, 640), (2, 2048), (8, 640), (16, 2048)])
def test_gpu_split_k_with_pdl_in_cuda_graph(batch, topk):
    """The combine launched as a programmatic dependent of the split kernel (which lets it start
    early) must still read every partial after it landed: eagerly, ten calls repeat the first bit
    for bit and match the reference; captured in a graph and replayed on new inputs, too."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    heads, dim, scale = 64, 512, 512**-0.5
    kv_cache = make_gpu_cache(batch + 1, seed=topk)
    q, indices, sink = make_gpu_query(batch, topk, seed=batch)
    workspace = sparse_mla_workspace(batch, heads, dim, topk, "cuda", torch.bfloat16)
    call = lambda: smt.sparse_mla_decode_split_k(q, kv_cache, indices, sink, scale, workspace=workspace, pdl=True)  # noqa: E731
    out, lse = call()
    assert_matches_reference(out, lse, q, kv_cache, indices, sink, scale)
    for _ in range(10):
        again, lse_again = call()
        assert torch.equal(again, out) and torch.equal(lse_again, lse)
    graph, (out, lse) = capture(call)
    for round_ in range(3):
        replay_on_fresh_inputs(graph, round_, kv_cache, q, indices, sink)
        assert_matches_reference(out, lse, q, kv_cache, indices, sink, scale)


@pytest.mark.gpu
@pytest.mark.parametrize("batch,topk", [(1, 640), (2, 2048), (16, 2048)])
def test_gpu_split_kernel_overlapping_its_predecessor_reads_its_output(batch, topk):
    """overlap_launch: the split kernel starts while the kernel before it runs. Inside the graph
    that kernel writes q, the indices and the cache (copies from staging tensors), so a split
    kernel that read any of them early would see the previous round's values."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    heads, dim, scale = 64, 512, 512**-0.5
    staged_cache = make_gpu_cache(batch + 1, seed=topk)
    staged = make_gpu_query(batch, topk, seed=batch)
    kv_cache, (q, indices, sink) = staged_cache.clone(), tuple(t.clone() for t in staged)
    workspace = sparse_mla_workspace(batch, heads, dim, topk, "cuda", torch.bfloat16)

    def call():
        for static, source in zip((kv_cache, q, indices, sink), (staged_cache, *staged)):
            static.copy_(source)
        return smt.sparse_mla_decode_split_k(
            q, kv_cache, indices, sink, scale, workspace=workspace, pdl=True, overlap_launch=True
        )

    out, lse = call()
    assert_matches_reference(out, lse, q, kv_cache, indices, sink, scale)
    graph, (out, lse) = capture(call)
    for round_ in range(3):
        replay_on_fresh_inputs(graph, round_, staged_cache, *staged)  # fills the staging tensors
        assert_matches_reference(out, lse, q, kv_cache, indices, sink, scale)
        assert torch.equal(q, staged[0]) and torch.equal(indices, staged[1])


def offline_usages(code: str) -> list[dict]:
    """Run `code`, which leaves a list of kernels.bench.resource_usage.Usage in `usages`, in a fresh
    process without the interpreter (which cannot compile); the usages as dicts. Skips where
    this Triton ships no cuobjdump."""
    from kernels.bench.resource_usage import _cuobjdump

    if not os.path.exists(_cuobjdump()):
        pytest.skip("this Triton ships no cuobjdump")
    code = "import dataclasses, json\n" + code + "print(json.dumps([dataclasses.asdict(u) for u in usages]))\n"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_offline_resource_usage_of_three_tiles():
    """kernels.bench.resource_usage compiles for sm_90 without a GPU and reads the cubin: the 64-head
    tile runs on Hopper's warpgroup MMA and needs more shared memory than the 16-head one, which
    uses warp-level MMA; a five-stage pipeline gets more KV buffers than a two-stage one. (A fresh
    process: this module runs Triton's interpreter, which cannot compile.)"""
    small, big, deep = offline_usages(
        "from kernels.sparse_mla import plan\n"
        "from kernels.bench.resource_usage import head_batched_usage\n"
        "tiles = [plan.TileConfig(16, 32, 4, 2), plan.head_batched_tiles(64), plan.TileConfig(64, 32, 8, 5)]\n"
        "usages = [head_batched_usage(t) for t in tiles]\n"
    )
    for usage in (small, big, deep):
        assert 0 < usage["registers"] <= 255 and usage["spill_bytes"] >= 0
    assert small["mma_sync"] > 0 and small["wgmma"] == 0
    assert big["wgmma"] > 0 and big["shared_bytes"] > small["shared_bytes"]
    assert deep["kv_buffers"] > big["kv_buffers"] >= 2


def test_offline_resource_usage_of_the_wgmma_kernel():
    """The Gluon kernel compiles for sm_90 with this Triton (its API moves between releases) and
    fits: no spills, within sm_90's shared memory, warpgroup MMAs and cp.async gathers in the
    code; a deeper ring of smaller blocks takes no more shared memory than the default ring. (A
    fresh process, as above.)"""
    pytest.importorskip("triton.experimental.gluon")
    default, split, small = offline_usages(
        "from kernels.bench.resource_usage import wgmma_usage\n"
        "usages = [wgmma_usage(**s) for s in (dict(), dict(split=True), dict(block_n=32, stages=3))]\n"
    )
    for usage in (default, split, small):
        assert 0 < usage["registers"] <= 255 and usage["spill_bytes"] == 0
        assert usage["shared_bytes"] <= 227 * 1024
        assert usage["wgmma"] > 0 and usage["mma_sync"] == 0 and usage["async_copies"] > 0
    assert small["shared_bytes"] < default["shared_bytes"]
